"""CUDA's versions of the model's small modules, swapped in at load: RMSNorm with the residual
add before it and SwiGLU's activation, each one Triton launch (`minipaged.kernels.triton.fused`)
where PyTorch runs four to eight small kernels. Same parameters, the same roundings; inputs the
kernels do not take (a dtype, a layout) run the model's own forward.
"""

from __future__ import annotations

import importlib

from torch import Tensor

from minipaged.models.layers import RMSNorm, SiluAndMul


def _fused():
    return importlib.import_module("minipaged.kernels.triton.fused")  # Triton, on first use


class CUDARMSNorm(RMSNorm):
    """`RMSNorm` in one launch; with a residual, the add too, written into the residual stream
    in place (the model hands each norm the stream it got back from the last one)."""

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        if not (x.is_cuda and x.stride(-1) == 1 and x.dtype == self.weight.dtype):
            return super().forward(x, residual)
        if residual is None:
            return _fused().rms_norm(x, self.weight, self.eps)
        return _fused().fused_add_rms_norm(x, residual, self.weight, self.eps,
                                           residual_out=residual)


class CUDASiluAndMul(SiluAndMul):
    """`silu(gate) * up` in one launch."""

    def forward(self, gate: Tensor, up: Tensor) -> Tensor:
        if not (gate.is_cuda and gate.stride(-1) == 1 and up.stride(-1) == 1):
            return super().forward(gate, up)
        return _fused().silu_mul(gate, up)
