"""A replayed decode step (`DecodeProgram`) against the model's own modules.

The program binds the same kernels the modules call at a few rows, so a step it replays must
give the modules' hidden states and caches to the bit: for float32, bfloat16 and int8 weights,
GQA ratios, q/k/v and output biases, one to eight sequences of random lengths in shuffled
blocks, several steps in a row through one replay (block tables growing, rows reused). Every
projection is forced onto the kernel (`force_kernel`) so the test does not depend on this
machine's timings. What it does not take (prefills, more rows than its kernels, a replaced
weight, per-head q/k norms, GPT-2, the reference backend, `enforce_eager`) runs the modules.
"""

from __future__ import annotations

import copy
import functools
import random
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import (
    force_kernel,
    minipaged_parts,
    plan_of,
    random_hf,
    run_bounded,
    scheduled,
    tiny_engine,
    tiny_llama_parts,
)
from torch.profiler import ProfilerActivity, profile

from minipaged.models.layers import ModelInputError
from minipaged.models.quantization import quantize_model
from minipaged.runner.backends import PagedAttentionBackend
from minipaged.runner.cpu_decode import PROFILER_NAME, DecodeProgram
from minipaged.runner.model_runner import ModelRunner
from minipaged.sampling.params import SamplingParams

BLOCK_SIZE, NUM_BLOCKS = 4, 80  # 8 sequences of up to 33 tokens fit


@functools.cache
def model_of(dtype: torch.dtype, num_kv_heads: int, bias: bool, int8: bool) -> torch.nn.Module:
    model, _ = tiny_llama_parts(num_key_value_heads=num_kv_heads, attention_bias=bias)
    if int8:
        quantize_model(model, "int8")
    return model.to(dtype).eval()


def runner_of(model: torch.nn.Module, **kwargs) -> ModelRunner:
    return ModelRunner(model, model.config, block_size=BLOCK_SIZE, num_gpu_blocks=NUM_BLOCKS,
                       dtype=next(model.parameters()).dtype, **kwargs)


def fill(caches: list[torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=gen).to(cache.dtype))


CONFIGS = [  # dtype, KV heads (of 4 query heads), biases, int8
    (torch.float32, 2, False, False),
    (torch.float32, 4, True, False),
    (torch.bfloat16, 1, False, False),
    (torch.bfloat16, 2, True, False),
    (torch.float32, 2, False, True),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c)))
