"""The CPU's small modules (`minipaged.platforms.cpu.modules`) against the model's own.

Each is a subclass of the module of `minipaged.models.layers` it is swapped in for, with the
same parameters, and must give that module's result: the rotary and the embedding's look-up
bit for bit, the residual add before a norm bit for bit (PyTorch's add), the norm and SwiGLU's
activation within the roundings their kernels document (a sum in another order, the C
library's exponential: a few units in the last place of float32, two bfloat16 steps). Inputs
are drawn with hypothesis: row counts, widths and head sizes that are and are not multiples of
a vector, strided rows (a fused projection's), magnitudes. Where the kernel does not take an
input (gradients wanted) the model's forward runs. Each module's kernel calls are recorded by a
capture (`replay`): a replay over new values written into the same inputs gives the eager
module's result. The int8 embedding looks up the rows of its int8 weights, dequantised.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from native_kernels import NEEDS_COMPILER
from tiny_models import dense_last_logits, tiny_llama_parts
from torch import Tensor, nn

from minipaged.kernels.cpu.gemv import quantize_int8
from minipaged.models.checkpoint.model_config import ModelConfig
from minipaged.models.layers import RMSNorm, RotaryEmbedding, SiluAndMul
from minipaged.models.registry import FAMILIES
from minipaged.platforms.cpu.modules import (
    CPUEmbedding,
    CPURMSNorm,
    CPURotaryEmbedding,
    CPUSiluAndMul,
    Int8Embedding,
)
from minipaged.platforms.cpu.replay import capture

pytestmark = NEEDS_COMPILER

DTYPES = st.sampled_from([torch.float32, torch.bfloat16])
# The norm and SiLU-and-multiply: a few units in the last place (float32), two steps (bfloat16).
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5),
             torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2)}


def swapped(module: nn.Module, cls: type) -> nn.Module:
    module.__class__ = cls
    return module


def norm_pair(width: int, dtype: torch.dtype, seed: int) -> tuple[RMSNorm, CPURMSNorm]:
    torch.manual_seed(seed)
    plain = RMSNorm(width, 1e-6)
    with torch.no_grad():
        plain.weight.uniform_(0.5, 1.5)
    plain = plain.to(dtype)
    fast = swapped(RMSNorm(width, 1e-6).to(dtype), CPURMSNorm)
    fast.load_state_dict(plain.state_dict())
    return plain, fast


@settings(max_examples=40, deadline=None)
@given(dtype=DTYPES, rows=st.integers(1, 9), width=st.sampled_from([2, 7, 16, 64, 576]),
       scale=st.sampled_from([1e-3, 1.0, 300.0]), add=st.booleans(), seed=st.integers(0, 2**16))
def test_the_norm_is_the_models_and_adds_the_residual_in_place(dtype, rows, width, scale, add,
                                                               seed):
    plain, fast = norm_pair(width, dtype, seed)
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, width, generator=gen) * scale).to(dtype)
    residual = (torch.randn(rows, width, generator=gen) * scale).to(dtype)
    with torch.inference_mode():
        if not add:
            torch.testing.assert_close(fast(x), plain(x), **TOLERANCE[dtype])
            return
        expected, expected_stream = plain(x, residual.clone())
        stream = residual.clone()
        normed, new_stream = fast(x, stream)
    assert new_stream is stream  # updated in place: the model hands the next norm this one
    assert torch.equal(new_stream, expected_stream)  # PyTorch's add, bit for bit
    torch.testing.assert_close(normed, expected, **TOLERANCE[dtype])


def rotary_config(head_dim: int, theta: float) -> ModelConfig:
    return ModelConfig(family=FAMILIES["llama"], vocab_size=8, hidden_size=head_dim * 2,
                       num_layers=1, num_heads=2, num_kv_heads=1, head_dim=head_dim,
                       intermediate_size=8, max_position_embeddings=128, rope_theta=theta)


@settings(max_examples=40, deadline=None)
@given(dtype=DTYPES, tokens=st.integers(1, 9), heads=st.integers(1, 4),
       kv_heads=st.integers(1, 2), head_dim=st.sampled_from([2, 6, 8, 16, 64]),
       fused=st.booleans(), theta=st.sampled_from([10000.0, 500.0]), seed=st.integers(0, 2**16))
def test_the_rotary_is_the_models_to_the_bit(dtype, tokens, heads, kv_heads, head_dim, fused,
                                             theta, seed):
    config = rotary_config(head_dim, theta)
    plain, fast = RotaryEmbedding(config), swapped(RotaryEmbedding(config), CPURotaryEmbedding)
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 128, (tokens,), generator=gen)
    width = (heads + kv_heads) * head_dim
    if fused:  # q and k as views of one projection's rows (rows strided)
        qk = torch.randn(tokens, width + 3, generator=gen).to(dtype)
        q = qk[:, :heads * head_dim].view(tokens, heads, head_dim)
        k = qk[:, heads * head_dim:width].view(tokens, kv_heads, head_dim)
    else:
        q = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
        k = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype)
    with torch.inference_mode():
        ours, theirs = fast(positions, q, k), plain(positions, q, k)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == dtype and torch.equal(a, b)


@settings(max_examples=30, deadline=None)
@given(dtype=DTYPES, rows=st.integers(1, 9), width=st.sampled_from([1, 7, 16, 96]),
       fused=st.booleans(), scale=st.sampled_from([0.1, 1.0, 20.0]), seed=st.integers(0, 2**16))
def test_the_swiglu_activation_is_the_models(dtype, rows, width, fused, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    if fused:  # the halves of one projection's output
        gate, up = (torch.randn(rows, 2 * width, generator=gen) * scale).to(dtype).chunk(2, -1)
    else:
        gate, up = ((torch.randn(rows, width, generator=gen) * scale).to(dtype) for _ in "gu")
    with torch.inference_mode():
        ours = swapped(SiluAndMul(), CPUSiluAndMul)(gate, up)
    torch.testing.assert_close(ours, SiluAndMul()(gate, up), **TOLERANCE[dtype])


@settings(max_examples=20, deadline=None)
@given(dtype=DTYPES, tokens=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_the_embedding_looks_its_rows_up_to_the_bit(dtype, tokens, seed):
    torch.manual_seed(seed)
    plain = nn.Embedding(50, 24).to(dtype)
    fast = swapped(nn.Embedding(50, 24).to(dtype), CPUEmbedding)
    fast.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 50, (tokens,))
    with torch.inference_mode():
        assert torch.equal(fast(ids), plain(ids))


@pytest.mark.parametrize("group_size", [None, 8])
def test_the_int8_embedding_looks_up_its_dequantised_rows(group_size):
    weight = torch.randn(50, 24)
    int8 = quantize_int8(weight, group_size)
    embedding = Int8Embedding(int8, torch.float32)
    assert (embedding.num_embeddings, embedding.embedding_dim) == (50, 24)
    ids = torch.tensor([3, 0, 49, 3, 17])
    with torch.inference_mode():
        torch.testing.assert_close(embedding(ids), F.embedding(ids, int8.dequantize()),
                                   atol=0, rtol=0)
    assert embedding(ids).dtype == torch.float32
    assert list(embedding.parameters()) == []  # no float copy of the matrix


def test_where_gradients_are_wanted_the_models_forward_runs():
    plain, fast = norm_pair(16, torch.float32, 0)
    x = torch.randn(3, 16, requires_grad=True)
    fast(x).sum().backward()  # the kernels have no backward: this is PyTorch's
    assert x.grad is not None and fast.weight.grad is not None
    gate = torch.randn(3, 8, requires_grad=True)
    swapped(SiluAndMul(), CPUSiluAndMul)(gate, torch.randn(3, 8)).sum().backward()
    assert gate.grad is not None


def test_a_model_of_the_cpu_modules_computes_what_the_plain_one_does():
    """All of them at once, in a model: the same logits as the plain model up to rounding."""
    model, _ = tiny_llama_parts()
    fast, _ = tiny_llama_parts()
    for module in fast.modules():
        cls = {RMSNorm: CPURMSNorm, RotaryEmbedding: CPURotaryEmbedding,
               SiluAndMul: CPUSiluAndMul, nn.Embedding: CPUEmbedding}.get(type(module))
        if cls is not None:
            module.__class__ = cls
    tokens = [5, 17, 3, 59, 42, 7]
    torch.testing.assert_close(dense_last_logits(fast, tokens), dense_last_logits(model, tokens),
                               atol=1e-5, rtol=1e-5)


def replays_like_eager(forward: Callable[[], Any], inputs: list[Tensor],
                       new_values: Callable[[Tensor, torch.Generator], Tensor]) -> None:
    """Capture `forward`, write new values into its inputs, replay: the eager result."""
    replay, out = capture(forward)
    outs = out if isinstance(out, tuple) else (out,)
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        for tensor in inputs:
            tensor.copy_(new_values(tensor, gen))
        with torch.inference_mode():
            replay.run()
            expected = forward()
        expected = expected if isinstance(expected, tuple) else (expected,)
        for a, b in zip(outs, expected, strict=True):
            assert torch.equal(a, b)


def test_each_module_is_captured_and_replays_over_new_inputs():
    def normal(t: Tensor, gen: torch.Generator) -> Tensor:
        return torch.randn(t.shape, generator=gen).to(t.dtype)

    def ids(t: Tensor, gen: torch.Generator) -> Tensor:
        return torch.randint(0, 50, t.shape, generator=gen)

    _, norm = norm_pair(16, torch.float32, 0)
    x = torch.randn(3, 16)
    replays_like_eager(lambda: norm(x), [x], normal)
    rotary = swapped(RotaryEmbedding(rotary_config(8, 10000.0)), CPURotaryEmbedding)
    q, k, positions = torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.tensor([0, 5, 9])
    replays_like_eager(lambda: rotary(positions, q, k), [q, k, positions],
                       lambda t, g: ids(t, g) if t is positions else normal(t, g))
    gate, up = torch.randn(3, 8), torch.randn(3, 8)
    act = swapped(SiluAndMul(), CPUSiluAndMul)
    replays_like_eager(lambda: act(gate, up), [gate, up], normal)
    embedding = swapped(nn.Embedding(50, 8), CPUEmbedding)
    tokens = torch.tensor([1, 2, 3])
    replays_like_eager(lambda: embedding(tokens), [tokens], ids)
    int8 = Int8Embedding(quantize_int8(torch.randn(50, 8)), torch.float32)
    replays_like_eager(lambda: int8(tokens), [tokens], ids)
