"""The CPU arrangement of paged attention against the dense oracle and the PyTorch reference.

`cpu_paged_attention` sends decodes to the native kernel (`minipaged.kernels.cpu.native`) and
computes the rest with the reference's plan and gather in the cache's dtype, packing grouped query
heads onto their KV head for decodes the kernel does not take. Both ways (`native`: the kernel
built, or as on a machine without a compiler) are checked on random block tables (hypothesis) with
every GQA ratio, decode-only batches and mixed ones, garbage in every slot no sequence owns, and
chunk budgets that cut a batch into many chunks. float32 matches the oracle within 1e-5; bfloat16
and float16 within the tolerances of `minipaged.testing.paged_examples.TOLERANCES` (about two units
in the last place of the output).

Under a capture (`minipaged.platforms.cpu.replay`) the KV write and the native decode are
recorded, and their replay over new queries, keys and values equals the eager call; a step the
replay cannot repeat (one that gathers, a KV write the native kernel does not take) is refused.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from native_kernels import NEEDS_COMPILER
from paged_utils import seq_and_query_lens

from minipaged.attention import reference as attention
from minipaged.attention.reference import paged_attention
from minipaged.platforms import get_attention_ops
from minipaged.platforms.cpu.attention import (
    CPU_OPS,
    cpu_paged_attention,
    cpu_reshape_and_cache,
    plan_cpu_attention,
)
from minipaged.platforms.cpu.replay import CaptureError, capture
from minipaged.testing.paged_examples import dense_reference, make_attention_case, tolerance

GQA_RATIOS = [1, 2, 3, 4, 8]  # 3: SmolLM2's 9 query heads over 3 KV heads


BOTH_WAYS = pytest.mark.parametrize("native", [True, False], ids=["native", "gathered"])


def attend(case, native: bool, **kwargs):
    """`cpu_paged_attention` with decodes in the native kernel, or gathered as where it
    cannot be built."""
    _, k_cache, _, block_tables, seq_lens, query_start_loc, _ = case.args()
    plan = plan_cpu_attention(block_tables, seq_lens, query_start_loc, k_cache, native=native)
    return cpu_paged_attention(*case.args(), plan=plan, **kwargs)


@st.composite
def cases(draw: st.DrawFn, dtype: torch.dtype, decodes_only: bool = False):
    block_size = draw(st.sampled_from([4, 8, 16]))
    seq_lens, query_lens = draw(seq_and_query_lens(block_size))
    if decodes_only:
        query_lens = [1] * len(seq_lens)
    num_kv_heads = draw(st.sampled_from([1, 2, 3]))
    return make_attention_case(
        seq_lens, query_lens,
        num_heads=num_kv_heads * draw(st.sampled_from(GQA_RATIOS)),
        num_kv_heads=num_kv_heads,
        head_dim=draw(st.sampled_from([32, 64])),
        block_size=block_size,
        dtype=dtype,
        seed=draw(st.integers(0, 2**16)),
        garbage=draw(st.sampled_from([float("nan"), float("inf"), 3e4])),
    )


@BOTH_WAYS
@given(case=cases(torch.float32), decode_case=cases(torch.float32, decodes_only=True))
@settings(max_examples=50)
def test_equals_dense_and_the_reference_float32(native, case, decode_case):
    for c in (case, decode_case):
        out = attend(c, native)
        assert out.dtype == torch.float32 and out.shape == c.q.shape
        torch.testing.assert_close(out, dense_reference(c), **tolerance(torch.float32))
        torch.testing.assert_close(out, paged_attention(*c.args()), **tolerance(torch.float32))


@BOTH_WAYS
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@given(data=st.data())
@settings(max_examples=25)
def test_equals_dense_in_low_precision(native, dtype, data):
    for c in (data.draw(cases(dtype)), data.draw(cases(dtype, decodes_only=True))):
        out = attend(c, native)
        assert out.dtype == dtype and out.shape == c.q.shape
        torch.testing.assert_close(out, dense_reference(c), **tolerance(dtype))


@BOTH_WAYS
@given(case=cases(torch.float32), chunk_bytes=st.sampled_from([1, 3000, 20000]))
@settings(max_examples=20)
def test_chunks_of_any_size_and_a_given_plan_do_not_change_the_result(native, case, chunk_bytes):
    _, k_cache, _, block_tables, seq_lens, query_start_loc, _ = case.args()
    with mock.patch.object(attention, "GATHER_CHUNK_BYTES", chunk_bytes):
        out = cpu_paged_attention(*case.args())
        plan = plan_cpu_attention(block_tables, seq_lens, query_start_loc, k_cache,
                                  native=native)
    has_decodes = 1 in query_start_loc.diff().tolist()
    assert (plan.decodes is not None) == (native and has_decodes)
    torch.testing.assert_close(out, dense_reference(case), **tolerance(torch.float32))
    planned = cpu_paged_attention(*case.args(), plan=plan, validate=False)
    torch.testing.assert_close(planned, out, **tolerance(torch.float32))


@BOTH_WAYS
def test_a_plan_for_other_metadata_is_refused(native):
    case = make_attention_case([5, 9], [1, 3], num_heads=4, num_kv_heads=2, head_dim=32,
                               block_size=4, seed=0)
    other = make_attention_case([5], [1], num_heads=4, num_kv_heads=2, head_dim=32,
                                block_size=4, seed=0)
    _, k_cache, _, block_tables, seq_lens, query_start_loc, _ = other.args()
    plan = plan_cpu_attention(block_tables, seq_lens, query_start_loc, k_cache, native=native)
    with pytest.raises(ValueError, match="plan covers 1 queries but q has 4"):
        cpu_paged_attention(*case.args(), plan=plan)


def test_bad_metadata_gets_the_contracts_error():
    case = make_attention_case([5, 9], [1, 3], num_heads=4, num_kv_heads=2, head_dim=32,
                               block_size=4, seed=0)
    q, k_cache, v_cache, tables, seq_lens, starts, scale = case.args()
    with pytest.raises(ValueError, match="seq_lens"):
        cpu_paged_attention(q, k_cache, v_cache, tables, seq_lens[:1], starts, scale)


def test_is_the_cpu_backend_and_the_default_on_a_cpu():
    assert get_attention_ops("cpu") is CPU_OPS
    assert get_attention_ops(device="cpu") is CPU_OPS
    assert get_attention_ops("auto", device="cpu") is CPU_OPS
    assert CPU_OPS.plan is plan_cpu_attention  # its own plan and KV writes; the reference's copies
    assert CPU_OPS.reshape_and_cache is cpu_reshape_and_cache
    assert CPU_OPS.copy_blocks is attention.copy_blocks
    assert get_attention_ops("torch").paged_attention is attention.paged_attention


@st.composite
def kv_writes(draw: st.DrawFn):
    """New keys and values for random slots of a cache (some tokens skipped with -1), given
    contiguous or as the columns of a fused projection's output, in any of the three dtypes."""
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    num_kv_heads, head_dim = draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from([4, 8, 64]))
    num_blocks, block_size = draw(st.integers(1, 6)), draw(st.sampled_from([1, 2, 16]))
    num_tokens = draw(st.integers(0, min(12, num_blocks * block_size)))
    slots = draw(st.permutations(range(num_blocks * block_size)))[:num_tokens]
    skipped = draw(st.lists(st.booleans(), min_size=num_tokens, max_size=num_tokens))
    fused = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return dtype, num_kv_heads, head_dim, num_blocks, block_size, slots, skipped, fused, seed


