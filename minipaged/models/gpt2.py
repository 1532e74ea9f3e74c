"""GPT-2 (Radford et al. 2019): LayerNorm, learned absolute positions, tanh-GELU.

The same pre-norm skeleton as LLaMA with older parts: LayerNorm with biases, a learned position
embedding added to the token embedding instead of rotary, one fused q/k/v projection (`c_attn`),
multi-head attention (as many KV heads as query heads) and a GELU MLP. Parameter names mirror
Hugging Face's without the `transformer.` prefix; Hugging Face's `Conv1D` weights are transposed
into `nn.Linear`'s layout when loaded (`minipaged.checkpoint.weight_names`).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from minipaged.checkpoint.model_config import ModelConfig
from minipaged.models.layers import AttentionBackend, CausalLM, Linear, check_flat_batch
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
        self.c_attn = Linear(config.hidden_size, 3 * width)
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
        self.c_fc = Linear(config.hidden_size, inner)
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
        check_flat_batch(self.config, input_ids, positions)
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            x = block(x, attn)
        return self.ln_f(x)

    def input_embedding(self) -> nn.Embedding:
        return self.wte
