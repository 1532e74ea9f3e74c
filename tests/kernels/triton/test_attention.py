"""The Triton paged-attention kernels equal dense attention, for any block table.

Run on CPU through Triton's interpreter (`TRITON_INTERPRET=1`, set by conftest.py) and on CUDA
by `benchmarks/gpu/check.py`. Every case scatters contiguous K/V into a shuffled paged cache with
garbage (NaN, inf or huge values) in every slot no sequence owns, so a kernel that reads one slot
too many fails. Oracle: `minipaged.attention.reference.dense_attention` per sequence; the PyTorch
reference `minipaged.attention.reference.paged_attention` must agree as well. Tolerances per dtype
are `paged_utils.TOLERANCES` (float32: 1e-5 relative and absolute; float16: 2e-3; bfloat16: 1.6e-2,
about one unit in the last place of the output dtype).

The interpreter costs a few milliseconds per loop iteration, so cases are small and some draw
small key/query tiles on purpose: that is what makes the online softmax span several tiles and
the split-K partitions hold several tiles each.
"""

from __future__ import annotations

import os
from dataclasses import astuple
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from paged_utils import lengths, seq_and_query_lens

import minipaged.attention.reference as reference
from minipaged import kernels
from minipaged.attention.contract import dense_attention
from minipaged.kernels.triton import attention as dispatch  # the dispatcher's module, to patch
from minipaged.kernels.triton.decode import paged_decode_attention
from minipaged.kernels.triton.prefill import (
    PREFILL_CANDIDATES,
    PREFILL_TILES,
    paged_prefill_attention,
    prefill_launches,
)
from minipaged.testing.paged_examples import dense_reference, make_attention_case, tolerance

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" \
    else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Garbage for unused slots: NaN, infinities, and a huge value that float16 can still hold.
GARBAGE = [float("nan"), float("inf"), float("-inf"), 6.0e4]


@st.composite
def attention_shapes(draw: st.DrawFn) -> dict:
    """Block size, head shapes, dtype, garbage and seed of one case."""
    num_kv_heads = draw(st.sampled_from([1, 2]))
    return {
        "block_size": draw(st.sampled_from([8, 16, 32])),
        "head_dim": draw(st.sampled_from([32, 64, 128])),
        "num_kv_heads": num_kv_heads,
        "num_heads": num_kv_heads * draw(st.sampled_from([1, 2, 3, 4, 8])),
        "dtype": draw(st.sampled_from(DTYPES)),
        "garbage": draw(st.sampled_from(GARBAGE)),
        "seed": draw(st.integers(0, 2**16)),
    }


def assert_matches_oracles(case, out: torch.Tensor) -> None:
    """`out` equals dense attention and the PyTorch paged reference within the dtype's tolerance."""
    tol = tolerance(case.q.dtype)
    torch.testing.assert_close(out.float().cpu(), dense_reference(case).float().cpu(), **tol)
    torch.testing.assert_close(
        out.float().cpu(), reference.paged_attention(*case.args()).float().cpu(), **tol
    )


@settings(max_examples=20)
@given(shapes=attention_shapes(), data=st.data())
def test_paged_attention_equals_dense(shapes: dict, data: st.DataObject) -> None:
    """Any varlen batch (query lengths 1..context) through the dispatcher equals the oracles."""
    seq_lens, query_lens = data.draw(seq_and_query_lens(shapes["block_size"], max_seqs=3))
    case = make_attention_case(seq_lens, query_lens, device=DEVICE, **shapes)
    out = kernels.paged_attention(*case.args())
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert_matches_oracles(case, out)


