"""Paged attention arranged for a CPU: the reference's method, in the cache's dtype, GQA-packed.

`minipaged.attention.paged_attention` is the paper's algorithm written to be read (Kwon et al.,
SOSP'23, section 4.1): it gathers a chunk of sequences' blocks (`plan_attention`,
`gather_context`) and runs one masked attention over them, in float32. This module keeps that
plan and that gather and changes only what the CPU pays for (`benchmarks/attention_cpu.py`
measures each against the reference):

* **The cache's dtype throughout.** K/V are gathered and attended in the dtype they are cached in;
  nothing is converted to float32 per layer. `scaled_dot_product_attention` on CPU accumulates a
  bfloat16 or float16 attention in float32 inside its kernel and rounds the output once, so the
  result is the reference's within one rounding of the output (bf16 tolerances in the tests).
* **Grouped queries packed onto their KV head** (decode chunks). The `H / H_kv` query heads that
  share a KV head become that head's query rows, so each K/V block is read once per KV head
  instead of once per query head, and the attention kernel multiplies several rows at a time
  instead of one (its single-row path is slow in bfloat16).

`cpu_paged_attention` has the attention contract's signature (`minipaged.attention_contract`);
`CPU_OPS` is the backend "cpu" of `minipaged.attention_backend`, the reference's KV writes, block
copies and plan beside this attention.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from minipaged import attention
from minipaged.attention import AttentionChunk, checked_plan, gather_context, plan_attention
from minipaged.attention_contract import AttentionOps


def cpu_paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    validate: bool = True,
    plan: list[AttentionChunk] | None = None,
) -> Tensor:
    """Causal attention of a flat varlen batch over paged K/V, as `attention.paged_attention`
    (same arguments, same plan), computed in the cache's dtype. Returns `[T, H, D]` in q's dtype.
    """
    plan = checked_plan(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                        max_query_len=max_query_len, max_seq_len=max_seq_len, validate=validate,
                        plan=plan)
    out = q.new_empty(q.shape)
    for chunk in plan:
        out[chunk.tokens] = _attend_chunk(q[chunk.tokens], k_cache, v_cache, chunk, scale)
    return out


def _attend_chunk(q: Tensor, k_cache: Tensor, v_cache: Tensor, chunk: AttentionChunk,
                  scale: float) -> Tensor:
    """One chunk; q: `[B * Q, H, D]`, sequence after sequence. Returns `[B * Q, H, D]`."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, num_kv_heads = len(chunk.seqs), k_cache.shape[2]
    keys, values = gather_context(k_cache, v_cache, chunk, dtype=k_cache.dtype)
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, H_kv, L_pad, D]
    q = q.to(k_cache.dtype)
    if chunk.query_len == 1:
        # Query head h attends with KV head h // group: view the group as that head's rows.
        # Every row of a decode sees the same keys, so the chunk's mask broadcasts over them.
        packed = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(packed, keys, values, attn_mask=chunk.visible,
                                             scale=scale)  # [B, H_kv, group, D]
        return out.reshape(num_tokens, num_heads, head_dim)
    out = F.scaled_dot_product_attention(
        q.view(num_seqs, chunk.query_len, num_heads, head_dim).transpose(1, 2), keys, values,
        attn_mask=chunk.visible, scale=scale, enable_gqa=True,
    )  # [B, H, Q, D]
    return out.transpose(1, 2).reshape(num_tokens, num_heads, head_dim)


CPU_OPS = AttentionOps(
    name="cpu",
    paged_attention=cpu_paged_attention,
    reshape_and_cache=attention.reshape_and_cache,
    copy_blocks=attention.copy_blocks,
    swap_blocks=attention.swap_blocks,
    plan=plan_attention,
)
