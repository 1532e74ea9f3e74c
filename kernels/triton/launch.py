"""Launch-side helpers shared by the kernel modules: launches as data, tile sizes, padding.

Nothing here runs on the device. Each launcher first plans its launches (`KernelLaunch`: kernel,
grid, arguments, compile-time constants, warps), then runs them; the same plans are what
`minipaged.kernels.triton.aot` compiles ahead of time for real GPUs, so the compiled programs are
the launched ones. The one policy decision is tile sizes: on a GPU, tiles are sized for registers
and occupancy; under Triton's CPU interpreter every loop iteration costs the same few milliseconds
whatever its size, so tiles are made as large as allowed.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
from torch import Tensor

# `tl.dot` on a GPU needs every dimension to be at least 16.
MIN_DOT_SIZE = 16
# The most elements of a float32 K or V tile that stay in registers beside the other tiles.
FP32_KV_TILE_ELEMENTS = 4096
# Elements per program of the element-wise kernels (norms, SiLU, cache writes, block copies) on
# a GPU: enough per thread to hide memory latency, few enough to keep every SM busy at a decode
# step's few rows.
GPU_TILE_ELEMENTS = 4096
INTERPRETER_TILE_ELEMENTS = 1 << 16  # the interpreter: few, large programs


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel launch as a launcher plans it: what to run, on which grid, with what.

    `args` are the runtime arguments in the kernel's order (tensors, ints, floats) and
    `constexprs` its compile-time constants by name. Triton's JIT compiles one program per
    distinct set of constants, argument dtypes and integer specialisations (values of 1,
    multiples of 16), so a plan fixes which program runs. `num_warps` and `num_stages` are
    compile options too.
    """

    name: str
    kernel: Any  # a @triton.jit function (an interpreted one under TRITON_INTERPRET=1)
    grid: tuple[int, ...]
    args: tuple
    constexprs: dict[str, Any] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int | None = None  # software-pipelining depth of the loops; None: Triton's own

    def __call__(self) -> Any:
        """Launch; returns what Triton returns (on a GPU, the compiled kernel)."""
        options: dict[str, int] = {"num_warps": self.num_warps}
        if self.num_stages is not None:
            options["num_stages"] = self.num_stages
        return self.kernel[self.grid](*self.args, **self.constexprs, **options)


def run_launches(launches: Iterable[KernelLaunch]) -> None:
    """Launch each planned launch, in order: what every launcher does with its plans."""
    for launch in launches:
        launch()


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pow2_at_least(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum): `tl.arange` sizes must be powers of two."""
    return max(triton.next_power_of_2(max(n, 1)), minimum)


def tile_elements() -> int:
    """Elements per program of an element-wise kernel: `INTERPRETER_TILE_ELEMENTS` in the
    interpreter, else `GPU_TILE_ELEMENTS`."""
    return INTERPRETER_TILE_ELEMENTS if interpreting() else GPU_TILE_ELEMENTS


def token_tile(per_token: int, num_tokens: int) -> int:
    """Tokens per program of a kernel that moves `per_token` elements a token, about
    `tile_elements()` a program: on a GPU the same compiled program for every batch size; in
    the interpreter, none larger than the batch."""
    tile = pow2_at_least(tile_elements() // per_token)
    return min(tile, pow2_at_least(num_tokens)) if interpreting() else tile


def check_output(name: str, out: Tensor, like: Tensor, dtype: torch.dtype) -> None:
    """Raise `ValueError` unless the output `out` has like's shape and device and `dtype`."""
    if out.shape != like.shape or out.dtype != dtype or out.device != like.device:
        raise ValueError(
            f"{name} must be {tuple(like.shape)} {dtype} on {like.device}, got "
            f"{tuple(out.shape)} {out.dtype} on {out.device}"
        )


def check_power_of_two(name: str, value: int, minimum: int = 1) -> None:
    """Raise `ValueError` unless `value` is a power of two >= `minimum` (a tile size)."""
    if value < minimum or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value}")


def default_key_tile(dtype: torch.dtype, head_dim_pad: int) -> int:
    """Keys per inner-loop iteration: a power of two >= 16 for `tl.dot`, set by the registers a
    K or V tile takes, not by the cache's block size (each key finds its own block through the
    block table, so a tile may hold part of a block or several).

    On a GPU, 64 keys for 16-bit caches, and for float32 ones a tile of at most
    `FP32_KV_TILE_ELEMENTS` (32 keys up to head dim 128, 16 at 256). A float32 tile is twice
    the bytes, and "tf32x3" keeps every float32 operand as two TF32 parts besides, so 64-key
    float32 tiles at head dim 128, or 32-key ones at 256, need more than the 255 registers a
    thread can have and spill to local memory (`minipaged.kernels.triton.aot` measures it). The
    interpreter takes 128.
    """
    if interpreting():
        return 128
    if dtype != torch.float32:
        return 64
    return max(min(32, FP32_KV_TILE_ELEMENTS // head_dim_pad), MIN_DOT_SIZE)
