"""Paged prefill attention: many queries per sequence, over a context read through block tables.

The general attention contract (`minipaged.attention.contract`): the queries of sequence `i` are the
last `n_i` positions of its `seq_lens[i]`-token context, with causal masking. That covers a plain
prefill (n_i = the whole context), a prefill whose prefix hit the prefix cache (n_i smaller),
chunked prefill and decode (n_i = 1) alike, so a mixed batch takes ONE launch.

Program (KV head, sequence, query tile). Its rows are a tile of queries times the query heads
sharing the KV head (GQA), so K and V are loaded once for the whole group. It streams the
context in key tiles, each a few cache blocks found through the block table (the vLLM paper's
PagedAttention, Kwon et al., SOSP'23, section 4.1), and keeps FlashAttention's online softmax
(running max, running sum, rescaled output) so that no full score row is ever stored.

It is FlashAttention-2's forward pass (Dao, 2023) as the Triton fused-attention tutorial writes
it, because a prefill is bound by tensor-core time: large tiles (128 query rows x 64 keys for
16-bit caches, `PREFILL_TILES`), loads pipelined a few tiles ahead (`num_stages`), softmax in
base 2 with the scale folded into one product, and the causal mask applied only where it can
bite: the key tiles wholly below the diagonal run a loop without masks or bounds checks, the
one to three tiles on the diagonal a second, masked loop, and the tiles above it are never
visited. Both products accumulate in float32. Q.K^T multiplies the stored 16-bit values exactly;
the probabilities enter P.V rounded to the cache dtype, as in FlashAttention and PyTorch's SDPA
(the decode kernel keeps them exact, `_tiles.pv_accumulate`: it is bound by memory, not by its
products). float32 caches multiply in "tf32x3" (`_tiles.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch import Tensor

from minipaged.attention.contract import check_paged_attention_args

from ._tiles import FP32_DOT_PRECISION, operand, qk_scores
from .launch import MIN_DOT_SIZE, KernelLaunch, check_power_of_two, interpreting, pow2_at_least


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
    BLOCK_SIZE: tl.constexpr, KEY_TILE: tl.constexpr, MASK_EVERY_TILE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Causal attention of QUERY_TILE queries x GROUP heads of one sequence over its context.

    Program (KV head, sequence, query tile), the query tiles numbered from the last: programs
    are started in grid order, so the tiles with the most keys start first and the short ones
    fill in behind them.
    """
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    query_tile = tl.num_programs(2) - 1 - tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if query_tile * QUERY_TILE >= q_len:  # the grid covers the longest query; this one is shorter
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    # Row r of the tile is query r // GROUP_PAD (within the tile) and head r % GROUP_PAD (within
    # the group); rows past the sequence's queries or past the group are padding: computed, never
    # stored.
    rows = tl.arange(0, QUERY_TILE * GROUP_PAD)
    query = query_tile * QUERY_TILE + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (query < q_len) & (rows % GROUP_PAD < GROUP)
    first = seq_len - q_len + query_tile * QUERY_TILE  # the tile's first query's position
    position = first + rows // GROUP_PAD  # each row's query's position in the context
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    io_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(
        q_ptr + (q_start + query)[:, None] * stride_qt + head[:, None] * stride_qh
        + dims[None, :] * stride_qd,
        mask=io_mask, other=0.0,
    )

    # exp2 instead of exp: scores are kept in log2 units (scale * log2(e) folded into one factor).
    qk_scale = scale * 1.4426950408889634
    m = tl.full([QUERY_TILE * GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([QUERY_TILE * GROUP_PAD], tl.float32)
    acc = tl.zeros([QUERY_TILE * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    table_row = block_tables_ptr + seq * stride_bt
    # Keys 0..first are visible to every row: whole tiles of them need no mask at all (and no
    # bound check: they are all inside the context). Key 0 is among them or in the first masked
    # tile, so every row's running max is finite after its first tile. MASK_EVERY_TILE: one
    # loop body only, for tiles whose registers do not leave room for a second.
    if MASK_EVERY_TILE:
        unmasked_end = 0
    else:
        unmasked_end = (first + 1) // KEY_TILE * KEY_TILE
    for key_start in range(0, unmasked_end, KEY_TILE):
        acc, l, m = _attend(
            acc, l, m, q, k_cache_ptr, v_cache_ptr, table_row, key_start, unmasked_end, position,
            kv_head, dims, dim_ok, qk_scale,
            stride_kb, stride_ks, stride_kh, stride_kd,
            stride_vb, stride_vs, stride_vh, stride_vd,
            BLOCK_SIZE, KEY_TILE, HEAD_DIM, HEAD_DIM_PAD, False, UPCAST,
        )
    # The diagonal: keys after the tile's last query are masked for every row, so stop there.
    key_end = tl.minimum(seq_len, first + QUERY_TILE)
    for key_start in range(unmasked_end, key_end, KEY_TILE):
        acc, l, m = _attend(
            acc, l, m, q, k_cache_ptr, v_cache_ptr, table_row, key_start, key_end, position,
            kv_head, dims, dim_ok, qk_scale,
            stride_kb, stride_ks, stride_kh, stride_kd,
            stride_vb, stride_vs, stride_vh, stride_vd,
            BLOCK_SIZE, KEY_TILE, HEAD_DIM, HEAD_DIM_PAD, True, UPCAST,
        )

    out = acc / l[:, None]
    tl.store(
        out_ptr + (q_start + query)[:, None] * stride_ot + head[:, None] * stride_oh
        + dims[None, :] * stride_od,
        out, mask=io_mask,
    )


@triton.jit
def _attend(
    acc, l, m, q, k_cache_ptr, v_cache_ptr, table_row, key_start, key_end, position,
    kv_head, dims, dim_ok, qk_scale,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    BLOCK_SIZE: tl.constexpr, KEY_TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    MASKED: tl.constexpr, UPCAST: tl.constexpr,
):
    """One key tile of FlashAttention's online softmax: (acc, l, m) updated by keys
    key_start..key_start + KEY_TILE.

    MASKED: the tile may reach past `key_end` or past some row's position (causal), so loads
    are bounds-checked and scores masked; otherwise every key is visible to every row and the
    tile is loaded and used as it is.
    """
    keys = key_start + tl.arange(0, KEY_TILE)
    key_ok = keys < key_end
    # Each key's physical block from the block table (the PagedAttention indirection, vLLM
    # paper section 4.1), then its slot inside that block.
    if MASKED:
        block = tl.load(table_row + keys // BLOCK_SIZE, mask=key_ok, other=0)
    else:
        block = tl.load(table_row + keys // BLOCK_SIZE)
    k_rows = block.to(tl.int64) * stride_kb + (keys % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
    v_rows = block.to(tl.int64) * stride_vb + (keys % BLOCK_SIZE) * stride_vs + kv_head * stride_vh
    k_ptrs = k_cache_ptr + k_rows[:, None] + dims[None, :] * stride_kd
    v_ptrs = v_cache_ptr + v_rows[:, None] + dims[None, :] * stride_vd
    if MASKED:
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    elif HEAD_DIM == HEAD_DIM_PAD:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=dim_ok[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=dim_ok[None, :], other=0.0)

    scores = qk_scores(q, k, qk_scale, UPCAST)  # log2 units
    if MASKED:
        visible = key_ok[None, :] & (keys[None, :] <= position[:, None])  # causal
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.math.exp2(m - m_new)
    p = tl.math.exp2(scores - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if v.dtype == tl.float32:
        acc = tl.dot(p, v, acc, input_precision=FP32_DOT_PRECISION)
    else:
        # The probabilities rounded to the cache dtype, as FlashAttention and PyTorch's SDPA
        # do: one 16-bit product instead of the decode kernel's two (`_tiles.pv_accumulate`).
        # The prefill is bound by tensor-core time, the decode by memory.
        acc = tl.dot(operand(p.to(v.dtype), UPCAST), operand(v, UPCAST), acc)
    return acc, l, m_new


@dataclass(frozen=True)
class PrefillTiles:
    """A prefill program's shape: `rows` query rows (queries x padded GQA group) against
    `keys` keys per loop iteration, on `num_warps` warps, with loads `num_stages` iterations
    ahead (Triton's software pipelining)."""

    rows: int
    keys: int
    num_warps: int
    num_stages: int


# On a GPU, by cache dtype and padded head dim. 16-bit caches take FlashAttention-2's tiles
# (the Triton fused-attention tutorial's): 128 rows x 64 keys on 8 warps, so that each of the
# two warp groups owns 64 whole rows (Hopper's wgmma is 64 rows tall) and no softmax statistic
# crosses them; 4 warps below head dim 64. At 256, 64 rows x 32 keys (64 keys spill on sm_80).
# float32 caches multiply in "tf32x3", which keeps every operand as two TF32 parts, so their
# tiles are 4-16x smaller. None spills on sm_80 or sm_90 (`minipaged.kernels.triton.aot`).
PREFILL_TILES: dict[tuple[str, int], PrefillTiles] = {
    ("16-bit", 16): PrefillTiles(128, 64, 4, 3),
    ("16-bit", 32): PrefillTiles(128, 64, 4, 3),
    ("16-bit", 64): PrefillTiles(128, 64, 8, 3),
    ("16-bit", 128): PrefillTiles(128, 64, 8, 3),
    ("16-bit", 256): PrefillTiles(64, 32, 8, 3),
    ("float32", 16): PrefillTiles(32, 32, 4, 2),
    ("float32", 32): PrefillTiles(64, 32, 4, 2),
    ("float32", 64): PrefillTiles(32, 32, 4, 2),
    ("float32", 128): PrefillTiles(16, 32, 8, 2),
    ("float32", 256): PrefillTiles(16, 16, 8, 3),
}
# Other shapes worth timing against the table's 16-bit choice at head dim 128, each spill-free
# on sm_90 (the H100 / H200); a sweep runs them in one GPU session through
# `paged_prefill_attention(..., query_tile=rows // group_pad, key_tile=keys, num_warps=...,
# num_stages=...)`. 128 x 128 is the tutorial's Hopper tile; 64 rows on 4 warps is one warp
# group, two programs per SM.
PREFILL_CANDIDATES: tuple[PrefillTiles, ...] = (
    PrefillTiles(128, 64, 8, 3),
    PrefillTiles(128, 128, 8, 2),
    PrefillTiles(64, 64, 4, 3),
)
# The interpreter: one size, large (every loop iteration costs the same whatever its size).
INTERPRETER_TILES = PrefillTiles(128, 128, 4, 1)


def prefill_tiles(dtype: torch.dtype, head_dim_pad: int) -> PrefillTiles:
    """The tiles `paged_prefill_attention` takes for a cache dtype and padded head dim."""
    if interpreting():
        return INTERPRETER_TILES
    kind = "float32" if dtype == torch.float32 else "16-bit"
    if (kind, head_dim_pad) in PREFILL_TILES:
        return PREFILL_TILES[kind, head_dim_pad]
    # Wider heads than any table entry: the widest entry's tiles, rows shrunk in proportion.
    widest = PREFILL_TILES[kind, 256]
    return replace(widest, rows=max(widest.rows * 256 // head_dim_pad, MIN_DOT_SIZE))


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
    num_warps: int | None = None,
    num_stages: int | None = None,
    validate: bool = True,
) -> Tensor:
    """Causal attention of a varlen batch over its paged contexts -> [T, H, D]; one launch.

    The attention contract (`minipaged.attention.contract`). `max_query_len` sizes the grid (None:
    read from `query_start_loc`, one host sync); `max_seq_len` is accepted for signature parity.
    `query_tile` queries per program and `key_tile` keys per loop iteration are powers of two;
    they, `num_warps` and `num_stages` default to `prefill_tiles` (the device's table).
    `validate=False` skips the argument checks (and their host syncs).
    """
    if validate:
        check_paged_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                   max_query_len=max_query_len, max_seq_len=max_seq_len)
    if max_query_len is None:
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        max_query_len = int(query_lens.max()) if query_lens.numel() else 0
    out, launches = prefill_launches(q, k_cache, v_cache, block_tables, seq_lens,
                                     query_start_loc, scale, max_query_len=max_query_len,
                                     query_tile=query_tile, key_tile=key_tile,
                                     num_warps=num_warps, num_stages=num_stages)
    for launch in launches:
        launch()
    return out


def prefill_launches(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
    query_start_loc: Tensor, scale: float, *, max_query_len: int,
    query_tile: int | None = None, key_tile: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None,
) -> tuple[Tensor, list[KernelLaunch]]:
    """The output tensor and the one launch over the whole batch that fills it.

    The tile and warp choices of `paged_prefill_attention`, on arguments whose metadata has
    been validated; no launch for an empty batch. Works on meta tensors too, which is how
    `minipaged.kernels.triton.aot` compiles exactly this launch for a GPU. The grid comes from
    shapes and `max_query_len` alone, so the launch can be captured in a CUDA graph.
    """
    num_seqs = block_tables.shape[0]
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    group_pad = pow2_at_least(group)
    head_dim_pad = pow2_at_least(head_dim, MIN_DOT_SIZE)
    tiles = prefill_tiles(k_cache.dtype, head_dim_pad)
    if key_tile is None:
        key_tile = tiles.keys
    check_power_of_two("key_tile", key_tile, MIN_DOT_SIZE)
    if query_tile is None:
        query_tile = max(tiles.rows // group_pad, 1, triton.cdiv(MIN_DOT_SIZE, group_pad))
    check_power_of_two("query_tile", query_tile, triton.cdiv(MIN_DOT_SIZE, group_pad))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, like the reference
    if num_seqs == 0 or max_query_len == 0:
        return out, []
    launch = KernelLaunch(
        "prefill", _prefill_kernel,
        (num_kv_heads, num_seqs, triton.cdiv(max_query_len, query_tile)),
        (q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, scale,
         *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
         block_tables.stride(0)),
        dict(GROUP=group, GROUP_PAD=group_pad, QUERY_TILE=query_tile,
             HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
             BLOCK_SIZE=block_size, KEY_TILE=key_tile,
             MASK_EVERY_TILE=k_cache.dtype == torch.float32 and head_dim_pad > 128,
             UPCAST=interpreting()),
        num_warps=num_warps or tiles.num_warps,
        num_stages=num_stages or tiles.num_stages,
    )
    return out, [launch]
