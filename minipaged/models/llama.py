"""The LLaMA family: LLaMA 1-3 and SmolLM2, Mistral, Qwen2 / Qwen2.5 and Qwen3, in one model.

A pre-norm decoder (Touvron et al. 2023): RMSNorm, grouped-query attention with rotary position
embeddings, a SwiGLU MLP. The relatives are LLaMA with a switch or two of `ModelConfig`:

| family | differs from LLaMA by |
|---|---|
| Mistral | `sliding_window` (served up to the window: `config.cap_to_sliding_window`) |
| Qwen2 / Qwen2.5 | `qkv_bias`: biases on the q, k and v projections |
| Qwen3 | `qk_norm`: RMSNorm over each head's q and k before the rotary; its own `head_dim` |

`head_dim` need not be hidden / heads (Qwen3, Mistral Nemo): the projections are sized by it.
Parameter names mirror Hugging Face's without the `model.` prefix. The module ends with the
family's declaration (`LLAMA`, `QWEN2`, `QWEN3`, each a `FamilySpec`): its config.json and GGUF
keys, its parameters' names and shapes, llama.cpp's Q/K permutation, its tensor-parallel splits.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import Tensor, nn

from minipaged.models.checkpoint.gguf_weights import GGUFMetadata
from minipaged.models.checkpoint.model_config import (
    FamilySpec,
    ModelConfig,
    cap_to_sliding_window,
    head_size,
    required,
)
from minipaged.models.layers import (
    AttentionBackend,
    CausalLM,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    check_flat_batch,
)
from minipaged.models.tensor_parallel import (
    SINGLE_RANK,
    TensorParallel,
    kv_heads,
    lm_head,
    q_heads,
    row_parallel_linear,
    token_embedding,
)


class LlamaAttention(nn.Module):
    """Grouped-query attention: `num_heads` query heads share `num_kv_heads` key/value heads.

    Under tensor parallelism (`tp`) the layer holds its rank's query heads and the KV heads
    they read (`minipaged.models.tensor_parallel`): q/k/v split by columns, o by rows and
    all-reduced.
    """

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TensorParallel,
                 rotary: RotaryEmbedding):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = len(q_heads(config, tp)), len(kv_heads(config, tp))
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        q_size, kv_size = self.num_heads * config.head_dim, self.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.o_proj = row_parallel_linear(q_size, config.hidden_size, config.o_bias, tp)
        # Qwen3: each head's queries and keys normalised on their own (over head_dim).
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps) if config.qk_norm else None
        self.rotary = rotary  # one module, shared by every layer (its tables are the model's)

    def forward(self, positions: Tensor, x: Tensor, attn: AttentionBackend) -> Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = attn(self.layer_idx, q, k, v, self.scale)
        return self.o_proj(out.view(t, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU (Shazeer 2020): down(silu(gate(x)) * up(x)); gate/up split by columns and down
    by rows under tensor parallelism."""

    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        inner = config.intermediate_size // tp.world_size
        self.gate_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.act = SiluAndMul()
        self.down_proj = row_parallel_linear(inner, config.hidden_size, False, tp)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x += attn(norm(x)); x += mlp(norm(x)). The residual stream `residual`
    runs beside the sublayers' outputs; each norm adds the last output to it first (`RMSNorm`
    with a residual), so the block reads as nano-vllm's and vLLM's do."""

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TensorParallel,
                 rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, tp, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = LlamaMLP(config, tp)

    def forward(self, positions: Tensor, x: Tensor, residual: Tensor | None,
                attn: AttentionBackend) -> tuple[Tensor, Tensor]:
        """(this block's MLP output, the residual stream before it is added): the next norm
        adds them."""
        if residual is None:  # the first block: the embeddings are the residual stream
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, attn)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(CausalLM):
    """The LLaMA family's causal language model (see the module docstring for its members);
    with `tp`, one rank's shard of it."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE_RANK):
        super().__init__()
        self.config = config
        self.embed_tokens = token_embedding(config, tp)
        rotary = RotaryEmbedding(config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, tp, rotary) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = lm_head(config, tp)

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionBackend) -> Tensor:
        """Hidden states `[T, hidden_size]` (final norm applied) of a flat token batch."""
        check_flat_batch(self.config, input_ids, positions, self.checks_values)
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, attn)
        return self.norm(x, residual)[0]

    def input_embedding(self) -> nn.Embedding:
        return self.embed_tokens


# -- the family's declaration: names, shapes, config keys, GGUF quirks ---------------------------

_LLAMA_KEY_TYPES = {
    **dict.fromkeys(
        ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
         "head_dim", "intermediate_size", "max_position_embeddings", "sliding_window"),
        "int",
    ),
    **dict.fromkeys(("rms_norm_eps", "rope_theta"), "number"),
    **dict.fromkeys(("attention_bias", "mlp_bias", "use_sliding_window"), "bool"),
    **dict.fromkeys(("rope_scaling", "rope_parameters"), "object"),
}


