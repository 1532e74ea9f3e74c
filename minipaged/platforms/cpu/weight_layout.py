"""A CPU model's weights in one buffer on huge pages, in the order a step reads them.

A decode step of one request reads every weight once, layer after layer, so on a CPU its time is
the weights' bytes over the memory's read rate. `lay_out_weights` copies every weight of a model
into one buffer (`huge_page_buffer`), back to back in the order its modules are registered (a
layer's norms and projections in the order its forward reads them, the layers in order), each
on a cache line (`ALIGNMENT`): a step reads one stream from its first layer to its last, as
llama.cpp reads its one weight buffer, through a TLB entry per 2 MiB instead of per 4 KiB.
`benchmarks/cpu/roofline.py` measures the step against the machine's read rate.

The weights are views into that buffer, given to each module as new objects (`module.weight =
...`) at load, before any kernel call is bound to them; tied weights stay one object. Int8 weights
(`Int8Weight`) go in too, each one's scales right after its values.
"""

from __future__ import annotations

import dataclasses

from torch import Tensor, nn

from minipaged.kernels.cpu.gemv import Int8Weight
from minipaged.kernels.cpu.pages import huge_page_buffer

# Bytes each weight starts on: a cache line, the kernels' vector loads then never span two.
ALIGNMENT = 64


def _held(model: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter | Int8Weight]]:
    """(module, field, what it holds) for every parameter and `Int8Weight` of `model`, in
    module registration order."""
    held = []
    for module in model.modules():
        held += [(module, name, p) for name, p in module.named_parameters(recurse=False)]
        held += [(module, name, v) for name, v in vars(module).items()
                 if isinstance(v, Int8Weight)]
    return held


def _tensors(value: nn.Parameter | Int8Weight) -> list[Tensor]:
    return [value.data, value.scales] if isinstance(value, Int8Weight) else [value]


def _copied(value: nn.Parameter | Int8Weight,
            copies: dict[int, Tensor]) -> nn.Parameter | Int8Weight:
    """`value` over the copies of its tensors (`copies`, by the originals' ids)."""
    if isinstance(value, Int8Weight):
        return dataclasses.replace(
            value, data=copies[id(value.data)], scales=copies[id(value.scales)])
    return nn.Parameter(copies[id(value)], requires_grad=value.requires_grad)


def lay_out_weights(model: nn.Module) -> int:
    """Copy every parameter and int8 weight of a CPU `model` into one buffer, in registration
    order, each on a cache line, and give the modules the copies (module docstring); return the
    buffer's bytes. Values, dtypes, shapes and ties are unchanged; the old tensors are freed
    when nothing else holds them. Raises ValueError for a model not wholly on the CPU."""
    held = _held(model)
    originals = list({id(value): value for _, _, value in held}.values())  # ties once
    tensors = [t for value in originals for t in _tensors(value)]
    devices = {t.device.type for t in tensors}
    if devices - {"cpu"}:
        raise ValueError(f"lay_out_weights takes a CPU model, this one is on {sorted(devices)}")
    offsets, size = [], 0
    for tensor in tensors:
        offsets.append(size)
        size += -(-tensor.nbytes // ALIGNMENT) * ALIGNMENT
    raw = huge_page_buffer(size)  # starts on a huge page, so on a cache line
    copies: dict[int, Tensor] = {}
    for tensor, offset in zip(tensors, offsets, strict=True):
        view = raw[offset:offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        copies[id(tensor)] = view.copy_(tensor)
    replacement = {id(value): _copied(value, copies) for value in originals}
    for module, name, value in held:
        setattr(module, name, replacement[id(value)])
    return size
