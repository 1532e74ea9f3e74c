"""The CPU's versions of the model's small modules, swapped in at load: RMSNorm (with the residual
add), rotary embeddings, SwiGLU's activation and the token embedding, each one C call
(`minipaged.kernels.cpu.norm_rotary`) made through `launch`, so a capture records it
(`minipaged.platforms.cpu.replay`).

Each is a subclass of the model's module with the same parameters and the same result: the same
roundings, a sum taken in another order where the docstring of its kernel says so. Where the
kernel does not take the input (a dtype it lacks, a layout, gradients) the model's own forward
runs; a capture then refuses the step (its operators compute outside the platform's code).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minipaged.kernels.cpu.gemv import Int8Weight
from minipaged.kernels.cpu.norm_rotary import (
    NORM_PROFILER_NAME,
    ROTARY_PROFILER_NAME,
    SILU_MUL_PROFILER_NAME,
    bind_add_rms_norm,
    bind_gather_rows,
    bind_rms_norm,
    bind_rotary,
    bind_silu_mul,
    rms_norm_supports,
    rotary_supports,
    silu_mul_supports,
)
from minipaged.models.layers import RMSNorm, RotaryEmbedding, SiluAndMul
from minipaged.platforms.cpu.replay import empty, launch, launch_python, platform_code

EMBEDDING_PROFILER_NAME = "minipaged::embedding"


class CPURMSNorm(RMSNorm):
    """`RMSNorm` in one C call; with a residual, the add goes into the same call and the
    residual stream is updated in place (the model hands each norm the stream it got back from
    the last one, so no one else reads the old value)."""

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        weight = self.weight
        takes = rms_norm_supports(x, weight) and (
            residual is None or (residual.shape == x.shape and rms_norm_supports(residual, weight)
                                 and residual.data_ptr() != x.data_ptr()))
        if not takes:
            return super().forward(x, residual)
        with platform_code():
            out = empty(x.shape, x.dtype)
            if residual is None:
                launch(bind_rms_norm(x, weight, self.eps, out), NORM_PROFILER_NAME, x, out)
                return out
            launch(bind_add_rms_norm(residual, x, weight, self.eps, out), NORM_PROFILER_NAME,
                   residual, x, out)
            return out, residual


class CPURotaryEmbedding(RotaryEmbedding):
    """Rotary embeddings in C: the positions' cos/sin rows looked up, then q and k turned."""

    def forward(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        dtype = q.dtype
        tables = self._tables(dtype)
        if tables is None or positions.dim() != 1 or not positions.is_contiguous():
            return super().forward(positions, q, k)
        with platform_code():
            rows = positions.shape[0]
            cos, sin = (empty((rows, t.shape[1]), dtype) for t in tables)
            if not (rotary_supports(q, cos, sin) and rotary_supports(k, cos, sin)):
                return super().forward(positions, q, k)
            for table, out in zip(tables, (cos, sin), strict=True):
                launch(bind_gather_rows(table, positions, out), EMBEDDING_PROFILER_NAME,
                       table, positions, out)
            q_out, k_out = empty(q.shape, dtype), empty(k.shape, dtype)
            for x, out in ((q, q_out), (k, k_out)):
                launch(bind_rotary(x, cos, sin, out), ROTARY_PROFILER_NAME, x, cos, sin, out)
            return q_out, k_out

    def _tables(self, dtype: torch.dtype) -> tuple[Tensor, Tensor] | None:
        """cos and sin in `dtype`, contiguous (made once per dtype), or None off the CPU."""
        if self.cos.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            return None
        cache = self.__dict__.setdefault("_by_dtype", {})
        if dtype not in cache:
            cache[dtype] = (self.cos.to(dtype).contiguous(), self.sin.to(dtype).contiguous())
        return cache[dtype]


class CPUSiluAndMul(SiluAndMul):
    """`silu(gate) * up` in one C call."""

    def forward(self, gate: Tensor, up: Tensor) -> Tensor:
        if not silu_mul_supports(gate, up):
            return super().forward(gate, up)
        with platform_code():
            out = empty(gate.shape, gate.dtype)
            launch(bind_silu_mul(gate, up, out), SILU_MUL_PROFILER_NAME, gate, up, out)
            return out


class CPUEmbedding(nn.Embedding):
    """The token embedding's look-up as one C call (a row copy per token)."""

    def forward(self, input_ids: Tensor) -> Tensor:
        weight = self.weight
        if not (weight.dtype in (torch.float32, torch.bfloat16) and weight.is_contiguous()
                and input_ids.dim() == 1 and input_ids.dtype == torch.int64
                and input_ids.is_contiguous() and not torch.is_grad_enabled()):
            return super().forward(input_ids)
        with platform_code():
            out = empty((input_ids.shape[0], weight.shape[1]), weight.dtype)
            launch(bind_gather_rows(weight, input_ids, out), EMBEDDING_PROFILER_NAME,
                   weight, input_ids, out)
            return out


class Int8Embedding(nn.Module):
    """A token embedding over int8 rows (the tied head's `Int8Weight`): looks the ids' rows up
    and dequantises only those, so no float copy of the vocabulary's matrix is kept."""

    def __init__(self, weight: Int8Weight, dtype: torch.dtype) -> None:
        super().__init__()
        self.int8, self.dtype = weight, dtype
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, input_ids: Tensor) -> Tensor:
        with platform_code():
            out = empty((*input_ids.shape, self.embedding_dim), self.dtype)

        def look_up() -> None:
            data = F.embedding(input_ids, self.int8.data).float()
            scales = F.embedding(input_ids, self.int8.scales)
            rows = data.view(*data.shape[:-1], scales.shape[-1], -1) * scales[..., None]
            out.copy_(rows.view(data.shape))

        launch_python(look_up, input_ids, out)
        return out
