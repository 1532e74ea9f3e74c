"""The CPU's linear layers, swapped in for the model's `nn.Linear` at load: the faster of
PyTorch's two GEMMs, the few-row GEMV kernel at the rows it wins, and weight-only int8.

* `CPULinear`: `nn.Linear` (same parameters) whose product runs on the GEMM `linear` picks
  (MKL's through `F.linear`, or oneDNN's over a copy packed once: `minipaged.platforms.cpu.
  onednn`), and at a few rows on the GEMV kernel (`minipaged.kernels.cpu.gemv`), which reads
  the weight in its checkpoint layout at the memory's speed. Up to how many rows the kernel
  takes is the layer's `few_rows`, chosen at load (`choose_few_rows`): measured on this CPU
  once per weight shape, or fixed by the caller.
* `Int8Linear`: the same layer over int8 weights with a float32 scale per group of input
  features (`quantize_int8`), a quarter of float32's bytes; the kernel dequantises them in
  registers at a few rows, more rows dequantise the weight for PyTorch's GEMM (gpt-fast's
  `WeightOnlyInt8Linear` swap).

Through `launch`, a kernel call is recorded when a step is being captured
(`minipaged.platforms.cpu.replay`); a GEMM is not a kernel call, so a captured step is one
whose every projection takes the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minipaged.kernels.cpu.gemv import (
    PROFILER_NAME,
    GemvPlan,
    Int8Weight,
    gemv_available,
    gemv_row_limit,
    quantize_int8,
)
from minipaged.kernels.cpu.norm_rotary import bind_to_float32
from minipaged.platforms.cpu.onednn import (
    may_use_onednn,
    onednn_is_faster,
    onednn_linear,
    packed_copy,
    packed_weight,
    uses_onednn,
)
from minipaged.platforms.cpu.replay import contiguous, empty, launch, platform_code

# Rows up to which int8 weights take the GEMV kernel (8 rows at a time, the weight re-read from
# cache): dequantising a 1536 x 576 weight for PyTorch's GEMM costs 2.4 ms, the kernel 0.43 ms
# at 8 rows, 1.7 at 48, 4.6 at 128 (4.1 dequantised); PyTorch's int8 kernels are slower still.
INT8_GEMV_ROWS = 96


@dataclass(frozen=True, eq=False)
class FewRows:
    """A layer's few-row path: the GEMV kernel's call for its weight and the most rows it takes
    (`max_rows`); more rows take the GEMM."""

    plan: GemvPlan
    max_rows: int


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)` on whichever of PyTorch's two CPU GEMMs is faster here.

    PyTorch's CPU build sends `F.linear` to MKL's GEMM, which rearranges the weight into its
    blocked layout on every call: at the few rows of a decode step that costs about as much as
    the product. oneDNN's linear op multiplies a copy packed once (`packed_weight`). Which is
    faster depends on the CPU and the weight's shape: `onednn_is_faster` times both, once per
    shape and dtype. The sums are the same in another order: outputs differ by rounding."""
    if uses_onednn(x, weight):
        return onednn_linear(x, packed_weight(weight), bias)
    return F.linear(x, weight, bias)


class CPULinear(nn.Linear):
    """`nn.Linear` on the faster GEMM, and at up to `few_rows.max_rows` rows the GEMV kernel.
    `logits` (the LM head): outputs in float32, as `CausalLM.compute_logits` returns them."""

    few_rows: FewRows | None = None
    logits: bool = False

    def forward(self, x: Tensor) -> Tensor:
        out = few_rows_product(self.few_rows, x, self.logits)
        if out is not None:
            return out
        return linear(x, self.weight, self.bias)


class Int8Linear(nn.Module):
    """A linear layer over `int8` weights (no float weight: the int8 values stand for it), the
    GEMV kernel at up to `few_rows.max_rows` rows, else the dequantised weight."""

    few_rows: FewRows | None = None
    logits: bool = False

    def __init__(self, int8: Int8Weight, bias: Tensor | None) -> None:
        super().__init__()
        self.int8, self.bias = int8, bias
        self.out_features, self.in_features = int8.shape

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int | None) -> Int8Linear:
        """`linear`'s weight quantised, a float32 scale per `group_size` input features of each
        output row (None: one per row; `quantize_int8`); its bias kept as it is."""
        return cls(quantize_int8(linear.weight.detach(), group_size), linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        out = few_rows_product(self.few_rows, x, self.logits)
        if out is not None:
            return out
        return F.linear(x, self.int8.dequantize(x.dtype), self.bias)


def few_rows_product(path: FewRows | None, x: Tensor, logits: bool = False) -> Tensor | None:
    """The kernel's product for `x` where `path` takes it (2-D x of the plan's dtype, 1 to
    `max_rows` rows, nothing to differentiate), in float32 for `logits`; else None."""
    if (path is None or x.dim() != 2 or not 0 < x.shape[0] <= path.max_rows
            or x.dtype != path.plan.dtype or (torch.is_grad_enabled() and x.requires_grad)):
        return None
    plan = path.plan
    with platform_code():
        x = contiguous(x, "a strided input to a projection is")
        out = empty((x.shape[0], plan.width), plan.dtype)
        launch(plan.bind(x, out), PROFILER_NAME, x, out)
        if logits and out.dtype != torch.float32:
            wide = empty(out.shape, torch.float32)
            launch(bind_to_float32(out, wide), PROFILER_NAME, out, wide)
            return wide
        return out


def choose_few_rows(layer: CPULinear | Int8Linear, max_rows: int | None = None) -> None:
    """Set `layer.few_rows`: the kernel up to `max_rows` rows where given (0: never), else up
    to the rows it measured faster than the GEMM `linear` uses for this weight's shape
    (`gemv_row_limit`, once per shape and dtype); int8 weights take it up to
    `INT8_GEMV_ROWS`. None where the kernel is not built or does not take the weight."""
    layer.few_rows = None
    if not gemv_available():
        return
    weight = layer.int8 if isinstance(layer, Int8Linear) else layer.weight  # what it multiplies
    dtype = torch.float32 if isinstance(weight, Int8Weight) else weight.dtype
    try:
        plan = GemvPlan([weight], [layer.bias], dtype)
    except ValueError:
        return
    if max_rows is not None:
        limit = max_rows
    elif isinstance(weight, Int8Weight):
        limit = INT8_GEMV_ROWS
    elif may_use_onednn(weight) and onednn_is_faster(*weight.shape, dtype):
        limit = gemv_row_limit((tuple(weight.shape),), dtype, onednn_linear, packed_copy)
    else:
        limit = gemv_row_limit((tuple(weight.shape),), dtype, F.linear)
    if limit > 0:
        layer.few_rows = FewRows(plan, limit)


def pack_for_onednn(layer: CPULinear) -> None:
    """Pack the layer's weight for oneDNN now, at load, where `linear` will use oneDNN for it
    (`onednn_is_faster`, measured once per shape): no step pays for the packing."""
    weight = layer.weight
    if may_use_onednn(weight) and onednn_is_faster(*weight.shape, weight.dtype):
        packed_weight(weight)
