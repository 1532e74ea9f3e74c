"""From-scratch decoder-only transformers (LLaMA and GPT-2) and dense reference generation.

The models run on a *flat token batch* (DESIGN.md, "The data that flows"): the new tokens of every
sequence in one step, concatenated into `input_ids [T]` with their `positions [T]`. Nothing in a
model knows where past keys and values live: each layer hands its new queries, keys and values to
an `AttentionBackend`, which owns the KV cache. Two backends plug in:

* `DenseAttentionBackend` (here): each sequence's keys and values in one contiguous row of a
  preallocated tensor per layer (`DenseKVCache`, the "reserve the maximum" cache of the vLLM
  paper's section 3), attended with `attention.dense_attention` (decode steps:
  `decode_attention`, the same sums over the whole batch at once). It is simple and obviously
  correct: the oracle that the paged engine is tested against, token for token, through
  `generate_dense`.
* `attention.PagedAttentionBackend`: writes K/V into fixed-size blocks and calls paged
  attention with `AttentionMetadata` (Kwon et al., SOSP'23, section 4.1).

Parameter names mirror Hugging Face's, so a checkpoint's state dict loads by name (after the
`model.` / `transformer.` prefix is dropped) and a reader can hold the two side by side.
"""

from __future__ import annotations

import heapq
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minipaged.attention_contract import dense_attention
from minipaged.config import ModelConfig

# ---------------------------------------------------------------------------------------------
# The attention interface between a model and whatever holds the KV cache
# ---------------------------------------------------------------------------------------------


class AttentionBackend(Protocol):
    """Attention of the new tokens of a flat batch over their sequences' whole context.

    `q [T, H, D]`, `k`, `v [T, H_kv, D]` are the projections of the step's new tokens, rotary
    already applied. The backend stores `k`/`v` in its cache for layer `layer_idx`, then returns
    causal attention of each new token over its own sequence's cached plus new keys: `[T, H, D]`.
    """

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        ...


class ModelInputError(ValueError):
    """The flat batch handed to a model does not fit it (shape, dtype or position range)."""


class CheckpointMismatchError(ValueError):
    """A state dict does not match the model its config describes (missing, extra, mis-shaped)."""


# ---------------------------------------------------------------------------------------------
# The dense backend: a contiguous, reserve-the-maximum KV cache
# ---------------------------------------------------------------------------------------------


