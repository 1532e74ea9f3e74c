"""The shape of a model: one `ModelConfig` for every supported architecture.

A checkpoint loader (`minipaged.checkpoint.loader`) fills it from a Hugging Face `config.json` or
from GGUF metadata; the models (`minipaged.models.registry`) are built from it. Field names follow
Hugging Face where they exist, so a reader can hold the two side by side.

Mistral, Qwen2 / Qwen2.5 and Qwen3 are LLaMA with a few switches, each a field here:
`qkv_bias` (Qwen2), `qk_norm` and an explicit `head_dim` (Qwen3), `o_bias` (LLaMA's and Qwen3's
`attention_bias`), `sliding_window` (Mistral). minipaged's attention sees every earlier token of
a sequence, so a model with a sliding window is served only as far as the window reaches (see
`cap_to_sliding_window`).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The LLaMA family (one model class, `minipaged.models.llama`) and GPT-2.
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gpt2")
# Hugging Face `model_type` -> architecture. Mistral is LLaMA with a sliding window.
HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# The JSON type of each config.json key read (an int is not a bool; a number is an int or a
# float; null is always allowed and means "not set"), checked before any is used.
_HF_KEY_TYPES = {
    **dict.fromkeys(
        ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings",
         "sliding_window", "bos_token_id", "pad_token_id", "n_embd", "n_head", "n_layer",
         "n_inner", "n_positions"),
        "int",
    ),
    **dict.fromkeys(("rms_norm_eps", "rope_theta", "layer_norm_epsilon"), "number"),
    **dict.fromkeys(("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window"),
                    "bool"),
    **dict.fromkeys(("rope_scaling", "rope_parameters"), "object"),
    "model_type": "string",
    "eos_token_id": "int or list of int",
}
# Sizes that must be positive integers for any architecture.
_POSITIVE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                    "head_dim", "intermediate_size", "max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer."""

    architecture: str  # one of SUPPORTED_ARCHITECTURES
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
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"minipaged implements {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in _POSITIVE_FIELDS:
            _check_positive_int(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.architecture == "gpt2":
            if self.num_heads * self.head_dim != self.hidden_size:
                raise ValueError(
                    f"gpt2 needs num_heads * head_dim == hidden_size, got "
                    f"{self.num_heads} * {self.head_dim} != {self.hidden_size}"
                )
            switches = [n for n in ("qkv_bias", "o_bias", "qk_norm") if getattr(self, n)]
            if switches or self.sliding_window is not None:
                raise ValueError(
                    f"{', '.join(switches) or 'sliding_window'}: LLaMA-family switches, "
                    f"gpt2 has none of them"
                )
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
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from the contents of a Hugging Face `config.json`."""
        if not isinstance(cfg, dict):
            raise ValueError(f"config.json must hold a JSON object, not {type(cfg).__name__}")
        _check_hf_key_types(cfg)
        model_type = cfg.get("model_type", "")
        if model_type != "gpt2" and model_type not in HF_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r} in config.json; minipaged implements "
                f"{', '.join([*HF_MODEL_TYPES, 'gpt2'])}"
            )
        eos = cfg.get("eos_token_id")
        common = dict(
            vocab_size=_required(cfg, "vocab_size"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            pad_token_id=cfg.get("pad_token_id"),
        )
        if model_type == "gpt2":
            hidden, num_heads = _required(cfg, "n_embd"), _required(cfg, "n_head")
            return cls(
                architecture="gpt2",
                hidden_size=hidden,
                num_layers=_required(cfg, "n_layer"),
                num_heads=num_heads,
                num_kv_heads=num_heads,
                head_dim=head_size(hidden, num_heads, "n_embd", "n_head"),
                intermediate_size=cfg.get("n_inner") or 4 * hidden,
                max_position_embeddings=_required(cfg, "n_positions"),
                norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
                tie_word_embeddings=cfg.get("tie_word_embeddings", True),
                **common,
            )
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias is true: biases in the MLP are not supported")
        num_heads, hidden = _required(cfg, "num_attention_heads"), _required(cfg, "hidden_size")
        if model_type == "qwen3":  # its head size is its own (128), never hidden / heads
            head_dim = _required(cfg, "head_dim")
        else:
            head_dim = cfg.get("head_dim") or head_size(
                hidden, num_heads, "hidden_size", "num_attention_heads"
            )
        attention_bias = bool(cfg.get("attention_bias", False))  # LLaMA's, Qwen3's: q, k, v, o
        # Qwen's configs name a window they do not use unless `use_sliding_window` says so.
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        return cls(
            architecture=HF_MODEL_TYPES[model_type],
            hidden_size=hidden,
            num_layers=_required(cfg, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            intermediate_size=_required(cfg, "intermediate_size"),
            max_position_embeddings=cap_to_sliding_window(
                cfg.get("max_position_embeddings", 2048), window, "config.json"
            ),
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta")
            or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0),
            rope_scaling=_rope_scaling(cfg),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias,
            qk_norm=model_type == "qwen3",
            sliding_window=window,
            **common,
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            cfg = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a readable config.json ({exc})") from exc
        try:
            return cls.from_hf_dict(cfg)
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
            raise ValueError(
                f"{name} {token!r} is outside the vocabulary of {vocab_size} tokens"
            )


# Token ids, positions and lengths are int32 in the attention contract's metadata: no size of a
# model may exceed it.
INT32_MAX = 2**31 - 1


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if value > INT32_MAX:
        raise ValueError(f"{name} must be a positive integer of at most 2**31 - 1, got {value}")


def _check_hf_key_types(cfg: dict[str, Any]) -> None:
    """Raise `ValueError` naming the first key of `_HF_KEY_TYPES` whose value is of another
    type."""

    def fits(value: Any, kind: str) -> bool:
        if kind == "int or list of int":
            return fits(value, "int") or (
                isinstance(value, list) and all(fits(v, "int") for v in value)
            )
        if isinstance(value, bool):
            return kind == "bool"
        expected = {"int": int, "number": (int, float), "bool": bool, "object": dict,
                    "string": str}[kind]
        return isinstance(value, expected)

    for key, kind in _HF_KEY_TYPES.items():
        if cfg.get(key) is not None and not fits(cfg[key], kind):
            raise ValueError(f"config.json: {key} must be {kind}, not {cfg[key]!r:.60}")


def _required(cfg: dict[str, Any], key: str) -> Any:
    """A key every config.json of this model type must have; its absence is a clear error."""
    if key not in cfg:
        raise ValueError(
            f"config.json (model_type {cfg.get('model_type')!r}) lacks the required key {key!r}"
        )
    return cfg[key]


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """HF's rope scaling dict, always keyed by `rope_type`; None for plain RoPE.

    HF has spelled it `rope_scaling` with a `type` key (older) and `rope_parameters` with
    `rope_type` and the base `rope_theta` inside (newer); the base lives in `rope_theta` here.
    """
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    return {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")} | {
        "rope_type": kind
    }
