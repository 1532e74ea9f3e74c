"""Paged decode attention with split-K ("flash-decoding"): one query per sequence.

A decode step has one query token per sequence but a long context, so one program per sequence
and head leaves most of a GPU idle. Flash-decoding cuts each sequence's context into
`num_splits` partitions computed by separate programs (stage 1), then merges the partial results
by their log-sum-exp (stage 2). The keys are read through the block table, as in the vLLM
paper's PagedAttention kernel (Kwon et al., SOSP'23, section 4.1); the split-K partitions follow
vLLM's "v2" kernel and Dao et al.'s Flash-Decoding.

GQA: one stage-1 program serves all query heads that share a KV head, so each key and value is
loaded once per group. The group is padded to 16 rows (masked) so the products are `tl.dot`s
that a GPU compiles onto tensor cores; they accumulate in float32, as exact as float32
arithmetic (`_tiles.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from minipaged.attention.contract import check_paged_attention_args

from ._tiles import load_kv_tile, pv_accumulate, qk_scores
from .launch import (
    MIN_DOT_SIZE,
    KernelLaunch,
    check_power_of_two,
    default_key_tile,
    interpreting,
    pow2_at_least,
)

MAX_SPLITS = 64


# One compiled program for every split count and batch: Triton would otherwise compile another
# for num_splits == 1 and for multiples of 16, and for block tables whose row stride (the
# batch's longest sequence, in blocks) is a multiple of 16.
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _decode_partition_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    part_out_ptr, part_lse_ptr,
    scale, num_splits,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KEY_TILE: tl.constexpr, UPCAST: tl.constexpr,
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
    )

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

        scores = qk_scores(q, k, scale, UPCAST)
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)  # rescales what was summed under the old max
        p = tl.exp(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = pv_accumulate(acc * alpha[:, None], p, v, UPCAST)
        m = m_new

    nonempty = l > 0.0
    l_safe = tl.where(nonempty, l, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(nonempty, m + tl.log(l_safe), float("-inf"))
    # part_lse is contiguous [B, H, splits] and part_out [B, H, splits, D]: element `part` of
    # the first starts row `part` of the second.
    part = (seq * tl.num_programs(1) * GROUP + heads) * num_splits + split
    tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out,
             mask=row_ok[:, None] & dim_ok[None, :])
    tl.store(part_lse_ptr + part, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_partitions_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, query_start_loc_ptr,
    num_splits,
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

    part = (seq * tl.num_programs(1) + head) * num_splits + splits
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
    """`split_count` for the GPU `device`; 1 elsewhere (the interpreter runs programs one by
    one, so there a single partition is fastest)."""
    if interpreting() or torch.device(device).type != "cuda":
        return 1
    multiprocessors = torch.cuda.get_device_properties(device).multi_processor_count
    return split_count(num_seqs, num_kv_heads, max_seq_len, key_tile, multiprocessors)


def split_count(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, key_tile: int, multiprocessors: int,
) -> int:
    """Enough partitions to give a GPU about two programs per multiprocessor, no more; each
    partition keeps at least one key tile."""
    splits = triton.cdiv(2 * multiprocessors, max(num_seqs * num_kv_heads, 1))
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

    The attention contract (`minipaged.attention.contract`) restricted to one query per sequence.
    `num_splits` partitions per context (None: chosen for the device); `key_tile` keys per loop
    iteration (a power of two >= 16; None: chosen for the device).
    `max_query_len` is accepted for signature parity and must be 1 if given; `max_seq_len` saves a
    host sync. `validate=False` skips the argument checks (and their host syncs).
    """
    if validate:
        check_paged_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                   max_query_len=max_query_len, max_seq_len=max_seq_len)
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        if q.shape[0] != block_tables.shape[0] or bool((query_lens != 1).any()):
            raise ValueError("decode attention needs exactly one query per sequence")
    if max_query_len is not None and max_query_len != 1:
        raise ValueError(f"decode attention needs max_query_len == 1, got {max_query_len}")
    out, launches = decode_launches(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                    scale, max_seq_len=max_seq_len, num_splits=num_splits,
                                    key_tile=key_tile)
    for launch in launches:
        launch()
    return out


def decode_launches(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
    query_start_loc: Tensor, scale: float, *, max_seq_len: int | None = None,
    num_splits: int | None = None, key_tile: int | None = None,
) -> tuple[Tensor, list[KernelLaunch]]:
    """The output tensor and the two launches (partitions, merge) that fill it.

    The tile and split choices of `paged_decode_attention`, on arguments whose metadata has
    been validated; no launch for an empty batch. Works on meta tensors too, which is how
    `minipaged.kernels.triton.aot` compiles exactly these launches for a GPU.
    """
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    num_seqs = block_tables.shape[0]
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    head_dim_pad = pow2_at_least(head_dim, MIN_DOT_SIZE)
    if key_tile is None:
        key_tile = default_key_tile(k_cache.dtype, head_dim_pad)
    check_power_of_two("key_tile", key_tile, MIN_DOT_SIZE)
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max()) if num_seqs else 0
        num_splits = default_num_splits(num_seqs, num_kv_heads, max_seq_len, key_tile, q.device)
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, like the reference
    if num_seqs == 0:
        return out, []
    part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim,
                           dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    partitions = KernelLaunch(
        "decode_partition", _decode_partition_kernel, (num_seqs, num_kv_heads, num_splits),
        (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, part_out, part_lse,
         scale, num_splits, *q.stride(), *k_cache.stride(), *v_cache.stride(),
         block_tables.stride(0)),
        dict(GROUP=group, GROUP_PAD=pow2_at_least(group, MIN_DOT_SIZE),
             HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
             BLOCK_SIZE=block_size, KEY_TILE=key_tile, UPCAST=interpreting()),
        # 4 warps, or 8 for float32 caches at head dims above 128, whose [16, head dim]
        # accumulator and tf32x3 operands (two TF32 parts each) spill out of 4 warps' registers
        # on sm_90 (24-56 bytes of stack at head dim 256, with 16- or 32-key tiles;
        # `minipaged.kernels.triton.aot`).
        num_warps=8 if k_cache.dtype == torch.float32 and head_dim_pad > 128 else 4,
    )
    # Every split count merges in one program (masked rows cost no memory traffic), so a new
    # batch size never compiles a new one.
    merge = KernelLaunch(
        "decode_merge", _merge_partitions_kernel, (num_seqs, num_heads),
        (part_out, part_lse, out, query_start_loc, num_splits, *out.stride()),
        dict(SPLITS_PAD=MAX_SPLITS, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad),
    )
    return out, [partitions, merge]