@settings(max_examples=15)
@given(shapes=attention_shapes(), data=st.data())
def test_prefill_tiles_equal_dense(shapes: dict, data: st.DataObject) -> None:
    """The prefill kernel with small query and key tiles (many tiles per sequence, several
    query tiles per program grid row, queries far from the context start) equals the oracles."""
    block_size = shapes["block_size"]
    seq_lens, query_lens = data.draw(
        seq_and_query_lens(block_size, max_seqs=3, max_len=6 * block_size)
    )
    case = make_attention_case(seq_lens, query_lens, device=DEVICE, **shapes)
    group_pad = 1 << (shapes["num_heads"] // shapes["num_kv_heads"] - 1).bit_length()
    query_tile = data.draw(st.sampled_from([16, 32])) // min(group_pad, 16)
    # A key tile may be part of a block (16 keys of a 32-key block), one block or several.
    key_tile = data.draw(st.sampled_from([16, max(block_size, 16), 2 * block_size]))
    out = paged_prefill_attention(*case.args(), query_tile=query_tile, key_tile=key_tile)
    assert_matches_oracles(case, out)


@settings(max_examples=6)
@given(shapes=attention_shapes(), data=st.data())
def test_decode_every_split_count_gives_the_same_result(shapes: dict, data: st.DataObject) -> None:
    """Split-K decode with 1..8 partitions: each equals the oracles and the 1-split answer."""
    block_size = shapes["block_size"]
    key_tile = max(block_size, 16)
    # Up to 8 key tiles per context, so that 8 partitions can all hold work (or some none).
    seq_lens = data.draw(st.lists(lengths(block_size, 8 * key_tile), min_size=1, max_size=2))
    case = make_attention_case(seq_lens, [1] * len(seq_lens), device=DEVICE, **shapes)
    single = paged_decode_attention(*case.args(), num_splits=1, key_tile=key_tile)
    assert_matches_oracles(case, single)
    # The merge only reorders float32 sums, so splits agree far more tightly than the oracle
    # tolerance in float32; in 16-bit dtypes they may round one unit apart.
    same = ({"rtol": 2e-6, "atol": 2e-6} if case.q.dtype == torch.float32
            else tolerance(case.q.dtype))
    for num_splits in range(2, 9):
        out = paged_decode_attention(*case.args(), num_splits=num_splits,
                                             key_tile=key_tile)
        torch.testing.assert_close(out.float(), single.float(), **same)
        torch.testing.assert_close(out.float().cpu(), dense_reference(case).float().cpu(),
                                   **tolerance(case.q.dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_boundary_lengths_and_odd_head_shapes(dtype: torch.dtype) -> None:
    """Contexts of 1, bs-1, bs, bs+1 tokens; head dim 80 (not a power of two, padded with a
    mask) and GQA group 3 (SmolLM2's 9 query / 3 KV heads), through both kernels."""
    bs = 16
    seq_lens = [1, bs - 1, bs, bs + 1, 3 * bs + 5]
    case = make_attention_case(seq_lens, [1, bs - 1, 2, bs + 1, 20], num_heads=9,
                               num_kv_heads=3, head_dim=80, block_size=bs, dtype=dtype,
                               device=DEVICE)
    assert_matches_oracles(case, kernels.paged_attention(*case.args()))
    decode = make_attention_case(seq_lens, [1] * len(seq_lens), num_heads=9, num_kv_heads=3,
                                 head_dim=80, block_size=bs, dtype=dtype, device=DEVICE)
    assert_matches_oracles(decode, paged_decode_attention(*decode.args(), num_splits=3,
                                                                  key_tile=bs))


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_dim_256_with_the_gpu_tiles(dtype: torch.dtype) -> None:
    """Head dim 256 (Gemma's) through the dispatcher and through both kernels with the tiles a
    GPU takes there (`minipaged.kernels.triton.aot` shows them spill-free): 16-key tiles, half of
    each 32-key block for float32, and 16 query rows; for 16-bit caches 32-key tiles in the
    prefill, 64-key ones in the decode."""
    bs = 32
    seq_lens, query_lens = [1, bs + 1, 2 * bs + 6], [1, bs + 1, 5]
    case = make_attention_case(seq_lens, query_lens, num_heads=4, num_kv_heads=2,
                               head_dim=256, block_size=bs, dtype=dtype, device=DEVICE)
    assert_matches_oracles(case, kernels.paged_attention(*case.args()))
    key_tile = 16 if dtype == torch.float32 else 32
    assert_matches_oracles(case, paged_prefill_attention(*case.args(), query_tile=8,
                                                         key_tile=key_tile))
    key_tile = 16 if dtype == torch.float32 else 64
    decode = make_attention_case(seq_lens, [1] * len(seq_lens), num_heads=4, num_kv_heads=2,
                                 head_dim=256, block_size=bs, dtype=dtype, device=DEVICE)
    assert_matches_oracles(decode, paged_decode_attention(*decode.args(), num_splits=2,
                                                          key_tile=key_tile))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiles", sorted({t for t in PREFILL_TILES.values() if t.rows >= 64}
                                         | set(PREFILL_CANDIDATES), key=astuple),
                         ids=lambda t: "x".join(map(str, astuple(t))))
def test_prefill_with_the_gpu_tiles(dtype: torch.dtype, tiles) -> None:
    """The prefill kernel with each large tile shape a GPU takes (`PREFILL_TILES`, and the
    `PREFILL_CANDIDATES` a timing sweep tries), on contexts that need both of its loops: whole
    key tiles below the diagonal (a prefix-cache hit puts the first query at 2-4 key tiles) and
    the masked diagonal, with a last query tile that is partly padding."""
    num_heads, num_kv_heads = 8, 2
    group_pad = 4
    # The last sequence's first query sits at position 2 * keys - 2: one key short of a third
    # whole tile, the edge between the two loops.
    seq_lens = [2 * tiles.keys + 37, 4 * tiles.keys + 5, 9, 2 * tiles.keys + 3]
    query_lens = [tiles.rows // group_pad + 3, 2 * tiles.keys, 9, 5]
    case = make_attention_case(seq_lens, query_lens, num_heads=num_heads,
                               num_kv_heads=num_kv_heads, head_dim=64, block_size=16,
                               dtype=dtype, device=DEVICE)
    out = paged_prefill_attention(*case.args(), query_tile=tiles.rows // group_pad,
                                  key_tile=tiles.keys, num_warps=tiles.num_warps,
                                  num_stages=tiles.num_stages)
    assert_matches_oracles(case, out)


def test_prefill_grid_runs_the_longest_query_tiles_first_and_comes_from_shapes() -> None:
    """Grid (KV heads, sequences, query tiles of the longest query) from shapes and
    `max_query_len` alone; on meta tensors too (no device memory is read to plan it)."""
    q = torch.empty(300, 8, 64, dtype=torch.float16, device="meta")
    cache = torch.empty(40, 16, 2, 64, dtype=torch.float16, device="meta")
    tables = torch.empty(3, 40, dtype=torch.int32, device="meta")
    lens = torch.empty(3, dtype=torch.int32, device="meta")
    starts = torch.empty(4, dtype=torch.int32, device="meta")
    _, [launch] = prefill_launches(q, cache, cache, tables, lens, starts, 0.125,
                                   max_query_len=200, query_tile=32, key_tile=64)
    assert launch.grid == (2, 3, 7)
    assert launch.constexprs["QUERY_TILE"] == 32 and launch.constexprs["GROUP_PAD"] == 4


@pytest.mark.parametrize("query_lens", [[1, 1], [4, 30]], ids=["decode", "prefill"])
def test_strided_queries_as_sliced_from_a_fused_projection(query_lens: list[int]) -> None:
    """q may be a non-contiguous view (a slice of a fused QKV output); the output is contiguous."""
    case = make_attention_case([9, 30], query_lens, num_heads=4, num_kv_heads=2, head_dim=32,
                               block_size=8, device=DEVICE)
    fused = torch.cat([case.q, torch.full_like(case.q, float("nan"))], dim=1)  # [T, 2H, D]
    strided = fused[:, :4]
    assert not strided.is_contiguous()
    c = case.cache
    out = kernels.paged_attention(strided, c.k_cache, c.v_cache, c.block_tables, c.seq_lens,
                                  case.query_start_loc, case.scale)
    assert out.is_contiguous()
    torch.testing.assert_close(out, dense_reference(case), **tolerance(torch.float32))


def test_dispatcher_sends_pure_decode_to_the_decode_kernel() -> None:
    """One query per sequence -> decode kernel; any longer query or empty sequence -> prefill."""
    decode = make_attention_case([5, 40], [1, 1], num_heads=4, num_kv_heads=2, head_dim=32,
                                 block_size=8, device=DEVICE)
    mixed = make_attention_case([5, 40], [1, 7], num_heads=4, num_kv_heads=2, head_dim=32,
                                block_size=8, device=DEVICE)
    with mock.patch.object(dispatch, "paged_decode_attention",
                           wraps=dispatch.paged_decode_attention) as dec, \
            mock.patch.object(dispatch, "paged_prefill_attention",
                              wraps=dispatch.paged_prefill_attention) as pre:
        kernels.paged_attention(*decode.args())
        assert (dec.call_count, pre.call_count) == (1, 0)
        kernels.paged_attention(*mixed.args())
        assert (dec.call_count, pre.call_count) == (1, 1)
        # Two sequences, one query in total: the other has none, so it is not a pure decode.
        case = make_attention_case([5, 40], [1, 1], num_heads=4, num_kv_heads=2, head_dim=32,
                                   block_size=8, device=DEVICE)
        q = case.q[:1]
        qsl = torch.tensor([0, 1, 1], dtype=torch.int32, device=DEVICE)
        c = case.cache
        out = kernels.paged_attention(q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens, qsl,
                                      case.scale)
        assert (dec.call_count, pre.call_count) == (1, 2)
    expected = dense_attention(q, case.keys[0], case.values[0], case.scale)
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))


