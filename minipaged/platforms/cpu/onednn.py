"""oneDNN's linear op over weights packed once, and whether it beats `F.linear` on this CPU.

PyTorch's CPU build sends `F.linear` to MKL's GEMM (oneDNN's for bfloat16 where the CPU has
it), which rearranges the weight into the GEMM's blocked layout on every call: at the few rows
of a decode step that costs about as much as the product. oneDNN's linear op (from PyTorch's
oneDNN integration; torch.compile's CPU backend emits it for frozen linear layers) multiplies a
copy packed into that layout once (`packed_weight`). Which is faster depends on the CPU and the
weight's shape, so `onednn_is_faster` times both here, once per shape and dtype; the models'
`linear` (`minipaged.models.layers`) asks it.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from minipaged.kernels.cpu.gemv import best_times

# The op and its weight packing; absent from builds without oneDNN, where `linear` is `F.linear`.
ONEDNN_AVAILABLE = torch.backends.mkldnn.is_available() and all(
    hasattr(torch.ops.mkldnn, op) for op in ("_linear_pointwise", "_reorder_linear_weight")
)
logger = logging.getLogger(__name__)
# The row counts `onednn_is_faster` times both GEMMs at: a small decode step and a large one.
GEMM_PROBE_ROWS = (1, 16)
# The weight copies each probe streams through: more than a server CPU's last-level cache.
GEMM_PROBE_BYTES = 48 << 20
# How much faster oneDNN must measure to be chosen over `F.linear`, PyTorch's default.
ONEDNN_MARGIN = 0.1


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear` on oneDNN, whatever the sizes, for a plain or a packed weight (`linear` decides
    when to call it)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


# Each weight oneDNN multiplies -> (its storage and version when packed, the packed copy).
_PACKED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def packed_weight(weight: Tensor) -> Tensor:
    """`weight` in oneDNN's blocked layout for its linear op: packed on first use and kept while
    the weight lives, packed again once the weight is written in place (its version counter
    moves, as `load_state_dict` and `copy_` move it) or given new storage.

    The copy takes as much memory as the weight, which stays the model's parameter (checkpoints,
    tensor-parallel slices and a tied embedding read it). `weight` must not be an inference
    tensor (see `may_use_onednn`)."""
    if weight.is_inference():
        raise ValueError("packed_weight needs a weight made outside torch.inference_mode: an "
                         "inference tensor has no version counter to tell when it changes")
    stamp = (weight.data_ptr(), weight._version)
    cached = _PACKED.get(weight)
    if cached is None or cached[0] != stamp:
        with torch.no_grad():
            cached = (stamp, packed_copy(weight.detach()))
        _PACKED[weight] = cached
    return cached[1]


def uses_onednn(x: Tensor, weight: Tensor) -> bool:
    """Whether `linear(x, weight)` runs on oneDNN (see `linear`)."""
    return (
        x.dtype == weight.dtype
        and may_use_onednn(weight)
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and onednn_is_faster(weight.shape[0], weight.shape[1], weight.dtype)
    )


def may_use_onednn(weight: Tensor) -> bool:
    """Whether oneDNN's linear can take `weight` at all: a CPU weight of a dtype it runs here
    (`onednn_runs`), not made under `torch.inference_mode` (such a tensor has no version counter
    to tell when a packed copy is stale)."""
    return (
        weight.device.type == "cpu"
        and onednn_runs(weight.dtype)
        and not weight.is_inference()
    )


@functools.cache
def onednn_runs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's linear runs `dtype` weights on this CPU: float32 wherever PyTorch has
    oneDNN; bfloat16 only where the CPU has what oneDNN's bfloat16 path needs (AVX-512BW, VL and
    DQ, or AVX-NE-CONVERT; elsewhere packing a weight raises), as oneDNN itself reports. A
    bfloat16 model on another CPU multiplies with `F.linear`, and the log says so once."""
    if not ONEDNN_AVAILABLE or dtype not in (torch.float32, torch.bfloat16):
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        logger.info("this CPU lacks the instructions oneDNN's bfloat16 linear needs "
                    "(AVX-512BW/VL/DQ or AVX-NE-CONVERT): bfloat16 weights use F.linear")
        return False
    return True


def packed_copy(weight: Tensor) -> Tensor:
    """`weight` in oneDNN's blocked layout, not kept: for throwaway copies (the probes)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight)


@functools.cache
def onednn_is_faster(out_features: int, in_features: int, dtype: torch.dtype) -> bool:
    """Whether oneDNN's linear over packed weights beats `F.linear` on this CPU for an
    `[out, in]` weight of `dtype`.

    Measured once per process and shape, the way a step uses weights: both GEMMs multiply
    `GEMM_PROBE_ROWS` rows by copies of the weight that together overflow the CPU's caches
    (`GEMM_PROBE_BYTES`, so each is read from memory, as a step reads 30 layers' weights), in
    turns, three times; oneDNN is chosen if its best time summed over the row counts is
    `ONEDNN_MARGIN` lower. Taking turns, the best of three and the margin keep other load on a
    shared machine from deciding (where the two are about as fast, `F.linear` stays). Its fixed
    cost per call is higher, so tiny weights keep `F.linear`.
    """
    gen = torch.Generator().manual_seed(0)
    copies = max(1, min(64, GEMM_PROBE_BYTES // (out_features * in_features * dtype.itemsize)))
    weights = [torch.randn(out_features, in_features, generator=gen).to(dtype)
               for _ in range(copies)]
    inputs = [torch.randn(n, in_features, generator=gen).to(dtype) for n in GEMM_PROBE_ROWS]
    with torch.inference_mode():
        # Throwaway copies, possibly made under inference_mode: packed directly, not cached.
        packed = [packed_copy(weight) for weight in weights]
        best = best_times({
            "F.linear": lambda x: [F.linear(x, w) for w in weights],
            "oneDNN": lambda x: [onednn_linear(x, w) for w in packed],
        }, inputs)
    return best["oneDNN"] < (1 - ONEDNN_MARGIN) * best["F.linear"]