@given(lens=st.lists(st.integers(1, 30), min_size=1, max_size=8), seed=st.integers(0, 2**16))
@settings(max_examples=12, deadline=None)
def test_a_replayed_step_equals_the_modules_to_the_bit(config, lens, seed):
    model = model_of(*config)
    runner = runner_of(model, enforce_eager=True)
    force_kernel(model, max_rows=8)
    assert runner.decode_program is None
    fill(runner.kv_caches, seed)
    replayed_caches = copy.deepcopy(runner.kv_caches)
    program = DecodeProgram.build(model, replayed_caches, BLOCK_SIZE)
    assert program is not None and program.max_rows == 8
    rng = random.Random(seed)
    blocks = rng.sample(range(NUM_BLOCKS), NUM_BLOCKS)
    tables = [[blocks.pop() for _ in range(-(-(n + 3) // BLOCK_SIZE))] for n in lens]
    for step in range(3):  # the same replay again, the tables' used width growing
        entries = [scheduled([rng.randrange(64)], n + step - 1, table, seq_id=i)
                   for i, (n, table) in enumerate(zip(lens, tables, strict=True))]
        batch = runner.flat_batch(entries)
        input_ids, positions, metadata = runner.prepare(entries)
        assert program.takes(batch)
        with torch.inference_mode():
            eager = model(input_ids, positions,
                          PagedAttentionBackend(runner.kv_caches, metadata, runner.layer_ops))
            eager = model.compute_logits(eager)
            replayed = program.run(batch)
        assert torch.equal(replayed, eager)
        for ours, theirs in zip(replayed_caches, runner.kv_caches, strict=True):
            assert torch.equal(ours, theirs)


def test_what_it_does_not_take_runs_the_modules():
    model = model_of(torch.float32, 2, False, False)
    runner = runner_of(model, enforce_eager=True)
    force_kernel(model, max_rows=2)
    program = DecodeProgram.build(model, runner.kv_caches, BLOCK_SIZE)
    assert program is not None and program.max_rows == 2
    decodes = [scheduled([1], 4, [0, 1], seq_id=0), scheduled([2], 2, [2], seq_id=1)]
    assert program.takes(runner.flat_batch(decodes))
    three = decodes + [scheduled([3], 0, [3], seq_id=2)]
    assert not program.takes(runner.flat_batch(three))  # more rows than its kernels take
    prefill = [scheduled([1, 2, 3], 0, [0], seq_id=0)]
    assert not program.takes(runner.flat_batch(prefill))
    layer = model.layers[1].mlp.up_proj
    weight = layer.weight
    layer.weight = torch.nn.Parameter(weight.detach().clone())  # new storage: stale calls
    try:
        assert not program.takes(runner.flat_batch(decodes))
    finally:
        layer.weight = weight
    assert program.takes(runner.flat_batch(decodes))
    group, path = model.layers[0].mlp.gate_up, model.layers[0].mlp.gate_up.path
    group.path = None  # planned again (`choose_gemms(model, gemv=False)`): the modules run
    assert not program.takes(runner.flat_batch(decodes))
    group.path = path
    assert program.takes(runner.flat_batch(decodes))


def test_a_token_or_position_outside_the_model_is_refused_before_any_kernel_runs():
    model = model_of(torch.float32, 2, False, False)
    runner = runner_of(model, enforce_eager=True)
    force_kernel(model, max_rows=2)
    program = DecodeProgram.build(model, runner.kv_caches, BLOCK_SIZE)
    before = [cache.clone() for cache in runner.kv_caches]
    vocab, longest = model.config.vocab_size, model.config.max_position_embeddings
    for token in (vocab, -1):
        batch = runner.flat_batch([scheduled([token], 4, [7, 3])])
        assert program.takes(batch)
        with pytest.raises(ModelInputError, match="token id out of range"), \
                torch.inference_mode():
            program.run(batch)
    beyond = runner.flat_batch([scheduled([3], longest, range(longest // BLOCK_SIZE + 1))])
    assert not program.takes(beyond)  # more blocks than its buffers hold; and if run anyway:
    with pytest.raises(ModelInputError, match="position out of range"), torch.inference_mode():
        program.run(beyond)
    for cache, kept in zip(runner.kv_caches, before, strict=True):
        assert torch.equal(cache, kept)


def test_it_applies_only_to_one_rank_llama_models_on_the_cpu_backend():
    model = model_of(torch.float32, 2, False, False)
    assert runner_of(model, attention_backend="torch").decode_program is None
    assert runner_of(model, enforce_eager=True).decode_program is None
    qwen3, _ = minipaged_parts(random_hf("qwen3", vocab_size=64, hidden_size=32,
                                         intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=8))
    force_kernel(qwen3)
    assert DecodeProgram.build(qwen3, runner_of(qwen3).kv_caches, BLOCK_SIZE) is None  # q/k norms
    gpt2, _ = minipaged_parts(random_hf("gpt2", vocab_size=64, n_embd=32, n_layer=1, n_head=4,
                                        bos_token_id=0, eos_token_id=0))
    assert DecodeProgram.build(gpt2, runner_of(gpt2).kv_caches, BLOCK_SIZE) is None


def test_the_runner_replays_decodes_and_gives_the_eager_runners_logits():
    """Two runners over one float32 model, one eager: a prefill then decodes, their logits equal
    to the bit; the replaying runner's decodes went through its program (profiled by name).
    The runners plan the model's GEMMs as they start: forced onto the kernel here."""
    model = model_of(torch.float32, 2, True, False)
    with mock.patch("minipaged.runner.model_runner.choose_gemms", force_kernel):
        eager, replaying = runner_of(model, enforce_eager=True), runner_of(model)
    assert replaying.decode_program is not None
    tokens = [5, 9, 2, 7, 11]
    steps = [plan_of([scheduled(tokens, 0, [3, 1])])] + [
        plan_of([scheduled([t], len(tokens) + i, [3, 1])]) for i, t in enumerate([4, 8, 1])]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for plan in steps:
            assert torch.equal(replaying.execute(plan), eager.execute(plan))
    events = [event for event in prof.key_averages() if event.key == PROFILER_NAME]
    assert events and events[0].count == 3


def test_a_failed_step_rerun_request_by_request_keeps_each_ones_logits():
    """A replayed step's logits are its program's buffer, written again by the next step; when
    a step fails and the engine runs each request alone, it must keep each one's logits before
    running the next. Three greedy requests, every step of more than one request made to
    fail: each must get the tokens it gets alone."""
    parts = tiny_llama_parts()
    prompts = [[5, 9, 2], [7, 1, 30, 4], [11, 3]]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    with mock.patch("minipaged.runner.model_runner.choose_gemms", force_kernel):
        engine = tiny_engine(parts, block_size=4, num_gpu_blocks=64, num_cpu_blocks=0)
    assert engine.runner.decode_program is not None
    alone = []
    for prompt in prompts:
        engine.add_request(None, prompt, params)
        alone.append(list(run_bounded(engine).values())[0].outputs[0].token_ids)
    real = engine.runner.execute

    def fails_together(plan):
        if len(plan.scheduled) > 1:
            raise RuntimeError("injected: the batch fails, each request alone does not")
        return real(plan)

    with mock.patch.object(engine.runner, "execute", fails_together):
        ids = [engine.add_request(None, prompt, params) for prompt in prompts]
        finals = run_bounded(engine)
    for request_id, tokens in zip(ids, alone, strict=True):
        assert finals[request_id].outputs[0].token_ids == tokens
