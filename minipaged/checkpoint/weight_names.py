"""The parameters of each model family, named and shaped once, for checkpoints and models alike.

`expected_shapes(config)` lists every tensor a family needs under Hugging Face's name
(`model.layers.3.self_attn.q_proj.weight`), in Hugging Face's layout, in model order. The
checkpoint readers check a file against it before reading any data (`check_tensors`), and
`minipaged.models.registry.build_model` checks a state dict against it and then loads the model by
name:
minipaged's modules have Hugging Face's attribute paths once the base model's prefix (`model.`,
`transformer.`) is dropped, and GPT-2's `Conv1D` weights, stored `(in, out)`, are transposed to
`nn.Linear`'s `(out, in)` (`to_module_name`, `is_conv1d`).

Every problem is a `CheckpointError` (a `ValueError`) whose message names the tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from minipaged.checkpoint.model_config import ModelConfig


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

# GPT-2's linear layers are Hugging Face `Conv1D`s, whose weight is [in, out].
_GPT2_CONV1D = re.compile(r"\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")


def base_prefix(config: ModelConfig) -> str:
    """The prefix of the base model inside Hugging Face's `...ForCausalLM`."""
    return "transformer." if config.architecture == "gpt2" else "model."


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face parameter name the architecture needs, with its shape, in model order.

    `lm_head.weight` is listed only when the head is not tied to the token embedding.
    """
    shapes = _gpt2_shapes(config) if config.architecture == "gpt2" else _llama_shapes(config)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    return shapes


def _llama_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """LLaMA and its relatives: optional q/k/v and output biases, optional per-head q/k norms."""
    hidden, q_dim, kv_dim = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, hidden)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        attn = {
            "q_proj.weight": (q_dim, hidden),
            "k_proj.weight": (kv_dim, hidden),
            "v_proj.weight": (kv_dim, hidden),
            "o_proj.weight": (hidden, q_dim),
        }
        if c.qkv_bias:
            attn |= {"q_proj.bias": (q_dim,), "k_proj.bias": (kv_dim,), "v_proj.bias": (kv_dim,)}
        if c.o_bias:
            attn["o_proj.bias"] = (hidden,)
        if c.qk_norm:
            attn |= {"q_norm.weight": (c.head_dim,), "k_norm.weight": (c.head_dim,)}
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes |= {p + "self_attn." + name: shape for name, shape in attn.items()}
        shapes |= {
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (c.intermediate_size, hidden),
            p + "mlp.up_proj.weight": (c.intermediate_size, hidden),
            p + "mlp.down_proj.weight": (hidden, c.intermediate_size),
        }
    shapes["model.norm.weight"] = (hidden,)
    return shapes


def _gpt2_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    hidden, inner = c.hidden_size, c.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "transformer.wte.weight": (c.vocab_size, hidden),
        "transformer.wpe.weight": (c.max_position_embeddings, hidden),
    }
    for i in range(c.num_layers):
        p = f"transformer.h.{i}."
        shapes |= {
            p + "ln_1.weight": (hidden,),
            p + "ln_1.bias": (hidden,),
            p + "attn.c_attn.weight": (hidden, 3 * hidden),
            p + "attn.c_attn.bias": (3 * hidden,),
            p + "attn.c_proj.weight": (hidden, hidden),
            p + "attn.c_proj.bias": (hidden,),
            p + "ln_2.weight": (hidden,),
            p + "ln_2.bias": (hidden,),
            p + "mlp.c_fc.weight": (hidden, inner),
            p + "mlp.c_fc.bias": (inner,),
            p + "mlp.c_proj.weight": (inner, hidden),
            p + "mlp.c_proj.bias": (hidden,),
        }
    shapes["transformer.ln_f.weight"] = (hidden,)
    shapes["transformer.ln_f.bias"] = (hidden,)
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
    prefixed = base_prefix(config) + name
    return prefixed if prefixed in expected else name


def is_conv1d(config: ModelConfig, name: str) -> bool:
    """Whether the Hugging Face tensor `name` is a GPT-2 `Conv1D` weight, stored `(in, out)`."""
    return config.architecture == "gpt2" and bool(_GPT2_CONV1D.search(name))


def to_module_name(config: ModelConfig, name: str) -> str:
    """The name of Hugging Face's tensor `name` inside minipaged's model (no base prefix)."""
    return name.removeprefix(base_prefix(config))


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


def check_tensors(
    config: ModelConfig, found: Mapping[str, tuple[int, ...]], file: Path, origin: Mapping[str, str]
) -> None:
    """Raise `CheckpointError` unless `found` is exactly the parameter set of `config`.

    `found` maps Hugging Face names to shapes; `origin` maps them to the names used inside
    `file`, so a message can point at the tensor the user would look for.
    """
    missing, wrong, unexpected = mismatches(config, found)
    if missing:
        raise CheckpointError(f"{missing[0]} missing in {file}")
    if wrong:
        name = wrong[0]
        raise CheckpointError(
            f"{_describe(name, origin)} in {file} has shape {list(found[name])}, but the "
            f"config ({config.architecture}, hidden {config.hidden_size}, heads "
            f"{config.num_heads}/{config.num_kv_heads} x {config.head_dim}, vocab "
            f"{config.vocab_size}) needs {list(expected_shapes(config)[name])}"
        )
    if unexpected:
        raise CheckpointError(
            f"unexpected tensor {_describe(unexpected[0], origin)} in {file}: minipaged's "
            f"{config.architecture} with this config has no such parameter"
        )


def _describe(name: str, origin: Mapping[str, str]) -> str:
    inner = origin.get(name, name)
    return name if inner == name else f"{name} ({inner} in the file)"
