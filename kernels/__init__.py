"""The hand-written kernels, imported as `minipaged.kernels`: in `triton/` the paged-attention
kernels in Triton (layer 6), in `cpu/` the CPU's C kernels (layer 0).

The Triton kernels' entry points are this package's names too (`from minipaged.kernels import
paged_attention`), imported on first use: importing the C kernels, which the models call, never
imports Triton, and `TRITON_INTERPRET=1` (Triton's CPU interpreter, for machines without a GPU)
may still be set before the first Triton kernel is asked for.
"""

from __future__ import annotations

import importlib
from typing import Any

TRITON_NAMES = (
    "copy_blocks",
    "paged_attention",
    "paged_decode_attention",
    "paged_prefill_attention",
    "reshape_and_cache",
)

__all__ = list(TRITON_NAMES)


def __getattr__(name: str) -> Any:
    if name in TRITON_NAMES:
        return getattr(importlib.import_module("minipaged.kernels.triton"), name)
    raise AttributeError(f"module 'minipaged.kernels' has no attribute {name!r}")
