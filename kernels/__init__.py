"""The hand-written kernels, imported as `minipaged.kernels`: Triton's for paged attention
(layer 6), and in `cpu/` the CPU's C kernels (layer 0).

Asking for a Triton kernel imports Triton. On a machine without a GPU, set `TRITON_INTERPRET=1`
before that to run the kernels through Triton's CPU interpreter.

* `paged_attention`: the attention contract (docs/architecture.md), dispatching to
* `paged_decode_attention` (one query per sequence, split-K "flash-decoding") or
* `paged_prefill_attention` (any number of queries per sequence, one launch per batch);
* `reshape_and_cache`: write new K/V into their cache slots;
* `copy_blocks`: copy-on-write block copies, in every layer.

Each launcher plans its launches (`*_launches`, `launch.KernelLaunch`) before running them;
`minipaged.kernels.aot` compiles the same plans ahead of time for real GPUs, without one.
"""

from __future__ import annotations

import importlib
from typing import Any

# Imported on first use, so that `minipaged.kernels.cpu` (layer 0: the C kernels, which the
# models call) never imports Triton, and `TRITON_INTERPRET=1` may still be set before the
# first Triton kernel is asked for.
_LAZY = {
    "copy_blocks": "minipaged.kernels.copy_blocks",
    "paged_attention": "minipaged.kernels.attention",
    "paged_decode_attention": "minipaged.kernels.decode",
    "paged_prefill_attention": "minipaged.kernels.prefill",
    "reshape_and_cache": "minipaged.kernels.reshape_and_cache",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'minipaged.kernels' has no attribute {name!r}")
