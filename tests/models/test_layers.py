"""The models' linear layers on the CPU's few-row kernel, and weight-only int8 models.

`Linear` and `LinearGroup` take the GEMV kernel at the rows `choose_gemms` measured it faster
for (forced here to its whole range, so the test does not depend on this machine's timings) and
PyTorch's GEMM above; both must give `F.linear`'s results. A model's forward pass over a few
rows equals the one without the kernel. `quantize_model`
leaves no float copy of a quantised weight, and the int8 model equals the float model holding
the dequantised weights (the kernel and the dequantise-then-GEMM path agree, and the tied
embedding looks its rows up from the same int8 values).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import dense_last_logits, force_kernel, tiny_engine, tiny_llama_parts

from minipaged.engine.config import EngineConfig
from minipaged.kernels.cpu.gemv import gemv_available
from minipaged.models.layers import Linear, LinearGroup, RMSNorm, VersionedWeights
from minipaged.models.quantization import Int8Embedding, quantize_model
from minipaged.sampling.params import SamplingParams

pytestmark = pytest.mark.skipif(not gemv_available(), reason="needs a C compiler")


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 12), st.sampled_from([torch.float32, torch.bfloat16]), st.booleans(),
       st.integers(0, 2**16))
def test_a_group_equals_its_layers_on_f_linear(rows, dtype, bias, seed):
    torch.manual_seed(seed)
    layers = [Linear(48, n, bias=bias).to(dtype) for n in (48, 16, 16)]
    group = LinearGroup(*layers)
    owner = torch.nn.Module()
    owner.group = group
    for i, layer in enumerate(layers):
        owner.add_module(f"l{i}", layer)
    assert force_kernel(owner, max_rows=8) == 4
    x = torch.randn(rows, 48).to(dtype)
    with torch.inference_mode():
        outs = group(x)
        singles = [layer(x) for layer in layers]
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
    for out, single, layer in zip(outs, singles, layers, strict=True):
        expected = F.linear(x.float(), layer.weight.float(),
                            None if layer.bias is None else layer.bias.float())
        torch.testing.assert_close(out.float(), expected, **tol)
        torch.testing.assert_close(single.float(), expected, **tol)


def test_autograd_takes_f_linear():
    layer = Linear(16, 8)
    force_kernel(layer)
    x = torch.randn(2, 16, requires_grad=True)
    layer(x).sum().backward()  # the kernel has no backward: this must be F.linear's
    assert x.grad is not None and layer.weight.grad is not None


def test_a_replaced_weight_is_multiplied_not_the_planned_one():
    layer = Linear(16, 8, bias=False)
    force_kernel(layer)
    layer.weight = torch.nn.Parameter(torch.randn(8, 16))
    x = torch.randn(1, 16)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight))


def test_choose_gemms_measures_fetching_ahead_at_start_up_not_in_a_step(monkeypatch):
    import minipaged.models.layers as layers
    from minipaged.kernels.cpu.gemv import quantize_int8

    asked = []
    monkeypatch.setattr(layers, "fetch_ahead", lambda dtype, rows: asked.append((dtype, rows)))
    model = torch.nn.Sequential(Linear(64, 32, bias=False))
    model[0].int8 = quantize_int8(model[0].weight.detach(), 64)  # int8: always a few-row path
    layers.choose_gemms(model)
    assert model[0].few_rows is not None
    assert sorted(asked) == [(torch.int8, rows) for rows in layers.FETCH_AHEAD_ROWS]


def test_the_weight_generation_counts_weights_and_plans_given_not_weights_written():
    linear, norm = Linear(4, 3, bias=True), RMSNorm(4, 1e-6)
    group = LinearGroup(linear, Linear(4, 2))
    before = VersionedWeights.generation
    with torch.no_grad():
        linear.weight.add_(1.0)  # in place: a bound call reads it already
        norm.weight.mul_(2.0)
    linear.in_features = 4  # not a weight or a plan
    assert VersionedWeights.generation == before
    linear.weight = torch.nn.Parameter(torch.zeros(3, 4))
    linear.bias = None
    linear.int8 = None
    norm.weight = torch.nn.Parameter(torch.ones(4))
    linear.few_rows = None  # a plan: `choose_gemms` planned again
    group.path = None
    assert VersionedWeights.generation == before + 6


def test_the_kernel_leaves_the_models_logits_alone():
    model, config = tiny_llama_parts()
    tokens = [5, 17, 3, 59, 42, 7]
    without = dense_last_logits(model, tokens)
    force_kernel(model)
    torch.testing.assert_close(dense_last_logits(model, tokens), without, atol=1e-4, rtol=1e-4)


def test_int8_model_equals_the_float_model_of_its_dequantised_weights():
    model, config = tiny_llama_parts(tie_word_embeddings=True)
    quantized = copy.deepcopy(model)
    quantize_model(quantized, "int8", group_size=16)
    assert isinstance(quantized.input_embedding(), Int8Embedding)
    for name, module in quantized.named_modules():
        if isinstance(module, Linear):
            assert module.weight is None and module.int8 is not None, name  # no float copy
    # The float model holding exactly the int8 values' weights.
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for (_, module), (_, q) in zip(reference.named_modules(), quantized.named_modules(),
                                          strict=True):
            if isinstance(module, Linear):
                module.weight.copy_(q.int8.dequantize())
    tokens = [5, 17, 3, 59, 42, 7, 1, 8, 9, 11, 12]
    expected = dense_last_logits(reference, tokens)
    torch.testing.assert_close(dense_last_logits(quantized, tokens), expected,
                               atol=1e-4, rtol=1e-4)  # dequantise-then-GEMM, before the choice
    force_kernel(quantized, max_rows=8)
    torch.testing.assert_close(dense_last_logits(quantized, tokens), expected,
                               atol=1e-4, rtol=1e-4)  # the kernel, 8 rows at a time


def test_an_int8_engine_generates_and_drains():
    parts = tiny_llama_parts()
    quantize_model(parts[0], "int8")
    engine = tiny_engine(parts, device="cpu", num_gpu_blocks=64)
    engine.add_request(None, [1, 2, 3, 4], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.add_request(None, [9, 8], SamplingParams(max_tokens=3, ignore_eos=True))
    finals = engine.run_until_done(use_tqdm=False)
    assert sorted(len(f.outputs[0].token_ids) for f in finals.values()) == [3, 5]
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_gpu_blocks


def test_quantization_refusals_name_the_field():
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(quantization="int8", tensor_parallel_size=2, device="cpu")
    model, _ = tiny_llama_parts()
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize_model(model, "fp8")
    with pytest.raises(ValueError, match="dtype must be float32"):
        quantize_model(model.to(torch.bfloat16), "int8")


@pytest.mark.parametrize("groups_win", [True, False])
def test_a_layer_whose_group_takes_few_rows_is_given_none_of_its_own(monkeypatch, groups_win):
    """`choose_gemms` probes a group's weights together; its layers' few rows are the group's
    call, so they are probed alone (and given a path) only where the group has none."""
    import minipaged.models.layers as layers_module

    probed: list[tuple] = []

    def limit(shapes, dtype, rival, prepare=None):  # the kernel wins 4 rows, groups as asked
        probed.append(shapes)
        return 4 if groups_win or len(shapes) == 1 else 0

    monkeypatch.setattr(layers_module, "gemv_row_limit", limit)
    model, _ = tiny_llama_parts()
    layers_module.choose_gemms(model)
    groups = [v for m in model.modules() for v in vars(m).values() if isinstance(v, LinearGroup)]
    assert groups
    for group in groups:
        assert (group.path is not None) == groups_win
        for layer in group.layers:
            assert (layer.few_rows is None) == groups_win
    alone = [m for m in model.modules() if isinstance(m, Linear)
             and not any(m in g.layers for g in groups)]
    assert alone and all(m.few_rows is not None and m.few_rows.max_rows == 4 for m in alone)
    assert len(probed) == len(groups) + len(alone) + (0 if groups_win else sum(
        len(group.layers) for group in groups))
