"""The CPU's few-row linear kernel against `F.linear`, for every path this CPU has.

Shapes, row counts (1-8 and beyond, which the kernel takes 8 at a time), weight and input dtypes,
biases, several weights in one call, and int8 weights with their group sizes are drawn by
hypothesis; each result is compared with `F.linear` in float64 over the same (dequantised)
weights, within what the dtype's rounding allows. Every path the CPU can run is checked
("avx512_bf16" where it has AVX-512's bfloat16 dot products, "avx512" where it has AVX-512,
"avx2", plain "c"), so the tails of odd sizes are too. The start-up probes that choose how it
reads (`fetch_ahead`) measure over weight copies laid out as a model's are.
"""

from __future__ import annotations

import copy
import ctypes
import importlib
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.kernels.cpu.build import architecture, build_native, isa_tier
from minipaged.kernels.cpu.gemv import (
    ISAS,
    SOURCE,
    TIER_PATHS,
    GemvPlan,
    Int8Weight,
    fetch_ahead,
    gemv,
    gemv_available,
    gemv_isa,
    gemv_row_limit,
    quantize_int8,
)

PATHS = [isa for isa, level in ISAS.items() if level <= ISAS.get(gemv_isa(), -1)]


def reference(x: torch.Tensor, weights, biases) -> torch.Tensor:
    outs = []
    for w, b in zip(weights, biases, strict=True):
        dense = w.dequantize() if isinstance(w, Int8Weight) else w
        outs.append(F.linear(x.double(), dense.double(), None if b is None else b.double()))
    return torch.cat(outs, dim=1)


def test_the_kernel_is_built_here_with_the_cpus_widest_path():
    """The widest path the CPU reports, read from /proc/cpuinfo, within the tier that
    `$MINIPAGED_CPU_ISA` caps (`isa_tier`)."""
    assert gemv_available()
    flags = set(Path("/proc/cpuinfo").read_text().split())
    widest = ("neon" if architecture() == "aarch64"
              else "avx512_bf16" if {"avx512bw", "avx512_bf16"} <= flags
              else "avx512" if "avx512bw" in flags else "avx2" if "avx2" in flags else "c")
    tier = isa_tier()
    expected = widest if tier is None else min(widest, {v: k for k, v in ISAS.items()}[
        TIER_PATHS[tier]], key=ISAS.get)
    assert gemv_isa() == expected


@st.composite
def problems(draw: st.DrawFn):
    in_features = draw(st.sampled_from([1, 7, 16, 33, 64, 100, 576]))
    rows = draw(st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17]))
    io = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    count = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    weights, biases = [], []
    for _ in range(count):
        out = draw(st.integers(1, 70))
        kind = draw(st.sampled_from(["float32", "bfloat16", "int8"]))
        w = torch.randn(out, in_features, generator=gen)
        if kind == "int8":
            divisors = [g for g in (1, 16, 32, 64) if in_features % g == 0] + [None]
            weights.append(quantize_int8(w, draw(st.sampled_from(divisors))))
        else:
            weights.append(w.to(getattr(torch, kind)))
        biases.append(torch.randn(out, generator=gen).to(io) if draw(st.booleans()) else None)
    x = torch.randn(rows, in_features, generator=gen).to(io)
    return x, weights, biases


@settings(max_examples=120, deadline=None)
@given(problems(), st.sampled_from(PATHS), st.sampled_from([1, 2]), st.booleans())
def test_equals_f_linear(problem, isa, threads, ahead):
    x, weights, biases = problem
    torch.set_num_threads(threads)
    try:
        out = GemvPlan(weights, biases, x.dtype)(x, isa=isa, ahead=ahead)
    finally:
        torch.set_num_threads(1)
    expected = reference(x, weights, biases)
    assert out.dtype == x.dtype and out.shape == expected.shape
    scale = x.double().abs().sum(1, keepdim=True) * 4 + 1  # |x| . |w| bounds the sum's size
    rel = 2e-6 if x.dtype == torch.float32 else 1e-2  # bfloat16 output: 8 bits of mantissa
    err = (out.double() - expected).abs()
    assert bool((err <= rel * scale + rel * expected.abs()).all()), float(err.max())


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([16, 48, 576]), st.sampled_from([None, 16]), st.integers(0, 2**16))
def test_int8_quantisation_round_trips_within_half_a_step(in_features, group, seed):
    w = torch.randn(37, in_features, generator=torch.Generator().manual_seed(seed)) * 3
    q = quantize_int8(w, group)
    assert q.data.dtype == torch.int8 and int(q.data.abs().max()) <= 127
    step = q.scales.repeat_interleave(q.group_size, dim=1)
    assert bool(((q.dequantize() - w).abs() <= step / 2 + 1e-6).all())
    assert torch.equal(q.dequantize(), q.data.float() * step)


