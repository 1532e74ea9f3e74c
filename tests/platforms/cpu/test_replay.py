"""A decode step captured from the model's own forward and replayed (`replay`), against the
same platform's modules run eagerly and against the reference platform (the plain model).

The replay makes the very kernel calls the modules made while it was recorded, over the
runner's static buffers, so its logits and the K/V it writes must be the eager modules' to the
bit: for every model type of every family the registry says the CPU replays (`cpu_replays`:
the LLaMA kind, LLaMA, Qwen2's q/k/v biases, Qwen3's per-head q/k norms and own head size,
Mistral), float32, bfloat16 and int8 weights (a tied head: its
embedding is a Python look-up in the replay), one to eight sequences of random lengths in
shuffled blocks over a cache full of garbage, several steps through one capture, the CPU's
ladder of every size and a ladder of 1, 2, 4, 8 (padded rows). Against the reference (PyTorch's
modules, the reference attention) they agree up to rounding.

The `Recorder` refuses a forward that computes between the platform's modules, since a replay
would silently skip it: GPT-2's PyTorch layer norm, an RMSNorm left unswapped, an extra
`x * 2`, in-place writes; the runner then runs such steps through the modules, with the same
results as an eager runner. Every few-row projection is fixed on the GEMV kernel
(`MINIPAGED_GEMV_ROWS=8` in conftest.py), so what runs does not depend on this machine.
"""

from __future__ import annotations

import copy
import functools
import random
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from native_kernels import NEEDS_COMPILER
from tiny_models import (
    SMALL_LLAMA,
    cpu_platform,
    cpu_runner,
    minipaged_parts,
    plan_of,
    random_hf,
    scheduled,
)
from torch import Tensor, nn
from torch.profiler import ProfilerActivity, profile

from minipaged.models.checkpoint.model_config import ModelConfig
from minipaged.models.layers import RMSNorm
from minipaged.models.llama import LlamaMLP
from minipaged.models.registry import FAMILIES as REGISTRY
from minipaged.platforms.base import CaptureUnsupported, Platform
from minipaged.platforms.cpu import CPUPlatform
from minipaged.platforms.cpu.linear import CPULinear, Int8Linear, choose_few_rows
from minipaged.platforms.cpu.modules import CPURMSNorm
from minipaged.platforms.cpu.replay import (
    PROFILER_NAME,
    Arena,
    CaptureError,
    capture,
    launch_python,
    platform_code,
)
from minipaged.runner.model_runner import ModelRunner

pytestmark = NEEDS_COMPILER

BLOCK_SIZE, NUM_BLOCKS = 4, 64  # eight sequences of up to 12 + 3 tokens fit, shuffled
CPU = torch.device("cpu")

# Every model type of each family the CPU replays, as the registry says (`cpu_replays`).
FAMILIES = [kind for spec in REGISTRY.values() if spec.cpu_replays for kind in spec.hf_model_types]
# A model type's config over SMALL_LLAMA where it needs one: Qwen3's head size differs from
# hidden / heads; Mistral is served up to its window (a shorter context: fewer blocks per row).
OVERRIDES: dict[str, dict[str, Any]] = {"qwen3": {"head_dim": 16},
                                        "mistral": {"sliding_window": 64}}
# (model type, dtype, int8 weights): the int8 models have a tied head (an `Int8Embedding`).
VARIANTS = ([(family, torch.float32, False) for family in FAMILIES]
            + [(family, torch.bfloat16, False) for family in FAMILIES]
            + [("llama", torch.float32, True), ("qwen3", torch.float32, True)])
# Replay against the reference platform, for logits of magnitude up to ~0.7: float32 and int8
# (the reference holds the dequantised weights) sum in other orders (seen: 2e-7); bfloat16
# also rounds each module's output where the reference may not (seen: 2e-3, one bf16 step).
REFERENCE_TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5),
                       torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}
# The K/V they write (magnitudes up to ~5): bfloat16 within two steps (Qwen3's q/k norms round
# once more before the rotary; seen: 0.03 at a magnitude of 2 to 4).
CACHE_TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5),
                   torch.bfloat16: dict(atol=4e-2, rtol=1.6e-2)}


