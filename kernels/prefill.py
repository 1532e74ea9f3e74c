"""Paged prefill attention: many queries per sequence, over a context read through block tables.

The general attention contract (DESIGN.md): the queries of sequence `i` are the last `n_i`
positions of its `seq_lens[i]`-token context, with causal masking. That covers a plain prefill
(n_i = the whole context), a prefill whose prefix hit the prefix cache (n_i smaller), chunked
prefill and decode (n_i = 1) alike, so a mixed batch takes ONE launch.

Program (sequence, query tile, KV head). Its rows are a tile of queries times the query heads
sharing the KV head (GQA), so K and V are loaded once for the whole group. It streams the
context in key tiles, each a few cache blocks found through the block table (the vLLM paper's
PagedAttention, Kwon et al., SOSP'23, section 4.1), and keeps FlashAttention's online softmax
(running max, running sum, rescaled output) so that no full score row is ever stored.
Everything is computed in float32.
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


@triton.jit
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
    BLOCK_SIZE: tl.constexpr, KEY_TILE: tl.constexpr,
    QK_PRECISION: tl.constexpr, PV_PRECISION: tl.constexpr,
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
    ).to(tl.float32)

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

        scores = tl.dot(q, tl.trans(k), input_precision=QK_PRECISION) * scale
        visible = key_ok[None, :] & (keys[None, :] <= position[:, None])  # causal
        scores = tl.where(visible, scores, float("-inf"))
        # Every row sees key 0 in the first tile, so m_new is finite from then on.
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PV_PRECISION)
        m = m_new

    out = acc / l[:, None]
    tl.store(
        out_ptr + (q_start + query)[:, None] * stride_ot + head[:, None] * stride_oh
        + dims[None, :] * stride_od,
        out, mask=io_mask,
    )


def default_query_tile(group_pad: int) -> int:
    """Queries per program: about 64 rows (128 in the interpreter), at least 16 for `tl.dot`."""
    rows = 128 if interpreting() else 64
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

    The attention contract (DESIGN.md). `max_query_len` sizes the grid (None: read from
    `query_start_loc`, one host sync); `max_seq_len` is accepted for signature parity.
    `query_tile` queries per program and `key_tile` keys per loop iteration are powers of two
    (None: chosen for the device). `validate=False` skips the argument checks (and their host
    syncs).
    """
    if validate:
        check_paged_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                   max_query_len=max_query_len, max_seq_len=max_seq_len)
    block_size = k_cache.shape[1]
    if key_tile is None:
        key_tile = default_key_tile(block_size)
    check_power_of_two("key_tile", key_tile, max(block_size, MIN_DOT_SIZE))
    group_pad = pow2_at_least(q.shape[1] // k_cache.shape[2])
    if query_tile is None:
        query_tile = default_query_tile(group_pad)
    check_power_of_two("query_tile", query_tile, triton.cdiv(MIN_DOT_SIZE, group_pad))
    if max_query_len is None:
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        max_query_len = int(query_lens.max()) if query_lens.numel() else 0
    return _launch_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                           max_query_len=max_query_len, query_tile=query_tile, key_tile=key_tile)


def _launch_prefill(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
    query_start_loc: Tensor, scale: float, *, max_query_len: int, query_tile: int, key_tile: int,
) -> Tensor:
    """One launch over the whole batch, on already validated arguments."""
    num_seqs = block_tables.shape[0]
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, like the reference
    if num_seqs == 0 or max_query_len == 0:
        return out
    group_pad = pow2_at_least(group)
    head_dim_pad = pow2_at_least(head_dim, MIN_DOT_SIZE)
    # A [64, 128] float32 tile is 64 registers per thread at 4 warps; q, acc, K and V need 8.
    num_warps = 8 if query_tile * group_pad * head_dim_pad >= 64 * 128 else 4
    grid = (num_seqs, triton.cdiv(max_query_len, query_tile), num_kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        scale,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, QUERY_TILE=query_tile,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=k_cache.shape[1], KEY_TILE=key_tile,
        QK_PRECISION=qk_precision(q.dtype), PV_PRECISION=PV_PRECISION,
        num_warps=num_warps,
    )
    return out
