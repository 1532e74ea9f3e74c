"""Layer 7 -- the platforms: each device's speed behind one seam (`Platform`), so that the
model is written once, in plain PyTorch, and the runner calls one interface.

The runner picks one for its device (`minipaged.runner.backends.get_platform`): the CPU's
(`cpu`: C kernels swapped in at load, int8 weights, weights on huge pages, the CPU attention
backend, decode steps replayed from a recording of the model's forward), CUDA's (`cuda`: the
Triton kernels, CUDA graphs captured from the model's forward, memory measured after the
weights), or the reference (`Platform`: the model as written, `attention_backend="torch"` with
`enforce_eager=True`).
"""

from __future__ import annotations

from minipaged.platforms.base import CaptureUnsupported, Platform, Replay, logger

__all__ = ["CaptureUnsupported", "Platform", "Replay", "logger"]
