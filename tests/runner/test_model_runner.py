"""The model runner against plain references: the flat batch, the block movements, the logits.

* `prepare` is the flat batch of `minipaged.runner.flat_batch` (`test_flat_batch.py`) as tensors;
* `apply_cache_ops` must move exactly the named blocks, in every layer, keys and values alike;
* `execute` over several steps of mixed chunked prefills and decodes, with shuffled physical
  blocks, a swap out and in, and a copy-on-write fork, must give the logits of a dense forward
  pass over each sequence's whole context: on the CPU platform (decode steps replayed), on it
  eagerly, and on the reference platform (the plain model);
* a token or position outside the model is refused before any kernel writes the cache;
* without `num_gpu_blocks` the cache takes what the platform's `kv_cache_bytes` grants after the
  profile run of the largest step: a stand-in platform grants a chosen budget.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import BudgetPlatform, cpu_runner, dense_last_logits, plan_of, scheduled

from minipaged.attention.reference import paged_attention, plan_attention
from minipaged.models.checkpoint.model_config import ModelConfig
from minipaged.models.gpt2 import GPT2ForCausalLM
from minipaged.models.layers import ModelInputError
from minipaged.models.llama import LlamaForCausalLM
from minipaged.models.registry import FAMILIES
from minipaged.platforms.base import GiB, Platform
from minipaged.platforms.cpu import CPUPlatform
from minipaged.runner.backends import PagedAttentionBackend
from minipaged.runner.model_runner import ModelRunner, kv_bytes_per_block
from minipaged.sched.output import ScheduledSequence, SchedulerOutput

VOCAB = 64


def tiny_config(architecture: str = "llama") -> ModelConfig:
    return ModelConfig(
        family=FAMILIES[architecture],
        vocab_size=VOCAB,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2 if architecture == "llama" else 4,
        head_dim=8,
        intermediate_size=64,
        max_position_embeddings=256,
    )


def tiny_model(architecture: str = "llama", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cls = LlamaForCausalLM if architecture == "llama" else GPT2ForCausalLM
    model = cls(tiny_config(architecture)).eval()
    with torch.no_grad():  # norms start at 1: perturb them so a wrong layer shows in the logits
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    return model


def make_runner(model, num_gpu_blocks=32, num_cpu_blocks=16, block_size=4,
                **kwargs) -> ModelRunner:
    return cpu_runner(
        model,
        model.config,
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=num_cpu_blocks,
        **kwargs,
    )


# How a runner runs its steps: the CPU platform replaying decode steps (the default on a CPU),
# the same platform through its modules, the reference platform (the plain model).
PLATFORMS = {
    "cpu": dict(),
    "cpu-eager": dict(enforce_eager=True),
    "reference": dict(attention_backend="torch", enforce_eager=True),
}


def test_the_step_plan_groups_decodes_and_attends_as_one_call_per_sequence():
    """The plan a step's backend makes once for every layer cuts this batch into five chunks,
    and attending chunk by chunk gives what attending each sequence on its own gives."""
    model = tiny_model()
    runner = make_runner(model, num_gpu_blocks=40, block_size=4)
    for cache in runner.kv_caches:
        cache.normal_()
    rng = random.Random(3)
    entries = []
    free = list(range(40))
    rng.shuffle(free)
    for start, n in [(3, 1), (30, 1), (0, 9), (12, 1), (5, 6), (60, 1)]:
        table = [free.pop() for _ in range(-(-(start + n) // 4))]
        entries.append(scheduled([rng.randrange(VOCAB) for _ in range(n)], start, table))
    _, _, md = runner.prepare(entries)
    plan = plan_attention(md.block_tables, md.seq_lens, md.query_start_loc, runner.kv_caches[0][0])
    assert len(plan) == 5  # decodes of contexts 4 | 13 | 31 and 61; two prefills
    q = torch.randn(len(md.slot_mapping), 4, 8)
    k, v = torch.randn(2, len(md.slot_mapping), 2, 8)
    backend = PagedAttentionBackend(runner.kv_caches, md, runner.layer_ops)
    with torch.inference_mode():  # as in `execute` (the reference's gather buffer is shared)
        out = backend(0, q, k, v, 0.3)
        cache = runner.kv_caches[0]
        starts = md.query_start_loc.tolist()
        alone = torch.cat([
            paged_attention(q[starts[i] : starts[i + 1]], cache[0], cache[1],
                            md.block_tables[i : i + 1], md.seq_lens[i : i + 1],
                            torch.tensor([0, starts[i + 1] - starts[i]], dtype=torch.int32), 0.3)
            for i in range(len(entries))
        ])
    torch.testing.assert_close(out, alone)


# -- block movements ------------------------------------------------------------------------------


@st.composite
def cache_ops(draw, num_gpu_blocks=12, num_cpu_blocks=8):
    """A step's swaps and copies as the KV cache manager could produce them: distinct
    destinations, no block both copied from and to, swap-out destinations free on the host."""
    host = draw(st.permutations(range(num_cpu_blocks)))
    device = draw(st.permutations(range(num_gpu_blocks)))
    n_out = draw(st.integers(0, 3))
    n_in = draw(st.integers(0, 3))
    n_copy = draw(st.integers(0, 3))
    swap_out = list(zip(device[:n_out], host[:n_out], strict=True))
    # Swap-ins read other host blocks and may reuse a block just swapped out (it is free now).
    swap_in = list(zip(host[n_out : n_out + n_in], device[:n_in], strict=True))
    rest = device[max(n_out, n_in) :]
    n_copy = min(n_copy, len(rest) // 2)
    copy = list(zip(rest[:n_copy], rest[n_copy : 2 * n_copy], strict=True))
    return SchedulerOutput(swap_in=swap_in, swap_out=swap_out, copy=copy)


@given(cache_ops())
@settings(max_examples=40)
def test_cache_ops_move_exactly_the_named_blocks(ops):
    runner = make_runner(tiny_model(), num_gpu_blocks=12, num_cpu_blocks=8)
    torch.manual_seed(1)
    for cache in runner.kv_caches + runner.host_caches:
        cache.normal_()
    device_before = [c.clone() for c in runner.kv_caches]
    host_before = [c.clone() for c in runner.host_caches]
    runner.apply_cache_ops(ops)
    for layer in range(len(runner.kv_caches)):
        dev, host = device_before[layer].clone(), host_before[layer].clone()
        # The documented order: swap out, swap in, copy.
        for d, h in ops.swap_out:
            host[:, h] = dev[:, d]
        for h, d in ops.swap_in:
            dev[:, d] = host[:, h]
        for src, dst in ops.copy:
            dev[:, dst] = dev[:, src]
        assert torch.equal(runner.kv_caches[layer], dev)
        assert torch.equal(runner.host_caches[layer], host)


def test_swap_out_then_in_restores_a_block_elsewhere():
    runner = make_runner(tiny_model(), num_gpu_blocks=6, num_cpu_blocks=2)
    for cache in runner.kv_caches:
        cache.normal_()
    saved = [c[:, 3].clone() for c in runner.kv_caches]
    runner.apply_cache_ops(SchedulerOutput(swap_out=[(3, 1)]))
    for cache in runner.kv_caches:
        cache[:, 3] = 0.0  # the device block is reused by someone else
    runner.apply_cache_ops(SchedulerOutput(swap_in=[(1, 5)]))
    for cache, block in zip(runner.kv_caches, saved, strict=True):
        assert torch.equal(cache[:, 5], block)


# -- execute against dense logits -----------------------------------------------------------------


class PagedSequences:
    """Just enough block bookkeeping for a test: each sequence owns a list of physical blocks."""

    def __init__(self, num_blocks: int, block_size: int, rng: random.Random) -> None:
        self.free = list(range(num_blocks))
        rng.shuffle(self.free)  # physical blocks in no particular order
        self.block_size = block_size
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.tables: dict[str, list[int]] = {}

    def add(self, name: str, tokens: list[int]) -> None:
        self.tokens[name], self.computed[name], self.tables[name] = list(tokens), 0, []

    def entry(self, name: str, n: int) -> ScheduledSequence:
        start = self.computed[name]
        end = start + n
        while len(self.tables[name]) * self.block_size < end:
            self.tables[name].append(self.free.pop())
        return scheduled(
            self.tokens[name][start:end], start, list(self.tables[name]),
            needs_logits=end == len(self.tokens[name]),
        )


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
def test_execute_over_steps_equals_dense_logits(architecture, platform):
    model = tiny_model(architecture)  # the oracle: the plain model, no platform's modules
    block_size = 4
    runner = make_runner(copy.deepcopy(model), num_gpu_blocks=40, num_cpu_blocks=8,
                         block_size=block_size, **PLATFORMS[platform])
    assert (runner.graphs is not None) == (platform == "cpu")
    for cache in runner.host_caches:  # the host pool is not zeroed: nothing may read a block
        cache.fill_(float("nan"))  # before the swap-out that writes it
    rng = random.Random(0)
    seqs = PagedSequences(40, block_size, rng)
    for name, length in (("a", 11), ("b", 3), ("c", 17)):
        seqs.add(name, [rng.randrange(VOCAB) for _ in range(length)])

    def step(plan: dict[str, int], ops: SchedulerOutput | None = None) -> None:
        entries = [seqs.entry(name, n) for name, n in plan.items()]
        logits = runner.execute(plan_of(entries, ops))
        sampled = [name for name, e in zip(plan, entries, strict=True) if e.needs_logits]
        assert logits.shape == (len(sampled), VOCAB)
        for name, row in zip(sampled, logits, strict=True):
            torch.testing.assert_close(row, dense_last_logits(model, seqs.tokens[name]),
                                       rtol=1e-4, atol=1e-4)
        for name, n in plan.items():
            seqs.computed[name] += n
        for name in sampled:  # append a next token (any token: the check is the logits)
            seqs.tokens[name].append(rng.randrange(VOCAB))

    step({"a": 11, "b": 3, "c": 6})  # two whole prompts and a chunk of the third
    step({"a": 1, "b": 1, "c": 11})  # decodes next to the rest of a chunked prefill
    step({"a": 1, "b": 1, "c": 1})
    # Swap "a" out to the host, then back into different device blocks.
    host = list(range(len(seqs.tables["a"])))
    runner.apply_cache_ops(SchedulerOutput(swap_out=list(zip(seqs.tables["a"], host, strict=True))))
    new_blocks = [seqs.free.pop() for _ in host]
    seqs.free += seqs.tables["a"]
    seqs.tables["a"] = new_blocks
    step({"a": 1, "c": 1}, SchedulerOutput(swap_in=list(zip(host, new_blocks, strict=True))))
    # Fork "c" into "d" (parallel sampling): shared full blocks, a private copy of the last one.
    shared, last = seqs.tables["c"][:-1], seqs.tables["c"][-1]
    copy_to = seqs.free.pop()
    seqs.add("d", seqs.tokens["c"][:-1] + [(seqs.tokens["c"][-1] + 1) % VOCAB])
    seqs.computed["d"], seqs.tables["d"] = seqs.computed["c"], shared + [copy_to]
    step({"a": 1, "b": 1, "c": 1, "d": 1}, SchedulerOutput(copy=[(last, copy_to)]))
    step({"c": 1, "d": 1})


def test_execute_with_nothing_scheduled_still_moves_blocks():
    runner = make_runner(tiny_model(), num_gpu_blocks=4, num_cpu_blocks=2)
    for cache in runner.kv_caches:
        cache.normal_()
    logits = runner.execute(SchedulerOutput(swap_out=[(2, 0)]))
    assert logits.shape == (0, VOCAB)
    for device, host in zip(runner.kv_caches, runner.host_caches, strict=True):
        assert torch.equal(host[:, 0], device[:, 2])


# -- bfloat16 against the float32 oracle -------------------------------------------------------

# bfloat16 keeps 8 bits of mantissa: through SmolLM2's 30 layers its logits (magnitude ~30) stay
# within 0.85 of float32's on these prompts; the bound leaves headroom for other prompts.
BF16_LOGIT_ATOL = 1.5


def test_bfloat16_runner_follows_the_float32_oracle_up_to_near_ties(bundled_model):
    """The bundled model served in bfloat16 (CPU attention, bf16 KV cache): over a prefill and
    six greedy decode steps its logits stay within `BF16_LOGIT_ATOL` of the float32 dense
    model's on the same context, and each greedy token is float32's choice unless float32's top
    two were within that tolerance (a near-tie that bfloat16 rounding may flip)."""
    model, config = bundled_model
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    runner = cpu_runner(bf16, config, block_size=16, num_gpu_blocks=16, dtype=torch.bfloat16)
    assert runner.ops.name == "cpu" and runner.kv_caches[0].dtype == torch.bfloat16
    rng = random.Random(0)
    tokens = [[rng.randrange(17, config.vocab_size) for _ in range(n)] for n in (41, 7)]
    tables = [list(range(i * 4, i * 4 + 4)) for i in range(len(tokens))]
    computed = [0] * len(tokens)
    for _ in range(7):
        entries = [scheduled(t[c:], c, table)
                   for t, c, table in zip(tokens, computed, tables, strict=True)]
        logits = runner.execute(plan_of(entries))
        assert logits.dtype == torch.float32
        for i, row in enumerate(logits):
            oracle = dense_last_logits(model, tokens[i])
            torch.testing.assert_close(row, oracle, rtol=0, atol=BF16_LOGIT_ATOL)
            ours, best = int(row.argmax()), int(oracle.argmax())
            assert ours == best or oracle[best] - oracle[ours] < BF16_LOGIT_ATOL
            computed[i] = len(tokens[i])
            tokens[i].append(ours)


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
def test_the_gemm_choice_is_made_when_the_runner_starts_not_in_a_step(architecture):
    from minipaged.platforms.cpu.linear import CPULinear
    from minipaged.platforms.cpu.onednn import onednn_is_faster

    onednn_is_faster.cache_clear()  # earlier tests' choices must not stand in for this one's
    model = tiny_model(architecture, seed=5)
    runner = make_runner(model)
    measured = onednn_is_faster.cache_info().misses
    linears = [m for m in runner.model.modules() if isinstance(m, CPULinear)]
    assert linears
    for module in linears:  # every weight shape's choice is already made
        onednn_is_faster(*module.weight.shape, module.weight.dtype)
    assert onednn_is_faster.cache_info().misses == measured
    runner.execute(plan_of([scheduled([1, 2, 3], 0, [0])]))
    runner.execute(plan_of([scheduled([4], 3, [0])]))  # a decode (replayed for LLaMA)
    assert onednn_is_faster.cache_info().misses == measured  # no step measured anything


@pytest.mark.parametrize("platform", PLATFORMS)
def test_a_token_or_position_outside_the_model_is_refused_before_any_kernel_runs(platform):
    longest = tiny_config().max_position_embeddings
    runner = make_runner(tiny_model(), num_gpu_blocks=longest // 4 + 1, **PLATFORMS[platform])
    runner.execute(plan_of([scheduled([1, 2, 3, 4], 0, [7, 3])]))
    before = [cache.clone() for cache in runner.kv_caches]
    refused = [
        ("token id out of range", [scheduled([VOCAB], 4, [7, 3])]),
        ("token id out of range", [scheduled([-1], 4, [7, 3]), scheduled([5], 0, [9], seq_id=1)]),
        ("position out of range", [scheduled([3], longest, list(range(longest // 4 + 1)))]),
    ]
    for message, entries in refused:
        with pytest.raises(ModelInputError, match=message):
            runner.execute(plan_of(entries))
    for cache, kept in zip(runner.kv_caches, before, strict=True):
        assert torch.equal(cache, kept)


# -- the KV cache's size --------------------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(blocks=st.floats(0, 300), block_size=st.sampled_from([1, 4, 16]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       max_num_batched_tokens=st.integers(1, 600), max_num_seqs=st.integers(1, 300))
def test_the_cache_takes_the_platforms_budget_after_a_profile_of_the_largest_step(
        blocks, block_size, dtype, max_num_batched_tokens, max_num_seqs):
    config = tiny_config()
    per_block = kv_bytes_per_block(config, block_size, dtype)
    platform = BudgetPlatform(blocks * per_block)
    model = tiny_model().to(dtype)

    def build() -> ModelRunner:
        return cpu_runner(model, config, block_size=block_size, dtype=dtype, platform=platform,
                          max_num_batched_tokens=max_num_batched_tokens,
                          max_num_seqs=max_num_seqs, gpu_memory_utilization=0.5,
                          kv_cache_memory=2.0)

    if int(blocks) < 1:
        with pytest.raises(ValueError, match="no memory left for even one KV block"):
            build()
    else:
        runner = build()
        assert platform.configs == [runner.config]  # the settings handed to the platform
        assert runner.num_gpu_blocks == int(platform.budget // per_block)
        assert all(c.shape[1] == runner.num_gpu_blocks for c in runner.kv_caches)
        assert runner.kv_caches[0].dtype == dtype
    tokens = min(max_num_batched_tokens, config.max_position_embeddings)
    assert platform.forwards == [(tokens, True)]  # the profile ran the largest step, no cache
    assert platform.logit_rows == [min(max_num_seqs, tokens)]


def test_where_decode_steps_are_captured_the_largest_is_profiled_too():
    """The memory a capture keeps is counted before the cache is sized: the platform is handed
    a profile of the largest captured decode step (its rows, their logits) after the largest
    step's."""
    config = tiny_config()
    platform = BudgetPlatform(9 * kv_bytes_per_block(config, 4, torch.float32), (2, 4))
    runner = cpu_runner(tiny_model(), config, block_size=4, platform=platform,
                        max_num_batched_tokens=32, max_num_seqs=8)
    assert runner.num_gpu_blocks == 9 and runner.graphs is not None
    assert platform.forwards == [(32, True), (4, True)] and platform.logit_rows == [8, 4]
    eager = BudgetPlatform(9 * kv_bytes_per_block(config, 4, torch.float32), (2, 4))
    cpu_runner(tiny_model(), config, block_size=4, platform=eager, max_num_batched_tokens=32,
               max_num_seqs=8, enforce_eager=True)
    assert eager.forwards == [(32, True)]


def test_a_given_number_of_blocks_runs_no_profile():
    platform = BudgetPlatform(0)
    runner = make_runner(tiny_model(), num_gpu_blocks=7, platform=platform)
    assert runner.num_gpu_blocks == 7 and platform.forwards == []


def test_the_cpu_and_reference_platforms_grant_kv_cache_memory_gib():
    config = tiny_config()
    per_block = kv_bytes_per_block(config, 4, torch.float32)
    for platform in (Platform(torch.device("cpu")), CPUPlatform(torch.device("cpu"))):
        runner = cpu_runner(tiny_model(), config, block_size=4, platform=platform,
                            kv_cache_memory=0.001)
        assert runner.num_gpu_blocks == int(0.001 * GiB // per_block)