# --- bad input -------------------------------------------------------------------------------

ENTRY_POINTS = [kernels.paged_attention, kernels.paged_decode_attention,
                kernels.paged_prefill_attention]


def _decode_case():
    return make_attention_case([9, 20], [1, 1], num_heads=4, num_kv_heads=2, head_dim=32,
                               block_size=8, device=DEVICE)


def _bad_inputs() -> dict[str, tuple[callable, str]]:
    """name -> (a function turning good args into bad ones, a phrase the error must contain)."""

    def with_(index, value):
        def change(args):
            args = list(args)
            args[index] = value(args)
            return args
        return change

    return {
        "seq_len beyond block table": (
            with_(4, lambda a: a[4] + a[4].new_tensor([0, 100])), "block table"),
        "mismatched heads": (with_(0, lambda a: a[0][:, :3].contiguous()), "multiple of KV heads"),
        "head dim mismatch": (with_(0, lambda a: a[0][..., :16].contiguous()), "head_dim"),
        "dtype mismatch": (with_(0, lambda a: a[0].half()), "dtype"),
        "unsupported dtype": (
            lambda a: [a[0].double(), a[1].double(), a[2].double(), *a[3:]], "float32"),
        "float block tables": (with_(3, lambda a: a[3].float()), "block_tables"),
        "block id out of range": (with_(3, lambda a: a[3] + 1000), "outside"),
        "query_start_loc wrong length": (with_(5, lambda a: a[5][:-1]), "query_start_loc"),
    }


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("bad", list(_bad_inputs()))
def test_bad_metadata_raises_value_error(entry, bad: str) -> None:
    change, phrase = _bad_inputs()[bad]
    args = change(_decode_case().args())
    with pytest.raises(ValueError, match=phrase):
        entry(*args)