def llama_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face parameter (lm_head aside) with its shape: optional q/k/v and output
    biases, optional per-head q/k norms."""
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


def llama_config_from_hf(
    cfg: dict[str, Any], qkv_bias: bool = False, qk_norm: bool = False
) -> dict[str, Any]:
    """config.json's LLaMA keys as `ModelConfig` fields. Qwen2 always has q/k/v biases
    (`qkv_bias`); Qwen3 has per-head q/k norms (`qk_norm`) and its own head size (128), never
    hidden / heads, which its config must state."""
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias is true: biases in the MLP are not supported")
    num_heads, hidden = required(cfg, "num_attention_heads"), required(cfg, "hidden_size")
    if qk_norm:
        head_dim = required(cfg, "head_dim")
    else:
        head_dim = cfg.get("head_dim") or head_size(
            hidden, num_heads, "hidden_size", "num_attention_heads"
        )
    attention_bias = bool(cfg.get("attention_bias", False))  # LLaMA's, Qwen3's: q, k, v, o
    # Qwen's configs name a window they do not use unless `use_sliding_window` says so.
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    return dict(
        hidden_size=hidden,
        num_layers=required(cfg, "num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        intermediate_size=required(cfg, "intermediate_size"),
        max_position_embeddings=cap_to_sliding_window(
            cfg.get("max_position_embeddings", 2048), window, "config.json"
        ),
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=cfg.get("rope_theta")
        or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0),
        rope_scaling=_hf_rope_scaling(cfg),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        qkv_bias=qkv_bias or attention_bias,
        o_bias=attention_bias,
        qk_norm=qk_norm,
        sliding_window=window,
    )


def _hf_rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
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
    scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")}
    return scaling | {"rope_type": kind}


def llama_config_from_gguf(meta: GGUFMetadata, qkv_bias: bool = False,
                           qk_norm: bool = False) -> dict[str, Any]:
    """The GGUF metadata's LLaMA keys as `ModelConfig` fields (`qkv_bias`, `qk_norm` as in
    `llama_config_from_hf`); q/k/v and output biases also when the file has them."""
    num_heads = meta.arch_get("attention.head_count")
    head_dim = meta.arch_get("attention.key_length", None)
    if head_dim is None:
        head_dim = head_size(
            meta.arch_get("embedding_length"), num_heads,
            f"{meta.architecture}.embedding_length", f"{meta.architecture}.attention.head_count",
        )
    if meta.arch_get("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(
            f"{meta.architecture}.rope.dimension_count "
            f"{meta.arch_get('rope.dimension_count')} != head dim {head_dim}: partial rotary "
            f"embeddings are not supported"
        )
    if "rope_freqs.weight" in meta.tensor_names:
        raise ValueError(
            "rope_freqs.weight (per-frequency rope factors, llama.cpp's form of llama3 rope "
            "scaling) is not supported"
        )
    window = meta.arch_get("attention.sliding_window", None)
    return dict(
        head_dim=head_dim,
        num_kv_heads=meta.arch_get("attention.head_count_kv", num_heads),
        max_position_embeddings=cap_to_sliding_window(
            meta.arch_get("context_length"), window, str(meta.file)
        ),
        norm_eps=meta.arch_get("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=meta.arch_get("rope.freq_base", 10000.0),
        rope_scaling=_gguf_rope_scaling(meta),
        qkv_bias=qkv_bias or "blk.0.attn_q.bias" in meta.tensor_names,
        o_bias="blk.0.attn_output.bias" in meta.tensor_names,
        qk_norm=qk_norm,
        sliding_window=window,
    )


def _gguf_rope_scaling(meta: GGUFMetadata) -> dict[str, Any] | None:
    """llama.cpp's `{arch}.rope.scaling.*` keys as Hugging Face's `rope_scaling` dict."""
    kind = meta.arch_get("rope.scaling.type", None)
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": meta.arch_get("rope.scaling.factor")}
    original = meta.arch_get("rope.scaling.original_context_length", None)
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    return scaling


# How tensor parallelism splits each parameter (`minipaged.models.tensor_parallel.split_of`).
LLAMA_TP_SPLITS = {
    r"^(embed_tokens|lm_head)\.weight$": "vocab",
    r"\.self_attn\.q_proj\.(weight|bias)$": "query",
    r"\.self_attn\.(k|v)_proj\.(weight|bias)$": "key_value",
    r"\.self_attn\.o_proj\.weight$": "attention_row",
    r"\.mlp\.(gate|up)_proj\.weight$": "mlp_column",
    r"\.mlp\.down_proj\.weight$": "mlp_row",
}


def llama_family(architecture: str, hf_model_types: tuple[str, ...], *, qkv_bias: bool = False,
                 qk_norm: bool = False, gguf_permuted_qk: bool = False) -> FamilySpec:
    """A member of the LLaMA family: LLaMA with Qwen2's `qkv_bias` or Qwen3's `qk_norm`."""
    switches = dict(qkv_bias=qkv_bias, qk_norm=qk_norm)
    return FamilySpec(
        architecture=architecture,
        hf_model_types=hf_model_types,
        hf_key_types=_LLAMA_KEY_TYPES,
        from_hf=partial(llama_config_from_hf, **switches),
        shapes=llama_shapes,
        gguf_architecture=architecture,
        from_gguf=partial(llama_config_from_gguf, **switches),
        gguf_permuted_qk=gguf_permuted_qk,
        model_class=LlamaForCausalLM,
        tp_splits=LLAMA_TP_SPLITS,
        cpu_replays=True,
    )


# llama.cpp's converter permutes LLaMA's Q/K rows for its interleaved rotary, not Qwen's.
LLAMA = llama_family("llama", ("llama", "mistral"), gguf_permuted_qk=True)  # Mistral: a window
QWEN2 = llama_family("qwen2", ("qwen2",), qkv_bias=True)
QWEN3 = llama_family("qwen3", ("qwen3",), qk_norm=True)
