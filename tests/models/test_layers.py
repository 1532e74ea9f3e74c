"""The models' building blocks in plain PyTorch (`minipaged.models.layers`) and the shape of a
layer that lets a platform capture it.

* `RMSNorm` is Hugging Face's `LlamaRMSNorm`; given the residual stream, it returns the norm of
  the sum and the sum itself (the stream after the sublayer), leaving its inputs alone.
* `RotaryEmbedding` turns q and k as Hugging Face's rotary does, keeps each head's length, and
  makes a rotated query's dot product with a rotated key depend only on their distance; linear
  rope scaling stretches positions by its factor.
* `SiluAndMul` is SwiGLU's `silu(gate) * up`.
* `check_flat_batch` refuses a batch of the wrong shape or dtype on any device, and reads the
  values (token ids, positions) only when asked: a model a runner drives skips it (a device
  sync; the runner checks every batch on the host first).
* Between a LLaMA-family layer's modules there are only views (what lets a platform capture a
  step from the model's own forward): with every module's work marked as the platform's, a
  capture of the forward finds nothing else that computes; GPT-2 computes between its modules.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import SMALL_LLAMA, minipaged_parts, random_hf
from torch import Tensor, nn

from minipaged.models.checkpoint.model_config import ModelConfig
from minipaged.models.layers import (
    ModelInputError,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    check_flat_batch,
    check_input_ranges,
)
from minipaged.models.registry import FAMILIES
from minipaged.platforms.cpu.replay import CaptureError, capture, platform_code

transformers = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama as hf_llama  # noqa: E402

DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


def config_of(head_dim: int = 8, theta: float = 10000.0,
              scaling: dict[str, Any] | None = None) -> ModelConfig:
    return ModelConfig(family=FAMILIES["llama"], vocab_size=64, hidden_size=32, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=head_dim, intermediate_size=64,
                       max_position_embeddings=512, rope_theta=theta, rope_scaling=scaling)


@settings(max_examples=30, deadline=None)
@given(dtype=DTYPES, rows=st.integers(1, 6), width=st.sampled_from([4, 32, 96]),
       eps=st.sampled_from([1e-6, 1e-5]), scale=st.sampled_from([1e-2, 1.0, 100.0]),
       seed=st.integers(0, 2**16))
def test_rms_norm_is_hugging_faces_and_adds_the_residual_first(dtype, rows, width, eps, scale,
                                                               seed):
    gen = torch.Generator().manual_seed(seed)
    ours, theirs = RMSNorm(width, eps), hf_llama.LlamaRMSNorm(width, eps)
    weight = torch.rand(width, generator=gen) + 0.5
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    x = (torch.randn(rows, width, generator=gen) * scale).to(dtype)
    residual = (torch.randn(rows, width, generator=gen) * scale).to(dtype)
    kept = (x.clone(), residual.clone())
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))
        normed, stream = ours(x, residual)
        assert torch.equal(stream, x + residual)  # the stream after the sublayer
        assert torch.equal(normed, theirs(x + residual))
    assert torch.equal(x, kept[0]) and torch.equal(residual, kept[1])  # inputs left alone


def hf_rotary(config: ModelConfig, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, ...]:
    hf_config = transformers.LlamaConfig(
        hidden_size=config.hidden_size, num_attention_heads=config.num_heads,
        head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
        rope_theta=config.rope_theta)
    cos, sin = hf_llama.LlamaRotaryEmbedding(hf_config)(q, positions)
    return hf_llama.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)


@settings(max_examples=30, deadline=None)
@given(dtype=DTYPES, tokens=st.integers(1, 6), head_dim=st.sampled_from([2, 8, 16, 64]),
       theta=st.sampled_from([10000.0, 500000.0]), seed=st.integers(0, 2**16))
def test_the_rotary_is_hugging_faces(dtype, tokens, head_dim, theta, seed):
    config = config_of(head_dim, theta)
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    q = torch.randn(tokens, 4, head_dim, generator=gen).to(dtype)
    k = torch.randn(tokens, 2, head_dim, generator=gen).to(dtype)
    ours = RotaryEmbedding(config)(positions, q, k)
    theirs = hf_rotary(config, positions, q, k)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else {}
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, **tolerance)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(0, 200), n=st.integers(0, 200), shift=st.integers(0, 300),
       head_dim=st.sampled_from([2, 8, 64]), seed=st.integers(0, 2**16))
def test_a_rotated_dot_product_depends_only_on_the_distance(m, n, shift, head_dim, seed):
    rotary = RotaryEmbedding(config_of(head_dim))
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 1, 1, head_dim, generator=gen)

    def score(at_q: int, at_k: int) -> Tensor:
        rq, _ = rotary(torch.tensor([at_q]), q, q)
        _, rk = rotary(torch.tensor([at_k]), k, k)
        return (rq * rk).sum()

    torch.testing.assert_close(score(m + shift, n + shift), score(m, n), atol=1e-4, rtol=1e-4)
    rq, _ = rotary(torch.tensor([m]), q, q)
    torch.testing.assert_close(rq.norm(), q.norm())  # a rotation keeps each head's length


@given(position=st.integers(0, 127), factor=st.sampled_from([2, 4]))
def test_linear_rope_scaling_stretches_positions_by_its_factor(position, factor):
    plain = RotaryEmbedding(config_of())
    scaled = RotaryEmbedding(config_of(scaling={"rope_type": "linear", "factor": float(factor)}))
    q = torch.randn(1, 1, 8)
    torch.testing.assert_close(scaled(torch.tensor([position * factor]), q, q)[0],
                               plain(torch.tensor([position]), q, q)[0], atol=1e-5, rtol=1e-4)


def test_one_rotary_module_serves_every_layer_of_a_llama():
    model, _ = minipaged_parts(random_hf("llama", **SMALL_LLAMA))
    rotaries = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    assert len(rotaries) == 1
    assert all(layer.self_attn.rotary is rotaries[0] for layer in model.layers)


@settings(max_examples=20, deadline=None)
@given(dtype=DTYPES, rows=st.integers(1, 5), width=st.sampled_from([1, 8, 64]),
       seed=st.integers(0, 2**16))
def test_silu_and_mul_is_swiglus_activation(dtype, rows, width, seed):
    gen = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(rows, width, generator=gen).to(dtype) for _ in "gu")
    expected = (gate.double() * torch.sigmoid(gate.double()) * up.double())
    tolerance = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2,
                                                                               rtol=1.6e-2)
    torch.testing.assert_close(SiluAndMul()(gate, up).double(), expected, **tolerance)


def test_a_flat_batch_of_the_wrong_shape_or_dtype_is_refused_on_any_device():
    config = config_of()
    ids = torch.tensor([1, 2, 3])
    for device in ("cpu", "meta"):
        good = ids.to(device)
        check_flat_batch(config, good, good, values=device == "cpu")  # meta's cannot be read
        with pytest.raises(ModelInputError, match="must both be"):
            check_flat_batch(config, good[None], good[None])
        with pytest.raises(ModelInputError, match="must both be"):
            check_flat_batch(config, good, good[:2])
        with pytest.raises(ModelInputError, match="int64"):
            check_flat_batch(config, good.int(), good)
        with pytest.raises(ModelInputError, match="empty"):
            check_flat_batch(config, good[:0], good[:0])


def test_values_are_read_only_when_asked():
    """A batch's ranges are checked unless `values` is False (a runner's model: reading them
    would be a sync, and the runner checks them on the host first): a meta batch, whose values
    cannot be read, then passes."""
    config = config_of()
    for ids, positions, message in (([0, 64], [0, 1], "token id"), ([-1], [0], "token id"),
                                    ([3, 4], [0, 512], "position"), ([3], [-1], "position")):
        ids, positions = torch.tensor(ids), torch.tensor(positions)
        with pytest.raises(ModelInputError, match=f"{message} out of range"):
            check_flat_batch(config, ids, positions)
        with pytest.raises(ModelInputError, match=f"{message} out of range"):
            check_input_ranges(config, (int(ids.min()), int(ids.max())),
                               (int(positions.min()), int(positions.max())))
        check_flat_batch(config, ids, positions, values=False)
        check_flat_batch(config, ids.to("meta"), positions.to("meta"), values=False)
    check_input_ranges(config, (0, 63), (0, 511))


class MarkedAttention:
    """Attention as a platform's: its work is the platform's code (here: zeros)."""

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        with platform_code():
            return torch.zeros_like(q)


def mark_modules_as_platform_code(model: nn.Module) -> None:
    """Every module of the kinds a platform swaps runs as platform code: a capture then sees
    only what the model does between them."""
    stack: list[contextlib.AbstractContextManager] = []

    def enter(module: nn.Module, args: Any) -> None:
        stack.append(platform_code())
        stack[-1].__enter__()

    def leave(module: nn.Module, args: Any, out: Any) -> None:
        stack.pop().__exit__(None, None, None)

    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Embedding | RMSNorm | RotaryEmbedding | SiluAndMul):
            module.register_forward_pre_hook(enter)
            module.register_forward_hook(leave)


@pytest.mark.parametrize(("family", "extra"), [
    ("llama", {}), ("qwen2", {}), ("qwen3", {"head_dim": 16}), ("mistral", {}),
    ("llama", {"tie_word_embeddings": True}),
])
def test_between_a_llama_layers_modules_there_are_only_views(family, extra):
    model, _ = minipaged_parts(random_hf(family, **(SMALL_LLAMA | extra)))
    mark_modules_as_platform_code(model)
    ids, positions = torch.tensor([1, 7, 3]), torch.tensor([0, 4, 9])
    _, logits = capture(lambda: model.compute_logits(model(ids, positions, MarkedAttention())))
    assert logits.shape == (3, 64)


def test_gpt2_computes_between_its_modules():
    model, _ = minipaged_parts(random_hf("gpt2", vocab_size=64, n_embd=32, n_layer=1, n_head=4,
                                         bos_token_id=0, eos_token_id=0))
    mark_modules_as_platform_code(model)
    ids = torch.tensor([1, 2])
    with pytest.raises(CaptureError, match="computes outside the platform's modules"):
        capture(lambda: model(ids, torch.tensor([0, 1]), MarkedAttention()))


def test_a_norm_over_each_head_keeps_the_heads_apart():
    """Qwen3's q/k norms normalise each head of `[T, H, D]` on its own (over D)."""
    norm = RMSNorm(8, 1e-6)
    q = torch.randn(3, 4, 8)
    with torch.no_grad():
        per_head = norm(q)
        torch.testing.assert_close(per_head[:, 2], norm(q[:, 2].contiguous()))
        torch.testing.assert_close(per_head, q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True)
                                                             + 1e-6))
