"""Layer 6 -- the CPU's native kernels: C sources beside this package, compiled by the
system's C compiler on first use for the machine's own instruction set and loaded with ctypes.

Paged attention (`native`: decode over blocks read in place, and the KV write), the few-row
linear layers, float32, bfloat16 or weight-only int8 (`gemv`), and RMSNorm, rotary
embeddings and SwiGLU's SiLU-and-multiply (`norm_rotary`), the greedy choice of a step's
tokens (`greedy`), all built and loaded one way (`build`), and memory on huge pages for them to
stream (`pages`). Each has a `bind_*` form (`GemvPlan.bind`) that fixes a call's arguments once
(`calls.KernelCall`), and a list of bound calls runs in one call into C (`calls.KernelCalls`):
a decode step replayed again and again. Only the CPU fast paths of the layers above call into
it; their reference paths are plain PyTorch and run without a compiler.
"""

from __future__ import annotations

from minipaged.kernels.cpu.build import build_native, load_native, profiled
from minipaged.kernels.cpu.calls import KernelCall, KernelCalls, kernel_calls_available
from minipaged.kernels.cpu.gemv import (
    GemvPlan,
    Int8Weight,
    fetch_ahead,
    gemv,
    gemv_available,
    gemv_isa,
    gemv_row_limit,
    quantize_int8,
)
from minipaged.kernels.cpu.greedy import greedy_tokens, greedy_tokens_available
from minipaged.kernels.cpu.native import (
    bind_paged_decode,
    bind_write_kv,
    build_native_decode,
    native_decode_available,
    native_decode_supports,
    paged_decode,
    write_kv_supports,
)
from minipaged.kernels.cpu.norm_rotary import (
    bind_add_rms_norm,
    bind_gather_rows,
    bind_rms_norm,
    bind_rotary,
    bind_silu_mul,
    bind_to_float32,
    norm_rotary_available,
    rms_norm,
    rms_norm_supports,
    rotary,
    rotary_supports,
    silu_mul,
    silu_mul_supports,
)
from minipaged.kernels.cpu.pages import huge_page_buffer

__all__ = [
    "GemvPlan",
    "Int8Weight",
    "KernelCall",
    "KernelCalls",
    "bind_add_rms_norm",
    "bind_gather_rows",
    "bind_paged_decode",
    "bind_rms_norm",
    "bind_rotary",
    "bind_silu_mul",
    "bind_to_float32",
    "bind_write_kv",
    "build_native",
    "build_native_decode",
    "fetch_ahead",
    "gemv",
    "gemv_available",
    "gemv_isa",
    "gemv_row_limit",
    "greedy_tokens",
    "greedy_tokens_available",
    "huge_page_buffer",
    "kernel_calls_available",
    "load_native",
    "native_decode_available",
    "native_decode_supports",
    "norm_rotary_available",
    "paged_decode",
    "profiled",
    "quantize_int8",
    "rms_norm",
    "rms_norm_supports",
    "rotary",
    "rotary_supports",
    "silu_mul",
    "silu_mul_supports",
    "write_kv_supports",
]
