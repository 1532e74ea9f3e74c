"""Paged decode attention with split-K ("flash-decoding"): one query per sequence.

A decode step has one query token per sequence but a long context, so one program per sequence
and head leaves most of a GPU idle. Flash-decoding cuts each sequence's context into
`num_splits` partitions computed by separate programs (stage 1), then merges the partial results
by their log-sum-exp (stage 2). The keys are read through the block table, as in the vLLM
paper's PagedAttention kernel (Kwon et al., SOSP'23, section 4.1); the split-K partitions follow
vLLM's "v2" kernel and Dao et al.'s Flash-Decoding.

GQA: one stage-1 program serves all query heads that share a KV head, so each key and value is
loaded once per group. The group is padded to 16 rows (masked) so the products are `tl.dot`s
that a GPU compiles onto tensor cores; everything is computed in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from minipaged.attention_contract import check_paged_attention_args

from ._launch import (
    MIN_DOT_SIZE,
    PV_PRECISION,
    check_power_of_two,
    default_key_tile,
    interpreting,
    pow2_at_least,
    qk_precision,
)
from ._tiles import load_kv_tile

MAX_SPLITS = 64


@triton.jit
def _decode_partition_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    part_out_ptr, part_lse_ptr,
    scale, num_splits,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    stride_pb, stride_ph, stride_ps,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KEY_TILE: tl.constexpr,
    QK_PRECISION: tl.constexpr, PV_PRECISION: tl.constexpr,
):
    """Stage 1: attention of one sequence's query group over one partition of its context.

    Program (sequence, KV head, split). Writes, per query head of the group, the partition's
    softmax-normalised output and its log-sum-exp (-inf for an empty partition).
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    q_row = tl.load(query_start_loc_ptr + seq)

    rows = tl.arange(0, GROUP_PAD)  # query heads of the group, padded
    dims = tl.arange(0, HEAD_DIM_PAD)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    heads = kv_head * GROUP + rows
    q = tl.load(
        q_ptr + q_row * stride_qt + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
        mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
    ).to(tl.float32)

    # This split's whole key tiles: [first_tile, last_tile).
    num_tiles = tl.cdiv(seq_len, KEY_TILE)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    first_tile = split * tiles_per_split
    last_tile = tl.minimum(first_tile + tiles_per_split, num_tiles)

    # Online softmax state per query head: running max, running sum, unnormalised output.
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for tile in range(first_tile, last_tile):
        keys = tile * KEY_TILE + tl.arange(0, KEY_TILE)
        key_ok = keys < seq_len
        # Each key's physical block from the block table, then its slot inside the block.
        k, v = load_kv_tile(
            k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt, keys, key_ok,
            kv_head, dims, dim_ok,
            stride_kb, stride_ks, stride_kh, stride_kd,
            stride_vb, stride_vs, stride_vh, stride_vd,
            BLOCK_SIZE,
        )

        scores = tl.dot(q, tl.trans(k), input_precision=QK_PRECISION) * scale
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)  # rescales what was summed under the old max
        p = tl.exp(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PV_PRECISION)
        m = m_new

    nonempty = l > 0.0
    l_safe = tl.where(nonempty, l, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(nonempty, m + tl.log(l_safe), float("-inf"))
    # part_lse is contiguous [B, H, splits] and part_out [B, H, splits, D]: element `part` of
    # the first starts row `part` of the second.
    part = seq * stride_pb + heads * stride_ph + split * stride_ps
    tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out,
             mask=row_ok[:, None] & dim_ok[None, :])
    tl.store(part_lse_ptr + part, lse, mask=row_ok)