@pytest.mark.parametrize("entry", [kernels.paged_attention, kernels.paged_prefill_attention],
                         ids=lambda f: f.__name__)
def test_more_queries_than_context_raises(entry) -> None:
    case = make_attention_case([3, 9], [3, 9], num_heads=2, num_kv_heads=1, head_dim=32,
                               block_size=8, device=DEVICE)
    c = case.cache
    too_short = c.seq_lens - torch.tensor([0, 2], dtype=c.seq_lens.dtype, device=DEVICE)
    with pytest.raises(ValueError, match="queries but a context"):
        entry(case.q, c.k_cache, c.v_cache, c.block_tables, too_short, case.query_start_loc,
              case.scale)


def test_decode_rejects_bad_decode_arguments() -> None:
    prefill = make_attention_case([9, 20], [2, 1], num_heads=4, num_kv_heads=2, head_dim=32,
                                  block_size=8, device=DEVICE)
    with pytest.raises(ValueError, match="one query per sequence"):
        paged_decode_attention(*prefill.args())
    case = _decode_case()
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(*case.args(), num_splits=0)
    with pytest.raises(ValueError, match="key_tile"):
        paged_decode_attention(*case.args(), key_tile=24)
    with pytest.raises(ValueError, match="key_tile"):
        paged_prefill_attention(*case.args(), key_tile=4)
