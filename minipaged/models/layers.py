"""The building blocks every model family shares, and the interface a model attends through.

The models run on a *flat token batch*: the new tokens of every sequence in one step,
concatenated into `input_ids [T]` with their `positions [T]` (`check_flat_batch` checks it).
Nothing in a model knows where past keys and values live: each layer hands its new queries, keys
and values to an `AttentionBackend`, which owns the KV cache (the dense oracle's in
`minipaged.testing.dense`, the paged one in `minipaged.attention.reference`, Kwon et al., SOSP'23,
section 4.1).

The blocks: `Linear` (every projection, on the GEMM that is faster on this CPU), `RMSNorm`, and
rotary position embeddings (`RotaryEmbedding`, `apply_rotary`).
"""

from __future__ import annotations

import functools
import math
import time
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from minipaged.checkpoint.model_config import ModelConfig


class AttentionBackend(Protocol):
    """Attention of the new tokens of a flat batch over their sequences' whole context.

    `q [T, H, D]`, `k`, `v [T, H_kv, D]` are the projections of the step's new tokens, rotary
    already applied. The backend stores `k`/`v` in its cache for layer `layer_idx`, then returns
    causal attention of each new token over its own sequence's cached plus new keys: `[T, H, D]`.
    """

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        ...


class CausalLM(nn.Module):
    """What every family's model offers: `forward` over a flat batch to the final hidden
    states, `compute_logits` of some of their rows, and the token embedding a tied head shares.
    """

    config: ModelConfig
    lm_head: Linear

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionBackend) -> Tensor:
        """Hidden states `[T, hidden_size]` (final norm applied) of a flat token batch."""
        raise NotImplementedError

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Next-token logits `[N, vocab_size]` in float32 for the rows of `hidden`."""
        return self.lm_head(hidden).float()

    def input_embedding(self) -> nn.Embedding:
        """The token embedding, which a tied head shares."""
        raise NotImplementedError


class ModelInputError(ValueError):
    """The flat batch handed to a model does not fit it (shape, dtype or position range)."""


def check_flat_batch(config: ModelConfig, input_ids: Tensor, positions: Tensor) -> None:
    """Raise `ModelInputError` unless `input_ids` and `positions` are a valid flat batch."""
    if input_ids.dim() != 1 or positions.shape != input_ids.shape:
        raise ModelInputError(
            f"input_ids and positions must both be [T], got {tuple(input_ids.shape)} and "
            f"{tuple(positions.shape)}"
        )
    if input_ids.dtype != torch.long or positions.dtype != torch.long:
        raise ModelInputError(
            f"input_ids and positions must be int64, got {input_ids.dtype} and {positions.dtype}"
        )
    if input_ids.numel() == 0:
        raise ModelInputError("empty flat batch")
    # One host sync per step; the sampler syncs anyway, and a readable error beats a device assert.
    lo_id, hi_id = int(input_ids.min()), int(input_ids.max())
    if lo_id < 0 or hi_id >= config.vocab_size:
        raise ModelInputError(f"token id out of range [0, {config.vocab_size}): {lo_id}..{hi_id}")
    lo_pos, hi_pos = int(positions.min()), int(positions.max())
    if lo_pos < 0 or hi_pos >= config.max_position_embeddings:
        raise ModelInputError(
            f"position out of range [0, {config.max_position_embeddings}): {lo_pos}..{hi_pos}"
        )


# ---------------------------------------------------------------------------------------------
# Linear layers: every projection of every family
# ---------------------------------------------------------------------------------------------

# oneDNN's linear op and its weight packing, from PyTorch's oneDNN integration (torch.compile's
# CPU backend emits both for frozen linear layers); absent from builds without oneDNN, where
# `linear` is `F.linear`.
ONEDNN_AVAILABLE = torch.backends.mkldnn.is_available() and all(
    hasattr(torch.ops.mkldnn, op) for op in ("_linear_pointwise", "_reorder_linear_weight")
)
# The row counts `onednn_is_faster` times both GEMMs at: a small decode step and a large one.
GEMM_PROBE_ROWS = (1, 16)
# The weight copies each probe streams through: more than a server CPU's last-level cache.
GEMM_PROBE_BYTES = 48 << 20
# How much faster oneDNN must measure to be chosen over `F.linear`, PyTorch's default.
ONEDNN_MARGIN = 0.1


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`x @ weight.T + bias`, as `F.linear`, on whichever of PyTorch's two CPU GEMMs is faster.

    PyTorch's CPU build sends `F.linear` to MKL's GEMM (oneDNN's for bfloat16 where the CPU has
    it), which rearranges the weight into the GEMM's blocked layout on every call: at the few
    rows of a decode step that rearranging costs about as much as the product. The other is
    oneDNN's linear op over a copy of the weight packed into that layout once
    (`packed_weight`). Which is faster depends on the CPU and on the weight's shape, so
    `onednn_is_faster` times both on this machine, once per weight shape and dtype
    (`benchmarks/linear_cpu.py` compares them at every row count). The sums are the same, in
    another order: outputs differ from `F.linear` by float rounding. The oneDNN op has no
    backward, so anything that needs gradients takes `F.linear`.
    """
    if uses_onednn(x, weight):
        return onednn_linear(x, packed_weight(weight), bias)
    return F.linear(x, weight, bias)


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
            cached = (stamp, torch.ops.mkldnn._reorder_linear_weight(weight.detach()))
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
    """Whether oneDNN's linear can take `weight` at all: a CPU weight of float32 or bfloat16,
    not made under `torch.inference_mode` (such a tensor has no version counter to tell when a
    packed copy is stale)."""
    return (
        ONEDNN_AVAILABLE
        and weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and not weight.is_inference()
    )


