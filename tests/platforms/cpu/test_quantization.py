"""Weight-only int8 (`minipaged.platforms.cpu.quantization`): `quantize_model` makes every
`nn.Linear` an `Int8Linear` without a float copy of its weight (a tied head's embedding an
`Int8Embedding` over the same int8 values), and the quantised model computes what the float
model holding the dequantised weights computes, through PyTorch's GEMM and through the few-row
kernel alike. What it cannot take (another scheme, bfloat16, a tensor-parallel shard, a weight
off the CPU) is refused by name; an int8 engine generates and gives every block back.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tiny_models import dense_last_logits, tiny_engine, tiny_llama_parts
from torch import nn

from minipaged.engine.config import EngineConfig
from minipaged.kernels.cpu.gemv import gemv_available
from minipaged.models.llama import LlamaForCausalLM
from minipaged.models.tensor_parallel import TensorParallel
from minipaged.platforms.cpu.linear import Int8Linear, choose_few_rows
from minipaged.platforms.cpu.modules import Int8Embedding
from minipaged.platforms.cpu.quantization import (
    GROUP_SIZE,
    QUANTIZATIONS,
    group_size_for,
    quantize_model,
)
from minipaged.sampling.params import SamplingParams

TOKENS = [5, 17, 3, 59, 42, 7, 1, 8, 9, 11, 12]


@pytest.mark.parametrize("tied", [True, False])
def test_an_int8_model_is_the_float_model_of_its_dequantised_weights(tied):
    model, _ = tiny_llama_parts(tie_word_embeddings=tied)
    quantized = copy.deepcopy(model)
    linears = [name for name, m in quantized.named_modules() if type(m) is nn.Linear]
    quantize_model(quantized, "int8", group_size=16)
    assert [n for n, m in quantized.named_modules() if isinstance(m, Int8Linear)] == linears
    for name in linears:
        module = quantized.get_submodule(name)
        assert not hasattr(module, "weight") and module.int8.group_size == 16, name  # no float
    if tied:
        embedding = quantized.input_embedding()
        assert isinstance(embedding, Int8Embedding)
        assert embedding.int8 is quantized.lm_head.int8  # one int8 matrix for both
        assert all(p.dim() == 1 for p in quantized.parameters())  # only norms stay float
    else:
        assert type(quantized.input_embedding()) is nn.Embedding
    reference = copy.deepcopy(model)  # the float model holding exactly the int8 values
    with torch.no_grad():
        for name in linears:
            reference.get_submodule(name).weight.copy_(
                quantized.get_submodule(name).int8.dequantize())
    expected = dense_last_logits(reference, TOKENS)
    torch.testing.assert_close(dense_last_logits(quantized, TOKENS), expected,
                               atol=1e-5, rtol=1e-5)  # dequantise-then-GEMM
    if gemv_available():
        for name in linears:
            choose_few_rows(quantized.get_submodule(name), 8)
        torch.testing.assert_close(dense_last_logits(quantized, TOKENS), expected,
                                   atol=1e-5, rtol=1e-5)  # the kernel, 8 rows at a time


@given(st.integers(1, 4096), st.sampled_from([16, 32, GROUP_SIZE]))
def test_a_group_size_is_used_only_where_it_divides_the_features(in_features, group_size):
    chosen = group_size_for(in_features, group_size)
    assert chosen == (group_size if in_features % group_size == 0 else None)


def test_what_int8_cannot_take_is_refused_by_name():
    for scheme in QUANTIZATIONS:
        EngineConfig(quantization=scheme)  # what the engine takes is what quantize_model does
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(quantization="int8", tensor_parallel_size=2, device="cpu")
    model, config = tiny_llama_parts()
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize_model(model, "fp8")
    with pytest.raises(ValueError, match="dtype must be float32"):
        quantize_model(copy.deepcopy(model).to(torch.bfloat16), "int8")
    with pytest.raises(ValueError, match="one rank"):
        quantize_model(LlamaForCausalLM(config, TensorParallel(0, 2)), "int8")
    with pytest.raises(ValueError, match="int8 weights run on the CPU; layers.0.self_attn.q_proj "
                                         "is on meta"):
        quantize_model(copy.deepcopy(model).to("meta"), "int8")


def test_an_int8_engine_generates_and_drains():
    parts = tiny_llama_parts()
    engine = tiny_engine(parts, device="cpu", num_gpu_blocks=64, quantization="int8")
    assert any(isinstance(m, Int8Linear) for m in engine.runner.model.modules())
    engine.add_request(None, [1, 2, 3, 4], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.add_request(None, [9, 8], SamplingParams(max_tokens=3, ignore_eos=True))
    finals = engine.run_until_done(use_tqdm=False)
    assert sorted(len(f.outputs[0].token_ids) for f in finals.values()) == [3, 5]
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_gpu_blocks
