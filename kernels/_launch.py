"""Launch-side helpers shared by the kernel modules: tile sizes, padding, dot precision.

Nothing here runs on the device. The one policy decision is tile sizes: on a GPU, tiles are sized
for registers and occupancy; under Triton's CPU interpreter every loop iteration costs the same
few milliseconds whatever its size (TOOLCHAIN.md), so tiles are made as large as allowed.
"""

from __future__ import annotations

import os

import torch
import triton

# `tl.dot` on a GPU needs every dimension to be at least 16.
MIN_DOT_SIZE = 16


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pow2_at_least(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum): `tl.arange` sizes must be powers of two."""
    return max(triton.next_power_of_2(max(n, 1)), minimum)


def check_power_of_two(name: str, value: int, minimum: int = 1) -> None:
    """Raise `ValueError` unless `value` is a power of two >= `minimum` (a tile size)."""
    if value < minimum or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value}")


def default_key_tile(block_size: int) -> int:
    """Keys per inner-loop iteration: a whole number of cache blocks, at least 16 for `tl.dot`."""
    target = 128 if interpreting() else 64
    return max(target, block_size, MIN_DOT_SIZE)


def qk_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision for the Q.K^T product on GPU tensor cores.

    Keys and queries stored in float16/bfloat16 have at most 11 significant bits, so TF32 (11
    bits) holds them exactly and their products are exact in float32: plain "tf32" is as exact
    as float32 arithmetic. Float32 storage needs "tf32x3" (three TF32 products recovering float32
    accuracy). The interpreter ignores the setting and multiplies in float32.
    """
    return "tf32" if dtype in (torch.float16, torch.bfloat16) else "tf32x3"


# The P.V product multiplies float32 probabilities, never exact in TF32: always "tf32x3".
PV_PRECISION = "tf32x3"
