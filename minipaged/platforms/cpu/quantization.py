"""Weight-only int8: a model's linear layers (and its token embedding) quantised at load.

A decode step of one request reads every weight once, so its time is the weights' bytes over the
memory's bandwidth; int8 weights are a quarter of float32's bytes. `quantize_model` makes every
`nn.Linear` of a loaded model an `Int8Linear` (`minipaged.platforms.cpu.linear`), built by
`Int8Linear.from_linear` and put in its place with `set_submodule`: int8 values with a float32
scale per group of `group_size` input features of each output row
(`minipaged.kernels.cpu.gemv.quantize_int8`), its float weight dropped. Activations, norms and
the KV cache stay float32: only the weights are rounded. The model's classes know nothing of
it: the layers are swapped, as gpt-fast swaps `WeightOnlyInt8Linear` in for `nn.Linear`.

A tied head shares the token embedding's matrix: both become one `Int8Weight`, the embedding
looking its rows up and dequantising just those (`Int8Embedding`), so no float copy of the
vocabulary's matrix is kept either.
"""

from __future__ import annotations

import torch
from torch import nn

from minipaged.models.layers import CausalLM
from minipaged.platforms.base import QUANTIZATIONS
from minipaged.platforms.cpu.linear import CPULinear, Int8Linear
from minipaged.platforms.cpu.modules import CPUEmbedding, Int8Embedding

GROUP_SIZE = 64  # input features per scale (a divisor of the hidden sizes models use)


def group_size_for(in_features: int, group_size: int = GROUP_SIZE) -> int | None:
    """`group_size` where it divides `in_features`, else one scale per row (None)."""
    return group_size if in_features % group_size == 0 else None


def quantize_model(model: CausalLM, quantization: str, group_size: int = GROUP_SIZE) -> None:
    """Quantise `model`'s weights in place (`quantization`: one of `QUANTIZATIONS`): every
    `nn.Linear` becomes an `Int8Linear` without a float weight (a tied head's embedding becomes
    an `Int8Embedding` sharing the head's int8 weights). For a float32 CPU model on one rank;
    raises ValueError otherwise, naming what does not fit."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    embedding = model.input_embedding()
    if type(embedding) not in (nn.Embedding, CPUEmbedding):
        raise ValueError("int8 quantisation takes a model on one rank (not tensor-parallel)")
    dtype = embedding.weight.dtype
    if dtype != torch.float32:
        raise ValueError(f"int8 weights take float32 activations: dtype must be float32, got "
                         f"{dtype}")
    tied = model.lm_head.weight is embedding.weight
    for name, module in list(model.named_modules()):
        if type(module) not in (nn.Linear, CPULinear):
            continue
        if module.weight.device.type != "cpu":
            raise ValueError(f"int8 weights run on the CPU; {name} is on {module.weight.device}")
        group = group_size_for(module.weight.shape[1], group_size)
        model.set_submodule(name, Int8Linear.from_linear(module, group))
    if tied:
        name = next(name for name, module in model.named_modules() if module is embedding)
        model.set_submodule(name, Int8Embedding(model.lm_head.int8, dtype))
