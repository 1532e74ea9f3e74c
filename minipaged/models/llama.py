"""The LLaMA family: LLaMA 1-3 and SmolLM2, Mistral, Qwen2 / Qwen2.5 and Qwen3, in one model.

A pre-norm decoder (Touvron et al. 2023): RMSNorm, grouped-query attention with rotary position
embeddings, a SwiGLU MLP. The relatives are LLaMA with a switch or two of `ModelConfig`:

| family | differs from LLaMA by |
|---|---|
| Mistral | `sliding_window` (served up to the window: `config.cap_to_sliding_window`) |
| Qwen2 / Qwen2.5 | `qkv_bias`: biases on the q, k and v projections |
| Qwen3 | `qk_norm`: RMSNorm over each head's q and k before the rotary; its own `head_dim` |

`head_dim` need not be hidden / heads (Qwen3, Mistral Nemo): the projections are sized by it.
Parameter names mirror Hugging Face's without the `model.` prefix
(`minipaged.checkpoint.weight_names`).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from minipaged.checkpoint.model_config import ModelConfig
from minipaged.models.layers import (
    AttentionBackend,
    CausalLM,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
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

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TensorParallel):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = len(q_heads(config, tp)), len(kv_heads(config, tp))
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        q_size, kv_size = self.num_heads * config.head_dim, self.num_kv_heads * config.head_dim
        self.q_proj = Linear(config.hidden_size, q_size, bias=config.qkv_bias)
        self.k_proj = Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.v_proj = Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.o_proj = row_parallel_linear(q_size, config.hidden_size, config.o_bias, tp)
        # Qwen3: each head's queries and keys normalised on their own (over head_dim).
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps) if config.qk_norm else None

    def forward(self, x: Tensor, rotation: tuple[Tensor, Tensor], attn: AttentionBackend) -> Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rotation), apply_rotary(k, *rotation)
        out = attn(self.layer_idx, q, k, v, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU (Shazeer 2020): down(silu(gate(x)) * up(x)); gate/up split by columns and down
    by rows under tensor parallelism."""

    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        inner = config.intermediate_size // tp.world_size
        self.gate_proj = Linear(config.hidden_size, inner, bias=False)
        self.up_proj = Linear(config.hidden_size, inner, bias=False)
        self.down_proj = row_parallel_linear(inner, config.hidden_size, False, tp)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x += attn(norm(x)); x += mlp(norm(x))."""

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TensorParallel):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = LlamaMLP(config, tp)

    def forward(self, x: Tensor, rotation: tuple[Tensor, Tensor], attn: AttentionBackend) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotation, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(CausalLM):
    """The LLaMA family's causal language model (see the module docstring for its members);
    with `tp`, one rank's shard of it."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE_RANK):
        super().__init__()
        self.config = config
        self.embed_tokens = token_embedding(config, tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, tp) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = lm_head(config, tp)
        self.rotary = RotaryEmbedding(config)

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionBackend) -> Tensor:
        """Hidden states `[T, hidden_size]` (final norm applied) of a flat token batch."""
        check_flat_batch(self.config, input_ids, positions)
        x = self.embed_tokens(input_ids)
        rotation = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rotation, attn)
        return self.norm(x)

    def input_embedding(self) -> nn.Embedding:
        return self.embed_tokens
