"""Weight-only int8: a model's linear layers (and its token embedding) quantised at load.

A decode step of one request reads every weight once, so its time is the weights' bytes over the
memory's bandwidth; int8 weights are a quarter of float32's bytes. `quantize_model` turns every
`Linear` of a loaded model into int8 values with a float32 scale per group of `group_size` input
features of each output row (`minipaged.kernels.cpu.gemv.quantize_int8`) and drops its float weight;
the CPU's GEMV kernel multiplies them, dequantising in registers, and more rows than it takes
dequantise a layer's weight for PyTorch's GEMM (`Linear.forward`). Activations, norms and the KV
cache stay float32: only the weights are rounded.

A tied head shares the token embedding's matrix: both become one `Int8Weight`, the embedding
looking its rows up and dequantising just those (`Int8Embedding`), so no float copy of the
vocabulary's 49152 x 576 matrix is kept either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minipaged.kernels.cpu.gemv import Int8Weight, quantize_int8
from minipaged.models.layers import CausalLM, Linear
from minipaged.models.weight_layout import lay_out_weights

QUANTIZATIONS = ("int8",)  # what `quantize_model` (and `EngineConfig.quantization`) takes
GROUP_SIZE = 64  # input features per scale (a divisor of the hidden sizes models use)


class Int8Embedding(nn.Module):
    """A token embedding over int8 rows: looks the ids' rows up and dequantises only those."""

    def __init__(self, weight: Int8Weight, dtype: torch.dtype) -> None:
        super().__init__()
        self.int8, self.dtype = weight, dtype
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, input_ids: Tensor) -> Tensor:
        data = F.embedding(input_ids, self.int8.data).float()
        scales = F.embedding(input_ids, self.int8.scales)
        rows = data.view(*data.shape[:-1], scales.shape[-1], -1) * scales[..., None]
        return rows.view(data.shape).to(self.dtype)


def group_size_for(in_features: int, group_size: int = GROUP_SIZE) -> int | None:
    """`group_size` where it divides `in_features`, else one scale per row (None)."""
    return group_size if in_features % group_size == 0 else None


def quantize_model(model: CausalLM, quantization: str, group_size: int = GROUP_SIZE) -> None:
    """Quantise `model`'s weights in place (`quantization`: one of `QUANTIZATIONS`): every
    `Linear` gets its `int8` weights and loses its float `weight` (a tied head keeps the
    embedding's, which becomes an `Int8Embedding` sharing the head's int8 weights). For a CPU
    model on one rank; raises ValueError otherwise, naming what does not fit."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    embedding = model.input_embedding()
    if not isinstance(embedding, nn.Embedding):
        raise ValueError("int8 quantisation takes a model on one rank (not tensor-parallel)")
    tied = model.lm_head.weight is embedding.weight
    dtype = embedding.weight.dtype
    if dtype != torch.float32:
        raise ValueError(f"int8 weights take float32 activations: dtype must be float32, got "
                         f"{dtype}")
    for name, module in list(model.named_modules()):
        if not isinstance(module, Linear) or module.int8 is not None:
            continue
        weight = module.weight
        if weight.device.type != "cpu":
            raise ValueError(f"int8 weights run on the CPU; {name} is on {weight.device}")
        module.int8 = quantize_int8(weight, group_size_for(weight.shape[1], group_size))
        module.few_rows = None  # chosen again by `choose_gemms`, for the int8 weights
        if not (tied and module is model.lm_head):
            module.weight = None  # the int8 values stand for it: no float copy is kept
    if tied:
        int8_embedding = Int8Embedding(model.lm_head.int8, dtype)
        model.lm_head.weight = None
        for name, module in model.named_modules():
            if module is embedding:
                model.set_submodule(name, int8_embedding)
                break
    lay_out_weights(model)  # the int8 weights in one buffer too; the float one is freed
