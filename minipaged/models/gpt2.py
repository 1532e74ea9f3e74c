"""GPT-2 (Radford et al. 2019): LayerNorm, learned absolute positions, tanh-GELU.

The same pre-norm skeleton as LLaMA with older parts: LayerNorm with biases, a learned position
embedding added to the token embedding instead of rotary, one fused q/k/v projection (`c_attn`),
multi-head attention (as many KV heads as query heads) and a GELU MLP. Parameter names mirror
Hugging Face's without the `transformer.` prefix; Hugging Face's `Conv1D` weights are transposed
into `nn.Linear`'s layout when loaded. The module ends with the family's declaration (`GPT2`, a
`FamilySpec`): its config keys, its parameters' names and shapes, its tensor-parallel splits.
"""

from __future__ import annotations

import re
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from minipaged.models.checkpoint.gguf_weights import GGUFMetadata
from minipaged.models.checkpoint.model_config import FamilySpec, ModelConfig, head_size, required
from minipaged.models.layers import AttentionBackend, CausalLM, check_flat_batch
from minipaged.models.tensor_parallel import (
    SINGLE_RANK,
    TensorParallel,
    lm_head,
    q_heads,
    row_parallel_linear,
    token_embedding,
)


class GPT2Attention(nn.Module):
    """Multi-head attention with one fused q/k/v projection (`c_attn`); under tensor
    parallelism its rank's heads of each of q, k and v, and `c_proj` split by rows."""

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TensorParallel):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = len(q_heads(config, tp)), config.head_dim
        self.scale = config.head_dim**-0.5
        width = self.num_heads * self.head_dim
        self.c_attn = nn.Linear(config.hidden_size, 3 * width)
        self.c_proj = row_parallel_linear(width, config.hidden_size, True, tp)

    def forward(self, x: Tensor, attn: AttentionBackend) -> Tensor:
        t = x.shape[0]
        q, k, v = self.c_attn(x).view(t, 3, self.num_heads, self.head_dim).unbind(1)
        out = attn(self.layer_idx, q, k, v, self.scale)
        return self.c_proj(out.reshape(t, self.num_heads * self.head_dim))


class GPT2MLP(nn.Module):
    """c_proj(gelu_tanh(c_fc(x))); c_fc split by columns and c_proj by rows under tensor
    parallelism."""

    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        inner = config.intermediate_size // tp.world_size
        self.c_fc = nn.Linear(config.hidden_size, inner)
        self.c_proj = row_parallel_linear(inner, config.hidden_size, True, tp)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    """Pre-norm block: x += attn(ln_1(x)); x += mlp(ln_2(x))."""

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TensorParallel):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = GPT2Attention(config, layer_idx, tp)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = GPT2MLP(config, tp)

    def forward(self, x: Tensor, attn: AttentionBackend) -> Tensor:
        x = x + self.attn(self.ln_1(x), attn)
        return x + self.mlp(self.ln_2(x))


class GPT2ForCausalLM(CausalLM):
    """GPT-2's causal language model; its head is tied to `wte` unless the config unties it.
    With `tp`, one rank's shard of it."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE_RANK):
        super().__init__()
        self.config = config
        self.wte = token_embedding(config, tp)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, i, tp) for i in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.lm_head = lm_head(config, tp)

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionBackend) -> Tensor:
        """Hidden states `[T, hidden_size]` (final norm applied) of a flat token batch."""
        check_flat_batch(self.config, input_ids, positions, self.checks_values)
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            x = block(x, attn)
        return self.ln_f(x)

    def input_embedding(self) -> nn.Embedding:
        return self.wte


# -- the family's declaration: names, shapes, config keys, GGUF quirks ---------------------------


def gpt2_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face parameter (lm_head aside) with its shape; `Conv1D` weights `(in, out)`."""
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
    return shapes | {"transformer.ln_f.weight": (hidden,), "transformer.ln_f.bias": (hidden,)}


def gpt2_config_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json's GPT-2 keys (`n_embd`, `n_head`, ...) as `ModelConfig` fields."""
    hidden, num_heads = required(cfg, "n_embd"), required(cfg, "n_head")
    return dict(
        hidden_size=hidden,
        num_layers=required(cfg, "n_layer"),
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=head_size(hidden, num_heads, "n_embd", "n_head"),
        intermediate_size=cfg.get("n_inner") or 4 * hidden,
        max_position_embeddings=required(cfg, "n_positions"),
        norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
        tie_word_embeddings=cfg.get("tie_word_embeddings", True),
    )


def gpt2_config_from_gguf(meta: GGUFMetadata) -> dict[str, Any]:
    """The GGUF metadata's GPT-2 keys as `ModelConfig` fields."""
    num_heads = meta.arch_get("attention.head_count")
    return dict(
        head_dim=head_size(meta.arch_get("embedding_length"), num_heads,
                           "gpt2.embedding_length", "gpt2.attention.head_count"),
        num_kv_heads=num_heads,
        max_position_embeddings=meta.arch_get("context_length"),
        norm_eps=meta.arch_get("attention.layer_norm_epsilon", 1e-5),
    )


def check_gpt2_config(config: ModelConfig) -> None:
    """GPT-2's heads span the hidden size, and it has none of the LLaMA family's switches."""
    if config.num_heads * config.head_dim != config.hidden_size:
        raise ValueError(
            f"gpt2 needs num_heads * head_dim == hidden_size, got "
            f"{config.num_heads} * {config.head_dim} != {config.hidden_size}"
        )
    switches = [n for n in ("qkv_bias", "o_bias", "qk_norm") if getattr(config, n)]
    if switches or config.sliding_window is not None:
        raise ValueError(
            f"{', '.join(switches) or 'sliding_window'}: LLaMA-family switches, gpt2 has none "
            f"of them"
        )


GPT2 = FamilySpec(
    architecture="gpt2",
    hf_model_types=("gpt2",),
    hf_key_types={
        **dict.fromkeys(("n_embd", "n_head", "n_layer", "n_inner", "n_positions"), "int"),
        "layer_norm_epsilon": "number",
    },
    from_hf=gpt2_config_from_hf,
    shapes=gpt2_shapes,
    base_prefix="transformer.",
    # Hugging Face's `Conv1D` linear layers store their weight (in, out).
    transposed=re.compile(r"\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$"),
    gguf_architecture="gpt2",
    from_gguf=gpt2_config_from_gguf,
    check=check_gpt2_config,
    model_class=GPT2ForCausalLM,
    tp_splits={  # how tensor parallelism splits each parameter (`tensor_parallel.split_of`)
        r"^(wte|lm_head)\.weight$": "vocab",
        r"\.attn\.c_attn\.(weight|bias)$": "qkv",
        r"\.attn\.c_proj\.weight$": "attention_row",
        r"\.mlp\.c_fc\.(weight|bias)$": "mlp_column",
        r"\.mlp\.c_proj\.weight$": "mlp_row",
    },
)
