"""The parameters of a model, named and shaped once, for checkpoints and models alike.

`expected_shapes(config)` lists every tensor the config's family needs under Hugging Face's name
(`model.layers.3.self_attn.q_proj.weight`), in Hugging Face's layout, in model order, from the
table the family declares (`FamilySpec.shapes`). The checkpoint readers check a file against it
before reading any data (`check_tensors`), and `minipaged.models.registry.build_model` checks a
state dict against it and then loads the model by name: minipaged's modules have Hugging Face's
attribute paths once the base model's prefix (`FamilySpec.base_prefix`) is dropped, and weights
a family stores `(in, out)` (GPT-2's `Conv1D`) are transposed to `nn.Linear`'s `(out, in)`
(`to_module_name`, `is_transposed`).

Every problem is a `CheckpointError` (a `ValueError`) whose message names the tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from minipaged.models.checkpoint.model_config import ModelConfig


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the problem."""


@dataclass(frozen=True)
class PendingTensor:
    """One tensor found in a checkpoint, described before any data is read.

    `shape` is the Hugging Face shape the tensor will have once `read` has converted it, so the
    whole checkpoint can be checked before the (slow) reading and dequantising starts.
    """

    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]
    origin: str  # the tensor's name inside the file, for error messages
    # Reads only `index` (one slice per dimension) of the tensor, where the format can (a
    # tensor-parallel rank's share); None: read the whole tensor and slice it.
    read_part: Callable[[tuple[slice, ...]], torch.Tensor] | None = None

    def part(self, index: tuple[slice, ...]) -> torch.Tensor:
        """The elements `index` of the tensor, reading no more than the format requires."""
        return self.read_part(index) if self.read_part is not None else self.read()[index]


# Buffers older Hugging Face checkpoints saved alongside the parameters; the models recompute
# them, so a checkpoint may carry them without being wrong.
_IGNORABLE = re.compile(r"(^|\.)(rotary_emb\.inv_freq|attn\.bias|attn\.masked_bias)$")

def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face parameter name the family needs, with its shape, in model order.

    `lm_head.weight` is listed only when the head is not tied to the token embedding.
    """
    shapes = config.family.shapes(config)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    return shapes


def is_ignored(config: ModelConfig, name: str) -> bool:
    """Whether a stored tensor is skipped rather than loaded: a recomputed buffer, or the copy of
    a tied head that some writers save next to the embedding it shares."""
    return bool(_IGNORABLE.search(name)) or (
        name == "lm_head.weight" and config.tie_word_embeddings
    )


def full_name(config: ModelConfig, name: str, expected: Mapping[str, object]) -> str:
    """Add the base-model prefix a bare checkpoint lacks (`h.0.attn...` -> `transformer.h.0...`,
    as the Hub's original `gpt2` stores it); any other name is returned as it is."""
    if name in expected:
        return name
    prefixed = config.family.base_prefix + name
    return prefixed if prefixed in expected else name


def is_transposed(config: ModelConfig, name: str) -> bool:
    """Whether the family stores the Hugging Face tensor `name` `(in, out)` (GPT-2's `Conv1D`)."""
    pattern = config.family.transposed
    return pattern is not None and bool(pattern.search(name))


def to_module_name(config: ModelConfig, name: str) -> str:
    """The name of Hugging Face's tensor `name` inside minipaged's model (no base prefix)."""
    return name.removeprefix(config.family.base_prefix)


def mismatches(
    config: ModelConfig,
    found: Mapping[str, Iterable[int]],
    expected: Mapping[str, tuple[int, ...]] | None = None,
) -> tuple[list[str], list[str], list[str]]:
    """The names of `found` (Hugging Face names -> shapes) that do not fit the family's table
    (or `expected`, one tensor-parallel rank's shapes): (missing, mis-shaped, unexpected), each
    in the table's or `found`'s order."""
    expected = expected_shapes(config) if expected is None else expected
    missing = [name for name in expected if name not in found]
    wrong = [n for n in expected if n in found and tuple(found[n]) != expected[n]]
    unexpected = [name for name in found if name not in expected]
    return missing, wrong, unexpected


def check_layer_count(config: ModelConfig, num_tensors: int, where: str) -> None:
    """Raise `CheckpointError` if `config` has more layers than the checkpoint has tensors.

    Every layer holds several tensors, so such a config cannot fit; said before the table of
    every layer's names is built, which for a corrupt count (a flipped byte of a GGUF file's
    `block_count`) would take minutes and gigabytes. `where` names the file and field."""
    if config.num_layers > num_tensors:
        raise CheckpointError(
            f"{where}: {config.num_layers} layers, more than the checkpoint's {num_tensors} "
            f"tensors (every layer has several)"
        )


def check_tensors(config: ModelConfig, pending: Mapping[str, PendingTensor], file: Path) -> None:
    """Raise `CheckpointError` unless `pending` (`file`'s tensors under their Hugging Face
    names) is exactly the parameter set of `config`. A message names a tensor as it is called
    inside `file` too, so that it points at the tensor the user would look for.
    """
    found = {name: tensor.shape for name, tensor in pending.items()}
    missing, wrong, unexpected = mismatches(config, found)
    if missing:
        raise CheckpointError(f"{missing[0]} missing in {file}")
    if wrong:
        name = wrong[0]
        raise CheckpointError(
            f"{_describe(name, pending)} in {file} has shape {list(found[name])}, but the "
            f"config ({config.architecture}, hidden {config.hidden_size}, heads "
            f"{config.num_heads}/{config.num_kv_heads} x {config.head_dim}, vocab "
            f"{config.vocab_size}) needs {list(expected_shapes(config)[name])}"
        )
    if unexpected:
        raise CheckpointError(
            f"unexpected tensor {_describe(unexpected[0], pending)} in {file}: minipaged's "
            f"{config.architecture} with this config has no such parameter"
        )


def _describe(name: str, pending: Mapping[str, PendingTensor]) -> str:
    inner = pending[name].origin
    return name if inner == name else f"{name} ({inner} in the file)"
