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
