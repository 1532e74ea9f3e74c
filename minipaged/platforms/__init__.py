"""Layer 7 -- the platforms: each device's speed behind one seam (`Platform`), so that the
model is written once, in plain PyTorch, and the runner calls one interface; and the choice of
a platform for a device.

`platform_class` names a device's platform, whose class answers the device's questions
(`Platform.check_and_update_config`); `get_platform` builds one for a runner's settled config:
the CPU's (`cpu`: C kernels swapped in at load, int8 weights, weights on huge pages, the CPU
attention backend, decode steps replayed from a recording of the model's forward), CUDA's
(`cuda`: the Triton kernels, CUDA graphs captured from the model's forward, memory measured
after the weights), or the reference (`Platform`: the model as written, `attention_backend=
"torch"` with `enforce_eager=True`, and any other device). Each is imported only when chosen.
"""

from __future__ import annotations

from typing import Any

import torch

from minipaged.attention.contract import AttentionOps
from minipaged.attention.reference import REFERENCE_OPS
from minipaged.platforms.base import (
    DTYPES,
    QUANTIZATIONS,
    CaptureUnsupported,
    Platform,
    Replay,
    logger,
)

__all__ = ["BACKENDS", "DTYPES", "QUANTIZATIONS", "CaptureUnsupported", "Platform", "Replay",
           "default_device", "get_attention_ops", "get_platform", "logger", "platform_class"]

BACKENDS = ("torch", "cpu", "triton")  # the attention backends, by name


def default_device() -> str:
    """The device a config that names none runs on: a CUDA card where there is one."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def platform_class(device: str | torch.device) -> type[Platform]:
    """The platform of `device`'s kind: the CPU's, CUDA's, or the reference elsewhere."""
    kind = torch.device(device).type
    if kind == "cpu":
        from minipaged.platforms.cpu import CPUPlatform

        return CPUPlatform
    if kind == "cuda":
        from minipaged.platforms.cuda import CUDAPlatform

        return CUDAPlatform
    return Platform


def get_attention_ops(backend: str | None = None,
                      device: str | torch.device | None = None) -> AttentionOps:
    """The paged-attention operations of `backend`: "torch" (the reference,
    `minipaged.attention.reference`), "cpu" (the CPU platform's: decodes read their blocks in
    place, `minipaged.platforms.cpu.attention`), "triton" (`minipaged.kernels`, imported only
    now) or None / "auto": the platform of `device` (torch's default device) names it."""
    if backend is None or backend == "auto":
        backend = platform_class(device or torch.get_default_device()).attention_backend
    if backend == "torch":
        return REFERENCE_OPS
    if backend == "cpu":
        from minipaged.platforms.cpu.attention import CPU_OPS

        return CPU_OPS
    if backend == "triton":
        from minipaged.platforms.cuda import triton_ops

        return triton_ops()
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS} or 'auto'")


def get_platform(config: Any) -> Platform:
    """The platform a settled `RunnerConfig` runs on (`minipaged.runner.config`): its device's,
    with its attention backend, capturing decode steps of up to `max_num_seqs` sequences unless
    `enforce_eager`. The reference attention with `enforce_eager` is the reference platform on
    any device: the plain model, no platform code."""
    device = torch.device(config.device)
    ops = get_attention_ops(config.attention_backend, device)
    cls = Platform if ops is REFERENCE_OPS and config.enforce_eager else platform_class(device)
    return cls(device, ops, capture=not config.enforce_eager, max_num_seqs=config.max_num_seqs)
