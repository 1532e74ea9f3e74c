"""Layer 0 -- the CPU's native kernels: C sources beside this package, compiled by the
system's C compiler on first use for the machine's own instruction set and loaded with ctypes.

Only the CPU fast paths of the layers above call into it; their reference paths are plain
PyTorch and run without a compiler.
"""

from __future__ import annotations

from minipaged.cpu.native import (
    build_native_decode,
    native_decode_available,
    native_decode_supports,
    paged_decode,
)

__all__ = [
    "build_native_decode",
    "native_decode_available",
    "native_decode_supports",
    "paged_decode",
]
