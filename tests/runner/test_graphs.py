"""`StepGraphs`, the bookkeeping of replayed decode steps every platform shares, on the CPU.

A stand-in platform (`RerunPlatform`) captures a step by running its forward and replays it by
running the forward again over the static buffers into the same output buffer: what a CUDA
graph does, with PyTorch's modules and the reference attention, so every check here runs on
any machine. Checked: every size of the ladder 1, 2, 4, 8 is captured at start-up, largest
first, writing nothing; a step of n rows replays the smallest size that holds it (3 rows -> 4);
its logits are the eager runner's; the padded rows write no K/V (every slot but the step's
own keeps its value, even where the buffers still held an earlier step's slots); a new capture
key is captured by the step that meets it; only decode steps of up to the largest size within
the context limit replay; only the table rows that changed are copied to a device's buffers;
a size the platform cannot capture runs the modules and is not retried;
a greedy engine gives the eager engine's tokens; and a replayed step's logits, the buffer the
next replay writes again, are kept by a caller that reruns requests one by one.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import cpu_runner, plan_of, run_bounded, scheduled, tiny_llama_parts
from torch import Tensor, nn

from minipaged.attention.reference import REFERENCE_OPS
from minipaged.engine.config import EngineConfig
from minipaged.engine.engine import LLMEngine
from minipaged.platforms.base import CaptureUnsupported, Platform, Replay
from minipaged.runner.graphs import StaticBatch, StepGraphs
from minipaged.runner.model_runner import ModelRunner
from minipaged.sampling.params import SamplingParams

CPU = torch.device("cpu")
LADDER = (1, 2, 4, 8)
BLOCK_SIZE, NUM_BLOCKS = 4, 64
# The reference attention without its per-step plan: the plan is made from the metadata's
# values, which a rerun forward must read afresh from the static buffers at every replay.
UNPLANNED_OPS = dataclasses.replace(REFERENCE_OPS, plan=None)


class RerunPlatform(Platform):
    """Captures a step by running its forward; the replay runs it again and writes its result
    into the captured output buffer (what `StepGraphs` reads)."""

    name = "rerun"

    def __init__(self, sizes: tuple[int, ...] = LADDER) -> None:
        super().__init__(CPU, UNPLANNED_OPS)
        self.graph_sizes = sizes
        self.captures: list[int] = []  # the rows of each capture
        self.replays: list[int] = []  # the rows of each replay
        self.key: object = None

    def capture_key(self) -> object:
        return self.key

    def capture(self, forward: Callable[[], Tensor]) -> tuple[Replay, Tensor]:
        out = forward()
        self.captures.append(out.shape[0])

        def replay() -> None:
            self.replays.append(out.shape[0])
            out.copy_(forward())

        return replay, out


class RefusingPlatform(RerunPlatform):
    """Cannot capture a size of more than two rows."""

    def capture(self, forward: Callable[[], Tensor]) -> tuple[Replay, Tensor]:
        self.captures.append(-1)
        replay, out = super().capture(forward)
        if out.shape[0] > 2:
            raise CaptureUnsupported("too many rows for this stand-in")
        return replay, out


@pytest.fixture(scope="module")
def parts() -> tuple[nn.Module, Any]:
    return tiny_llama_parts()


def runner_of(parts: tuple[nn.Module, Any], platform: Platform | None = None,
              **kwargs: Any) -> ModelRunner:
    model, config = parts
    eager = platform is None
    return cpu_runner(model, config, block_size=BLOCK_SIZE, num_gpu_blocks=NUM_BLOCKS,
                      platform=Platform(CPU, UNPLANNED_OPS) if eager else platform,
                      enforce_eager=eager, **kwargs)


def fill(*runners: ModelRunner, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for caches in zip(*(r.kv_caches for r in runners), strict=True):
        values = torch.randn(caches[0].shape, generator=gen)
        for cache in caches:
            cache.copy_(values)


def decodes(rows: int, first_block: int = 0, start: int = 2, seed: int = 0) -> list:
    """`rows` decodes at position `start`, sequence i in block `first_block + i`."""
    rng = random.Random(seed)
    return [scheduled([rng.randrange(64)], start, [first_block + i], seq_id=i)
            for i in range(rows)]


def slots_of(entries: list) -> set[int]:
    return {e.block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
            for e in entries for p in range(e.start, e.start + len(e.token_ids))}


def assert_only_slots_changed(runner: ModelRunner, before: list[Tensor], slots: set[int]) -> None:
    """Every cache slot outside `slots` holds what it held, in every layer, K and V."""
    for cache, old in zip(runner.kv_caches, before, strict=True):
        flat, old_flat = cache.flatten(1, 2), old.flatten(1, 2)  # [2, slots, H_kv, D]
        kept = [s for s in range(flat.shape[1]) if s not in slots]
        assert torch.equal(flat[:, kept], old_flat[:, kept])
        for slot in slots:
            assert not torch.equal(flat[:, slot], old_flat[:, slot])  # written


@settings(max_examples=16, deadline=None)
@given(rows=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_a_step_runs_as_the_next_size_of_the_ladder_and_writes_only_its_own_slots(
        parts, rows, seed):
    """Every size is captured at start-up, largest first, over padded rows that write nothing;
    each step replays its size and gives the eager runner's logits and K/V, writing no other
    slot."""
    platform = RerunPlatform()
    runner, eager = runner_of(parts, platform), runner_of(parts)
    assert platform.captures == [8, 4, 2, 1]
    assert all(not cache.any() for cache in runner.kv_caches)  # the captures wrote nothing
    fill(runner, eager, seed=seed)
    size = next(s for s in LADDER if s >= rows)
    for start, replays in ((2, [size]), (3, [size, size])):  # 3 rows -> 4
        before = [cache.clone() for cache in runner.kv_caches]
        entries = decodes(rows, first_block=8, start=start, seed=seed)
        logits = runner.execute(plan_of(entries))
        assert platform.captures == [8, 4, 2, 1] and platform.replays == replays
        assert logits.shape == (rows, parts[1].vocab_size)
        torch.testing.assert_close(logits, eager.execute(plan_of(entries)), atol=1e-6,
                                   rtol=1e-6)
        assert_only_slots_changed(runner, before, slots_of(entries))
        for ours, theirs in zip(runner.kv_caches, eager.kv_caches, strict=True):
            torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)


def test_only_decode_steps_of_up_to_the_largest_size_within_the_context_replay(parts):
    platform = RerunPlatform()
    runner = runner_of(parts, platform, max_model_len=32)
    graphs = runner.graphs
    assert graphs is not None and graphs.sizes == LADDER and graphs.max_blocks == 8
    takes = {
        "one decode": decodes(1),
        "eight decodes": decodes(8),
        "a one-token prompt": [scheduled([5], 0, [3])],
        "nine decodes": decodes(9),
        "a prefill": [scheduled([1, 2, 3], 0, [3])],
        "a decode beside a chunk": decodes(2) + [scheduled([1, 2], 4, [30, 31], seq_id=7)],
        "a decode past max_model_len": [scheduled([1], 32, list(range(40, 49)))],
    }
    expected = {name: name in ("one decode", "eight decodes", "a one-token prompt")
                for name in takes}
    assert {name: graphs.takes(runner.flat_batch(e)) for name, e in takes.items()} == expected
    def captured_or_replayed() -> int:
        return len(platform.captures) + len(platform.replays)

    for name, entries in takes.items():
        steps = captured_or_replayed()
        runner.execute(plan_of(entries))
        assert captured_or_replayed() == steps + expected[name], name


def test_a_size_the_platform_cannot_capture_runs_the_modules_and_is_not_tried_again(parts):
    platform = RefusingPlatform()
    runner, eager = runner_of(parts, platform), runner_of(parts)
    for _ in range(2):
        for rows in (2, 3):
            entries = decodes(rows, first_block=10)
            torch.testing.assert_close(runner.execute(plan_of(entries)),
                                       eager.execute(plan_of(entries)), atol=1e-6, rtol=1e-6)
    assert platform.captures == [-1, 8, -1, 4, -1, 2, -1, 1]  # each tried once, at start-up
    assert platform.replays == [2, 2]  # 3 rows (size 4, refused) ran the modules


def test_a_size_is_captured_again_for_another_capture_key(parts):
    """A capture is bound to its platform's key (the CPU's: its thread count): the step that
    meets a new key is its size's capture under it, computed for real over that step's rows and
    padding only (the last step's blocks, another sequence's by now, keep what they hold), and
    the old captures replay under the old key."""
    platform = RerunPlatform()
    runner = runner_of(parts, platform)
    runner.execute(plan_of(decodes(3, first_block=0)))  # size 4
    platform.key = "other"
    fill(runner, seed=1)  # blocks 0-2 freed and written by someone else
    before = [cache.clone() for cache in runner.kv_caches]
    later = decodes(5, first_block=20)
    runner.execute(plan_of(later))  # size 8, captured now under the new key
    assert_only_slots_changed(runner, before, slots_of(later))
    platform.key = None
    runner.execute(plan_of(decodes(2)))
    assert platform.captures == [8, 4, 2, 1, 8] and platform.replays == [4, 2]


def test_only_the_table_rows_that_changed_are_copied_to_the_device():
    """With a device buffer apart from the host's (a GPU's), a step copies the per-row fields
    and, of the block tables, only the rows that differ from what the device holds."""
    batch = StaticBatch(4, 3, CPU, copies=True)
    assert batch.device_memory is not batch.host_memory
    first = [scheduled([9], 6, [1, 5], seq_id=0), scheduled([8], 6, [2, 6])]
    batch.write(_flat(first), 4)
    assert torch.equal(batch.device_memory, batch.host_memory)
    tables = batch.views["block_tables"]
    tables.fill_(99)  # stands for rows the next write must leave alone
    batch.write(_flat([scheduled([4], 7, [1, 5], seq_id=0), scheduled([3], 8, [2, 6, 7])]), 4)
    assert batch.views["input_ids"].tolist() == [4, 3, 0, 0]  # the per-row fields: all
    assert tables[1].tolist() == [2, 6, 7]  # the table that grew
    assert tables[0].tolist() == tables[2].tolist() == tables[3].tolist() == [99] * 3
    batch.write(_flat([scheduled([4], 7, [1, 5], seq_id=0)]), 4)  # row 1 padded now
    assert tables[1, 0] == 0 and tables[0].tolist() == [99] * 3


def test_the_static_batch_lies_in_one_buffer_and_pads_what_the_step_leaves():
    batch = StaticBatch(4, 3, CPU)
    assert batch.device_memory is batch.host_memory  # on a CPU one buffer serves both
    storage = batch.host_memory.untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == storage for v in batch.views.values())
    runner_batch = _flat([scheduled([9], 6, [1, 5], seq_id=0), scheduled([8], 6, [2, 6])])
    batch.write(runner_batch, 4)
    views = batch.views
    assert views["input_ids"].tolist() == [9, 8, 0, 0]
    assert views["positions"].tolist() == [6, 6, 0, 0]
    assert views["slot_mapping"].tolist() == [5 * 4 + 2, 6 * 4 + 2, -1, -1]
    assert views["seq_lens"].tolist() == [7, 7, 1, 1]
    assert views["query_start_loc"].tolist() == [0, 1, 2, 3, 4]
    assert views["block_tables"][:, 0].tolist() == [1, 2, 0, 0]
    assert views["block_tables"][:2, 1].tolist() == [5, 6]
    batch.write(_flat([scheduled([7], 2, [3])]), 4)  # fewer rows: the rest padded again
    assert views["input_ids"].tolist() == [7, 0, 0, 0]
    assert views["slot_mapping"].tolist() == [3 * 4 + 2, -1, -1, -1]
    assert views["seq_lens"].tolist() == [3, 1, 1, 1]


def _flat(entries: list) -> Any:
    from minipaged.runner.flat_batch import flat_batch

    return flat_batch(entries, BLOCK_SIZE, NUM_BLOCKS)


def engine_of(parts: tuple[nn.Module, Any], platform: Platform | None) -> LLMEngine:
    config = EngineConfig(block_size=BLOCK_SIZE, num_gpu_blocks=NUM_BLOCKS, num_cpu_blocks=0,
                          device="cpu")
    return LLMEngine(parts[0], parts[1], tokenizer=None, config=config,
                     runner=runner_of(parts, platform))


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 9, 2], [7, 1, 30, 4], [11, 3], [8], [60, 61, 62, 63, 1]]


def test_a_greedy_engine_gives_the_eager_engines_tokens(parts):
    tokens = []
    for platform in (RerunPlatform(), None):
        engine = engine_of(parts, platform)
        ids = [engine.add_request(None, p, GREEDY) for p in PROMPTS]
        finals = run_bounded(engine)
        tokens.append([finals[i].outputs[0].token_ids for i in ids])
        if platform is not None:
            assert platform.replays  # the decodes did replay
    assert tokens[0] == tokens[1]


def test_a_failed_step_rerun_request_by_request_keeps_each_ones_logits(parts):
    """A replayed step's logits are its buffer, written again by the next replay: when a step
    fails and the engine runs each request alone, it must keep each one's logits before
    running the next. Every step of more than one request fails here: each request must get
    the tokens it gets alone."""
    engine = engine_of(parts, RerunPlatform())
    alone = []
    for prompt in PROMPTS[:3]:
        engine.add_request(None, prompt, GREEDY)
        alone.append(list(run_bounded(engine).values())[0].outputs[0].token_ids)
    real = engine.runner.execute

    def fails_together(plan: Any) -> Tensor:
        if len(plan.scheduled) > 1:
            raise RuntimeError("injected: the batch fails, each request alone does not")
        return real(plan)

    with mock.patch.object(engine.runner, "execute", fails_together):
        ids = [engine.add_request(None, prompt, GREEDY) for prompt in PROMPTS[:3]]
        finals = run_bounded(engine)
    for request_id, tokens in zip(ids, alone, strict=True):
        assert finals[request_id].outputs[0].token_ids == tokens


def test_the_ladder_is_sorted_and_bounds_the_rows_and_blocks():
    model, config = tiny_llama_parts()
    caches = [torch.zeros(2, 4, BLOCK_SIZE, 2, 8) for _ in range(config.num_layers)]
    platform = RerunPlatform((8, 2, 4))
    graphs = StepGraphs(model, caches, UNPLANNED_OPS, platform, BLOCK_SIZE, 9)
    assert graphs.sizes == (2, 4, 8) and platform.captures == [8, 4, 2]  # sorted
    assert graphs.max_blocks == 3  # 9 positions in blocks of 4
    assert [graphs.size_for(n) for n in range(1, 10)] == [2, 2, 4, 4, 8, 8, 8, 8, None]