def test_an_all_zero_group_is_exact():
    q = quantize_int8(torch.zeros(3, 32), 16)
    assert torch.equal(q.dequantize(), torch.zeros(3, 32))
    assert bool((q.scales > 0).all())


def test_refusals_name_the_field():
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="group_size 5"):
        quantize_int8(w, 5)
    with pytest.raises(ValueError, match="input features"):
        GemvPlan([w, torch.randn(8, 17)])
    with pytest.raises(ValueError, match="Int8Weight"):
        GemvPlan([w.to(torch.int8)])
    with pytest.raises(ValueError, match="bias 0"):
        GemvPlan([w], [torch.randn(7)])
    with pytest.raises(ValueError, match="x must be"):
        GemvPlan([w])(torch.randn(2, 15))
    with pytest.raises(ValueError, match="x must be"):
        GemvPlan([w])(torch.randn(2, 16).bfloat16())
    with pytest.raises(ValueError, match="weight 0"):
        GemvPlan([w.t()])  # not contiguous


def test_a_plan_reads_weights_written_in_place_and_knows_replaced_ones():
    w = torch.randn(8, 16)
    plan = GemvPlan([w])
    x = torch.randn(1, 16)
    w.mul_(2)
    torch.testing.assert_close(plan(x), F.linear(x, w))
    assert plan.reads([w]) and not plan.reads([w.clone()])


def test_a_deep_copy_of_a_plan_reads_the_copies_of_its_weights():
    """`copy.deepcopy` of a model copies its plans (ctypes' arrays cannot be copied)."""
    w, b = torch.randn(8, 16), torch.randn(8)
    q = quantize_int8(torch.randn(4, 16), 16)
    plan = GemvPlan([w, q], [b, None])
    clone = copy.deepcopy({"w": w, "plan": plan})
    clone["w"].mul_(3)  # the copy's weight, not the original's
    x = torch.randn(2, 16)
    expected = torch.cat([F.linear(x, 3 * w, b), plan(x)[:, 8:]], dim=1)
    torch.testing.assert_close(clone["plan"](x), expected)
    assert clone["plan"].reads([clone["w"], clone["plan"].weights[1]])
    torch.testing.assert_close(plan(x)[:, :8], F.linear(x, w, b))


def test_zero_rows_and_a_non_contiguous_input():
    w = torch.randn(8, 16)
    assert GemvPlan([w])(torch.randn(0, 16)).shape == (0, 8)
    x = torch.randn(16, 3).t()  # [3, 16], not contiguous
    torch.testing.assert_close(gemv(x, [w]), F.linear(x, w))


def test_row_limit_is_within_range_and_measured_once():
    shapes = ((64, 32),)
    limit = gemv_row_limit(shapes, torch.float32, F.linear)
    assert 0 <= limit <= 8
    misses = gemv_row_limit.cache_info().misses
    assert gemv_row_limit(shapes, torch.float32, F.linear) == limit
    assert gemv_row_limit.cache_info().misses == misses


def instant(x: torch.Tensor, w: torch.Tensor) -> None:
    """A rival GEMM that takes no time: it wins every row count."""


