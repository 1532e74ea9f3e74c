"""Attention in plain PyTorch: the dense oracle and (issue #5) the paged reference.

Every attention path in minipaged is checked against `dense_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class AttentionMetadata:
    """The flat batch's attention bookkeeping (DESIGN.md, "The data that flows").

    Sequence `i` owns queries `query_start_loc[i]:query_start_loc[i+1]` of the flat batch; they are
    the last positions of its `seq_lens[i]`-token context, whose keys live in the blocks listed in
    `block_tables[i]` (padded with -1). `slot_mapping[t]` is where token `t`'s new K/V is written
    (`block_id * block_size + offset`, -1 = do not write).
    """

    slot_mapping: Tensor  # [T] int64
    query_start_loc: Tensor  # [B + 1] int32
    seq_lens: Tensor  # [B] int32
    block_tables: Tensor  # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


def dense_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Causal attention of one sequence over contiguous K/V: the oracle.

    q: [n, H, D], the last n positions of a context of L tokens; k, v: [L, H_kv, D].
    Returns [n, H, D]. Query heads are grouped onto KV heads (GQA: H % H_kv == 0).
    Computed in float32 whatever the input dtype, and returned in q's dtype.
    """
    n, num_heads, _ = q.shape
    context_len, num_kv_heads, _ = k.shape
    if n > context_len:
        raise ValueError(f"{n} queries but only {context_len} context tokens")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_heads}) not a multiple of KV heads ({num_kv_heads})")
    group = num_heads // num_kv_heads
    qf = q.float().transpose(0, 1)  # [H, n, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (qf @ kf.transpose(1, 2)) * scale  # [H, n, L]
    query_pos = torch.arange(context_len - n, context_len, device=q.device)[:, None]
    key_pos = torch.arange(context_len, device=q.device)[None, :]
    scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vf  # [H, n, D]
    return out.transpose(0, 1).to(q.dtype)


def check_paged_attention_args(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
) -> None:
    """Validate the attention contract's inputs; raise `ValueError` naming the problem.

    Shared by the PyTorch reference and the Triton launchers so both reject the same inputs.
    Checks shapes, dtypes and devices, then the metadata's values (one host sync, so callers on
    a hot path may skip it).
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, H_kv, D], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"head_dim mismatch: q has {head_dim}, the KV cache {cache_head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})"
        )
    if q.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"dtype mismatch: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}"
        )
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [B, max_blocks], got {tuple(block_tables.shape)}")
    num_seqs = block_tables.shape[0]
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must be [{num_seqs}], got {tuple(seq_lens.shape)}")
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"query_start_loc must be [{num_seqs + 1}], got {tuple(query_start_loc.shape)}"
        )
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    if int(query_start_loc[0]) != 0 or int(query_start_loc[-1]) != num_tokens:
        raise ValueError(
            f"query_start_loc must run from 0 to the number of query tokens ({num_tokens}), "
            f"got {int(query_start_loc[0])}..{int(query_start_loc[-1])}"
        )
    if bool((query_lens < 0).any()):
        raise ValueError("query_start_loc must be non-decreasing")
    if bool((query_lens > seq_lens).any()):
        i = int(torch.nonzero(query_lens > seq_lens)[0])
        raise ValueError(
            f"sequence {i} has {int(query_lens[i])} queries but a context of only "
            f"{int(seq_lens[i])} tokens"
        )
    blocks_needed = (seq_lens + block_size - 1) // block_size
    if bool((blocks_needed > block_tables.shape[1]).any()):
        i = int(torch.nonzero(blocks_needed > block_tables.shape[1])[0])
        raise ValueError(
            f"sequence {i} has {int(seq_lens[i])} tokens, more than its block table covers "
            f"({block_tables.shape[1]} blocks of {block_size})"
        )
    used = torch.arange(block_tables.shape[1], device=q.device)[None, :] < blocks_needed[:, None]
    ids = block_tables[used]
    if ids.numel() and bool(((ids < 0) | (ids >= k_cache.shape[0])).any()):
        raise ValueError(
            f"block_tables name a block outside the cache's {k_cache.shape[0]} blocks "
            "within a sequence's context"
        )
