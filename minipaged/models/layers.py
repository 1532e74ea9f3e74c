"""The building blocks every model family shares, and the interface a model attends through.

The models run on a *flat token batch*: the new tokens of every sequence in one step,
concatenated into `input_ids [T]` with their `positions [T]` (`check_flat_batch` checks it).
Nothing in a model knows where past keys and values live: each layer hands its new queries, keys
and values to an `AttentionBackend`, which owns the KV cache (the dense oracle's in
`minipaged.testing.dense`, the paged one in `minipaged.attention.reference`, Kwon et al., SOSP'23,
section 4.1).

The blocks, in plain PyTorch, one module for each computation of a layer (as nano-vllm's and
vLLM's `layers/` have them): `RMSNorm` (with the residual add before it), `RotaryEmbedding`,
`SiluAndMul`; the projections are `nn.Linear`. Between a layer's modules there are only views,
so a platform (`minipaged.platforms`) can swap in faster modules at load and capture a step
from this very forward, without a second description of the model.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minipaged.models.checkpoint.model_config import ModelConfig


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
    lm_head: nn.Linear
    # Whether `forward` reads the batch's values to check their ranges: a device sync, and a
    # break in a captured CUDA graph. A model runner checks every batch on the host first
    # (`check_input_ranges`) and turns it off.
    checks_values = True

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


def check_flat_batch(config: ModelConfig, input_ids: Tensor, positions: Tensor,
                     values: bool = True) -> None:
    """Raise `ModelInputError` unless `input_ids` and `positions` are a valid flat batch: its
    shapes and dtypes, and with `values` the ranges of its ids and positions."""
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
    if values:
        check_input_ranges(config, (int(input_ids.min()), int(input_ids.max())),
                           (int(positions.min()), int(positions.max())))


def check_input_ranges(config: ModelConfig, ids: tuple[int, int],
                       positions: tuple[int, int]) -> None:
    """Raise `ModelInputError` unless a batch's smallest and largest token ids lie in the
    vocabulary and its smallest and largest positions below `max_position_embeddings`."""
    (lo_id, hi_id), (lo_pos, hi_pos) = ids, positions
    if lo_id < 0 or hi_id >= config.vocab_size:
        raise ModelInputError(f"token id out of range [0, {config.vocab_size}): {lo_id}..{hi_id}")
    if lo_pos < 0 or hi_pos >= config.max_position_embeddings:
        raise ModelInputError(
            f"position out of range [0, {config.max_position_embeddings}): {lo_pos}..{hi_pos}"
        )


# ---------------------------------------------------------------------------------------------
# RMSNorm, rotary position embeddings, SwiGLU's activation
# ---------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dimension, computed in float32 (as Hugging Face does)
    and cast back.

    Given the residual stream too, it first adds the sublayer's output to it and returns both
    the normed sum and the new residual stream (`x + residual`): a pre-norm block's residual
    add and the norm after it are one module call, so that between a layer's modules there is
    nothing to compute, only views (what lets a platform capture a step from the forward).
    """

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        if residual is not None:
            x = residual = x + residual
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = self.weight * xf.to(x.dtype)
        return normed if residual is None else (normed, residual)


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

    def forward(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """`q [T, H, D]` and `k [T, H_kv, D]` of the tokens at `positions`, rotated."""
        cos = self.cos[positions][:, None, :].to(q.dtype)  # [T, 1, D]: broadcast over heads
        sin = self.sin[positions][:, None, :].to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension: a 90 degree turn per pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class SiluAndMul(nn.Module):
    """SwiGLU's activation (Shazeer 2020): `silu(gate) * up`."""

    def forward(self, gate: Tensor, up: Tensor) -> Tensor:
        return F.silu(gate) * up
