"""Layer 6 -- the hand-written kernels, `minipaged.kernels`: in `triton/` the paged-attention
kernels in Triton, in `cpu/` the CPU's C kernels.

Their code is the repository's root `kernels/` folder, installed as this package's `cpu` and
`triton` subpackages (`package-dir` in pyproject.toml). This `__init__` lives here, not in
`kernels/`, so that the root folder has none: a folder without `__init__.py` is only a namespace
portion, and `import kernels` with the repository's root on `sys.path` (`python -c` there) still
finds a regular `kernels` package anywhere on the path, such as Hugging Face's, which
`transformers` imports. A root `kernels/__init__.py` would hide it.

The Triton kernels' entry points are this package's names too (`from minipaged.kernels import
paged_attention`), imported on first use: importing the C kernels, which the models call, never
imports Triton, and `TRITON_INTERPRET=1` (Triton's CPU interpreter, for machines without a GPU)
may still be set before the first Triton kernel is asked for.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

__all__ = [  # the Triton kernels' entry points, imported on first use
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


# A source checkout on `sys.path` without an install (`PYTHONPATH=.`) holds the subpackages in the
# root's `kernels/`; an installed copy holds them beside this file, with no pyproject.toml above.
_CHECKOUT = Path(__file__).resolve().parents[2]
if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "kernels" / "cpu").is_dir():
    __path__.append(str(_CHECKOUT / "kernels"))


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("minipaged.kernels.triton"), name)
    raise AttributeError(f"module 'minipaged.kernels' has no attribute {name!r}")