@functools.cache
def plain_parts(family: str, dtype: torch.dtype, tied: bool) -> tuple[nn.Module, ModelConfig]:
    """A random tiny model of `family` (a template: every runner loads its own deep copy)."""
    with warnings.catch_warnings():  # Mistral's window is its context here, on purpose
        warnings.filterwarnings("ignore", "config.json: sliding_window")
        overrides = SMALL_LLAMA | OVERRIDES.get(family, {})
        model, config = minipaged_parts(random_hf(family, **overrides, tie_word_embeddings=tied))
    return model.to(dtype), config


class LadderPlatform(CPUPlatform):
    """The CPU platform with the ladder of 1, 2, 4, 8 rows (a GPU's), so a step's rows are
    padded up to the next size; the CPU's own ladder has every size."""

    def load(self, model: nn.Module, quantization: str | None = None) -> nn.Module:
        model = super().load(model, quantization)
        self.graph_sizes = tuple(s for s in (1, 2, 4, 8) if s <= max(self.graph_sizes))
        return model


def runner_of(model: nn.Module, config: ModelConfig, dtype: torch.dtype,
              **kwargs: Any) -> ModelRunner:
    return cpu_runner(copy.deepcopy(model), config, block_size=BLOCK_SIZE,
                      num_gpu_blocks=NUM_BLOCKS, dtype=dtype, **kwargs)


def dequantised_copy(model: nn.Module, quantised: nn.Module) -> nn.Module:
    """`model` holding exactly the int8 weights of `quantised` (a tied head writes its
    embedding too, as the int8 embedding looks its rows up from the head's values)."""
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in quantised.named_modules():
            if isinstance(module, Int8Linear):
                reference.get_submodule(name).weight.copy_(module.int8.dequantize())
    return reference


def count_replays(runner: ModelRunner) -> list[bool]:
    """Whether each decode step `runner.graphs` took was replayed (False: its size could not
    be captured and the modules ran)."""
    assert runner.graphs is not None
    replayed, real = [], runner.graphs.run

    def run(batch: Any) -> Tensor | None:
        out = real(batch)
        replayed.append(out is not None)
        return out

    runner.graphs.run = run
    return replayed


@functools.cache
def runners(variant: tuple[str, torch.dtype, bool],
            ladder: bool) -> tuple[ModelRunner, ModelRunner, ModelRunner, list[bool]]:
    """(replaying, eager, reference) runners of one variant, and the replaying one's replays;
    built once per variant (their captures are reused across examples, as in a server)."""
    family, dtype, int8 = variant
    model, config = plain_parts(family, dtype, int8)
    quantization = "int8" if int8 else None
    platform = LadderPlatform(CPU) if ladder else cpu_platform()
    replaying = runner_of(model, config, dtype, platform=platform, quantization=quantization)
    eager = runner_of(model, config, dtype, platform=cpu_platform(), quantization=quantization,
                      enforce_eager=True)
    reference_model = dequantised_copy(model, replaying.model) if int8 else model
    reference = runner_of(reference_model, config, dtype, platform=Platform(CPU),
                          enforce_eager=True)
    return replaying, eager, reference, count_replays(replaying)


def fill(runners_: tuple[ModelRunner, ...], seed: int) -> None:
    """The same garbage in every runner's cache: a step that read a slot it does not own, or
    wrote one, would show."""
    gen = torch.Generator().manual_seed(seed)
    for caches in zip(*(r.kv_caches for r in runners_), strict=True):
        values = torch.randn(caches[0].shape, generator=gen)
        for cache in caches:
            cache.copy_(values.to(cache.dtype))


def assert_caches(ours: ModelRunner, theirs: ModelRunner, **close: float) -> None:
    for a, b in zip(ours.kv_caches, theirs.kv_caches, strict=True):
        if close:
            torch.testing.assert_close(a.float(), b.float(), **close)
        else:
            assert torch.equal(a, b)


