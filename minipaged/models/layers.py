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

import math
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minipaged.kernels.cpu.gemv import (
    GemvPlan,
    Int8Weight,
    fetch_ahead,
    gemv_available,
    gemv_row_limit,
)
from minipaged.kernels.cpu.norm_rotary import (
    rms_norm,
    rms_norm_supports,
    rotary,
    rotary_supports,
    silu_mul,
    silu_mul_supports,
)
from minipaged.models.checkpoint.model_config import ModelConfig
from minipaged.models.onednn import (
    may_use_onednn,
    onednn_is_faster,
    onednn_linear,
    packed_copy,
    packed_weight,
    uses_onednn,
)


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
# Linear layers: every projection of every family
# ---------------------------------------------------------------------------------------------

# Rows up to which int8 weights take the GEMV kernel (8 rows at a time, the weight re-read from
# cache): dequantising a 1536 x 576 weight for PyTorch's GEMM costs 2.4 ms, the kernel 0.43 ms
# at 8 rows, 1.7 at 48, 4.6 at 128 (4.1 dequantised); PyTorch's int8 kernels are slower still.
INT8_GEMV_ROWS = 96
FETCH_AHEAD_ROWS = (1, 4, 8)  # a row count of each of the GEMV kernel's tile shapes


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


def choose_gemms(model: nn.Module, gemv: bool = True) -> None:
    """Make `linear`'s choice (`onednn_is_faster`) for every `Linear` weight of `model` now, at
    start-up, and pack the weights oneDNN will multiply; then measure up to how many rows the
    CPU's GEMV kernel beats that GEMM for each `LinearGroup` and each layer outside a group
    that has a few-row path (`few_rows`; the group's call takes its layers' few rows), or with
    `gemv` False give the float layers none (benchmarks compare the two in one run), and
    whether the kernel fetches weights ahead on this CPU (`fetch_ahead`). No step, and no
    profile of one, pays for the measurement or the packing."""
    groups = [value for module in model.modules() for value in vars(module).values()
              if isinstance(value, LinearGroup)]
    for group in groups:
        group.plan(gemv)
    grouped = {id(layer) for group in groups if group.path is not None for layer in group.layers}
    for module in model.modules():
        if not isinstance(module, Linear):
            continue
        weight = module.weight
        if module.int8 is None and may_use_onednn(weight):
            out_features, in_features = weight.shape
            if onednn_is_faster(out_features, in_features, weight.dtype):
                packed_weight(weight)
        module.few_rows = (few_rows(module) if (gemv or module.int8 is not None)
                           and id(module) not in grouped else None)
    planned = {path.plan.weight_dtype for module in model.modules()
               if isinstance(module, Linear) and (path := module.few_rows) is not None
               and path.plan.fetch_ahead_matters()}
    for weight_dtype in planned:  # measured now, not by a step's first call
        for rows in FETCH_AHEAD_ROWS:
            fetch_ahead(weight_dtype, rows)


@dataclass(frozen=True, eq=False)
class FewRows:
    """A layer's (or a group's) few-row path: the GEMV kernel's call for its weights and the
    most rows it takes (`max_rows`); more rows take the GEMM."""

    plan: GemvPlan
    max_rows: int


def few_rows(*layers: Linear) -> FewRows | None:
    """The few-row path of `layers` (weights reading the same input, one kernel call), or None
    where the kernel is not built, the weights are not all float32 / bfloat16 / int8 CPU
    weights of the model's dtype, or it never measured faster. For float weights the row limit
    is `gemv_row_limit` against the GEMM `linear` would use for each layer (the first's
    choice); int8 weights take the kernel up to `INT8_GEMV_ROWS` rows."""
    if not gemv_available():
        return None
    weights = [layer.multiplied_weight() for layer in layers]
    first = weights[0]
    dtype = torch.float32 if isinstance(first, Int8Weight) else first.dtype
    biases = [layer.bias for layer in layers]
    try:
        plan = GemvPlan(weights, biases, dtype)
    except ValueError:
        return None
    if isinstance(first, Int8Weight):
        return FewRows(plan, INT8_GEMV_ROWS)
    if any(isinstance(w, Int8Weight) or w.dtype != dtype for w in weights):
        return None
    shapes = tuple((w.shape[0], w.shape[1]) for w in weights)
    if may_use_onednn(first) and onednn_is_faster(*shapes[0], dtype):
        limit = gemv_row_limit(shapes, dtype, onednn_linear, packed_copy)
    else:
        limit = gemv_row_limit(shapes, dtype, F.linear)
    return FewRows(plan, limit) if limit > 0 else None


