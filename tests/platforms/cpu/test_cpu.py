"""The CPU platform (`CPUPlatform`): what `load` makes of a model, which steps it captures, and
its greedy sampling.

`load` gives every module of exactly the model's types (`nn.Linear`, `RMSNorm`, the shared
`RotaryEmbedding`, `SiluAndMul`, `nn.Embedding`) the CPU's subclass, and no other module
(tensor-parallel layers, GPT-2's layer norms keep theirs); ties stay tied, the weights keep
their values in one buffer, and the model computes what it did; with int8, no float weight of a
projection is left. Its few-row choice is fixed by `gemv_rows` or `MINIPAGED_GEMV_ROWS`, or
measured per layer; it captures decode steps of up to as many rows as every projection's kernel
takes, and none where told not to or on another attention backend. The start-up measurements
(fetching ahead) are made at load, never in a step.
"""

from __future__ import annotations

import copy
import functools
import importlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from native_kernels import NEEDS_COMPILER
from tiny_models import (
    SMALL_LLAMA,
    cpu_runner,
    dense_last_logits,
    minipaged_parts,
    plan_of,
    random_hf,
    scheduled,
    tiny_llama_parts,
)
from torch import nn

import minipaged.platforms.cpu as cpu_platform_module
from minipaged.attention.reference import REFERENCE_OPS
from minipaged.kernels.cpu.gemv import MAX_ROWS
from minipaged.models.layers import RMSNorm, RotaryEmbedding, SiluAndMul
from minipaged.models.llama import LlamaForCausalLM
from minipaged.models.tensor_parallel import (
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from minipaged.platforms.base import CaptureUnsupported
from minipaged.platforms.cpu import (
    GEMV_ROWS_VARIABLE,
    SWAPS,
    CPUPlatform,
    replay_ladder,
)
from minipaged.platforms.cpu.linear import CPULinear, Int8Linear
from minipaged.platforms.cpu.modules import (
    CPUEmbedding,
    CPURMSNorm,
    CPURotaryEmbedding,
    CPUSiluAndMul,
    Int8Embedding,
)
from minipaged.runner.config import RunnerConfig

pytestmark = NEEDS_COMPILER

# The module (the package's `gemv` is its function of that name).
gemv = importlib.import_module("minipaged.kernels.cpu.gemv")

CPU = torch.device("cpu")
SWAPPED = {nn.Linear: CPULinear, RMSNorm: CPURMSNorm, RotaryEmbedding: CPURotaryEmbedding,
           SiluAndMul: CPUSiluAndMul, nn.Embedding: CPUEmbedding}


def model_of(family: str, tied: bool) -> tuple[nn.Module, object]:
    if family == "gpt2":
        return minipaged_parts(random_hf("gpt2", vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                         bos_token_id=0, eos_token_id=0,
                                         tie_word_embeddings=tied))
    extra = {"head_dim": 16} if family == "qwen3" else {}
    return minipaged_parts(random_hf(family, **(SMALL_LLAMA | extra), tie_word_embeddings=tied))


def test_the_platform_swaps_what_the_model_declares():
    assert SWAPS == SWAPPED


@settings(max_examples=8, deadline=None)
@given(family=st.sampled_from(["llama", "qwen2", "qwen3", "gpt2"]), tied=st.booleans())
def test_load_swaps_exactly_the_models_types_keeps_ties_and_computes_the_same(family, tied):
    model, _ = model_of(family, tied)
    plain = copy.deepcopy(model)
    before = {name: (m, type(m)) for name, m in model.named_modules()}
    loaded = CPUPlatform(CPU, gemv_rows=8).load(model)
    assert loaded is model
    for name, module in model.named_modules():
        obj, cls = before[name]
        assert module is obj and type(module) is SWAPPED.get(cls, cls), name
    assert (model.lm_head.weight is model.input_embedding().weight) == tied
    assert model.lm_head.logits  # the head's kernel widens to float32 itself
    if family != "gpt2":
        assert len({id(layer.self_attn.rotary) for layer in model.layers}) == 1
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == 1  # laid out in one buffer
    for (name, ours), theirs in zip(model.state_dict().items(), plain.state_dict().values(),
                                    strict=True):
        assert torch.equal(ours, theirs), name
    tokens = [5, 17, 3, 59, 42, 7]
    torch.testing.assert_close(dense_last_logits(model, tokens), dense_last_logits(plain, tokens),
                               atol=1e-5, rtol=1e-5)


def test_load_leaves_a_tensor_parallel_shards_own_layers_alone():
    _, config = tiny_llama_parts()
    shard = LlamaForCausalLM(config, TensorParallel(0, 2))
    kinds = {name: type(m) for name, m in shard.named_modules()}
    assert {RowParallelLinear, VocabParallelHead, VocabParallelEmbedding} <= set(kinds.values())
    CPUPlatform(CPU, gemv_rows=8).load(shard)
    for name, module in shard.named_modules():
        assert type(module) is SWAPPED.get(kinds[name], kinds[name]), name
    assert isinstance(shard.layers[0].self_attn.q_proj, CPULinear)  # column-parallel: plain


@pytest.mark.parametrize("tied", [False, True])
def test_int8_load_keeps_no_float_weight_of_a_projection(tied):
    model, _ = tiny_llama_parts(tie_word_embeddings=tied)
    CPUPlatform(CPU, gemv_rows=8).load(model, "int8")
    linears = [m for m in model.modules() if isinstance(m, nn.Linear | Int8Linear)]
    assert linears and all(type(m) is Int8Linear and not hasattr(m, "weight") for m in linears)
    assert all(m.few_rows is not None and m.few_rows.max_rows == 8 for m in linears)
    embedding = model.input_embedding()
    if tied:
        assert type(embedding) is Int8Embedding and embedding.int8 is model.lm_head.int8
        assert all(p.dim() == 1 for p in model.parameters())  # only the norms' weights
    else:
        assert type(embedding) is CPUEmbedding
        assert [p.dim() for p in model.parameters()].count(2) == 1  # the embedding's alone


@pytest.mark.parametrize(("options", "env", "sizes"), [
    (dict(gemv_rows=8), None, tuple(range(1, 9))),
    (dict(gemv_rows=3), "8", (1, 2, 3)),  # given beats the environment
    (dict(), "5", (1, 2, 3, 4, 5)),
    (dict(gemv_rows=0), None, ()),  # no kernel: no step replays
    (dict(gemv_rows=8, capture=False), None, ()),
    (dict(gemv_rows=8, attention=REFERENCE_OPS), None, ()),  # the replay records CPU_OPS'
])
def test_the_steps_it_captures_are_those_every_projection_takes(monkeypatch, options, env,
                                                                sizes):
    monkeypatch.delenv(GEMV_ROWS_VARIABLE, raising=False)
    if env is not None:
        monkeypatch.setenv(GEMV_ROWS_VARIABLE, env)
    model, config = tiny_llama_parts()
    platform = CPUPlatform(CPU, **options)
    runner = cpu_runner(model, config, block_size=4, num_gpu_blocks=8, platform=platform)
    assert platform.graph_sizes == sizes
    assert (runner.graphs is None) == (sizes == ())


def test_the_cpu_answers_its_device_questions():
    """Its sizes are known before it loads anything (up to `max_num_seqs`; `load` keeps those
    every projection's kernel takes), its captures are bound to the thread count, its ranks
    run gloo with one thread each, its host memory is not pinned, and int8 runs on one rank
    over float32 weights."""
    platform = CPUPlatform(CPU, max_num_seqs=12, gemv_rows=8)
    assert platform.graph_sizes == tuple(range(1, 13))
    platform.load(tiny_llama_parts()[0])
    assert platform.graph_sizes == tuple(range(1, 9))
    assert platform.capture_key() == torch.get_num_threads()
    assert (CPUPlatform.collective_backend, CPUPlatform.rank_threads) == ("gloo", 1)
    assert not CPUPlatform.pin_memory and "int8" in CPUPlatform.quantizations
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1"):
        RunnerConfig(device="cpu", quantization="int8", tensor_parallel_size=2)


@given(st.integers(0, 200))
def test_every_row_count_the_kernel_takes_replays_at_its_own_size(max_rows):
    """No decode is padded on a CPU: a padded row costs its share of every projection."""
    assert replay_ladder(max_rows) == tuple(range(1, max_rows + 1))


def test_int8_decodes_past_a_tile_are_captured_at_their_own_size_and_replayed(monkeypatch):
    """Int8 weights take the kernel past one tile of rows: every size up to 24 is captured at
    start-up, largest first, and a 13-row decode replays at 13 rows, bit-equal to the same
    platform's eager modules."""
    monkeypatch.delenv(GEMV_ROWS_VARIABLE, raising=False)
    captured = []

    class Counting(CPUPlatform):
        def capture(self, forward):
            replay, out = super().capture(forward)
            captured.append(out.shape[0])
            return replay, out

    model, config = tiny_llama_parts()
    runners = [cpu_runner(copy.deepcopy(model), config, block_size=4, num_gpu_blocks=64,
                          platform=Counting(CPU, gemv_rows=24), quantization="int8",
                          enforce_eager=eager) for eager in (False, True)]
    assert runners[0].platform.graph_sizes == tuple(range(1, 25))
    rows = 13
    logits = []
    for runner in runners:
        runner.execute(plan_of([scheduled([1 + i, 2, 3], 0, [i * 4, i * 4 + 1], seq_id=i)
                                for i in range(rows)]))
        for position in (3, 4):  # two replays
            step = plan_of([scheduled([5 + i + position], position, [i * 4, i * 4 + 1],
                                      seq_id=i) for i in range(rows)])
            logits.append(runner.execute(step).clone())
    assert captured == list(range(24, 0, -1))
    assert torch.equal(logits[0], logits[2]) and torch.equal(logits[1], logits[3])


def test_the_slowest_projections_rows_bound_the_captured_sizes(monkeypatch):
    """Measured per weight, the few-row choice may differ by layer: a step replays only at the
    rows every projection's kernel takes (one on the GEMM would refuse the capture)."""
    real = cpu_platform_module.choose_few_rows

    def choose(layer, max_rows=None):
        real(layer, 2 if layer.out_features == 64 else MAX_ROWS)  # the MLP's gate and up

    monkeypatch.setattr(cpu_platform_module, "choose_few_rows", choose)
    model, _ = tiny_llama_parts()
    platform = CPUPlatform(CPU)
    platform.load(model)
    assert platform.graph_sizes == (1, 2)


@pytest.mark.parametrize(("dtype", "quantization", "weights"), [
    (torch.float32, None, torch.float32), (torch.float32, "int8", torch.int8),
    (torch.bfloat16, None, torch.bfloat16),
])
def test_fetching_ahead_is_measured_at_load_not_in_a_step(monkeypatch, dtype, quantization,
                                                          weights):
    """Whether the kernel fetches weights ahead is measured once per weight type and tile
    shape (`gemv.fetch_ahead`): at load for every shape a step may bind, so that no step, the
    captured ones included, pays for a measurement."""
    measured = []

    @functools.cache
    def measure(weight_dtype: torch.dtype, rows: int) -> bool:
        measured.append((weight_dtype, rows))
        return False

    monkeypatch.setattr(gemv, "_fetch_ahead", measure)
    model, config = tiny_llama_parts()
    runner = cpu_runner(model.to(dtype), config, block_size=4, num_gpu_blocks=8, dtype=dtype,
                        quantization=quantization, platform=CPUPlatform(CPU, gemv_rows=8))
    plans = [m.few_rows.plan for m in model.modules() if isinstance(m, CPULinear | Int8Linear)]
    expected = [(weights, rows) for rows in cpu_platform_module.FETCH_AHEAD_ROWS]
    assert measured == (expected if plans[0].fetch_ahead_matters() else [])
    assert runner.graphs is not None
    runner.execute(plan_of([scheduled([1, 2, 3], 0, [0])]))
    for rows in (1, 2, 3, 5, 8):  # decodes of every tile shape, replayed
        runner.execute(plan_of([scheduled([4], 0, [i], seq_id=i) for i in range(rows)]))
    assert measured == (expected if plans[0].fetch_ahead_matters() else [])


def test_a_forward_it_cannot_replay_is_refused_as_unsupported():
    platform = CPUPlatform(CPU, gemv_rows=8)
    x = torch.randn(2, 4)
    with pytest.raises(CaptureUnsupported, match="computes outside the platform's modules"):
        platform.capture(lambda: x * 2)


def test_greedy_tokens_are_the_argmax_and_its_log_probability():
    platform = CPUPlatform(CPU, gemv_rows=8)
    logits = torch.randn(5, 64)
    logits[2, [7, 9]] = 50.0  # a tie: the first, as argmax
    tokens, logprobs = platform.greedy_tokens(logits)
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(logprobs, F.log_softmax(logits, -1).max(-1).values)
    assert platform.greedy_tokens(logits.bfloat16()) is None  # the sampler's way
    assert platform.greedy_tokens(logits.T) is None  # not contiguous
