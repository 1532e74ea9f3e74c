"""The shape of a model: one `ModelConfig` for every family, and the `FamilySpec` each fills in.

A model family (LLaMA, GPT-2, ...) is declared once, in its module of `minipaged.models`, as a
`FamilySpec`: the `config.json` model types and the GGUF architecture it reads, how its config
keys become `ModelConfig` fields, its parameters' names and shapes, how its checkpoints store
them. This layer stays generic: its readers are *given* the families (`minipaged.models.FAMILIES`),
pick the one a file names, and the `ModelConfig` they build carries it (`config.family`), so every
later step asks the config rather than testing an architecture's name.

Field names follow Hugging Face where they exist, so a reader can hold the two side by side.
minipaged's attention sees every earlier token of a sequence, so a model with a sliding window
is served only as far as the window reaches (see `cap_to_sliding_window`).
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minipaged.tokenizer.gguf_file import check_types

# The JSON type of each config.json key every family reads (an int is not a bool; a number is an
# int or a float; null is always allowed and means "not set"), checked before any is used; a
# family adds its own keys (`FamilySpec.hf_key_types`).
HF_KEY_TYPES = {
    **dict.fromkeys(("vocab_size", "bos_token_id", "pad_token_id"), "int"),
    "tie_word_embeddings": "bool",
    "model_type": "string",
    "eos_token_id": "int or list of int",
}
# Sizes that must be positive integers for any architecture.
_POSITIVE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                    "head_dim", "intermediate_size", "max_position_embeddings")


@dataclass(frozen=True, kw_only=True, repr=False, eq=False)
class FamilySpec:
    """Everything the checkpoint readers and the model builder need to know of one family.

    The checkpoint layer reads all but the last two fields; `model_class` and `tp_splits` are
    carried for the model layer (`minipaged.models.registry.build_model`,
    `minipaged.models.tensor_parallel`). A family is one object: configs compare it by identity.
    """

    architecture: str  # `ModelConfig.architecture`, the family's key in the registry
    hf_model_types: tuple[str, ...]  # the config.json `model_type`s read as this family
    hf_key_types: Mapping[str, str]  # config.json key -> its JSON type (see HF_KEY_TYPES)
    # config.json's contents -> the `ModelConfig` fields besides vocabulary and special tokens.
    from_hf: Callable[[dict[str, Any]], dict[str, Any]]
    # Every Hugging Face parameter name with its shape, in model order, lm_head left out.
    shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]]
    base_prefix: str = "model."  # the base model's prefix inside Hugging Face's ...ForCausalLM
    transposed: re.Pattern[str] | None = None  # names stored (in, out), as GPT-2's Conv1D
    gguf_architecture: str | None = None  # GGUF `general.architecture`; None: no GGUF files
    # A GGUF file's metadata (`gguf_weights.GGUFMetadata`) -> `ModelConfig` fields, as `from_hf`.
    from_gguf: Callable[[Any], dict[str, Any]] | None = None
    gguf_permuted_qk: bool = False  # llama.cpp's converter permuted the Q/K rows (interleaved)
    check: Callable[[ModelConfig], None] | None = None  # the family's own rules, ValueError
    model_class: Any = None  # the `CausalLM` class that runs it (layer 3)
    # Every computation of its layers is a module the CPU platform swaps (only views between
    # them), so the CPU replays its decode steps (`minipaged.platforms.cpu.replay`).
    cpu_replays: bool = False
    # Module parameter name pattern -> how tensor parallelism splits it (`split_of`).
    tp_splits: Mapping[str, str] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"FamilySpec({self.architecture!r})"


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer of one family."""

    family: FamilySpec
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    # The positions minipaged serves: the checkpoint's context, capped to `sliding_window`.
    max_position_embeddings: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF's dict: {"rope_type": "linear"|"llama3", ...}
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # biases on the query, key and value projections
    o_bias: bool = False  # a bias on the attention's output projection
    qk_norm: bool = False  # RMSNorm over each head's queries and keys before the rotary
    sliding_window: int | None = None  # a query attends to keys fewer than this many back
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.family, FamilySpec):
            raise ValueError(f"family must be a FamilySpec, got {self.family!r:.60}")
        for name in _POSITIVE_FIELDS:
            _check_positive_int(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.family.check is not None:
            self.family.check(self)
        if self.norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError(
                f"norm_eps ({self.norm_eps}) and rope_theta ({self.rope_theta}) must be positive"
            )
        if self.sliding_window is not None:
            _check_positive_int("sliding_window", self.sliding_window)
            if self.max_position_embeddings > self.sliding_window:
                raise ValueError(
                    f"max_position_embeddings ({self.max_position_embeddings}) exceeds "
                    f"sliding_window ({self.sliding_window}): minipaged's attention sees every "
                    f"earlier token, so past the window it would attend further back than the "
                    f"model does; serve at most {self.sliding_window} positions"
                )
        check_token_ids(
            self.vocab_size,
            [("bos_token_id", self.bos_token_id), ("pad_token_id", self.pad_token_id)]
            + [("eos_token_id", token) for token in self.eos_token_ids],
        )

    @property
    def architecture(self) -> str:
        return self.family.architecture

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], families: Mapping[str, FamilySpec]) -> ModelConfig:
        """Build from the contents of a Hugging Face `config.json`, as the one of `families`
        whose `hf_model_types` has its `model_type`."""
        if not isinstance(cfg, dict):
            raise ValueError(f"config.json must hold a JSON object, not {type(cfg).__name__}")
        check_types(cfg, HF_KEY_TYPES, "config.json")
        model_type = cfg.get("model_type", "")
        family = next((f for f in families.values() if model_type in f.hf_model_types), None)
        if family is None:
            known = [name for f in families.values() for name in f.hf_model_types]
            raise ValueError(
                f"unsupported model_type {model_type!r} in config.json; minipaged implements "
                f"{', '.join(known)}"
            )
        check_types(cfg, family.hf_key_types, "config.json")
        eos = cfg.get("eos_token_id")
        return cls(
            family=family,
            vocab_size=required(cfg, "vocab_size"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            pad_token_id=cfg.get("pad_token_id"),
            **family.from_hf(cfg),
        )

    @classmethod
    def from_json_file(cls, path: str | Path, families: Mapping[str, FamilySpec]) -> ModelConfig:
        path = Path(path)
        try:
            cfg = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a readable config.json ({exc})") from exc
        try:
            return cls.from_hf_dict(cfg, families)
        except (TypeError, AttributeError, KeyError) as exc:  # deeper, e.g. inside rope_scaling
            raise ValueError(
                f"{path}: inconsistent config.json ({type(exc).__name__}: {exc})"
            ) from exc


def cap_to_sliding_window(context: int, window: int | None, source: str) -> int:
    """The positions minipaged serves of a model with `context` positions and attention window
    `window`: all of them when the window covers them, else the window, with a warning.

    Within the window, attending every earlier token is exactly sliding-window attention (a query
    attends keys fewer than `window` positions back, and no sequence is longer than that); past
    it, minipaged would attend further back than the model does, so the context stops there.
    """
    if window is None or not isinstance(context, int) or window >= context:
        return context
    warnings.warn(
        f"{source}: sliding_window {window} < context length {context}; minipaged has no "
        f"sliding-window attention, so it serves {window} positions, where the two agree",
        stacklevel=3,
    )
    return window


def head_size(hidden: int, num_heads: int, hidden_field: str, heads_field: str) -> int:
    """hidden / num_heads, the head size of a family that does not state one; a `ValueError`
    naming both fields when the heads do not divide the hidden size."""
    if not isinstance(hidden, int) or not isinstance(num_heads, int) or num_heads <= 0:
        raise ValueError(f"{hidden_field} ({hidden!r}) and {heads_field} ({num_heads!r}) must be "
                         f"positive integers")
    if hidden % num_heads != 0:
        raise ValueError(
            f"{heads_field} {num_heads} does not divide {hidden_field} {hidden}, and no head size "
            f"is given"
        )
    return hidden // num_heads


def check_token_ids(vocab_size: int, ids: Iterable[tuple[str, int | None]]) -> None:
    """Raise `ValueError` naming the first special token id (field name, id) that is not a
    token of a `vocab_size`-token vocabulary; None means the model has no such token."""
    for name, token in ids:
        if token is None:
            continue
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size:
            raise ValueError(f"{name} {token!r} is outside the vocabulary of {vocab_size} tokens")


# Token ids, positions and lengths are int32 in the attention contract's metadata: no size of a
# model may exceed it.
INT32_MAX = 2**31 - 1


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if value > INT32_MAX:
        raise ValueError(f"{name} must be a positive integer of at most 2**31 - 1, got {value}")


def required(cfg: dict[str, Any], key: str) -> Any:
    """A key every config.json of this model type must have; its absence is a clear error."""
    if key not in cfg:
        raise ValueError(
            f"config.json (model_type {cfg.get('model_type')!r}) lacks the required key {key!r}"
        )
    return cfg[key]
