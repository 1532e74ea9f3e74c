"""Paged attention arranged for a CPU: the reference's method, in the cache's dtype, GQA-packed.

`minipaged.attention.reference.paged_attention` is the paper's algorithm written to be read (Kwon
et al., SOSP'23, section 4.1): it gathers a chunk of sequences' blocks (`plan_attention`,
`gather_context`) and runs one masked attention over them, in float32. This module keeps that
plan and that gather and changes only what the CPU pays for (`benchmarks/cpu/attention.py`
measures each against the reference):

* **The cache's dtype throughout.** K/V are gathered and attended in the dtype they are cached in;
  nothing is converted to float32 per layer. `scaled_dot_product_attention` on CPU accumulates a
  bfloat16 or float16 attention in float32 inside its kernel and rounds the output once, so the
  result is the reference's within one rounding of the output (bf16 tolerances in the tests).
* **Decodes read their blocks in place.** Every decode of the step (one query per sequence) goes
  to the native kernel (`minipaged.kernels.cpu.native`, C with an online softmax over the sequence's
  blocks where they lie in the cache), in one call per layer: no gather copy, each K/V row read
  once for all the query heads that share it. Where the kernel cannot be built (no C compiler)
  or does not take the dtype (float16), decodes are gathered like prefills, with the grouped
  query heads packed onto their KV head so each block is read once per KV head and the
  attention multiplies several rows at a time (its single-row path is slow in bfloat16).
* **New keys and values are written in one call** (`write_kv`, beside the decode kernel): the
  reference's masked index and two `index_copy_` are six operators a layer, each dearer than the
  copy itself at a decode step.

`cpu_paged_attention` has the attention contract's signature (`minipaged.attention.contract`);
`CPU_OPS` is the CPU platform's backend "cpu": its plan (`plan_cpu_attention`,
the reference's chunks with the decodes set apart), attention and KV writes
(`cpu_reshape_and_cache`) beside the reference's block copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from minipaged.attention import reference as attention
from minipaged.attention.contract import (
    AttentionOps,
    check_paged_attention_args,
    check_reshape_and_cache_args,
)
from minipaged.attention.reference import (
    AttentionChunk,
    check_plan_covers,
    gather_context,
    plan_attention,
)
from minipaged.kernels.cpu.native import (
    PROFILER_NAME,
    WRITE_PROFILER_NAME,
    bind_paged_decode,
    bind_write_kv,
    native_decode_available,
    native_decode_supports,
    write_kv_supports,
)
from minipaged.platforms.cpu.replay import (
    CaptureError,
    contiguous,
    empty,
    launch,
    platform_code,
    recording,
)


@dataclass(frozen=True)
class NativeDecodes:
    """A step's decodes, as the native kernel takes them (int32, built once for every layer)."""

    rows: Tensor  # [n]: each decode's row of the flat batch
    seqs: Tensor  # [n]: its sequence
    block_tables: Tensor  # [B, max_blocks]
    seq_lens: Tensor  # [B]


@dataclass(frozen=True)
class CPUPlan:
    """The reference's chunks for what the kernel does not take, and the decodes it does."""

    chunks: list[AttentionChunk]
    decodes: NativeDecodes | None

    @property
    def num_queries(self) -> int:
        decoded = 0 if self.decodes is None else self.decodes.rows.numel()
        return decoded + sum(chunk.tokens.numel() for chunk in self.chunks)


@platform_code()
def plan_cpu_attention(
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    k_cache: Tensor,
    *,
    native: bool = True,
) -> CPUPlan:
    """`attention.plan_attention`'s chunks, with the decode chunks (one query per sequence) set
    apart for the native kernel when it is built and takes `k_cache`'s dtype. `native=False`
    gathers decodes like the rest, as where the kernel cannot be built (for comparison)."""
    chunks = plan_attention(block_tables, seq_lens, query_start_loc, k_cache)
    decode_chunks = [c for c in chunks if c.query_len == 1]
    if not (native and decode_chunks and native_decode_supports(k_cache)
            and native_decode_available()):
        return CPUPlan(chunks, None)
    decodes = NativeDecodes(
        rows=torch.cat([c.tokens for c in decode_chunks]).to(torch.int32),
        seqs=torch.tensor([i for c in decode_chunks for i in c.seqs], dtype=torch.int32),
        block_tables=block_tables.to(torch.int32).contiguous(),
        seq_lens=seq_lens.to(torch.int32).contiguous(),
    )
    return CPUPlan([c for c in chunks if c.query_len != 1], decodes)


@platform_code()
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
    plan: CPUPlan | None = None,
) -> Tensor:
    """Causal attention of a flat varlen batch over paged K/V, as `attention.paged_attention`
    (same arguments; `plan` from `plan_cpu_attention`), computed in the cache's dtype. Returns
    `[T, H, D]` in q's dtype."""
    if validate:
        check_paged_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                   max_query_len=max_query_len, max_seq_len=max_seq_len)
    if plan is None:
        plan = plan_cpu_attention(block_tables, seq_lens, query_start_loc, k_cache)
    elif validate:
        check_plan_covers(plan.num_queries, q)
    if plan.chunks and recording() is not None:
        raise CaptureError("a capture replays the native decode kernel only; this step gathers")
    out = empty(q.shape, q.dtype)
    if plan.decodes is not None:
        d = plan.decodes
        q = contiguous(q, "strided queries are")
        call = bind_paged_decode(out, q, k_cache, v_cache, d.block_tables, d.seq_lens, d.rows,
                                 d.seqs, scale, validate=validate)
        launch(call, PROFILER_NAME, out, q, k_cache, v_cache, d.block_tables, d.seq_lens,
               d.rows, d.seqs)
    for chunk in plan.chunks:
        out[chunk.tokens] = _attend_chunk(q[chunk.tokens], k_cache, v_cache, chunk, scale)
    return out


@platform_code()
def cpu_reshape_and_cache(
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    *,
    validate: bool = True,
) -> None:
    """`attention.reshape_and_cache` (same arguments and result), in one native call where the
    kernel is built and takes these tensors (`write_kv_supports`), else the reference's way."""
    if validate:
        check_reshape_and_cache_args(key, value, k_cache, v_cache, slot_mapping)
    if native_decode_available() and write_kv_supports(key, value, k_cache, v_cache,
                                                       slot_mapping):
        launch(bind_write_kv(key, value, k_cache, v_cache, slot_mapping),
               WRITE_PROFILER_NAME, key, value, k_cache, v_cache, slot_mapping)
    elif recording() is not None:
        raise CaptureError("the native KV write does not take these tensors")
    else:
        attention.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, validate=False)


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
    reshape_and_cache=cpu_reshape_and_cache,
    copy_blocks=attention.copy_blocks,
    swap_blocks=attention.swap_blocks,
    plan=plan_cpu_attention,
)
