"""Paged prefill attention: many queries per sequence, over a context read through block tables.

The general attention contract (`minipaged.attention.contract`): the queries of sequence `i` are the
last `n_i` positions of its `seq_lens[i]`-token context, with causal masking. That covers a plain
prefill (n_i = the whole context), a prefill whose prefix hit the prefix cache (n_i smaller),
chunked prefill and decode (n_i = 1) alike, so a mixed batch takes ONE launch.

Program (sequence, query tile, KV head). Its rows are a tile of queries times the query heads
sharing the KV head (GQA), so K and V are loaded once for the whole group. It streams the
context in key tiles, each a few cache blocks found through the block table (the vLLM paper's
PagedAttention, Kwon et al., SOSP'23, section 4.1), and keeps FlashAttention's online softmax
(running max, running sum, rescaled output) so that no full score row is ever stored.
The products accumulate in float32, as exact as float32 arithmetic (`_tiles.py`).
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


# The block table's row stride changes with every batch's longest sequence: not specialising
# it on divisibility by 16 keeps one compiled program for all of them.
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, QUERY_TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KEY_TILE: tl.constexpr, UPCAST: tl.constexpr,
):
    """Causal attention of QUERY_TILE queries x GROUP heads of one sequence over its context."""
    seq = tl.program_id(0)
    query_tile = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if query_tile * QUERY_TILE >= q_len:  # the grid covers the longest query; this one is shorter
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    # Row r of the tile is query r // GROUP_PAD (within the tile) and head r % GROUP_PAD (within
    # the group); rows past the sequence's queries or past the group are padding.
    rows = tl.arange(0, QUERY_TILE * GROUP_PAD)
    query = query_tile * QUERY_TILE + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (query < q_len) & (rows % GROUP_PAD < GROUP)
    position = seq_len - q_len + query  # each query's position in the context
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    io_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(
        q_ptr + (q_start + query)[:, None] * stride_qt + head[:, None] * stride_qh
        + dims[None, :] * stride_qd,
        mask=io_mask, other=0.0,
    )

    # Keys after the tile's last query are masked for every row: stop before them.
    key_end = tl.minimum(seq_len, seq_len - q_len + (query_tile + 1) * QUERY_TILE)
    m = tl.full([QUERY_TILE * GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([QUERY_TILE * GROUP_PAD], tl.float32)
    acc = tl.zeros([QUERY_TILE * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for key_start in range(0, key_end, KEY_TILE):
        keys = key_start + tl.arange(0, KEY_TILE)
        key_ok = keys < key_end
        k, v = load_kv_tile(
            k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt, keys, key_ok,
            kv_head, dims, dim_ok,
            stride_kb, stride_ks, stride_kh, stride_kd,
            stride_vb, stride_vs, stride_vh, stride_vd,
            BLOCK_SIZE,
        )

        scores = qk_scores(q, k, scale, UPCAST)
        visible = key_ok[None, :] & (keys[None, :] <= position[:, None])  # causal
        scores = tl.where(visible, scores, float("-inf"))
        # Every row sees key 0 in the first tile, so m_new is finite from then on.
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = pv_accumulate(acc * alpha[:, None], p, v, UPCAST)
        m = m_new

    out = acc / l[:, None]
    tl.store(
        out_ptr + (q_start + query)[:, None] * stride_ot + head[:, None] * stride_oh
        + dims[None, :] * stride_od,
        out, mask=io_mask,
    )


def default_query_tile(group_pad: int, dtype: torch.dtype, head_dim_pad: int) -> int:
    """Queries per program, so that a program has `rows = query tile x group` query rows.

    The interpreter takes 128 rows. On a GPU the [rows, head dim] query and accumulator tiles
    are what a thread must hold in registers (at most 255): for 16-bit caches tiles of at
    most 8192 elements (64 rows up to head dim 128, 32 at 256: 64 rows spill 48-280 bytes
    there); for float32 ones, whose "tf32x3" products keep every operand as two TF32 parts, of
    at most 2048 (32 rows at head dim 64, 16 at 128 and above). At least 16 rows, the
    smallest `tl.dot`.
    """
    if interpreting():
        rows = 128
    elif dtype == torch.float32:
        rows = 2048 // head_dim_pad
    else:
        rows = min(64, 8192 // head_dim_pad)
    rows = max(rows, MIN_DOT_SIZE)
    return max(rows // group_pad, 1, triton.cdiv(MIN_DOT_SIZE, group_pad))


def paged_prefill_attention(
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
    query_tile: int | None = None,
    key_tile: int | None = None,
    validate: bool = True,
) -> Tensor:
    """Causal attention of a varlen batch over its paged contexts -> [T, H, D]; one launch.

    The attention contract (`minipaged.attention.contract`). `max_query_len` sizes the grid (None:
    read from `query_start_loc`, one host sync); `max_seq_len` is accepted for signature parity.
    `query_tile` queries per program and `key_tile` keys per loop iteration are powers of two (None:
    chosen for the device). `validate=False` skips the argument checks (and their host syncs).
    """
    if validate:
        check_paged_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                   max_query_len=max_query_len, max_seq_len=max_seq_len)
    if max_query_len is None:
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        max_query_len = int(query_lens.max()) if query_lens.numel() else 0
    out, launches = prefill_launches(q, k_cache, v_cache, block_tables, seq_lens,
                                     query_start_loc, scale, max_query_len=max_query_len,
                                     query_tile=query_tile, key_tile=key_tile)
    for launch in launches:
        launch()
    return out


def prefill_launches(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
    query_start_loc: Tensor, scale: float, *, max_query_len: int,
    query_tile: int | None = None, key_tile: int | None = None,
) -> tuple[Tensor, list[KernelLaunch]]:
    """The output tensor and the one launch over the whole batch that fills it.

    The tile and warp choices of `paged_prefill_attention`, on arguments whose metadata has
    been validated; no launch for an empty batch. Works on meta tensors too, which is how
    `minipaged.kernels.triton.aot` compiles exactly this launch for a GPU.
    """
    block_size = k_cache.shape[1]
    num_seqs = block_tables.shape[0]
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    group_pad = pow2_at_least(group)
    head_dim_pad = pow2_at_least(head_dim, MIN_DOT_SIZE)
    if key_tile is None:
        key_tile = default_key_tile(k_cache.dtype, head_dim_pad)
    check_power_of_two("key_tile", key_tile, MIN_DOT_SIZE)
    if query_tile is None:
        query_tile = default_query_tile(group_pad, k_cache.dtype, head_dim_pad)
    check_power_of_two("query_tile", query_tile, triton.cdiv(MIN_DOT_SIZE, group_pad))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, like the reference
    if num_seqs == 0 or max_query_len == 0:
        return out, []
    # At head dim 128 the q, acc, K and V tiles (default sizes, either dtype) spill out of 4
    # warps' registers on sm_80; 8 warps halve each thread's share.
    num_warps = 8 if head_dim_pad >= 128 else 4
    launch = KernelLaunch(
        "prefill", _prefill_kernel,
        (num_seqs, triton.cdiv(max_query_len, query_tile), num_kv_heads),
        (q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, scale,
         *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
         block_tables.stride(0)),
        dict(GROUP=group, GROUP_PAD=group_pad, QUERY_TILE=query_tile,
             HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
             BLOCK_SIZE=block_size, KEY_TILE=key_tile, UPCAST=interpreting()),
        num_warps=num_warps,
    )
    return out, [launch]