@settings(deadline=None)  # the profile's examples (conftest.py): more where there is time
@given(variant=st.sampled_from(VARIANTS), ladder=st.booleans(),
       lens=st.lists(st.integers(1, 12), min_size=1, max_size=8), seed=st.integers(0, 2**16))
def test_a_replayed_step_is_the_eager_modules_to_the_bit_and_the_reference_up_to_rounding(
        variant, ladder, lens, seed):
    replaying, eager, reference, replayed = runners(variant, ladder)
    assert replaying.graphs is not None and eager.graphs is None and reference.graphs is None
    replayed.clear()
    tolerance = REFERENCE_TOLERANCE[variant[1]]
    fill((replaying, eager, reference), seed)
    rng = random.Random(seed)
    blocks = rng.sample(range(NUM_BLOCKS), NUM_BLOCKS)
    tables = [[blocks.pop() for _ in range(-(-(n + 3) // BLOCK_SIZE))] for n in lens]
    prompts = [[rng.randrange(64) for _ in range(n)] for n in lens]
    steps = [[scheduled(p, 0, t, seq_id=i)
               for i, (p, t) in enumerate(zip(prompts, tables, strict=True))]]
    steps += [[scheduled([rng.randrange(64)], n + step, t, seq_id=i)
               for i, (n, t) in enumerate(zip(lens, tables, strict=True))] for step in range(3)]
    for entries in steps:  # a prefill (the modules), then three decodes through one capture
        plan = plan_of(entries)
        ours = replaying.execute(plan).clone()  # a replay's logits: its buffer, reused
        assert torch.equal(ours, eager.execute(plan))
        torch.testing.assert_close(ours, reference.execute(plan), **tolerance)
    # Every step of one token per sequence replays (a one-token prompt's too); none other.
    assert replayed == [all(len(e.token_ids) == 1 for e in entries) for entries in steps
                        if all(len(e.token_ids) == 1 for e in entries)]
    assert len(replayed) >= 3
    assert_caches(replaying, eager)
    assert_caches(replaying, reference, **CACHE_TOLERANCE[variant[1]])


def gpt2_parts() -> tuple[nn.Module, ModelConfig]:
    return minipaged_parts(random_hf("gpt2", vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                     n_positions=64, bos_token_id=0, eos_token_id=0))


def decode_steps(num_seqs: int, steps: int = 3) -> list[list]:
    """A prefill of `num_seqs` sequences (blocks 2i, 2i + 1), then `steps` decode steps."""
    tables = [[2 * i, 2 * i + 1] for i in range(num_seqs)]
    plans = [[scheduled([1 + i, 2, 3], 0, t, seq_id=i) for i, t in enumerate(tables)]]
    plans += [[scheduled([5 + step], 3 + step, t, seq_id=i) for i, t in enumerate(tables)]
              for step in range(steps)]
    return plans


def assert_runs_eagerly_and_right(model: nn.Module, config: ModelConfig,
                                  platform: Callable[[], CPUPlatform],
                                  reference_model: nn.Module | None = None) -> None:
    """A runner on `platform` whose decode steps cannot be captured: every one runs through
    the modules, with the eager runner's logits to the bit and the reference's up to
    rounding."""
    replaying = runner_of(model, config, torch.float32, platform=platform())
    eager = runner_of(model, config, torch.float32, platform=platform(), enforce_eager=True)
    reference = runner_of(reference_model or model, config, torch.float32,
                          platform=Platform(CPU), enforce_eager=True)
    replayed = count_replays(replaying)
    for entries in decode_steps(3):
        plan = plan_of(entries)
        ours = replaying.execute(plan)
        assert torch.equal(ours, eager.execute(plan))
        torch.testing.assert_close(ours, reference.execute(plan), atol=1e-5, rtol=1e-5)
    assert replayed == [False] * 3
    assert_caches(replaying, eager)


def test_the_registry_says_which_families_replay():
    """The LLaMA kind replays (the test above covers each of its model types); GPT-2, whose
    layer norms and residual adds compute between modules, does not (the test below)."""
    assert {"llama", "mistral", "qwen2", "qwen3"} <= set(FAMILIES)
    assert not REGISTRY["gpt2"].cpu_replays


def test_gpt2_is_refused_by_the_capture_and_its_steps_run_the_modules():
    model, config = gpt2_parts()
    assert_runs_eagerly_and_right(model, config, cpu_platform)


def test_an_rms_norm_left_unswapped_is_refused_and_its_steps_run_the_modules():
    """A platform that keeps PyTorch's RMSNorm: its operators compute between the modules."""

    class KeepsNorms(CPUPlatform):
        def load(self, model: nn.Module, quantization: str | None = None) -> nn.Module:
            model = super().load(model, quantization)
            for module in model.modules():
                if type(module) is CPURMSNorm:
                    module.__class__ = RMSNorm
            return model

    model, config = plain_parts("llama", torch.float32, False)
    platform = KeepsNorms(CPU, gemv_rows=8)
    loaded = platform.load(copy.deepcopy(model))
    with pytest.raises(CaptureUnsupported, match="computes outside the platform's modules"):
        platform.capture(lambda: loaded.compute_logits(
            loaded(torch.tensor([1]), torch.tensor([0]), ZeroAttention())))
    assert_runs_eagerly_and_right(model, config, lambda: KeepsNorms(CPU, gemv_rows=8))


class DoublingMLP(LlamaMLP):
    """LLaMA's MLP with an extra `x * 2` after it: an operator between the modules."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) * 2


def test_a_model_that_computes_between_its_modules_is_refused_and_runs_them():
    model, config = plain_parts("llama", torch.float32, False)
    doubling = copy.deepcopy(model)
    for layer in doubling.layers:
        layer.mlp.__class__ = DoublingMLP
    assert_runs_eagerly_and_right(doubling, config, cpu_platform)


class ZeroAttention:
    """An attention backend made of views only (zeros handed in): for captures of a model
    alone."""

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        return q


def kernel_linear(in_features: int, out_features: int) -> CPULinear:
    layer = nn.Linear(in_features, out_features)
    layer.__class__ = CPULinear
    choose_few_rows(layer, 8)
    assert layer.few_rows is not None
    return layer


def between(op: Callable[[Tensor], Tensor | None]) -> Callable[[], Tensor]:
    """A forward of two kernel projections with `op` applied to the first one's output."""
    first, second = kernel_linear(8, 8), kernel_linear(8, 8)
    x = torch.randn(2, 8)

    def forward() -> Tensor:
        y = first(x)
        z = op(y)
        return second(y if z is None else z)

    return forward


def add_into_a_buffer(y: Tensor) -> Tensor:
    with platform_code():  # a buffer made as the platform's code makes them: no computation
        out = torch.empty(y.shape)
    return torch.add(y, 1.0, out=out)


def augmented(y: Tensor) -> Tensor:
    y += 1.0
    return y


def item_set(y: Tensor) -> None:
    y[0] = 0.0


@pytest.mark.parametrize("op", [
    lambda y: y * 2, lambda y: y.mul_(2), augmented, item_set, lambda y: y.clone(),
    lambda y: torch.relu(y), lambda y: y.contiguous().T.contiguous(), add_into_a_buffer,
], ids=["mul", "mul_", "iadd", "setitem", "clone", "relu", "transpose-copy", "out="])
def test_the_recorder_refuses_an_operator_that_computes_or_writes_between_modules(op):
    with pytest.raises(CaptureError, match="computes outside the platform's modules"):
        capture(between(op))


def test_views_between_modules_are_captured_and_the_replay_reads_new_inputs():
    """Views and shape checks are no computation: the capture keeps the kernels' calls, and a
    replay over new values written into the same input gives the eager modules' output."""
    first, second = kernel_linear(8, 16), kernel_linear(8, 4)
    x = torch.randn(3, 8)
    assert first.few_rows.max_rows >= 4

    def forward() -> Tensor:
        y = first(x).view(3, 2, 8)  # a view: heads
        assert y.shape[-1] == 8 and y.dim() == 3
        return second(y[1:].reshape(4, 8))  # views, contiguous

    replay, out = capture(forward)
    for seed in range(3):
        x.copy_(torch.randn(3, 8, generator=torch.Generator().manual_seed(seed)))
        replay.run()
        with torch.inference_mode():
            assert torch.equal(out, forward())


def test_a_python_step_is_replayed_in_order_with_the_kernel_calls():
    """`launch_python` (a look-up no kernel takes) is a segment of the replay between the
    kernel calls before and after it."""
    first, second = kernel_linear(8, 8), kernel_linear(8, 8)
    x = torch.randn(2, 8)

    def forward() -> Tensor:
        y = first(x)
        shifted = torch.empty(y.shape)  # a buffer the platform's own code would make

        def add_one() -> None:
            torch.add(y, 1.0, out=shifted)

        launch_python(add_one, y, shifted)
        return second(shifted)

    with pytest.raises(CaptureError):  # `torch.empty` outside the platform's code
        capture(forward)
    def marked() -> Tensor:
        y = first(x)
        with platform_code():
            shifted = torch.empty(y.shape)
        launch_python(lambda: torch.add(y, 1.0, out=shifted), y, shifted)
        return second(shifted)

    replay, out = capture(marked)
    assert len(replay.segments) == 3  # calls, the Python step, calls
    x.copy_(torch.randn(2, 8))
    with torch.inference_mode():  # as the runner replays (the buffers are inference tensors)
        replay.run()
        torch.testing.assert_close(out, second(first(x) + 1.0), rtol=0, atol=0)


def test_a_strided_input_to_a_kernel_is_refused_not_copied_once():
    """The kernel reads a contiguous copy of a strided input; made while capturing, a replay
    would read that copy, not the input's new values."""
    first, second = kernel_linear(8, 16), kernel_linear(8, 4)
    x = torch.randn(3, 8)
    with pytest.raises(CaptureError, match="strided"):
        capture(lambda: second(first(x).view(3, 2, 8)[:, 1]))
    with torch.inference_mode():  # run eagerly, the copy is made each time: the right product
        y = first(x).view(3, 2, 8)[:, 1]
        torch.testing.assert_close(second(y), torch.nn.functional.linear(
            y, second.weight, second.bias), atol=1e-6, rtol=1e-5)


def test_captures_do_not_nest():
    layer = kernel_linear(8, 8)
    x = torch.randn(1, 8)
    with pytest.raises(CaptureError, match="already in progress"):
        capture(lambda: capture(lambda: layer(x))[1])
    replay, out = capture(lambda: layer(x))  # the failed one left no recorder behind
    replay.run()
    with torch.inference_mode():
        assert torch.equal(out, layer(x))


def test_captures_share_their_arena_from_its_start():
    """A capture's buffers start where the last capture's did (a replay keeps nothing from one
    step to the next), so the captured sizes together hold the memory of the largest; the
    replay holds the arena, not its buffers one by one."""
    layer = kernel_linear(8, 8)
    arena = Arena()
    inputs = [torch.randn(rows, 8) for rows in (1, 3)]
    captured = [capture(lambda x=x: layer(x), arena) for x in inputs]
    outs = [out for _, out in captured]
    assert outs[0].data_ptr() == outs[1].data_ptr() and len(arena.chunks) == 1
    assert all(arena.owns(out) for out in outs)
    for (replay, out), x in zip(captured, inputs, strict=True):
        assert not any(isinstance(t, Tensor) and arena.owns(t) for t in replay.keep)
        replay.run()
        with torch.inference_mode():
            assert torch.equal(out, layer(x))


def test_replayed_steps_are_profiled_under_their_name_once_per_step():
    model, config = plain_parts("llama", torch.float32, False)
    replaying = runner_of(model, config, torch.float32, platform=cpu_platform())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for entries in decode_steps(2):
            replaying.execute(plan_of(entries))
    events = [event for event in prof.key_averages() if event.key == PROFILER_NAME]
    # the three decodes replayed (captured at start-up); the prefill ran the modules
    assert events and events[0].count == 3
