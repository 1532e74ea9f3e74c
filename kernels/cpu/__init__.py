"""Layer 0 -- the CPU's native kernels: C sources beside this package, compiled by the
system's C compiler on first use for the machine's own instruction set and loaded with ctypes.

Two kernels: paged-attention decode (`native`) and the few-row linear layers, float32,
bfloat16 or weight-only int8 (`gemv`). Only the CPU fast paths of the layers above call into
it; their reference paths are plain PyTorch and run without a compiler.
"""

from __future__ import annotations

from minipaged.kernels.cpu.gemv import (
    GemvPlan,
    Int8Weight,
    gemv,
    gemv_available,
    gemv_isa,
    gemv_row_limit,
    quantize_int8,
)
from minipaged.kernels.cpu.native import (
    build_native,
    build_native_decode,
    native_decode_available,
    native_decode_supports,
    paged_decode,
)

__all__ = [
    "GemvPlan",
    "Int8Weight",
    "build_native",
    "build_native_decode",
    "gemv",
    "gemv_available",
    "gemv_isa",
    "gemv_row_limit",
    "native_decode_available",
    "native_decode_supports",
    "paged_decode",
    "quantize_int8",
]
