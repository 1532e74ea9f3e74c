"""Layer 7 -- the platforms: each device's speed behind one seam (`Platform`), so that the
model is written once, in plain PyTorch, and the runner calls one interface.

`get_platform` picks one for a device: the CPU's (`minipaged.platforms.cpu`: C kernels swapped
in at load, int8 weights, weights on huge pages, the CPU attention backend, decode steps
replayed from a recording of the model's forward), CUDA's (`minipaged.platforms.cuda`: the
Triton kernels, CUDA graphs captured from the model's forward, memory measured after the
weights), or the reference (`Platform`: the model as written, `attention_backend="torch"` with
`enforce_eager=True`).
"""

from __future__ import annotations

import importlib

import torch

from minipaged.attention.contract import AttentionOps
from minipaged.attention.reference import REFERENCE_OPS
from minipaged.platforms.base import CaptureUnsupported, Platform, Replay, logger

__all__ = [
    "BACKENDS",
    "CaptureUnsupported",
    "Platform",
    "Replay",
    "get_attention_ops",
    "get_platform",
    "logger",
]

BACKENDS = ("torch", "cpu", "triton")  # the attention backends, by name


def get_attention_ops(backend: str | None = None,
                      device: str | torch.device | None = None) -> AttentionOps:
    """The paged-attention operations of `backend`: "torch" (the reference,
    `minipaged.attention.reference`), "cpu" (the CPU platform's: decodes read their blocks in
    place, `minipaged.platforms.cpu.attention`), "triton" (`minipaged.kernels`, imported only
    now) or None / "auto": Triton on a CUDA device, "cpu" on a CPU, the reference elsewhere.
    `device` defaults to torch's default device."""
    if backend is None or backend == "auto":
        device = torch.device(device) if device is not None else torch.get_default_device()
        backend = {"cuda": "triton", "cpu": "cpu"}.get(device.type, "torch")
    if backend == "torch":
        return REFERENCE_OPS
    if backend == "cpu":
        return importlib.import_module("minipaged.platforms.cpu.attention").CPU_OPS
    if backend == "triton":
        return importlib.import_module("minipaged.platforms.cuda").triton_ops()
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS} or 'auto'")


def get_platform(device: str | torch.device, attention_backend: str | None = None,
                 enforce_eager: bool = False, max_num_seqs: int = 256) -> Platform:
    """The platform for `device` with `attention_backend` (as `get_attention_ops` names
    them); `enforce_eager` captures no steps, else decode steps of up to `max_num_seqs`
    sequences may be. The reference attention with `enforce_eager` is the reference platform
    on any device: the plain model, no platform code."""
    device = torch.device(device)
    ops = get_attention_ops(attention_backend, device)
    if ops is REFERENCE_OPS and enforce_eager:
        return Platform(device)
    if device.type == "cpu":
        from minipaged.platforms.cpu import CPUPlatform

        return CPUPlatform(device, attention=ops, capture=not enforce_eager)
    if device.type == "cuda":
        from minipaged.platforms.cuda import CUDAPlatform

        return CUDAPlatform(device, attention=ops, capture=not enforce_eager,
                            max_num_seqs=max_num_seqs)
    return Platform(device, ops)