def no_faster(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A rival GEMM that is the kernel itself, planned anew on every call: never faster."""
    return gemv(x, [w])


def test_row_limit_gives_the_rows_to_whichever_the_rival_does_not_beat():
    """The kernel keeps every row a rival does not beat by the margin (a tie keeps the step
    replayable); it keeps none that an instant rival beats."""
    shapes = ((48, 32), (16, 32))
    assert gemv_row_limit(shapes, torch.float32, instant) == 0
    assert gemv_row_limit(shapes, torch.float32, no_faster) == 8


def test_fetching_ahead_is_chosen_per_tile_shape_and_changes_no_result():
    w = torch.randn(40, 64)
    x = torch.randn(2, 64)
    plan = GemvPlan([w])
    assert torch.equal(plan(x, ahead=True), plan(x, ahead=False))
    for dtype in (torch.float32, torch.bfloat16, torch.int8):
        chosen = [fetch_ahead(dtype, rows) for rows in range(1, 17)]
        assert all(isinstance(c, bool) for c in chosen)
        # one measurement per tile shape: 1-2 rows, 3-4, more (8 at a time beyond 8)
        assert len({*chosen[:2]}) == len({*chosen[2:4]}) == len({*chosen[4:]}) == 1


def test_only_calls_that_fetch_ahead_ask_whether_to(monkeypatch):
    """bfloat16 weights times bfloat16 inputs on the dot-product path never fetch ahead: binding
    them measures nothing; every other call asks `fetch_ahead`."""
    import sys

    module = sys.modules[GemvPlan.__module__]
    both = GemvPlan([torch.randn(8, 32).bfloat16()], dtype=torch.bfloat16)
    mixed = GemvPlan([torch.randn(8, 32).bfloat16(), torch.randn(8, 32)], dtype=torch.bfloat16)
    float_in = GemvPlan([torch.randn(8, 32).bfloat16()])
    assert not both.fetch_ahead_matters(ISAS["avx512_bf16"])
    assert both.fetch_ahead_matters(ISAS["avx512"])
    assert mixed.fetch_ahead_matters(ISAS["avx512_bf16"])
    assert float_in.fetch_ahead_matters(ISAS["avx512_bf16"])
    for path in PATHS:
        for plan in (both, mixed, float_in):
            asked = []
            monkeypatch.setattr(module, "fetch_ahead",
                                lambda dtype, rows, asked=asked: asked.append(dtype) or False)
            x = torch.randn(1, 32).to(plan.dtype)
            out = torch.empty(1, plan.width, dtype=plan.dtype)
            assert plan.bind(x, out, isa=path)() == 0
            level = min(ISAS[path], ISAS[gemv_isa()])
            assert bool(asked) == plan.fetch_ahead_matters(level), (path, plan.weight_dtypes)


def test_built_by_the_layers_one_builder(tmp_path: Path):
    built = build_native(SOURCE, cache_dir=tmp_path)
    assert built is not None and built.name.startswith("gemv-")
    assert hasattr(ctypes.CDLL(os.fspath(built)), "gemv")
    assert build_native(SOURCE, compiler="no-such-compiler-here", cache_dir=tmp_path / "x") is None


@pytest.mark.parametrize("probe", ["fetch_ahead", "gemv_row_limit"])
def test_the_start_up_probes_read_copies_on_huge_pages_beyond_the_caches(monkeypatch, probe):
    """Each measures what a step sees: weights laid out on huge pages (`huge_page_buffer`),
    `PROBE_BYTES` of them, not a few copies a last-level cache partly holds."""
    module = importlib.import_module("minipaged.kernels.cpu.gemv")  # not the function `gemv`
    requested, real = [], module.huge_page_buffer

    def recording(nbytes: int) -> torch.Tensor:
        requested.append(nbytes)
        return real(nbytes)

    monkeypatch.setattr(module, "huge_page_buffer", recording)
    if probe == "fetch_ahead":  # past the per-process caches
        chosen, copy_bytes = module._fetch_ahead.__wrapped__(torch.float32, 1), 4 * 1536 * 576
    else:  # its calls' own fetch-ahead probes (cached per process) are not what it reads
        monkeypatch.setattr(module, "fetch_ahead", lambda weight_dtype, rows: False)
        shapes = ((192, 576), (64, 576))
        chosen = module.gemv_row_limit.__wrapped__(shapes, torch.float32, F.linear)
        copy_bytes = 4 * 256 * 576
    assert isinstance(chosen, (bool, int))
    assert len(requested) == 1
    assert module.PROBE_BYTES - copy_bytes < requested[0] <= module.PROBE_BYTES
    assert module.PROBE_BYTES >= 128 << 20  # four times a 32 MiB last-level cache


def test_probe_copies_lie_back_to_back_and_hold_the_values():
    module = importlib.import_module("minipaged.kernels.cpu.gemv")
    shapes = [(48, 64), (16, 64)]
    values = [torch.randn(shape) for shape in shapes]
    copies = module.probe_copies(shapes, torch.float32, values)
    assert len(copies) == min(module.PROBE_MAX_COPIES, module.PROBE_BYTES // (64 * 64 * 4))
    for index, weights in enumerate(copies):
        for weight, value in zip(weights, values, strict=True):
            assert torch.equal(weight, value)
        assert weights[1].data_ptr() == weights[0].data_ptr() + 48 * 64 * 4
        if index:
            assert weights[0].data_ptr() == copies[index - 1][1].data_ptr() + 16 * 64 * 4
