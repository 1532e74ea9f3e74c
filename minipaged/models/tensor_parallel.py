"""Tensor parallelism inside a model: which slice of each weight a rank holds, and the layers
that put the slices' partial results back together (Shoeybi et al., Megatron-LM, section 3).

With `N` ranks each transformer layer costs two all-reduces:

* the attention's q/k/v projections are split by *columns* (output features, whole heads): a
  rank computes its heads' queries, keys and values and attends with them over its own shard
  of the paged KV cache; the output projection is split by *rows* (input features), so each
  rank's product is a partial sum of the full one, and an **all-reduce** adds them;
* the MLP likewise: gate/up (GPT-2's `c_fc`) by columns, down (`c_proj`) by rows, then an
  **all-reduce**.

The token embedding and the LM head are split by vocabulary: each rank holds `ceil(V / N)`
rows (the last rank's tail padded with zeros). The embedding looks up only the ids in its
range, zeros the others and all-reduces (one non-zero term per row: exact); the head computes
its slice of the logits, gathered on rank 0. A tied head shares its rank's embedding rows.

Grouped-query attention: a rank's KV heads are the ones its query heads read. With at least
`N` KV heads they are split like the query heads; with fewer, each rank holds the one KV head
of its query heads' group, so a KV head is replicated on `N / num_kv_heads` ranks.

`TensorParallel` is a rank's place in the group and its collectives (the default
`torch.distributed` process group); `split_of` is the shard arithmetic, in the models' own
parameter names and layout; the layers degrade to the plain ones at one rank.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from minipaged.models.checkpoint.model_config import ModelConfig
from minipaged.models.checkpoint.weight_names import (
    PendingTensor,
    expected_shapes,
    full_name,
    is_ignored,
    is_transposed,
    to_module_name,
)


class TensorParallelError(ValueError):
    """A model that cannot be split over the requested number of ranks."""


@dataclass(frozen=True)
class TensorParallel:
    """One rank's place in a tensor-parallel group, and the collectives its layers call.

    At `world_size` 1 (the default) every collective is the identity and no process group is
    needed; otherwise the default `torch.distributed` process group must be initialised.
    """

    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise TensorParallelError(f"tensor_parallel_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise TensorParallelError(f"rank {self.rank} outside [0, {self.world_size})")

    def all_reduce(self, x: Tensor) -> Tensor:
        """The sum of `x` over the ranks, on every rank (in place)."""
        if self.world_size > 1:
            dist.all_reduce(x)
        return x

    def gather_last_dim(self, x: Tensor) -> Tensor:
        """The ranks' `x` concatenated along the last dimension, on rank 0; `x` elsewhere."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else x


SINGLE_RANK = TensorParallel()  # no tensor parallelism: the whole model on one rank


# -- shard arithmetic ---------------------------------------------------------------------------


def check_shardable(config: ModelConfig, world_size: int) -> None:
    """Raise `TensorParallelError` unless `config`'s model splits over `world_size` ranks."""
    heads, kv_heads, inner = config.num_heads, config.num_kv_heads, config.intermediate_size
    if world_size < 1:
        raise TensorParallelError(f"tensor_parallel_size must be >= 1, got {world_size}")
    if world_size > heads:
        raise TensorParallelError(
            f"tensor_parallel_size {world_size} exceeds the model's {heads} attention heads "
            f"(at most {heads}: every rank needs a whole head)"
        )
    if heads % world_size:
        raise TensorParallelError(
            f"the model's {heads} attention heads do not divide among tensor_parallel_size "
            f"{world_size} ranks"
        )
    if kv_heads % world_size and world_size % kv_heads:
        raise TensorParallelError(
            f"the model's {kv_heads} KV heads can neither be split over nor replicated onto "
            f"tensor_parallel_size {world_size} ranks (one must divide the other)"
        )
    if inner % world_size:
        raise TensorParallelError(
            f"the model's intermediate size {inner} does not divide among "
            f"tensor_parallel_size {world_size} ranks"
        )


def q_heads(config: ModelConfig, tp: TensorParallel) -> range:
    """The query heads of rank `tp.rank`: a contiguous `num_heads / N` of them."""
    per = config.num_heads // tp.world_size
    return range(tp.rank * per, (tp.rank + 1) * per)


