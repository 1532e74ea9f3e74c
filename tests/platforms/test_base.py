"""The platform seam (`platforms.base`): the reference platform, `swap_modules`, and
which platform a device and an attention backend get.

The reference platform is the model as written: its `load` leaves every module of its class
and every weight the same object, it quantises nothing, captures nothing (without running the
forward), grants `kv_cache_memory` GiB without profiling, and has no faster greedy sampling; a
runner on it computes the plain model's logits. `swap_modules` changes the class of exactly the
types it is given (a subclass, such as a tensor-parallel layer, keeps its own), in place: the
same objects, parameters, ties and shared modules. `get_platform`: the reference attention
with `enforce_eager` is the reference platform on any device; a CPU otherwise gets the CPU
platform, whose decode sizes are known before it loads anything, capturing unless eager or on
another attention backend.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import cpu_runner, dense_last_logits, plan_of, scheduled, tiny_llama_parts
from torch import nn

from minipaged.attention.reference import REFERENCE_OPS
from minipaged.models.layers import RMSNorm, SiluAndMul
from minipaged.platforms import get_platform
from minipaged.platforms.base import CaptureUnsupported, GiB, Platform, swap_modules
from minipaged.platforms.cpu import CPUPlatform
from minipaged.platforms.cpu.attention import CPU_OPS
from minipaged.runner.config import RunnerConfig

CPU = torch.device("cpu")


def classes_and_weights(model: nn.Module) -> tuple[dict[str, type], dict[str, int]]:
    return ({name: type(m) for name, m in model.named_modules()},
            {name: id(p) for name, p in model.named_parameters(remove_duplicate=False)})


@pytest.mark.parametrize("tied", [False, True])
def test_the_reference_platform_runs_the_model_as_written(tied):
    model, config = tiny_llama_parts(tie_word_embeddings=tied)
    oracle = copy.deepcopy(model)
    before = classes_and_weights(model)
    platform = platform_of("cpu", "torch", eager=True)
    assert type(platform) is Platform and platform.attention is REFERENCE_OPS
    runner = cpu_runner(model, config, block_size=4, num_gpu_blocks=16, platform=platform,
                        enforce_eager=True)
    assert runner.model is model and runner.graphs is None
    assert classes_and_weights(model) == before  # no module swapped, no weight laid out
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    tokens = [5, 17, 3, 59, 42]
    logits = runner.execute(plan_of([scheduled(tokens, 0, [2, 0])]))
    torch.testing.assert_close(logits[0], dense_last_logits(oracle, tokens), atol=1e-5,
                               rtol=1e-5)
    logits = runner.execute(plan_of([scheduled([9], 5, [2, 0])]))
    torch.testing.assert_close(logits[0], dense_last_logits(oracle, tokens + [9]), atol=1e-5,
                               rtol=1e-5)


def test_the_reference_platform_quantises_captures_and_measures_nothing():
    platform = Platform(CPU)
    with pytest.raises(ValueError, match="quantization 'int8' needs a platform that has it"):
        RunnerConfig(device="meta", quantization="int8")
    ran = []
    with pytest.raises(CaptureUnsupported, match="reference platform captures no steps"):
        platform.capture(lambda: ran.append(1))
    assert platform.graph_sizes == ()
    settings = RunnerConfig(device="meta", kv_cache_memory=1.5)
    assert platform.kv_cache_bytes([lambda: ran.append(1)], settings) == 1.5 * GiB
    assert ran == []  # neither the forward nor the profile ran
    assert platform.greedy_tokens(torch.randn(2, 8)) is None


@pytest.mark.parametrize(("backend", "eager", "kind", "ops", "captures"), [
    ("torch", True, Platform, REFERENCE_OPS, False),
    (None, False, CPUPlatform, CPU_OPS, True),
    ("cpu", False, CPUPlatform, CPU_OPS, True),
    ("auto", True, CPUPlatform, CPU_OPS, False),
    ("torch", False, CPUPlatform, REFERENCE_OPS, False),  # its kernels, not its replays
])
def test_a_cpu_gets_the_cpu_platform_but_for_the_reference_run_eagerly(
        backend, eager, kind, ops, captures):
    platform = platform_of("cpu", backend, eager=eager)
    assert type(platform) is kind and platform.attention is ops
    assert platform.graph_sizes == (tuple(range(1, 65)) if captures else ())  # before `load`


def test_another_device_gets_the_reference_platform():
    for eager in (False, True):
        platform = platform_of("meta", eager=eager)
        assert type(platform) is Platform and platform.device == torch.device("meta")
        assert platform.attention is REFERENCE_OPS
    with pytest.raises(ValueError, match="unknown attention backend"):
        platform_of("cpu", "cuda")


def platform_of(device: str, backend: str | None = None, eager: bool = False) -> Platform:
    return get_platform(RunnerConfig(device=device, attention_backend=backend,
                                     enforce_eager=eager))


class Subclassed(nn.Linear):
    """A subclass of a swapped type (as a tensor-parallel layer is): keeps its class."""


class Swapped(nn.Linear):
    """A swap class: behaviour only."""


class SwappedNorm(RMSNorm):
    """A swap class: behaviour only."""


@settings(max_examples=10, deadline=None)
@given(tied=st.booleans(), layers=st.integers(1, 3))
def test_swap_modules_changes_exactly_the_named_types_in_place(tied, layers):
    model, _ = tiny_llama_parts(tie_word_embeddings=tied, num_hidden_layers=layers)
    model.extra = Subclassed(4, 4)
    before = {name: (m, type(m)) for name, m in model.named_modules()}
    params = {name: p for name, p in model.named_parameters(remove_duplicate=False)}
    linears = sum(type(m) is nn.Linear for _, m in model.named_modules())
    norms = sum(type(m) is RMSNorm for _, m in model.named_modules())
    count = swap_modules(model, {nn.Linear: Swapped, RMSNorm: SwappedNorm})
    assert count == linears + norms
    expected = {nn.Linear: Swapped, RMSNorm: SwappedNorm}
    for name, module in model.named_modules():
        obj, cls = before[name]
        assert module is obj  # the same object, its class changed
        assert type(module) is expected.get(cls, cls), name
    assert type(model.extra) is Subclassed
    assert {name: p for name, p in model.named_parameters(remove_duplicate=False)} == params
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    rotaries = {id(layer.self_attn.rotary) for layer in model.layers}
    assert len(rotaries) == 1  # one module, shared by every layer, still
    assert swap_modules(model, {SiluAndMul: SiluAndMul}) == layers  # each shared module once