@given(case=kv_writes())
@settings(max_examples=80, deadline=None)
def test_kv_writes_equal_the_reference(case):
    """Every written slot holds its token's key and value, every other slot is untouched: the
    same caches as the reference's `reshape_and_cache`, to the bit (a copy), whichever way the
    keys come (the native write, or the reference's for float16)."""
    dtype, num_kv_heads, head_dim, num_blocks, block_size, slots, skipped, fused, seed = case
    gen = torch.Generator().manual_seed(seed)
    width = num_kv_heads * head_dim
    if fused:  # q | k | v columns of one projection's output, as the models hand them on
        out = torch.randn(len(slots), 3 * width, generator=gen).to(dtype)
        key = out[:, width:2 * width].view(-1, num_kv_heads, head_dim)
        value = out[:, 2 * width:].view(-1, num_kv_heads, head_dim)
    else:
        key = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(dtype)
        value = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(dtype)
    mapping = torch.tensor([-1 if skip else slot for slot, skip in zip(slots, skipped,
                                                                       strict=True)],
                           dtype=torch.int64)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    before = torch.randn(2, *shape, generator=gen).to(dtype)
    caches = [before.clone(), before.clone()]
    cpu_reshape_and_cache(key, value, caches[0][0], caches[0][1], mapping)
    attention.reshape_and_cache(key, value, caches[1][0], caches[1][1], mapping)
    assert torch.equal(caches[0], caches[1])


