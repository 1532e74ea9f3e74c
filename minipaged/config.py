"""The shape of a model: one `ModelConfig` for every supported architecture.

A checkpoint loader (`minipaged.checkpoint`) fills it from a Hugging Face `config.json` or from
GGUF metadata; the models (`minipaged.model`) are built from it. Field names follow Hugging Face
where they exist, so a reader can hold the two side by side.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "gpt2")

# Sizes that must be positive integers for any architecture.
_POSITIVE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer."""

    architecture: str  # "llama" or "gpt2"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF's dict: {"rope_type": "linear"|"llama3", ...}
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"minipaged implements {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in _POSITIVE_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.architecture == "gpt2" and self.num_heads * self.head_dim != self.hidden_size:
            raise ValueError(
                f"gpt2 needs num_heads * head_dim == hidden_size, got "
                f"{self.num_heads} * {self.head_dim} != {self.hidden_size}"
            )
        if self.norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError(
                f"norm_eps ({self.norm_eps}) and rope_theta ({self.rope_theta}) must be positive"
            )

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from the contents of a Hugging Face `config.json`."""
        model_type = cfg.get("model_type", "")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if model_type in ("llama", "mistral"):
            num_heads = _required(cfg, "num_attention_heads")
            hidden = _required(cfg, "hidden_size")
            return cls(
                architecture="llama",
                vocab_size=_required(cfg, "vocab_size"),
                hidden_size=hidden,
                num_layers=_required(cfg, "num_hidden_layers"),
                num_heads=num_heads,
                num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
                head_dim=cfg.get("head_dim") or hidden // num_heads,
                intermediate_size=_required(cfg, "intermediate_size"),
                max_position_embeddings=cfg.get("max_position_embeddings", 2048),
                norm_eps=cfg.get("rms_norm_eps", 1e-6),
                rope_theta=cfg.get("rope_theta")
                or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0),
                rope_scaling=_rope_scaling(cfg),
                tie_word_embeddings=cfg.get("tie_word_embeddings", False),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        if model_type == "gpt2":
            hidden = _required(cfg, "n_embd")
            num_heads = _required(cfg, "n_head")
            return cls(
                architecture="gpt2",
                vocab_size=_required(cfg, "vocab_size"),
                hidden_size=hidden,
                num_layers=_required(cfg, "n_layer"),
                num_heads=num_heads,
                num_kv_heads=num_heads,
                head_dim=hidden // num_heads,
                intermediate_size=cfg.get("n_inner") or 4 * hidden,
                max_position_embeddings=_required(cfg, "n_positions"),
                norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
                tie_word_embeddings=cfg.get("tie_word_embeddings", True),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        raise ValueError(
            f"unsupported model_type {model_type!r} in config.json; "
            f"minipaged implements {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            cfg = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a readable config.json ({exc})") from exc
        return cls.from_hf_dict(cfg)


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
