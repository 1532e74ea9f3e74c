"""Bound kernel calls (`KernelCall`) and a list of them made in one call into C (`KernelCalls`).

A list of calls run by the C loop must leave exactly what making each call from Python in the
same order leaves: hypothesis draws chains of norms, SiLU-and-multiply and GEMVs whose calls
read what earlier ones wrote, so an order or an argument block that C reads wrongly shows in the
buffers. A call that refuses its arguments stops the loop there, with an error that names it.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.kernels.cpu.calls import KernelCalls, kernel_calls_available
from minipaged.kernels.cpu.gemv import GemvPlan
from minipaged.kernels.cpu.native import bind_paged_decode
from minipaged.kernels.cpu.norm_rotary import bind_add_rms_norm, bind_rms_norm, bind_silu_mul


def test_the_call_loop_is_built_on_this_machine():
    assert kernel_calls_available()


def chain(links: list[str], width: int, dtype: torch.dtype, seed: int):
    """Buffers and the bound calls of `links` ("norm", "add_norm", "silu", "gemv"), each reading
    the buffer the previous one wrote, and the tensors the calls read (alive while they are)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, width, generator=gen).to(dtype)
    residual = torch.randn(2, width, generator=gen).to(dtype)
    norm = torch.rand(width, generator=gen).to(dtype) + 0.5
    weight = (torch.randn(width, width, generator=gen) / width**0.5).to(dtype)
    plan = GemvPlan([weight], dtype=dtype)
    buffers, calls = [x], []
    for link in links:
        source, target = buffers[-1], torch.zeros(2, width, dtype=dtype)
        if link == "norm":
            calls.append(bind_rms_norm(source, norm, 1e-5, target))
        elif link == "add_norm":
            calls.append(bind_add_rms_norm(source, residual, norm, 1e-5, target))
        elif link == "silu":
            calls.append(bind_silu_mul(source, residual, target))
        else:
            calls.append(plan.bind(source, target))
        buffers.append(target)
    return buffers, calls, (plan, residual, norm)


@given(links=st.lists(st.sampled_from(["norm", "add_norm", "silu", "gemv"]), min_size=1,
                      max_size=8),
       width=st.sampled_from([8, 40, 96]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16))
@settings(max_examples=40, deadline=None)
def test_a_list_in_one_c_call_equals_its_calls_made_one_by_one(links, width, dtype, seed):
    one_by_one, calls, read = chain(links, width, dtype, seed)
    for call in calls:
        assert call() == 0
    del read
    in_c, calls, _read = chain(links, width, dtype, seed)
    replay = KernelCalls(calls)
    assert len(replay) == len(links)
    replay.run()
    for ours, theirs in zip(in_c, one_by_one, strict=True):
        assert torch.equal(ours, theirs)


def test_a_refused_call_stops_the_list_and_is_named():
    x, out = torch.ones(1, 8), torch.zeros(1, 8)
    norm = torch.ones(8)
    cache = torch.zeros(4, 2, 3, 8)  # 3 KV heads ...
    q = torch.zeros(1, 4, 8)  # ... and 4 query heads: the decode kernel refuses
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    rows = torch.zeros(1, dtype=torch.int32)
    refused = bind_paged_decode(torch.zeros_like(q), q, cache, cache, table, lens, rows, rows,
                                1.0, validate=False)
    assert refused() != 0
    after = torch.zeros(1, 8)
    replay = KernelCalls([bind_rms_norm(x, norm, 1e-5, out), refused,
                          bind_rms_norm(x, norm, 1e-5, after)])
    with pytest.raises(RuntimeError, match="call 1 of 3 refused.*paged_decode_call"):
        replay.run()
    expected = torch.zeros(1, 8)
    assert bind_rms_norm(x, norm, 1e-5, expected)() == 0
    assert torch.equal(out, expected)  # made before it
    assert torch.equal(after, torch.zeros(1, 8))  # not made after it