def kv_heads(config: ModelConfig, tp: TensorParallel) -> range:
    """The KV heads the rank's query heads read (query head h reads KV head h // group)."""
    heads, group = q_heads(config, tp), config.num_queries_per_kv
    return range(heads.start // group, (heads.stop - 1) // group + 1)


def vocab_range(config: ModelConfig, tp: TensorParallel) -> range:
    """The token ids whose embedding rows and logits rank `tp.rank` holds (see `vocab_rows`)."""
    rows = vocab_rows(config, tp)
    vocab = config.vocab_size
    return range(min(tp.rank * rows, vocab), min((tp.rank + 1) * rows, vocab))


def vocab_rows(config: ModelConfig, tp: TensorParallel) -> int:
    """Rows of the vocabulary-parallel tables on every rank: ceil(vocab / N), zero-padded."""
    return math.ceil(config.vocab_size / tp.world_size)


@dataclass(frozen=True)
class Split:
    """A rank's slice of one weight: the `pieces` [start, stop) of dimension `dim`, in order,
    concatenated and zero-padded to `size` (only the vocabulary tables are padded)."""

    dim: int
    pieces: tuple[tuple[int, int], ...]
    size: int

    def take(self, full: Tensor) -> Tensor:
        """This slice of the whole tensor `full`."""
        return self._joined([full.narrow(self.dim, a, b - a) for a, b in self.pieces])

    def read(self, tensor: PendingTensor) -> Tensor:
        """This slice of a checkpoint's tensor, reading no more of it than the format needs
        (safetensors: only its bytes; GGUF: only its rows, or for a split of columns the whole
        tensor dequantised, sliced and freed; a reader without `read_part`: the whole tensor)."""
        lead = (slice(None),) * self.dim  # the whole of every dimension before `dim`
        return self._joined([tensor.part(lead + (slice(a, b),)) for a, b in self.pieces])

    def _joined(self, parts: list[Tensor]) -> Tensor:
        taken = sum(part.shape[self.dim] for part in parts)
        if taken < self.size:
            pad = list(parts[0].shape)
            pad[self.dim] = self.size - taken
            parts.append(parts[0].new_zeros(pad))
        return torch.cat(parts, dim=self.dim)


def split_of(config: ModelConfig, name: str, tp: TensorParallel) -> Split | None:
    """Rank `tp.rank`'s slice of the model parameter `name` (minipaged's name and `nn.Linear`
    layout: dimension 0 is the output), or None for a tensor every rank holds whole (norms,
    position embeddings, the biases of row-parallel layers, which are added after the sum).

    The family names its parameters' splits (`FamilySpec.tp_splits`, pattern -> kind): `vocab`
    (rows by token id), `query` / `key_value` (rows by the rank's heads), `qkv` (a fused
    [q | k | v], each `hidden_size` wide), `mlp_column` (rows of the MLP's inner size),
    `attention_row` / `mlp_row` (columns: input features of the attention's heads, of the MLP).
    """
    kind = next((k for p, k in config.family.tp_splits.items() if re.search(p, name)), None)
    if kind is None:
        return None
    d, h, ids = config.head_dim, config.hidden_size, vocab_range(config, tp)
    q, kv = q_heads(config, tp), kv_heads(config, tp)
    q_cols = (q.start * d, q.stop * d)
    inner = config.intermediate_size // tp.world_size
    inner_cols = (tp.rank * inner, (tp.rank + 1) * inner)
    qkv = tuple((j * h + q_cols[0], j * h + q_cols[1]) for j in range(3))  # [q | k | v]
    splits = {
        "vocab": Split(0, ((ids.start, ids.stop),), vocab_rows(config, tp)),
        "query": Split(0, (q_cols,), len(q) * d),
        "key_value": Split(0, ((kv.start * d, kv.stop * d),), len(kv) * d),
        "qkv": Split(0, qkv, 3 * len(q) * d),
        "attention_row": Split(1, (q_cols,), len(q) * d),
        "mlp_column": Split(0, (inner_cols,), inner),
        "mlp_row": Split(1, (inner_cols,), inner),
    }
    if kind not in splits:
        raise TensorParallelError(f"{config.architecture}: unknown split {kind!r} of {name}")
    return splits[kind]


def checkpoint_split(config: ModelConfig, hf_name: str, tp: TensorParallel) -> Split | None:
    """`split_of` for a Hugging Face tensor name, in the checkpoint's layout (GPT-2's `Conv1D`
    weights are stored transposed)."""
    split = split_of(config, to_module_name(config, hf_name), tp)
    if split is not None and is_transposed(config, hf_name):
        return Split(1 - split.dim, split.pieces, split.size)
    return split


def read_shard(config: ModelConfig, name: str, tensor: PendingTensor, tp: TensorParallel) -> Tensor:
    """Rank `tp.rank`'s slice of the checkpoint tensor `name` (a `checkpoint.TensorReader`)."""
    check_shardable(config, tp.world_size)
    split = checkpoint_split(config, name, tp)
    return tensor.read() if split is None else split.read(tensor)


def hf_state_dict(config: ModelConfig, state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """`state_dict`'s tensors under their full Hugging Face names (a stored name may lack the
    base prefix), without the buffers the family ignores (`weight_names.is_ignored`)."""
    expected = expected_shapes(config)
    names = {stored: full_name(config, stored, expected) for stored in state_dict}
    return {names[s]: t for s, t in state_dict.items() if not is_ignored(config, names[s])}


def shard_state_dict(
    config: ModelConfig, state_dict: dict[str, Tensor], tp: TensorParallel
) -> dict[str, Tensor]:
    """Rank `tp.rank`'s slices of a whole Hugging Face-named state dict (names with or without
    the base prefix, as `build_model` takes them)."""
    check_shardable(config, tp.world_size)
    shard = {}
    for name, tensor in hf_state_dict(config, state_dict).items():
        split = checkpoint_split(config, name, tp)
        shard[name] = tensor if split is None else split.take(tensor)
    return shard


def checkpoint_state_dict(config: ModelConfig, model: nn.Module) -> dict[str, Tensor]:
    """A whole model's parameters under Hugging Face's names and in its layout (the inverse of
    `build_model`'s loading), ready for `shard_state_dict` and to be pickled to the ranks: a
    parameter that is a view into a larger buffer (a CPU model's weights share one,
    `platforms.cpu.weight_layout`) is copied out of it, since pickling a view sends
    its whole storage."""
    state = {}
    for name, tensor in hf_state_dict(config, model.state_dict()).items():
        if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
            tensor = tensor.clone()
        state[name] = tensor.t() if is_transposed(config, name) else tensor
    return state


def shard_shapes(config: ModelConfig, tp: TensorParallel) -> dict[str, tuple[int, ...]]:
    """`expected_shapes` of one rank: every Hugging Face tensor with its slice's shape."""
    shapes = {}
    for name, shape in expected_shapes(config).items():
        split = checkpoint_split(config, name, tp)
        if split is not None:
            shape = shape[: split.dim] + (split.size,) + shape[split.dim + 1 :]
        shapes[name] = shape
    return shapes


# -- the layers ---------------------------------------------------------------------------------


class RowParallelLinear(nn.Linear):
    """A linear layer whose input features are split over the ranks: each computes a partial
    product, the all-reduce sums them, and the (whole) bias is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel):
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: Tensor) -> Tensor:
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """The token embedding's rows of one rank's vocabulary range; the others come as zeros and
    the all-reduce fills them in."""

    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.tp, self.ids = tp, vocab_range(config, tp)
        self.weight = nn.Parameter(torch.empty(vocab_rows(config, tp), config.hidden_size))

    def forward(self, input_ids: Tensor) -> Tensor:
        local = input_ids - self.ids.start
        inside = (local >= 0) & (local < len(self.ids))
        rows = F.embedding(torch.where(inside, local, 0), self.weight)
        return self.tp.all_reduce(rows.masked_fill(~inside[:, None], 0.0))


class VocabParallelHead(nn.Linear):
    """The LM head's rows of one rank's vocabulary range; the logits are gathered on rank 0
    (and the padding rows dropped there)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__(config.hidden_size, vocab_rows(config, tp), bias=False)
        self.tp, self.vocab_size = tp, config.vocab_size

    def forward(self, hidden: Tensor) -> Tensor:
        logits = self.tp.gather_last_dim(F.linear(hidden, self.weight))
        return logits[:, : self.vocab_size] if self.tp.rank == 0 else logits


def row_parallel_linear(
    in_features: int, out_features: int, bias: bool, tp: TensorParallel
) -> nn.Linear:
    """A row-parallel layer of `in_features` (this rank's share); plain `nn.Linear` at one rank."""
    if tp.world_size == 1:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp)


def token_embedding(config: ModelConfig, tp: TensorParallel) -> nn.Module:
    """The token embedding of one rank; a plain `nn.Embedding` at one rank, initialised as
    `nn.Embedding` does except on the meta device (`build_model`, whose weights come from the
    checkpoint), where `normal_` would import TorchDynamo: 1.4 s at every start."""
    if tp.world_size == 1:
        weight = torch.empty(config.vocab_size, config.hidden_size)
        if not weight.is_meta:
            nn.init.normal_(weight)
        return nn.Embedding.from_pretrained(weight, freeze=False)
    return VocabParallelEmbedding(config, tp)


def lm_head(config: ModelConfig, tp: TensorParallel) -> nn.Linear:
    """The LM head of one rank; a plain `nn.Linear` at one rank."""
    if tp.world_size == 1:
        return nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    return VocabParallelHead(config, tp)
