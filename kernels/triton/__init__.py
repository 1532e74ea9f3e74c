"""Layer 6 -- Triton kernels for paged attention, whose entry points `minipaged.kernels` names.

Importing this package imports Triton. On a machine without a GPU, set `TRITON_INTERPRET=1`
before the import to run the kernels through Triton's CPU interpreter.

* `paged_attention`: the attention contract (docs/architecture.md), dispatching to
* `paged_decode_attention` (one query per sequence, split-K "flash-decoding") or
* `paged_prefill_attention` (any number of queries per sequence, one launch per batch);
* `reshape_and_cache`: write new K/V into their cache slots;
* `copy_blocks`: copy-on-write block copies, in every layer;
* `rms_norm`, `fused_add_rms_norm`, `silu_and_mul`, `silu_mul`: a layer's small operators,
  fused (`fused.py`).

Each launcher plans its launches (`*_launches`, `launch.KernelLaunch`) before running them;
`minipaged.kernels.triton.aot` compiles the same plans ahead of time for real GPUs, without one.
"""

from .attention import paged_attention
from .copy_blocks import copy_blocks
from .decode import paged_decode_attention
from .fused import fused_add_rms_norm, rms_norm, silu_and_mul, silu_mul
from .prefill import paged_prefill_attention
from .reshape_and_cache import reshape_and_cache

__all__ = [
    "copy_blocks",
    "fused_add_rms_norm",
    "paged_attention",
    "paged_decode_attention",
    "paged_prefill_attention",
    "reshape_and_cache",
    "rms_norm",
    "silu_and_mul",
    "silu_mul",
]