@triton.jit
def _merge_partitions_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, query_start_loc_ptr,
    num_splits,
    stride_pb, stride_ph, stride_ps,
    stride_ot, stride_oh, stride_od,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    """Stage 2: merge one (sequence, query head)'s partitions, each weighted by exp(its lse).

    softmax over the whole context = sum over partitions of out_i * exp(lse_i - lse_total),
    computed relative to the largest lse so that nothing overflows.
    """
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    split_ok = splits < num_splits
    dim_ok = dims < HEAD_DIM

    part = seq * stride_pb + head * stride_ph + splits * stride_ps
    lse = tl.load(part_lse_ptr + part, mask=split_ok, other=float("-inf"))
    weights = tl.exp(lse - tl.max(lse, axis=0))  # empty partitions: exp(-inf) = 0
    weights = weights / tl.sum(weights, axis=0)
    partial = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :],
                      mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
    out = tl.sum(weights[:, None] * partial, axis=0)

    q_row = tl.load(query_start_loc_ptr + seq)
    tl.store(out_ptr + q_row * stride_ot + head * stride_oh + dims * stride_od, out, mask=dim_ok)


def default_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, key_tile: int,
    device: torch.device | str = "cuda",
) -> int:
    """Enough partitions to give the GPU about two programs per multiprocessor, no more.

    Each partition keeps at least one key tile; the interpreter runs programs one by one, so
    there a single partition is fastest.
    """
    if interpreting() or torch.device(device).type != "cuda":
        return 1
    programs = num_seqs * num_kv_heads
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    splits = triton.cdiv(target, max(programs, 1))
    return max(1, min(splits, triton.cdiv(max_seq_len, key_tile), MAX_SPLITS))


def paged_decode_attention(
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
    num_splits: int | None = None,
    key_tile: int | None = None,
    validate: bool = True,
) -> Tensor:
    """Attention of each sequence's single query over its paged context -> [B, H, D].

    The attention contract (DESIGN.md) restricted to one query per sequence. `num_splits`
    partitions per context (None: chosen for the device); `key_tile` keys per loop iteration
    (a power of two >= 16 and >= the block size; None: chosen for the device).
    `max_query_len` is accepted for signature parity and must be 1 if given; `max_seq_len`
    saves a host sync. `validate=False` skips the argument checks (and their host syncs).
    """
    num_seqs = block_tables.shape[0]
    if validate:
        check_paged_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                   max_query_len=max_query_len, max_seq_len=max_seq_len)
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        if q.shape[0] != num_seqs or bool((query_lens != 1).any()):
            raise ValueError("decode attention needs exactly one query per sequence")
    if max_query_len is not None and max_query_len != 1:
        raise ValueError(f"decode attention needs max_query_len == 1, got {max_query_len}")
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    block_size = k_cache.shape[1]
    if key_tile is None:
        key_tile = default_key_tile(block_size)
    check_power_of_two("key_tile", key_tile, max(block_size, MIN_DOT_SIZE))
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if num_seqs else 0
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, k_cache.shape[2], max_seq_len, key_tile,
                                        q.device)
    return _launch_decode(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                          num_splits=num_splits, key_tile=key_tile)


def _launch_decode(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
    query_start_loc: Tensor, scale: float, *, num_splits: int, key_tile: int,
) -> Tensor:
    """Run both stages on already validated arguments."""
    num_seqs = block_tables.shape[0]
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, like the reference
    if num_seqs == 0:
        return out
    part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim,
                           dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    head_dim_pad = pow2_at_least(head_dim, MIN_DOT_SIZE)

    _decode_partition_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        part_out, part_lse,
        scale, num_splits,
        *q.stride(), *k_cache.stride(), *v_cache.stride(),
        block_tables.stride(0),
        *part_lse.stride(),
        GROUP=group, GROUP_PAD=pow2_at_least(group, MIN_DOT_SIZE),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=k_cache.shape[1], KEY_TILE=key_tile,
        QK_PRECISION=qk_precision(q.dtype), PV_PRECISION=PV_PRECISION,
    )
    _merge_partitions_kernel[(num_seqs, num_heads)](
        part_out, part_lse, out, query_start_loc,
        num_splits,
        *part_lse.stride(),
        *out.stride(),
        SPLITS_PAD=pow2_at_least(num_splits, 2),  # no size-1 aranges
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
    )
    return out