def choose_gemms(model: nn.Module) -> None:
    """Make `linear`'s choice (`onednn_is_faster`) for every `Linear` weight of `model` now, at
    start-up, and pack the weights oneDNN will multiply, so that no step, and no profile of one,
    pays for the measurement or the packing."""
    for module in model.modules():
        if isinstance(module, Linear) and may_use_onednn(module.weight):
            out_features, in_features = module.weight.shape
            if onednn_is_faster(out_features, in_features, module.weight.dtype):
                packed_weight(module.weight)


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
    element_bytes = torch.tensor([], dtype=dtype).element_size()
    copies = max(1, min(64, GEMM_PROBE_BYTES // (out_features * in_features * element_bytes)))
    weights = [torch.randn(out_features, in_features, generator=gen).to(dtype)
               for _ in range(copies)]
    inputs = [torch.randn(n, in_features, generator=gen).to(dtype) for n in GEMM_PROBE_ROWS]
    with torch.inference_mode():
        # Throwaway copies, possibly made under inference_mode: packed directly, not cached.
        packed = [torch.ops.mkldnn._reorder_linear_weight(weight) for weight in weights]
        candidates = {F.linear: weights, onednn_linear: packed}
        best = dict.fromkeys(candidates, float("inf"))
        for fn, operands in candidates.items():  # warm-up: first-call costs are not a step's
            fn(inputs[0], operands[0])
        for _ in range(3):
            for fn, operands in candidates.items():
                start = time.perf_counter()
                for x in inputs:
                    for weight in operands:
                        fn(x, weight)
                best[fn] = min(best[fn], time.perf_counter() - start)
    return best[onednn_linear] < (1 - ONEDNN_MARGIN) * best[F.linear]


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same checkpoint layout) whose forward is `linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


# ---------------------------------------------------------------------------------------------
# RMSNorm and rotary position embeddings
# ---------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dimension, computed in float32 (as Hugging Face does)
    and cast back."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inverse_frequencies(config: ModelConfig) -> Tensor:
    """The rotary angle per position of each of the head's `head_dim / 2` dimension pairs.

    theta_i = rope_theta ** (-2i / head_dim) (Su et al., RoFormer), optionally rescaled to stretch
    the context: "linear" divides every frequency by `factor` (position interpolation); "llama3"
    divides only the low frequencies (long wavelengths) by `factor`, keeps the high ones, and
    blends smoothly in between (Llama 3.1).
    """
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))

    def positive(key: str) -> float:
        value = scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"rope scaling {kind!r} needs a positive number {key}, got {value!r}")
        return value

    if kind == "linear":
        return inv_freq / positive("factor")
    if kind == "llama3":
        factor, old_context = positive("factor"), positive("original_max_position_embeddings")
        low_freq_factor = positive("low_freq_factor")
        high_freq_factor = positive("high_freq_factor")
        if high_freq_factor <= low_freq_factor:
            raise ValueError(
                f"rope scaling 'llama3' needs high_freq_factor ({high_freq_factor}) above "
                f"low_freq_factor ({low_freq_factor})"
            )
        wavelen = 2 * math.pi / inv_freq
        low_freq_wavelen = old_context / low_freq_factor  # longer than this: divide by factor
        high_freq_wavelen = old_context / high_freq_factor  # shorter than this: keep
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        return torch.where(
            wavelen > low_freq_wavelen,
            inv_freq / factor,
            torch.where(wavelen < high_freq_wavelen, inv_freq, blended),
        )
    raise ValueError(f"unsupported rope scaling {kind!r}; minipaged implements linear and llama3")


class RotaryEmbedding(nn.Module):
    """Rotates each query and key by an angle proportional to its position (RoFormer).

    Dimension `i` is paired with dimension `i + D/2` (Hugging Face's `rotate_half` layout), and the
    pair is rotated by `position * inv_freq[i]`. The dot product of a rotated query and key then
    depends only on their distance. cos/sin are cached for every position up to
    `max_position_embeddings`, in float32, on the CPU even when the model is built on the meta
    device (they are computed, not loaded); moving the model moves them.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        inv_freq = rope_inverse_frequencies(config)
        angles = torch.arange(config.max_position_embeddings, dtype=torch.float32, device="cpu")
        angles = angles[:, None] * inv_freq[None, :]  # [P, D/2]
        angles = torch.cat([angles, angles], dim=-1)  # [P, D]: pair (i, i + D/2) shares an angle
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin `[T, 1, D]` of the tokens at `positions` (looked up once per forward pass,
        shared by all layers; the 1 broadcasts over heads)."""
        return self.cos[positions][:, None, :].to(dtype), self.sin[positions][:, None, :].to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each pair (i, i + D/2) of every head of `x [T, heads, D]` by its angle."""
    return x * cos + rotate_half(x) * sin


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension: a 90 degree turn per pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)