@dataclass
class DenseKVCache:
    """Keys and values of every sequence in contiguous memory: one row per sequence.

    This is the cache that the vLLM paper measures paging against (Kwon et al., SOSP'23,
    section 3): each sequence reserves a contiguous chunk of `capacity` token slots up front,
    used or not. Layer `l` holds `keys[l]` and `values[l]`, each `[rows, H_kv, capacity, D]`;
    sequence `s` owns row `row_of[s]`, and its `j`-th token sits at `[row, :, j]`. The unused
    tail of a row is the internal fragmentation (and the spare rows the reservation) that paged
    blocks avoid. What the reservation buys is simplicity: new keys are written in place, and a
    decode step attends a plain view of the rows, with no copying. Heads come before positions
    so that each (sequence, KV head) pair's keys form one `[capacity, D]` matrix, which is what
    the batched matmul in `decode_attention` reads (Hugging Face's cache uses the same order).

    `max_seq_len` and `max_num_seqs` size the tensors when known (`generate_dense` passes the
    longest prompt plus `max_new_tokens`, and the number of prompts). They are hints, not limits:
    a layer whose tensor is too small doubles it. A freed sequence's row is reused, lowest first;
    its stale keys stay behind the new sequence's length, where nothing reads them.
    """

    num_layers: int
    max_seq_len: int = 0
    max_num_seqs: int = 0
    keys: list[Tensor | None] = field(init=False)
    values: list[Tensor | None] = field(init=False)
    row_of: dict[int, int] = field(init=False, default_factory=dict)
    # Tokens cached per layer, indexed by row: lengths[layer][row].
    lengths: list[list[int]] = field(init=False)
    free_rows: list[int] = field(init=False, default_factory=list)  # a heap: lowest row first

    def __post_init__(self) -> None:
        if self.num_layers <= 0:
            raise ValueError(f"num_layers must be positive, got {self.num_layers}")
        if self.max_seq_len < 0 or self.max_num_seqs < 0:
            raise ValueError(f"capacity hints must be >= 0, got max_seq_len={self.max_seq_len}, "
                             f"max_num_seqs={self.max_num_seqs}")
        self.keys = [None] * self.num_layers
        self.values = [None] * self.num_layers
        self.lengths = [[] for _ in range(self.num_layers)]

    def row(self, seq_id: int) -> int:
        """The row of `seq_id`, reserving the lowest free one on its first use."""
        if seq_id not in self.row_of:
            if self.free_rows:
                row = heapq.heappop(self.free_rows)
            else:
                row = len(self.lengths[0])
                for layer_lengths in self.lengths:
                    layer_lengths.append(0)
            self.row_of[seq_id] = row
        return self.row_of[seq_id]

    def length(self, seq_id: int) -> int:
        """Number of tokens cached for `seq_id` (those of the last layer; 0 if unknown)."""
        row = self.row_of.get(seq_id)
        return 0 if row is None else self.lengths[-1][row]

    def append(self, seq_id: int, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write `k`, `v [n, H_kv, D]` after sequence `seq_id`'s cached tokens of layer `layer_idx`.

        Returns views of the sequence's whole K and V for that layer, `[L, H_kv, D]`.
        """
        row = self.row(seq_id)
        start = self.lengths[layer_idx][row]
        end = start + k.shape[0]
        self._reserve(layer_idx, row + 1, end, k)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[row, :, start:end] = k.transpose(0, 1)
        values[row, :, start:end] = v.transpose(0, 1)
        self.lengths[layer_idx][row] = end
        return keys[row, :, :end].transpose(0, 1), values[row, :, :end].transpose(0, 1)

    def append_one_each(self, layer_idx: int, rows: Sequence[int], k: Tensor, v: Tensor) -> None:
        """Write one token per row, `k[i]`, `v[i] [H_kv, D]` after row `rows[i]`'s cached tokens
        of layer `layer_idx`: one indexed write for the whole batch (a decode step)."""
        lengths = self.lengths[layer_idx]
        positions = [lengths[row] for row in rows]
        self._reserve(layer_idx, max(rows) + 1, max(positions) + 1, k)
        index = (torch.tensor(rows, device=k.device), slice(None),
                 torch.tensor(positions, device=k.device))
        self.keys[layer_idx][index] = k
        self.values[layer_idx][index] = v
        for row in rows:
            lengths[row] += 1

    def free(self, seq_id: int) -> None:
        """Forget `seq_id`; its row goes back to the free rows (a no-op for an unknown id)."""
        row = self.row_of.pop(seq_id, None)
        if row is not None:
            for layer_lengths in self.lengths:
                layer_lengths[row] = 0
            heapq.heappush(self.free_rows, row)

    def _reserve(self, layer_idx: int, num_rows: int, seq_len: int, like: Tensor) -> None:
        """Make layer `layer_idx`'s tensors hold at least `num_rows` rows of `seq_len` tokens,
        allocating them (shaped after `like [n, H_kv, D]`) or doubling what is too small."""
        old = self.keys[layer_idx]
        if old is not None and old.shape[0] >= num_rows and old.shape[2] >= seq_len:
            return
        if old is None:
            rows, capacity = max(num_rows, self.max_num_seqs), max(seq_len, self.max_seq_len)
        else:
            rows = max(num_rows, old.shape[0] if old.shape[0] >= num_rows else 2 * old.shape[0])
            capacity = max(seq_len, old.shape[2] if old.shape[2] >= seq_len else 2 * old.shape[2])
        shape = (rows, like.shape[1], capacity, like.shape[2])
        # Zeros, not empty: a masked-out slot gets weight 0, and 0 * garbage could be NaN.
        new_k, new_v = like.new_zeros(shape), like.new_zeros(shape)
        if old is not None:
            old_v = self.values[layer_idx]
            new_k[:old.shape[0], :, :old.shape[2]] = old
            new_v[:old.shape[0], :, :old.shape[2]] = old_v
        self.keys[layer_idx], self.values[layer_idx] = new_k, new_v


class DenseAttentionBackend:
    """`AttentionBackend` over a `DenseKVCache` for one step of a flat batch.

    The flat batch holds `query_lens[i]` new tokens of sequence `seq_ids[i]`, in that order (the
    same layout as `AttentionMetadata.query_start_loc`). A step with a prompt in it attends each
    sequence on its own with the oracle, `dense_attention`. A decode step (one new token per
    sequence) writes all new keys with one indexed write and attends every sequence at once with
    `decode_attention`, over a view of the cache's rows: the same sums, no Python loop and no
    copy of the cache.
    """

    def __init__(self, cache: DenseKVCache, seq_ids: Sequence[int], query_lens: Sequence[int]):
        if len(seq_ids) != len(query_lens):
            raise ValueError(f"{len(seq_ids)} sequence ids but {len(query_lens)} query lengths")
        if any(n <= 0 for n in query_lens):
            raise ValueError(f"every sequence needs at least one new token, got {list(query_lens)}")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a sequence appears twice in one step: {list(seq_ids)}")
        self.cache = cache
        self.seq_ids = list(seq_ids)
        self.query_lens = list(query_lens)
        self.num_tokens = sum(self.query_lens)
        self.is_decode = all(n == 1 for n in self.query_lens)
        if self.is_decode:
            self._plan_decode()

    def _plan_decode(self) -> None:
        """What every layer of a decode step shares: each sequence's row, the rows attended
        (0 up to the highest one in the step), and their context lengths after this step."""
        self.rows = [self.cache.row(s) for s in self.seq_ids]
        self.num_rows = max(self.rows) + 1
        # Sequence i ends up with cache.length(i) + 1 tokens. A row in the view but not in this
        # step is attended over its first slot only, and its output dropped.
        self.row_lengths = [1] * self.num_rows
        for seq_id, row in zip(self.seq_ids, self.rows, strict=True):
            self.row_lengths[row] = self.cache.length(seq_id) + 1
        self.max_len = max(self.row_lengths)
        self._index: tuple[Tensor, Tensor] | None = None  # rows and row_lengths, on q's device

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        if q.shape[0] != self.num_tokens:
            raise ValueError(f"{q.shape[0]} query tokens but query_lens sum to {self.num_tokens}")
        if self.is_decode:
            return self._decode(layer_idx, q, k, v, scale)
        outputs = []
        start = 0
        for seq_id, n in zip(self.seq_ids, self.query_lens, strict=True):
            end = start + n
            keys, values = self.cache.append(seq_id, layer_idx, k[start:end], v[start:end])
            outputs.append(dense_attention(q[start:end], keys, values, scale))
            start = end
        return torch.cat(outputs)

    def _decode(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        if self._index is None:
            self._index = (torch.tensor(self.rows, device=q.device),
                           torch.tensor(self.row_lengths, device=q.device))
        rows, row_lengths = self._index
        self.cache.append_one_each(layer_idx, self.rows, k, v)
        view = (slice(0, self.num_rows), slice(None), slice(0, self.max_len))
        keys, values = self.cache.keys[layer_idx][view], self.cache.values[layer_idx][view]
        # Each query into its sequence's row; rows not in this step get zeros, dropped after.
        q_rows = q.new_zeros(self.num_rows, *q.shape[1:]).index_copy_(0, rows, q)
        return decode_attention(q_rows, keys, values, row_lengths, scale)[rows]


def decode_attention(q: Tensor, keys: Tensor, values: Tensor, lengths: Tensor,
                     scale: float) -> Tensor:
    """Attention of one new query per sequence over its first `lengths[i]` keys.

    q: `[B, H, D]`, row i the last position of sequence i; keys, values: `[B, H_kv, L, D]`, row i
    sequence i's context in its first `lengths[i]` slots (what follows is ignored); lengths `[B]`.
    Returns `[B, H, D]`, what `dense_attention(q[i:i+1], keys[i, :, :lengths[i]].transpose(0, 1),
    ...)` gives for each i. A query at the last position sees every key of its context, so the
    only mask hides the slots past each length. Query heads are grouped onto their KV head by a
    reshape (GQA, H % H_kv == 0). Computed in float32, returned in q's dtype.
    """
    num_seqs, num_heads, head_dim = q.shape
    if keys.shape[0] != num_seqs or values.shape[0] != num_seqs or lengths.shape != (num_seqs,):
        raise ValueError(f"{num_seqs} queries but {keys.shape[0]} keys, {values.shape[0]} values "
                         f"and {tuple(lengths.shape)} lengths")
    num_kv_heads, max_len = keys.shape[1], keys.shape[2]
    group = num_heads // num_kv_heads
    qg = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = (qg @ keys.float().transpose(-1, -2)) * scale  # [B, H_kv, G, L]
    past_end = torch.arange(max_len, device=q.device)[None, :] >= lengths[:, None]  # [B, L]
    scores = scores.masked_fill(past_end[:, None, None, :], float("-inf"))
    out = torch.softmax(scores, dim=-1) @ values.float()  # [B, H_kv, G, D]
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# Linear layers: every projection of both architectures
# ---------------------------------------------------------------------------------------------


# oneDNN's linear op, from PyTorch's oneDNN integration (torch.compile's CPU backend emits it for
# fused linear layers); absent from builds without oneDNN, where `linear` is `F.linear`.
ONEDNN_AVAILABLE = torch.backends.mkldnn.is_available() and hasattr(
    torch.ops.mkldnn, "_linear_pointwise"
)
# oneDNN costs ~10 us more per call than MKL. Below 2^16 weights (256 x 256) that is more than it
# saves at decode row counts; at 2^16 the two tie at 1-8 rows and oneDNN wins at 64
# (`benchmarks/linear_cpu.py`, per-shape table).
ONEDNN_MIN_WEIGHT_ELEMENTS = 1 << 16


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`x @ weight.T + bias`, as `F.linear`; in float32 on CPU, through oneDNN's matmul.

    PyTorch's CPU build sends `F.linear` to MKL's GEMM, which on the AMD EPYC machine these
    benchmarks run on is slow at the few rows of a decode step and at odd row counts. oneDNN,
    the other GEMM that ships inside PyTorch, runs SmolLM2's projections 1.3x faster at 1 row,
    1.5x at the 8 rows of a decode step and 2x at prefill sizes, and the output head 1.6-1.9x
    (`benchmarks/linear_cpu.py`; on Intel CPUs, where MKL is tuned, expect less). Small weights
    (tiny test models) stay with `F.linear`: oneDNN's fixed cost per call outweighs its gain.
    The sums are the same, in another order: outputs differ from `F.linear` by float rounding.
    The oneDNN op has no backward, so anything that needs gradients takes `F.linear`.
    """
    if uses_onednn(x, weight):
        return onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear` on oneDNN, whatever the sizes (`linear` decides when to call it)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def uses_onednn(x: Tensor, weight: Tensor) -> bool:
    """Whether `linear(x, weight)` runs on oneDNN (see `linear`)."""
    return (
        ONEDNN_AVAILABLE
        and weight.numel() >= ONEDNN_MIN_WEIGHT_ELEMENTS
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same checkpoint layout) whose forward is `linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


# ---------------------------------------------------------------------------------------------
# LLaMA: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention
# ---------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 (as Hugging Face does) and cast back."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
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
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        old_context = scaling["original_max_position_embeddings"]
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
    `max_position_embeddings`, in float32.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        inv_freq = rope_inverse_frequencies(config)
        angles = torch.arange(config.max_position_embeddings, dtype=torch.float32)[:, None]
        angles = angles * inv_freq[None, :]  # [P, D/2]
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


class LlamaAttention(nn.Module):
    """Grouped-query attention: `num_heads` query heads share `num_kv_heads` key/value heads."""

    def __init__(self, config: ModelConfig, layer_idx: int, bias: bool):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = Linear(config.hidden_size, q_size, bias=bias)
        self.k_proj = Linear(config.hidden_size, kv_size, bias=bias)
        self.v_proj = Linear(config.hidden_size, kv_size, bias=bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor, rotation: tuple[Tensor, Tensor], attn: AttentionBackend) -> Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, *rotation), apply_rotary(k, *rotation)
        out = attn(self.layer_idx, q, k, v, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU (Shazeer 2020): down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x += attn(norm(x)); x += mlp(norm(x))."""

    def __init__(self, config: ModelConfig, layer_idx: int, attention_bias: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, attention_bias)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: Tensor, rotation: tuple[Tensor, Tensor], attn: AttentionBackend) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotation, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """The LLaMA family (LLaMA 1-3, SmolLM2, Mistral without sliding window)."""

    hf_prefix = "model."

    def __init__(self, config: ModelConfig, attention_bias: bool = False):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, attention_bias) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config)

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionBackend) -> Tensor:
        """Hidden states `[T, hidden_size]` (final norm applied) of a flat token batch."""
        check_flat_batch(self.config, input_ids, positions)
        x = self.embed_tokens(input_ids)
        rotation = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rotation, attn)
        return self.norm(x)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Next-token logits `[N, vocab_size]` in float32 for the rows of `hidden`."""
        return self.lm_head(hidden).float()


# ---------------------------------------------------------------------------------------------
# GPT-2: LayerNorm, learned positions, tanh-GELU
# ---------------------------------------------------------------------------------------------


class GPT2Attention(nn.Module):
    """Multi-head attention with one fused q/k/v projection (`c_attn`)."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.scale = config.head_dim**-0.5
        self.c_attn = Linear(config.hidden_size, 3 * config.hidden_size)
        self.c_proj = Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: Tensor, attn: AttentionBackend) -> Tensor:
        t = x.shape[0]
        q, k, v = self.c_attn(x).view(t, 3, self.num_heads, self.head_dim).unbind(1)
        out = attn(self.layer_idx, q, k, v, self.scale)
        return self.c_proj(out.reshape(t, self.num_heads * self.head_dim))


class GPT2MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.c_fc = Linear(config.hidden_size, config.intermediate_size)
        self.c_proj = Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = GPT2MLP(config)

    def forward(self, x: Tensor, attn: AttentionBackend) -> Tensor:
        x = x + self.attn(self.ln_1(x), attn)
        return x + self.mlp(self.ln_2(x))


class GPT2ForCausalLM(nn.Module):
    """GPT-2 (Radford et al. 2019): learned absolute positions, always a tied head."""

    hf_prefix = "transformer."

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionBackend) -> Tensor:
        """Hidden states `[T, hidden_size]` (final norm applied) of a flat token batch."""
        check_flat_batch(self.config, input_ids, positions)
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            x = block(x, attn)
        return self.ln_f(x)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Next-token logits `[N, vocab_size]` in float32 for the rows of `hidden`."""
        return self.lm_head(hidden).float()


CausalLM = LlamaForCausalLM | GPT2ForCausalLM

# Hugging Face stores GPT-2's linear layers as `Conv1D`, whose weight is [in, out]: the transpose
# of `nn.Linear`'s [out, in].
_GPT2_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Buffers some checkpoints carry that are recomputed here, not loaded.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


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
# Building a model from a config and a Hugging Face-named state dict
# ---------------------------------------------------------------------------------------------


def build_model(
    config: ModelConfig,
    state_dict: dict[str, Tensor],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> CausalLM:
    """The model of `config.architecture` holding the weights of `state_dict`, in eval mode.

    `state_dict` uses Hugging Face's names, with or without the `model.` / `transformer.` prefix.
    A tied head (`tie_word_embeddings`, always for GPT-2) shares the embedding's tensor. Raises
    `CheckpointMismatchError` naming any missing, unexpected or mis-shaped tensor.
    """
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
    tied = config.tie_word_embeddings or config.architecture == "gpt2"
    weights = _rename_hf_weights(config, state_dict)
    if tied:
        weights.pop("lm_head.weight", None)  # some state dicts list the shared tensor twice
    # Build on the meta device (no memory, no random init), then adopt the checkpoint's tensors.
    with torch.device("meta"):
        if config.architecture == "llama":
            model: CausalLM = LlamaForCausalLM(
                config, attention_bias="layers.0.self_attn.q_proj.bias" in weights
            )
        else:
            model = GPT2ForCausalLM(config)
    expected = {name: p.shape for name, p in model.named_parameters()}
    if tied:
        del expected["lm_head.weight"]
    _check_weights(expected, weights)
    model.load_state_dict(
        {name: w.to(device=device, dtype=dtype) for name, w in weights.items()},
        strict=False, assign=True,
    )
    if tied:
        model.lm_head.weight = model.get_submodule(
            "embed_tokens" if config.architecture == "llama" else "wte"
        ).weight
    # Non-persistent buffers (rotary cos/sin) were made on meta: recompute them for real.
    if config.architecture == "llama":
        model.rotary = RotaryEmbedding(config).to(device)
    return model.eval()


def load_model(
    path: str | os.PathLike[str] | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> tuple[CausalLM, ModelConfig]:
    """Load a checkpoint (HF folder, safetensors or GGUF; default: the bundled SmolLM2)."""
    from minipaged.checkpoint import load_checkpoint

    config, state_dict = load_checkpoint(path, dtype=torch.float32, progress=progress)
    return build_model(config, state_dict, dtype=dtype, device=device), config


def _rename_hf_weights(config: ModelConfig, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Drop HF's module prefix and recomputed buffers; transpose GPT-2's Conv1D weights."""
    prefix = "model." if config.architecture == "llama" else "transformer."
    out = {}
    for name, tensor in state_dict.items():
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        name = name.removeprefix(prefix)
        if config.architecture == "gpt2" and name.endswith(_GPT2_CONV1D):
            tensor = tensor.t()
        out[name] = tensor
    return out


def _check_weights(expected: dict[str, torch.Size], weights: dict[str, Tensor]) -> None:
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    wrong = sorted(
        f"{n}: expected {tuple(expected[n])}, got {tuple(weights[n].shape)}"
        for n in set(expected) & set(weights)
        if weights[n].shape != expected[n]
    )
    problems = []
    if missing:
        problems.append(f"missing {_abbrev(missing)}")
    if unexpected:
        problems.append(f"unexpected {_abbrev(unexpected)}")
    if wrong:
        problems.append(f"wrong shape {_abbrev(wrong)}")
    if problems:
        raise CheckpointMismatchError("state dict does not fit the config: " + "; ".join(problems))


def _abbrev(names: list[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


# ---------------------------------------------------------------------------------------------
# Dense reference generation
# ---------------------------------------------------------------------------------------------


@torch.inference_mode()
def generate_dense(
    model: CausalLM,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_token_ids: Iterable[int] = (),
) -> list[list[int]]:
    """Greedy continuations of `prompts`, with a contiguous KV cache: the engine's oracle.

    Every step runs one flat batch: a whole prompt for a sequence's first step, then its one
    latest token. A sequence stops after `max_new_tokens` tokens or after emitting a token of
    `eos_token_ids` (which is kept in its output, as `transformers`' `generate` does). Returns
    the new tokens of each prompt, in order.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty")
        if len(prompt) + max_new_tokens > model.config.max_position_embeddings:
            raise ValueError(
                f"prompt {i} ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                f"the model's {model.config.max_position_embeddings} positions"
            )
    eos = set(eos_token_ids)
    device = next(model.parameters()).device
    cache = DenseKVCache(model.config.num_layers, max_seq_len=max(map(len, prompts), default=0)
                         + max_new_tokens, max_num_seqs=len(prompts))
    outputs: list[list[int]] = [[] for _ in prompts]
    pending = {i: list(p) for i, p in enumerate(prompts)} if max_new_tokens > 0 else {}
    while pending:
        seq_ids = list(pending)
        input_ids, positions = [], []
        for i in seq_ids:
            start = cache.length(i)
            input_ids += pending[i]
            positions += range(start, start + len(pending[i]))
        query_lens = [len(pending[i]) for i in seq_ids]
        backend = DenseAttentionBackend(cache, seq_ids, query_lens)
        hidden = model(
            torch.tensor(input_ids, device=device), torch.tensor(positions, device=device), backend
        )
        last = torch.tensor(query_lens, device=device).cumsum(0) - 1
        next_tokens = model.compute_logits(hidden[last]).argmax(-1).tolist()
        for i, token in zip(seq_ids, next_tokens, strict=True):
            outputs[i].append(token)
            if token in eos or len(outputs[i]) == max_new_tokens:
                del pending[i]
                cache.free(i)
            else:
                pending[i] = [token]
    return outputs