def test_kv_writes_check_their_arguments_unless_told_not_to():
    k_cache = torch.zeros(2, 4, 1, 8)
    key = torch.ones(3, 1, 8)
    with pytest.raises(ValueError, match="slot_mapping"):
        cpu_reshape_and_cache(key, key, k_cache, k_cache.clone(),
                              torch.tensor([0, 1, 99], dtype=torch.int64))


NATIVE = NEEDS_COMPILER


def decode_step(dtype: torch.dtype = torch.float32):
    """A decode step of three sequences over a cache of garbage, with its new keys and values
    and the slots they go to."""
    case = make_attention_case([5, 9, 2], [1, 1, 1], num_heads=4, num_kv_heads=2, head_dim=32,
                               block_size=4, dtype=dtype, seed=0)
    q, k_cache, v_cache, tables, seq_lens, starts, scale = case.args()
    gen = torch.Generator().manual_seed(1)
    key, value = (torch.randn(3, 2, 32, generator=gen).to(dtype) for _ in "kv")
    last = (seq_lens - 1).long()
    slots = tables[torch.arange(3), last // 4].long() * 4 + last % 4
    return case, key, value, slots


@NATIVE
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_captured_decode_replays_over_new_queries_keys_and_values(dtype):
    case, key, value, slots = decode_step(dtype)
    q, k_cache, v_cache, tables, seq_lens, starts, scale = case.args()
    plan = plan_cpu_attention(tables, seq_lens, starts, k_cache)
    eager_caches = (k_cache.clone(), v_cache.clone())

    def step() -> torch.Tensor:
        cpu_reshape_and_cache(key, value, k_cache, v_cache, slots, validate=False)
        return cpu_paged_attention(q, k_cache, v_cache, tables, seq_lens, starts, scale,
                                   validate=False, plan=plan)

    replay, out = capture(step)
    gen = torch.Generator().manual_seed(2)
    for tensor in (q, key, value):
        tensor.copy_(torch.randn(tensor.shape, generator=gen).to(dtype))
    with torch.inference_mode():
        replay.run()
        cpu_reshape_and_cache(key, value, *eager_caches, slots)
        expected = cpu_paged_attention(q, *eager_caches, tables, seq_lens, starts, scale)
    assert torch.equal(out, expected)
    for ours, theirs in zip((k_cache, v_cache), eager_caches, strict=True):  # garbage: NaN
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)


def test_a_capture_refuses_what_its_replay_would_not_repeat():
    mixed = make_attention_case([5, 9], [1, 3], num_heads=4, num_kv_heads=2, head_dim=32,
                                block_size=4, seed=0)
    with pytest.raises(CaptureError, match="this step gathers"):
        capture(lambda: cpu_paged_attention(*mixed.args()))
    case, key, value, slots = decode_step(torch.float16)  # no native KV write for float16
    _, k_cache, v_cache, *_ = case.args()
    with pytest.raises(CaptureError, match="native KV write does not take"):
        capture(lambda: cpu_reshape_and_cache(key, value, k_cache, v_cache, slots))
