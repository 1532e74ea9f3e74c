"""The CPU's linear layers (`minipaged.platforms.cpu.linear`) against `F.linear`.

`CPULinear` takes the GEMV kernel up to its `few_rows.max_rows` rows and the faster GEMM above;
`Int8Linear` the kernel over int8 weights, or PyTorch's GEMM over the dequantised weight: each
must give `F.linear`'s product (of the weight it stands for) at any row count, float32 and
bfloat16, with and without a bias, the LM head's in float32. Where gradients are wanted, or the
input is not what the kernel takes, the GEMM runs. `choose_few_rows` sets the kernel's row
limit as it is told, or as measured against the GEMM `linear` uses for the weight's shape (the
measurement replaced here by a stand-in, so the test does not depend on this machine), and
`linear` is `F.linear` on whichever GEMM is faster.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from native_kernels import NEEDS_COMPILER
from torch import nn

import minipaged.platforms.cpu.linear as linear_module
from minipaged.platforms.cpu.linear import (
    INT8_GEMV_ROWS,
    CPULinear,
    FewRows,
    Int8Linear,
    choose_few_rows,
    few_rows_product,
    linear,
)
from minipaged.platforms.cpu.onednn import onednn_linear

pytestmark = NEEDS_COMPILER

TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


def cpu_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
               max_rows: int | None = 8, seed: int = 0) -> CPULinear:
    torch.manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=bias).to(dtype)
    layer.__class__ = CPULinear
    choose_few_rows(layer, max_rows)
    return layer


def int8_linear(in_features: int, out_features: int, bias: bool, group_size: int | None,
                max_rows: int | None = None, seed: int = 0) -> Int8Linear:
    torch.manual_seed(seed)
    layer = Int8Linear.from_linear(nn.Linear(in_features, out_features, bias=bias), group_size)
    choose_few_rows(layer, max_rows)
    return layer


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 12), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       bias=st.booleans(), logits=st.booleans(), seed=st.integers(0, 2**16))
def test_a_cpu_linear_is_f_linear_on_the_kernel_and_past_it(rows, dtype, bias, logits, seed):
    layer = cpu_linear(48, 40, bias, dtype, seed=seed)
    assert layer.few_rows is not None and layer.few_rows.max_rows == 8
    layer.logits = logits
    x = torch.randn(rows, 48, generator=torch.Generator().manual_seed(seed)).to(dtype)
    with torch.inference_mode():
        out = layer(x)
        kernel = few_rows_product(layer.few_rows, x, logits)
    assert (kernel is not None) == (rows <= 8)  # the GEMM above the kernel's rows
    if kernel is not None:
        assert torch.equal(out, kernel)
        if logits:  # the kernel's product, widened: as `compute_logits` widens it
            assert torch.equal(out, few_rows_product(layer.few_rows, x).float())
    assert out.shape == (rows, 40)
    assert out.dtype == (torch.float32 if logits and kernel is not None else dtype)
    torch.testing.assert_close(out.float(), reference(x, layer.weight, layer.bias),
                               **TOLERANCE[dtype])


@settings(max_examples=20, deadline=None)
@given(rows=st.sampled_from([1, 3, 8, 9, 96, 97]), bias=st.booleans(),
       group_size=st.sampled_from([None, 16, 64]), seed=st.integers(0, 2**16))
def test_an_int8_linear_is_f_linear_of_its_dequantised_weight(rows, bias, group_size, seed):
    layer = int8_linear(64, 24, bias, group_size, seed=seed)
    assert not hasattr(layer, "weight")  # no float copy: the int8 values stand for it
    assert layer.few_rows is not None and layer.few_rows.max_rows == INT8_GEMV_ROWS
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        out = layer(x)
    assert (few_rows_product(layer.few_rows, x) is not None) == (rows <= INT8_GEMV_ROWS)
    torch.testing.assert_close(out, reference(x, layer.int8.dequantize(), layer.bias),
                               atol=1e-5, rtol=1e-5)


def test_gradients_take_f_linear():
    for layer in (cpu_linear(16, 8, True, torch.float32), int8_linear(16, 8, True, None)):
        x = torch.randn(2, 16, requires_grad=True)
        layer(x).sum().backward()  # the kernel has no backward: this must be F.linear's
        assert x.grad is not None and layer.bias.grad is not None


def test_the_kernel_takes_only_what_it_can():
    layer = cpu_linear(16, 8, False, torch.float32, max_rows=4)
    path = layer.few_rows
    assert isinstance(path, FewRows) and path.max_rows == 4
    x = torch.randn(4, 16)
    with torch.inference_mode():
        assert few_rows_product(path, x) is not None
        assert few_rows_product(None, x) is None
        assert few_rows_product(path, torch.randn(5, 16)) is None  # more rows than it takes
        assert few_rows_product(path, x[None]) is None  # not [rows, in]
        assert few_rows_product(path, x.bfloat16()) is None  # another dtype than its plan's
        strided = torch.randn(4, 32)[:, ::2]
        torch.testing.assert_close(few_rows_product(path, strided), F.linear(strided, layer.weight))
    with torch.enable_grad():
        assert few_rows_product(path, x.clone().requires_grad_()) is None


def test_choose_few_rows_takes_the_limit_it_is_given():
    layer = cpu_linear(16, 8, False, torch.float32, max_rows=0)
    assert layer.few_rows is None  # 0: never the kernel
    choose_few_rows(layer, 3)
    assert layer.few_rows.max_rows == 3
    assert layer.few_rows.plan.reads([layer.weight])
    assert int8_linear(16, 8, False, None, max_rows=2).few_rows.max_rows == 2
    half = cpu_linear(16, 8, False, torch.float16, max_rows=8)
    assert half.few_rows is None  # a dtype the kernel lacks: the GEMM


@pytest.mark.parametrize("onednn_wins", [False, True])
def test_choose_few_rows_measures_against_the_gemm_linear_uses(monkeypatch, onednn_wins):
    """Unless given a limit, a float weight's is measured (once per shape) against the GEMM
    `linear` would run for it: oneDNN over a packed copy where that measured faster, else
    `F.linear`; int8 weights take the kernel up to `INT8_GEMV_ROWS` unmeasured."""
    asked = []

    def row_limit(shapes, dtype, rival, prepare=None):
        asked.append((shapes, dtype, rival, prepare))
        return 4

    monkeypatch.setattr(linear_module, "gemv_row_limit", row_limit)
    monkeypatch.setattr(linear_module, "may_use_onednn", lambda weight: True)
    monkeypatch.setattr(linear_module, "onednn_is_faster", lambda *shape: onednn_wins)
    layer = cpu_linear(16, 8, False, torch.float32, max_rows=None)
    assert layer.few_rows.max_rows == 4
    [(shapes, dtype, rival, prepare)] = asked
    assert shapes == ((8, 16),) and dtype == torch.float32
    assert rival is (onednn_linear if onednn_wins else F.linear)
    assert (prepare is not None) == onednn_wins
    assert int8_linear(16, 8, False, None).few_rows.max_rows == INT8_GEMV_ROWS
    assert len(asked) == 1  # int8 weights: not measured


@settings(max_examples=30, deadline=None)
@given(
    lead=st.sampled_from([(), (2,)]),
    rows=st.integers(0, 9),
    # (out, in): small weights take F.linear, large ones oneDNN (where the build has it).
    sizes=st.sampled_from([(5, 8), (33, 48), (256, 256), (260, 300), (192, 576)]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_linear_equals_f_linear(lead, rows, sizes, bias, seed):
    g = torch.Generator().manual_seed(seed)
    out_features, in_features = sizes
    x = torch.randn(*lead, rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g) * in_features**-0.5
    b = torch.randn(out_features, generator=g) if bias else None
    with torch.inference_mode():
        ours = linear(x, w, b)
    assert ours.shape == (*lead, rows, out_features)
    torch.testing.assert_close(ours, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_linear_keeps_gradients():
    x = torch.randn(5, 256)
    w = torch.randn(256, 256, requires_grad=True)
    linear(x, w).sum().backward()
    torch.testing.assert_close(w.grad, x.sum(0).expand(256, 256))