def _few_rows_apply(path: FewRows | None, x: Tensor, weights: list) -> Tensor | None:
    """The kernel's output for `x` when `path` takes it (2-D x of the plan's dtype, few rows,
    no autograd, the same weight objects as when it was planned); else None."""
    if (path is None or x.dim() != 2 or x.shape[0] > path.max_rows
            or x.dtype != path.plan.dtype or not path.plan.reads(weights)):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or any(
            isinstance(w, Tensor) and w.requires_grad for w in weights)):
        return None
    return path.plan(x)


# what `VersionedWeights` counts: weights, and the few-row plans over them (`Linear.few_rows`,
# `LinearGroup.path`)
WEIGHT_FIELDS = frozenset({"weight", "bias", "int8", "few_rows", "path"})


class VersionedWeights:
    """A mixin for weights that bound kernel calls hold (`minipaged.runner.cpu_decode`):
    `VersionedWeights.generation` counts the objects given to any such holder's `weight`,
    `bias` or `int8`, or its few-row plan (`few_rows`, a group's `path`: `choose_gemms` plans
    again) in this process, so a holder tells whether its calls may be stale by reading one
    number, not by looking every weight up (a weight given to another model only sends it to
    the look-up). A weight written in place needs no count: the calls read its storage."""

    generation: ClassVar[int] = 0

    def __setattr__(self, name: str, value: object) -> None:
        if name in WEIGHT_FIELDS:
            VersionedWeights.generation += 1
        super().__setattr__(name, value)


class Linear(VersionedWeights, nn.Linear):
    """`nn.Linear` (same parameters, same checkpoint layout) whose forward is `linear`, or at a
    few rows the CPU's GEMV kernel (`few_rows`, chosen by `choose_gemms`); with `int8` set
    (`minipaged.models.quantization`) it multiplies those int8 weights instead of `weight`."""

    int8: Int8Weight | None = None
    few_rows: FewRows | None = None

    def multiplied_weight(self) -> Tensor | Int8Weight:
        """The weight this layer multiplies: its int8 weights if quantised, else `weight`."""
        return self.weight if self.int8 is None else self.int8

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight if self.int8 is None else self.int8
        out = _few_rows_apply(self.few_rows, x, [weight])
        if out is not None:
            return out
        if self.int8 is not None:
            return linear(x, self.int8.dequantize(x.dtype), self.bias)
        return linear(x, weight, self.bias)


class LinearGroup(VersionedWeights):
    """Linear layers that read the same input (a layer's q, k, v projections; gate and up):
    at a few rows one GEMV kernel call reads all their weights and writes their outputs side
    by side; at more rows each layer multiplies on its own. Not a module: it holds no
    parameters, only the layers (which stay the model's modules and checkpoint names)."""

    def __init__(self, *layers: Linear) -> None:
        self.layers = layers
        self.sizes = [layer.out_features for layer in layers]
        self.path: FewRows | None = None

    def plan(self, gemv: bool = True) -> None:
        """Choose the group's few-row path now (`choose_gemms`); none for float layers
        without `gemv`."""
        int8 = any(layer.int8 is not None for layer in self.layers)
        self.path = few_rows(*self.layers) if gemv or int8 else None

    def __call__(self, x: Tensor) -> list[Tensor] | tuple[Tensor, ...]:
        out = _few_rows_apply(self.path, x, [layer.multiplied_weight() for layer in self.layers])
        if out is not None:
            return out.split(self.sizes, dim=1)
        return [layer(x) for layer in self.layers]


# ---------------------------------------------------------------------------------------------
# RMSNorm and rotary position embeddings
# ---------------------------------------------------------------------------------------------


class RMSNorm(VersionedWeights, nn.Module):
    """x / rms(x) * weight over the last dimension, computed in float32 (as Hugging Face does)
    and cast back. On a CPU, one C call where it applies (`minipaged.kernels.cpu.norm_rotary`:
    the same roundings, the sum of squares added in another order)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if rms_norm_supports(x, self.weight):
            return rms_norm(x, self.weight, self.eps)
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
    """Rotate each pair (i, i + D/2) of every head of `x [T, heads, D]` by its angle. On a CPU,
    one C call where it applies (`minipaged.kernels.cpu.norm_rotary`, bit for bit the same)."""
    if rotary_supports(x, cos, sin):
        return rotary(x, cos, sin)
    return x * cos + rotate_half(x) * sin


def silu_and_mul(gate: Tensor, up: Tensor) -> Tensor:
    """SwiGLU's activation (Shazeer 2020), `silu(gate) * up`. On a CPU, one C call where it
    applies (`minipaged.kernels.cpu.norm_rotary`: the same roundings, the C library's exp)."""
    if silu_mul_supports(gate, up):
        return silu_mul(gate, up)
    return F.silu(gate) * up


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension: a 90 degree turn per pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)
