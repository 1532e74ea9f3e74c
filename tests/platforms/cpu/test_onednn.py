"""oneDNN's linear over packed weights (`platforms.cpu.onednn`): the same product as
`F.linear`, chosen where it measured faster and autograd does not need `F.linear`, and a
packed copy never stale."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.platforms.cpu.linear import CPULinear, linear
from minipaged.platforms.cpu.onednn import (
    ONEDNN_AVAILABLE,
    onednn_is_faster,
    onednn_linear,
    onednn_runs,
    packed_weight,
    uses_onednn,
)

# oneDNN's bfloat16 path needs AVX-512BW, VL and DQ (or AVX-NE-CONVERT): absent on AVX2 CPUs
NEEDS_BF16 = pytest.mark.skipif(
    not onednn_runs(torch.bfloat16),
    reason="this CPU lacks AVX-512BW/VL/DQ and AVX-NE-CONVERT, which oneDNN's bfloat16 needs")

# A CPU without them, on any x86 machine: oneDNN capped at AVX2 (its own setting).
WITHOUT_BF16 = """
import logging, torch, torch.nn.functional as F
from minipaged.platforms.cpu.linear import linear
from minipaged.platforms.cpu.onednn import may_use_onednn, onednn_runs
logging.basicConfig(level=logging.INFO)
w = torch.randn(256, 256).bfloat16()
x = torch.randn(3, 256).bfloat16()
assert onednn_runs(torch.float32) and not onednn_runs(torch.bfloat16)
assert not may_use_onednn(w) and not may_use_onednn(w)
with torch.inference_mode():
    torch.testing.assert_close(linear(x, w), F.linear(x, w))
"""


def test_a_cpu_without_onednns_bfloat16_multiplies_bfloat16_with_f_linear_and_says_so_once():
    """oneDNN refuses to pack a bfloat16 weight on a CPU without the instructions its path
    needs; the platform asks oneDNN first and takes `F.linear` there, logging it once."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = subprocess.run([sys.executable, "-c", WITHOUT_BF16], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("lacks the instructions oneDNN's bfloat16 linear needs") == 1


def test_linear_takes_onednn_where_it_measured_faster_and_applies():
    big = torch.randn(256, 256)
    x = torch.randn(3, 256)
    faster = ONEDNN_AVAILABLE and onednn_is_faster(256, 256, torch.float32)
    with torch.inference_mode():
        assert uses_onednn(x, big) == faster
        assert not uses_onednn(x.half(), big.half())  # float32 and bfloat16 only
        assert not uses_onednn(x, big.bfloat16())  # mixed dtypes: F.linear's error
    assert onednn_is_faster(256, 256, torch.float32) == faster  # measured once per shape
    trainable = big.clone().requires_grad_()
    assert not uses_onednn(x, trainable)  # autograd needs F.linear: oneDNN has no backward
    with torch.no_grad():
        assert uses_onednn(x, trainable) == faster


@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(1, 40),
    sizes=st.sampled_from([(64, 48), (192, 576), (300, 260)]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=NEEDS_BF16)])
def test_onednn_over_a_packed_weight_equals_f_linear(rows, sizes, dtype, bias, seed):
    """The packed copy is the same matrix: oneDNN over it is F.linear up to rounding, at any row
    count (it is packed once, for every step's rows)."""
    assert ONEDNN_AVAILABLE  # PyTorch's x86 CPU builds have oneDNN
    g = torch.Generator().manual_seed(seed)
    out_features, in_features = sizes
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    w = (torch.randn(out_features, in_features, generator=g) * in_features**-0.5).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype) if bias else None
    with torch.inference_mode():
        ours = onednn_linear(x, packed_weight(w), b)
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), ref, rtol=tol, atol=tol)


def test_a_weight_is_packed_once_and_again_when_it_changes():
    """A stale packed copy would serve the old weights silently: writing the weight in place
    (`copy_`, `load_state_dict`) or giving it new storage packs it again; nothing else does."""
    layer = torch.nn.Linear(256, 256, bias=False)
    layer.__class__ = CPULinear  # no few-row path: its product is `linear`'s
    x = torch.randn(3, 256)
    with torch.inference_mode():
        first = packed_weight(layer.weight)
        assert packed_weight(layer.weight) is first
    new = {"weight": torch.randn(256, 256)}
    layer.load_state_dict(new)
    with torch.inference_mode():
        assert packed_weight(layer.weight) is not first
        torch.testing.assert_close(layer(x), x @ new["weight"].T, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(onednn_linear(x, packed_weight(layer.weight)),
                                   x @ new["weight"].T, rtol=1e-4, atol=1e-4)
    replaced = torch.randn(256, 256)
    layer.weight.data = replaced
    with torch.inference_mode():
        torch.testing.assert_close(onednn_linear(x, packed_weight(layer.weight)),
                                   x @ replaced.T, rtol=1e-4, atol=1e-4)
        made_here = torch.randn(256, 256)  # an inference tensor has no version counter
        assert not uses_onednn(x, made_here)
        torch.testing.assert_close(linear(x, made_here), x @ made_here.T, rtol=1e-4, atol=1e-4)
        with pytest.raises(ValueError, match="inference"):
            packed_weight(made_here)
