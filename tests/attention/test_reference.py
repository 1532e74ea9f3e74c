"""The PyTorch paged-attention reference and the KV-cache operations, checked against the dense
oracle and against plain per-slot bookkeeping.

Tolerances (`minipaged.testing.paged_examples.TOLERANCES`): float32 within 1e-5 relative (and 1e-5
absolute for outputs near 0); float16 within 2e-3 and bfloat16 within 1.6e-2 (about two units in
the last place: both sides round one float32 result to the storage dtype).
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from paged_utils import seq_and_query_lens

from minipaged.attention import reference as attention
from minipaged.attention.contract import AttentionMetadata, dense_attention
from minipaged.attention.reference import (
    MAX_CONTEXT_RATIO,
    copy_blocks,
    paged_attention,
    plan_attention,
    reshape_and_cache,
    swap_blocks,
)
from minipaged.platforms import get_attention_ops
from minipaged.runner.backends import PagedAttentionBackend, allocate_kv_caches
from minipaged.testing.paged_examples import (
    dense_reference,
    make_attention_case,
    make_paged_cache,
    random_block_tables,
    tolerance,
)

BLOCK_SIZES = [8, 16, 32]
HEAD_DIMS = [32, 64, 128]
GQA_RATIOS = [1, 2, 4, 8]
GARBAGE = [float("nan"), float("inf"), 3e4]  # what unused slots hold: must never leak in


@st.composite
def attention_cases(draw: st.DrawFn, dtype: torch.dtype):
    block_size = draw(st.sampled_from(BLOCK_SIZES))
    seq_lens, query_lens = draw(seq_and_query_lens(block_size))
    num_kv_heads = draw(st.sampled_from([1, 2]))
    return make_attention_case(
        seq_lens,
        query_lens,
        num_heads=num_kv_heads * draw(st.sampled_from(GQA_RATIOS)),
        num_kv_heads=num_kv_heads,
        head_dim=draw(st.sampled_from(HEAD_DIMS)),
        block_size=block_size,
        dtype=dtype,
        seed=draw(st.integers(0, 2**16)),
        garbage=draw(st.sampled_from(GARBAGE)),
    )


# ---------------------------------------------------------------------------------------------
# The test builder itself: the garbage really is everywhere a sequence does not own
# ---------------------------------------------------------------------------------------------


def test_builder_poisons_every_slot_no_sequence_owns():
    case = make_attention_case([1, 7, 8, 9, 20], [1, 1, 8, 2, 5], num_heads=4, num_kv_heads=2,
                               head_dim=32, block_size=8, seed=3)
    cache = case.cache
    owned = torch.zeros(cache.k_cache.shape[0] * cache.block_size, dtype=torch.bool)
    flat_k = cache.k_cache.view(-1, 2, 32)
    flat_v = cache.v_cache.view(-1, 2, 32)
    for i, (k, v) in enumerate(zip(case.keys, case.values, strict=True)):
        for pos in range(k.shape[0]):
            slot = cache.slot(i, pos)
            owned[slot] = True
            assert torch.equal(flat_k[slot], k[pos]) and torch.equal(flat_v[slot], v[pos])
    assert flat_k[~owned].isnan().all() and flat_v[~owned].isnan().all()
    assert (~owned).sum() >= 3 * cache.block_size  # spare blocks exist
    assert (cache.block_tables[:, -1] == -1).all()  # padding column


# ---------------------------------------------------------------------------------------------
# paged_attention == dense_attention
# ---------------------------------------------------------------------------------------------


@given(case=attention_cases(torch.float32))
@settings(max_examples=60)
def test_paged_attention_equals_dense_float32(case):
    out = paged_attention(*case.args())
    assert out.dtype == torch.float32 and out.shape == case.q.shape
    torch.testing.assert_close(out, dense_reference(case), **tolerance(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@given(data=st.data())
@settings(max_examples=20)
def test_paged_attention_equals_dense_low_precision(dtype, data):
    case = data.draw(attention_cases(dtype))
    out = paged_attention(*case.args())
    assert out.dtype == dtype
    torch.testing.assert_close(out, dense_reference(case), **tolerance(dtype))


@given(case=attention_cases(torch.float32), slack=st.integers(0, 40))
@settings(max_examples=15)
def test_max_lengths_and_validate_flag_do_not_change_the_result(case, slack):
    expected = paged_attention(*case.args())
    out = paged_attention(*case.args(), max_query_len=case.max_query_len + slack,
                          max_seq_len=case.max_seq_len + slack, validate=False)
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))  # padding reorders sums


@given(case=attention_cases(torch.float32), chunk_bytes=st.sampled_from([1, 3000, 20000]))
@settings(max_examples=20)
def test_gathering_in_chunks_of_sequences_does_not_change_the_result(case, chunk_bytes):
    # The default budget holds every test case in one chunk; a small one cuts the batch into
    # chunks of one or a few sequences.
    with mock.patch.object(attention, "GATHER_CHUNK_BYTES", chunk_bytes):
        out = paged_attention(*case.args())
    torch.testing.assert_close(out, dense_reference(case), **tolerance(torch.float32))


def test_a_prefill_does_not_pad_the_decodes_of_its_step():
    # Padding every sequence to the step's longest query made a chunked-prefill step with one
    # 512-token chunk and 63 decodes 25x slower than the two apart.
    case = make_attention_case([64, 30, 31, 32, 33], [64, 1, 1, 1, 1], num_heads=4,
                               num_kv_heads=2, head_dim=32, block_size=8, seed=4)
    padded_rows = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(q, *args, **kwargs):
        padded_rows.append(q.shape[0] * q.shape[2])  # sequences x padded query length
        return sdpa(q, *args, **kwargs)

    with mock.patch.object(attention.F, "scaled_dot_product_attention", recording_sdpa):
        out = paged_attention(*case.args())
    torch.testing.assert_close(out, dense_reference(case), **tolerance(torch.float32))
    assert sum(padded_rows) == case.q.shape[0]  # 64 + 4 query rows, none of them padding


# ---------------------------------------------------------------------------------------------
# The chunk plan: every query once, none padded, padding and gather size bounded
# ---------------------------------------------------------------------------------------------


@given(
    shapes=st.lists(st.tuples(st.sampled_from([0, 1, 1, 1, 2, 7, 16]), st.integers(0, 150)),
                    min_size=1, max_size=24),
    block_size=st.sampled_from([1, 4, 16]),
    budget_blocks=st.sampled_from([1, 3, 10, 40, 10**6]),
    seed=st.integers(0, 999),
)
def test_plan_covers_every_query_once_pads_none_and_respects_its_bounds(
    shapes, block_size, budget_blocks, seed
):
    query_lens = [q for q, _ in shapes]
    context_lens = [max(q + cached, 1) for q, cached in shapes]
    block_tables, num_blocks = random_block_tables(
        context_lens, block_size, generator=torch.Generator().manual_seed(seed))
    k_cache = torch.empty(num_blocks, block_size, 2, 4)
    bytes_per_block = 2 * k_cache[0].numel() * k_cache.element_size()
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    plan = plan_attention(block_tables, torch.tensor(context_lens, dtype=torch.int32),
                          torch.tensor(starts, dtype=torch.int32), k_cache,
                          chunk_bytes=budget_blocks * bytes_per_block)

    planned = [i for chunk in plan for i in chunk.seqs]
    assert sorted(planned) == [i for i, n in enumerate(query_lens) if n > 0]  # each once
    tokens = torch.cat([chunk.tokens for chunk in plan]).tolist() if plan else []
    assert sorted(tokens) == list(range(starts[-1]))  # every query row exactly once
    for chunk in plan:
        assert chunk.tokens.tolist() == [t for i in chunk.seqs
                                         for t in range(starts[i], starts[i + 1])]
        assert {query_lens[i] for i in chunk.seqs} == {chunk.query_len}  # no query padded
        contexts = [context_lens[i] for i in chunk.seqs]
        assert chunk.num_blocks == -(-max(contexts) // block_size)
        assert max(contexts) <= MAX_CONTEXT_RATIO * min(contexts)  # padding at most 2x
        gathered = len(chunk.seqs) * chunk.num_blocks * bytes_per_block
        assert len(chunk.seqs) == 1 or gathered <= budget_blocks * bytes_per_block
        assert torch.equal(chunk.block_ids,
                           block_tables[chunk.seqs, :chunk.num_blocks].clamp(min=0).long())
        # Which gathered slots each query row sees: causal, never past its sequence's end.
        key_pos = torch.arange(chunk.num_blocks * block_size)
        for row, i in enumerate(chunk.seqs):
            past_end = chunk.tail[1][chunk.tail[0] == row]
            assert past_end.tolist() == list(range(context_lens[i], len(key_pos)))
            for r in range(chunk.query_len):
                sees = key_pos <= context_lens[i] - chunk.query_len + r
                assert torch.equal(chunk.visible[row, 0, r], sees)
    # Chunks are cut only where needed: the next sequence of the same query length did not fit.
    for before, after in itertools.pairwise(plan):
        if before.query_len == after.query_len:
            first, nxt = context_lens[before.seqs[0]], context_lens[after.seqs[0]]
            too_big = ((len(before.seqs) + 1) * -(-nxt // block_size) * bytes_per_block
                       > budget_blocks * bytes_per_block)
            assert nxt > MAX_CONTEXT_RATIO * first or too_big


def test_a_plan_for_other_metadata_is_refused():
    first = make_attention_case([20, 9], [3, 9], num_heads=4, num_kv_heads=2, head_dim=32,
                                block_size=8, seed=1)
    other = make_attention_case([20, 9], [1, 1], num_heads=4, num_kv_heads=2, head_dim=32,
                                block_size=8, seed=1)
    c = other.cache
    plan = plan_attention(c.block_tables, c.seq_lens, other.query_start_loc, c.k_cache)
    with pytest.raises(ValueError, match="plan covers 2 queries but q has 12"):
        paged_attention(*first.args(), plan=plan)
    with pytest.raises(ValueError, match="block_tables has 2 rows, seq_lens 1 entries"):
        plan_attention(c.block_tables, c.seq_lens[:1], other.query_start_loc[:2], c.k_cache)


def test_blocks_shared_between_sequences():
    """Two sequences whose first block is the same physical block (a shared prefix, or a fork
    before copy-on-write); the block each would otherwise own is poisoned and unused."""
    gen = torch.Generator().manual_seed(0)
    bs, hkv, d = 8, 2, 32
    prefix_k = torch.randn(bs, hkv, d, generator=gen)
    prefix_v = torch.randn(bs, hkv, d, generator=gen)
    keys = [torch.cat([prefix_k, torch.randn(n, hkv, d, generator=gen)]) for n in (3, 11)]
    values = [torch.cat([prefix_v, torch.randn(n, hkv, d, generator=gen)]) for n in (3, 11)]
    cache = make_paged_cache(keys, values, bs, generator=gen)
    own_block = int(cache.block_tables[1, 0])
    cache.block_tables[1, 0] = cache.block_tables[0, 0]
    cache.k_cache[own_block] = float("nan")
    cache.v_cache[own_block] = float("nan")
    q = torch.randn(2 + 5, 4, d, generator=gen)
    qsl = torch.tensor([0, 2, 7], dtype=torch.int32)
    out = paged_attention(q, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens,
                          qsl, 0.2)
    expected = torch.cat([dense_attention(q[0:2], keys[0], values[0], 0.2),
                          dense_attention(q[2:7], keys[1], values[1], 0.2)])
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))


def test_reused_gather_buffer_never_aliases_an_output():
    first = make_attention_case([40, 9], [3, 9], num_heads=4, num_kv_heads=2, head_dim=32,
                                block_size=8, seed=1)
    second = make_attention_case([70, 30], [70, 1], num_heads=4, num_kv_heads=2, head_dim=32,
                                 block_size=8, seed=2)
    out = paged_attention(*first.args())
    kept = out.clone()
    paged_attention(*second.args())
    assert torch.equal(out, kept)


def test_gather_buffer_works_in_and_out_of_inference_mode():
    case = make_attention_case([24], [24], num_heads=4, num_kv_heads=2, head_dim=32,
                               block_size=8, seed=3)
    with torch.inference_mode():  # as the engine runs it
        inside = paged_attention(*case.args())
    outside = paged_attention(*case.args())  # as a notebook or a test might, afterwards
    torch.testing.assert_close(outside, inside.clone(), rtol=0, atol=0)


def test_empty_batch():
    case = make_attention_case([5], [1], num_heads=2, num_kv_heads=1, head_dim=32, block_size=8)
    c = case.cache
    out = paged_attention(case.q[:0], c.k_cache, c.v_cache, c.block_tables[:0],
                          c.seq_lens[:0], torch.zeros(1, dtype=torch.int32), case.scale)
    assert out.shape == (0, 2, 32)


# ---------------------------------------------------------------------------------------------
# Bad metadata: a ValueError that names the problem
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def good():
    case = make_attention_case([9, 20], [2, 4], num_heads=4, num_kv_heads=2, head_dim=32,
                               block_size=8, seed=5)
    c = case.cache
    return {"q": case.q, "k_cache": c.k_cache, "v_cache": c.v_cache,
            "block_tables": c.block_tables, "seq_lens": c.seq_lens,
            "query_start_loc": case.query_start_loc, "scale": case.scale}


def _call(args: dict, **changes):
    args = {**args, **changes}
    scale = args.pop("scale")
    max_query_len = args.pop("max_query_len", None)
    max_seq_len = args.pop("max_seq_len", None)
    return paged_attention(*args.values(), scale, max_query_len=max_query_len,
                           max_seq_len=max_seq_len)


def test_good_metadata_passes(good):
    _call(good)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda g: {"seq_lens": torch.tensor([9, 33], dtype=torch.int32)},
         "more than its block table covers"),
        (lambda g: {"seq_lens": torch.tensor([1, 20], dtype=torch.int32)},
         "2 queries but a context of only 1"),
        (lambda g: {"q": g["q"][:, :3]}, "must be a multiple of KV heads"),
        (lambda g: {"q": g["q"][..., :16]}, "head_dim mismatch"),
        (lambda g: {"q": g["q"].half()}, "dtype mismatch"),
        (lambda g: {"q": g["q"].int(), "k_cache": g["k_cache"].int(),
                    "v_cache": g["v_cache"].int()}, "float32, float16 or bfloat16"),
        (lambda g: {"block_tables": g["block_tables"].float()}, "block_tables must be an int"),
        (lambda g: {"seq_lens": g["seq_lens"].float()}, "seq_lens must be an int"),
        (lambda g: {"block_tables": g["block_tables"].masked_fill(g["block_tables"] >= 0, 99)},
         "outside the cache"),
        (lambda g: {"block_tables": torch.where(
            torch.arange(g["block_tables"].shape[1]) == 2, -1, g["block_tables"])},
         "outside the cache"),
        (lambda g: {"query_start_loc": torch.tensor([0, 2, 5], dtype=torch.int32)},
         "must run from 0 to the number of query tokens"),
        (lambda g: {"query_start_loc": torch.tensor([0, 2], dtype=torch.int32)},
         "query_start_loc must be"),
        (lambda g: {"seq_lens": g["seq_lens"][:1]}, "seq_lens must be"),
        (lambda g: {"k_cache": g["k_cache"][:, :, :1]}, "k_cache and v_cache must both be"),
        (lambda g: {"q": g["q"][0]}, r"q must be \[T, H, D\]"),
        (lambda g: {"max_query_len": 2}, "max_query_len=2 but a sequence has 4 queries"),
        (lambda g: {"max_seq_len": 19}, "max_seq_len=19 but a sequence has 20 tokens"),
    ],
)
def test_bad_metadata_raises_value_error(good, change, message):
    with pytest.raises(ValueError, match=message):
        _call(good, **change(good))


# ---------------------------------------------------------------------------------------------
# reshape_and_cache: exactly the named slots
# ---------------------------------------------------------------------------------------------


@given(
    num_blocks=st.integers(1, 6),
    block_size=st.sampled_from(BLOCK_SIZES),
    num_tokens=st.integers(0, 24),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    data=st.data(),
)
def test_reshape_and_cache_writes_exactly_the_named_slots(num_blocks, block_size, num_tokens,
                                                          dtype, data):
    num_slots = num_blocks * block_size
    num_tokens = min(num_tokens, num_slots + 3)
    slots = data.draw(st.lists(st.integers(0, num_slots - 1), min_size=num_tokens,
                               max_size=num_tokens, unique=True)
                      if num_tokens <= num_slots else st.just([]))
    slots = slots + [-1] * (num_tokens - len(slots))
    skipped = data.draw(st.sets(st.integers(0, max(num_tokens - 1, 0))))
    slots = [-1 if t in skipped else s for t, s in enumerate(slots)]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 999)))
    k_cache = torch.randn(num_blocks, block_size, 2, 32, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, 2, 32, generator=gen).to(dtype)
    key = torch.randn(num_tokens, 2, 32, generator=gen).to(dtype)
    value = torch.randn(num_tokens, 2, 32, generator=gen).to(dtype)
    expected_k, expected_v = k_cache.clone().view(num_slots, 2, 32), v_cache.clone().view(
        num_slots, 2, 32)
    for t, slot in enumerate(slots):
        if slot >= 0:
            expected_k[slot], expected_v[slot] = key[t], value[t]

    reshape_and_cache(key, value, k_cache, v_cache, torch.tensor(slots, dtype=torch.int64))
    assert torch.equal(k_cache.view(num_slots, 2, 32), expected_k)
    assert torch.equal(v_cache.view(num_slots, 2, 32), expected_v)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {"key": a["key"][:, :1], "value": a["value"][:, :1]}, "heads of dim"),
        (lambda a: {"value": a["value"][:2]}, "key and value must both be"),
        (lambda a: {"key": a["key"].half(), "value": a["value"].half()}, "dtype mismatch"),
        (lambda a: {"slot_mapping": torch.tensor([0, 1, 64])}, "outside -1..63"),
        (lambda a: {"slot_mapping": torch.tensor([0, -2, 5])}, "outside -1..63"),
        (lambda a: {"slot_mapping": torch.tensor([4, -1, 4])}, "same slot twice"),
        (lambda a: {"slot_mapping": torch.tensor([0, 1])}, "one slot per token"),
        (lambda a: {"slot_mapping": torch.tensor([0.0, 1.0, 2.0])}, "int32 or int64"),
        (lambda a: {"k_cache": a["k_cache"].transpose(0, 1),
                    "v_cache": a["v_cache"].transpose(0, 1)}, "must be contiguous"),
    ],
)
def test_reshape_and_cache_rejects_bad_input(change, message):
    args = {"key": torch.randn(3, 2, 32), "value": torch.randn(3, 2, 32),
            "k_cache": torch.zeros(8, 8, 2, 32), "v_cache": torch.zeros(8, 8, 2, 32),
            "slot_mapping": torch.tensor([0, -1, 9])}
    reshape_and_cache(*args.values())  # the unchanged arguments are fine
    args.update(change(args))
    with pytest.raises(ValueError, match=message):
        reshape_and_cache(*args.values())


# ---------------------------------------------------------------------------------------------
# copy_blocks and swap_blocks: exactly what they are told
# ---------------------------------------------------------------------------------------------


@given(num_blocks=st.integers(2, 12), num_layers=st.integers(1, 3), data=st.data())
def test_copy_blocks_copies_exactly_the_mapping_in_every_layer(num_blocks, num_layers, data):
    blocks = data.draw(st.permutations(range(num_blocks)))
    num_pairs = data.draw(st.integers(0, num_blocks // 2))
    mapping = [(blocks[i], blocks[num_pairs + i]) for i in range(num_pairs)]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 999)))
    caches = [torch.randn(2, num_blocks, 4, 2, 8, generator=gen) for _ in range(num_layers)]
    expected = [c.clone() for c in caches]
    for c in expected:
        for src, dst in mapping:
            c[:, dst] = c[:, src]

    copy_blocks(caches, torch.tensor(mapping, dtype=torch.int64).view(-1, 2))
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    "mapping, message",
    [
        ([[0, 1], [2, 1]], "same destination block twice"),
        ([[0, 1], [1, 2]], "both copied from and copied to"),
        ([[0, 6]], "destination block outside 0..5"),
        ([[-1, 2]], "source block outside 0..5"),
        ([[0, 1, 2]], r"must be \[N, 2\]"),
    ],
)
def test_copy_blocks_rejects_bad_mappings(mapping, message):
    caches = allocate_kv_caches(2, 6, 4, 2, 8)
    with pytest.raises(ValueError, match=message):
        copy_blocks(caches, torch.tensor(mapping))


def test_copy_blocks_rejects_mismatched_layers():
    caches = [torch.zeros(2, 6, 4, 2, 8), torch.zeros(2, 5, 4, 2, 8)]
    with pytest.raises(ValueError, match=r"kv_caches\[1\]"):
        copy_blocks(caches, torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match=r"\[2, num_blocks"):
        copy_blocks([torch.zeros(6, 4, 2, 8)], torch.tensor([[0, 1]]))


@given(num_device=st.integers(1, 8), num_host=st.integers(1, 8), data=st.data())
def test_swap_out_and_back_in_copies_exactly_the_mapping(num_device, num_host, data):
    n = data.draw(st.integers(0, min(num_device, num_host)))
    device_ids = data.draw(st.permutations(range(num_device)))[:n]
    host_ids = data.draw(st.permutations(range(num_host)))[:n]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 999)))
    device_cache = torch.randn(2, num_device, 4, 2, 8, generator=gen)
    host_pool = torch.randn(2, num_host, 4, 2, 8, generator=gen)
    original_device = device_cache.clone()
    expected_host = host_pool.clone()
    for d, h in zip(device_ids, host_ids, strict=True):
        expected_host[:, h] = device_cache[:, d]

    out_pairs = torch.tensor([device_ids, host_ids], dtype=torch.int64).T
    swap_blocks(device_cache, host_pool, out_pairs)
    assert torch.equal(host_pool, expected_host)
    assert torch.equal(device_cache, original_device)  # the source is only read

    device_cache[:, device_ids] = float("nan")  # the blocks were freed and reused meanwhile...
    swap_blocks(host_pool, device_cache, out_pairs.flip(1))
    assert torch.equal(device_cache, original_device)  # ...and come back intact


def test_swap_blocks_rejects_bad_input():
    device_cache, host_pool = torch.zeros(2, 4, 4, 2, 8), torch.zeros(2, 3, 4, 2, 8)
    with pytest.raises(ValueError, match="destination block outside 0..2"):
        swap_blocks(device_cache, host_pool, torch.tensor([[0, 3]]))
    with pytest.raises(ValueError, match="same block shape and dtype"):
        swap_blocks(device_cache, host_pool.half(), torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="same block shape and dtype"):
        swap_blocks(device_cache, torch.zeros(2, 3, 8, 2, 8), torch.tensor([[0, 1]]))


# ---------------------------------------------------------------------------------------------
# Choosing a backend
# ---------------------------------------------------------------------------------------------


def test_torch_backend_is_the_reference():
    for ops in (get_attention_ops("torch"), get_attention_ops(device="meta")):
        assert ops.name == "torch"
        assert ops.paged_attention is attention.paged_attention
        assert ops.reshape_and_cache is attention.reshape_and_cache
        assert ops.copy_blocks is attention.copy_blocks


def test_triton_backend_is_the_kernels_module():
    ops = get_attention_ops("triton")
    import minipaged.kernels as kernels

    assert ops.name == "triton"
    assert ops.paged_attention is kernels.paged_attention
    assert ops.reshape_and_cache is kernels.reshape_and_cache
    assert ops.copy_blocks is kernels.copy_blocks
    assert get_attention_ops(device="cuda").name == "triton"  # chosen by device type


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'"):
        get_attention_ops("cuda")


def test_torch_backend_never_imports_triton():
    code = ("import sys, minipaged, minipaged.platforms as a; "
            "a.get_attention_ops('torch'); "
            "a.get_attention_ops(device='cpu'); "
            "assert 'triton' not in sys.modules and 'minipaged.kernels.triton' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------
# PagedAttentionBackend over several engine steps
# ---------------------------------------------------------------------------------------------


class _Steps:
    """A minimal engine for the backend test: block tables grown on demand from a shuffled
    pool, and the same K/V kept contiguous per sequence and layer for the oracle."""

    def __init__(self, num_seqs: int, num_layers: int, num_blocks: int, block_size: int,
                 gen: torch.Generator):
        self.block_size = block_size
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables: list[list[int]] = [[] for _ in range(num_seqs)]
        self.lens = [0] * num_seqs
        self.dense_k = [[None] * num_seqs for _ in range(num_layers)]
        self.dense_v = [[None] * num_seqs for _ in range(num_layers)]

    def metadata(self, new_tokens: list[int]) -> AttentionMetadata:
        slots = []
        for i, n in enumerate(new_tokens):
            for pos in range(self.lens[i], self.lens[i] + n):
                if pos // self.block_size == len(self.tables[i]):
                    self.tables[i].append(self.free.pop())
                slots.append(self.tables[i][pos // self.block_size] * self.block_size
                             + pos % self.block_size)
            self.lens[i] += n
        width = max(len(t) for t in self.tables) + 1
        tables = [t + [-1] * (width - len(t)) for t in self.tables]
        starts = [0]
        for n in new_tokens:
            starts.append(starts[-1] + n)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(self.lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            max_query_len=max(new_tokens),
            max_seq_len=max(self.lens),
        )

    def dense(self, layer: int, new_tokens: list[int], q, k, v, scale):
        outs, start = [], 0
        for i, n in enumerate(new_tokens):
            end = start + n
            for store, new in ((self.dense_k, k), (self.dense_v, v)):
                old = store[layer][i]
                chunk = new[start:end]
                store[layer][i] = chunk if old is None else torch.cat([old, chunk])
            outs.append(dense_attention(q[start:end], self.dense_k[layer][i],
                                        self.dense_v[layer][i], scale))
            start = end
        return torch.cat(outs)


@given(
    prompts=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    block_size=st.sampled_from(BLOCK_SIZES),
    seed=st.integers(0, 999),
)
@settings(max_examples=10)
@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
def test_backend_over_prefill_chunked_prefill_and_decodes_equals_dense(prompts, block_size, seed,
                                                                       backend_name):
    gen = torch.Generator().manual_seed(seed)
    num_layers, num_heads, num_kv_heads, head_dim, scale = 2, 6, 2, 32, 0.17
    num_blocks = sum(p + 5 for p in prompts) // block_size + 2 * len(prompts) + 3
    caches = allocate_kv_caches(num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    for c in caches:
        c.fill_(float("nan"))  # never-written slots must never be read
    backend = PagedAttentionBackend(caches, ops=get_attention_ops(backend_name))
    assert backend.ops.name == backend_name
    engine = _Steps(len(prompts), num_layers, num_blocks, block_size, gen)

    # Step 0: the first sequence's whole prompt, the others' first halves (chunked prefill);
    # step 1: the first decodes while the others finish their prompts; then 4 decode steps.
    first = [p if i == 0 else (p + 1) // 2 for i, p in enumerate(prompts)]
    second = [1 if i == 0 else p - f for i, (p, f) in enumerate(zip(prompts, first, strict=True))]
    steps = [first, second] + [[1] * len(prompts)] * 4
    for new_tokens in steps:
        new_tokens = [max(n, 1) for n in new_tokens]
        backend.metadata = engine.metadata(new_tokens)
        num_tokens = sum(new_tokens)
        for layer in range(num_layers):
            q = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
            k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
            v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
            out = backend(layer, q, k, v, scale)
            expected = engine.dense(layer, new_tokens, q, k, v, scale)
            torch.testing.assert_close(out, expected, **tolerance(torch.float32))


def test_backend_rejects_missing_metadata_and_bad_layer():
    backend = PagedAttentionBackend(allocate_kv_caches(2, 4, 8, 1, 32))
    q, kv = torch.randn(1, 2, 32), torch.randn(1, 1, 32)
    with pytest.raises(ValueError, match="no AttentionMetadata"):
        backend(0, q, kv, kv, 1.0)
    backend.metadata = AttentionMetadata(
        slot_mapping=torch.tensor([0]), query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([1], dtype=torch.int32),
        block_tables=torch.tensor([[0]], dtype=torch.int32), max_query_len=1, max_seq_len=1)
    with pytest.raises(ValueError, match="layer_idx 2 outside 0..1"):
        backend(2, q, kv, kv, 1.0)
    torch.testing.assert_close(backend(1, q, kv, kv, 1.0), dense_attention(q, kv, kv, 1.0))
