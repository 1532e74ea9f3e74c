"""The baselines as drop-in parts: Orca reservations and static batching under the real schedulers.

* Reservation sizes are the paper's definitions (worked by hand) and, at one slot per block,
  identical to `minipaged.reservation.ReservationCache` -- chunk for chunk, slot for slot.
* A hypothesis-driven run of random requests through `OrcaScheduler` / `StaticBatchScheduler`
  keeps the adapter's invariants after every step, finishes every request with exactly its
  tokens and gives all memory back; static batching never admits into a running batch.
* In the engine, a baseline's contiguous block tables give the same greedy tokens as the dense
  model (the chunks are real, disjoint regions of the KV tensor).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import assert_engine_drained, tiny_engine, tiny_llama_parts

from minipaged.baselines import (
    SYSTEMS,
    OrcaScheduler,
    ReservationExceededError,
    ReservationKVCacheManager,
    StaticBatchScheduler,
    build_scheduler,
    install,
    reservation_len,
)
from minipaged.dense import generate_dense
from minipaged.kv_cache import KVCacheError, NoFreeBlocksError
from minipaged.reservation import ReservationCache
from minipaged.sampling import SamplingParams
from minipaged.scheduler import SchedulerConfig
from minipaged.sequence import Sequence, SequenceGroup, check_stop

MAX_LEN = 64
_ids = iter(range(10**9))


def make_group(prompt_len: int, max_tokens: int, width: int = 1) -> SequenceGroup:
    seq_id = next(_ids)
    seq = Sequence(seq_id, [5 + (seq_id + i) % 40 for i in range(prompt_len)])
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    if width > 1:
        params = SamplingParams(temperature=1.0, n=width, max_tokens=max_tokens, ignore_eos=True)
    return SequenceGroup(f"r{seq_id}", [seq], params, arrival_time=float(seq_id))


def run_step(scheduler) -> None:
    """The engine around the model, with made-up tokens; then the adapter's invariants."""
    out = scheduler.schedule(0.0)
    for item in out.scheduled:
        table = scheduler.kv_cache.block_table(item.seq.seq_id)
        assert len(table) * scheduler.kv_cache.block_size >= item.start + item.num_new_tokens
    scheduler.mark_computed(out)
    for item in out.scheduled:
        if item.needs_logits:
            item.seq.append_token(3, -0.5)
            decision = check_stop(item.seq, item.group.sampling_params)
            if decision is not None:
                item.seq.finish(decision)
    scheduler.finish_step()
    scheduler.kv_cache.check_invariants()


# -- reservation sizes ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "block_size", "reserved_blocks", "chunk_blocks"),
    [
        # prompt 10 + output 20 tokens, max length 64:
        ("max", 1, 64, 64),  # the maximum length
        ("pow2", 1, 42, 64),  # 10 + next power of two of 20 (32) = 42, buddy -> 64
        ("oracle", 1, 30, 32),  # exactly 30, buddy -> 32
        ("max", 8, 8, 8),  # 64 slots = 8 blocks of 8
        ("pow2", 8, 6, 8),  # 42 slots -> 6 blocks -> 8
        ("oracle", 8, 4, 4),  # 30 slots -> 4 blocks
    ],
)
def test_reservation_sizes_follow_the_policy(policy, block_size, reserved_blocks, chunk_blocks):
    kv = ReservationKVCacheManager(256 // block_size, block_size, policy, MAX_LEN)
    kv.expect(0, prompt_len=10, output_len=20)
    kv.allocate(0, list(range(10)))
    assert kv.reserved_blocks(0) == chunk_blocks
    usage = kv.memory_usage()
    assert usage.token_slots == 10
    assert usage.reserved_slots == 20
    assert usage.internal_fragmentation_slots == reserved_blocks * block_size - 30
    assert usage.external_fragmentation_slots == (chunk_blocks - reserved_blocks) * block_size
    assert kv.num_free_blocks == 256 // block_size - chunk_blocks


@given(
    policy=st.sampled_from(["max", "pow2", "oracle"]),
    prompt_len=st.integers(1, 1000),
    output_len=st.integers(1, 1000),
)
def test_reservation_len_is_reservation_caches(policy, prompt_len, output_len):
    max_len = 2048
    reference = ReservationCache(max_len, policy, max_len)
    assert reservation_len(policy, prompt_len, output_len, max_len) == reference.reservation_len(
        prompt_len, output_len
    )


@settings(max_examples=15)
@given(
    policy=st.sampled_from(["max", "pow2", "oracle"]),
    requests=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 24)), min_size=1, max_size=30),
    data=st.data(),
)
def test_one_slot_blocks_account_exactly_like_reservation_cache(policy, requests, data):
    """Admit in order while both fit, grow, free in a random order: the same memory, always."""
    capacity = 300
    kv = ReservationKVCacheManager(capacity, 1, policy, MAX_LEN)
    reference = ReservationCache(capacity, policy, MAX_LEN)
    live = []
    for rid, (prompt_len, output_len) in enumerate(requests):
        kv.expect(rid, prompt_len, output_len)
        fits = reference.can_allocate(prompt_len, output_len)
        assert kv.can_reserve(rid) == fits
        if fits:
            kv.allocate(rid, [1] * prompt_len)
            reference.allocate(rid, prompt_len, output_len)
            grow = data.draw(st.integers(0, output_len), label="grow")
            kv.append_slots(rid, [1] * grow)
            reference.append(rid, grow)
            live.append(rid)
        if live and data.draw(st.booleans(), label="free one"):
            victim = live.pop(data.draw(st.integers(0, len(live) - 1), label="victim"))
            kv.free(victim)
            reference.free(victim)
        kv.check_invariants()
        assert kv.memory_usage() == reference.memory_usage()
        assert kv.num_free_blocks == reference.allocator.num_free_slots


def test_parallel_samples_each_get_a_chunk_reserved_at_admission():
    kv = ReservationKVCacheManager(128, 1, "oracle", MAX_LEN)
    kv.expect(0, prompt_len=5, output_len=11, width=3)  # 16 slots each
    kv.allocate(0, [1] * 5)
    assert kv.num_free_blocks == 128 - 3 * 16
    kv.mark_computed(0, 5)
    kv.fork(0, 1)
    kv.fork(0, 2)
    assert kv.num_tokens(2) == 5 and kv.num_computed_tokens(2) == 5
    tables = [set(kv.block_table(s)) for s in range(3)]
    assert not (tables[0] & tables[1] or tables[0] & tables[2] or tables[1] & tables[2])
    with pytest.raises(NoFreeBlocksError):
        kv.fork(0, 3)  # a fourth sequence: the request reserved three chunks
    kv.check_invariants()
    for s in (1, 0):
        kv.free(s)
        assert kv.num_free_blocks == 128 - 3 * 16  # held until the request's last sequence
    kv.free(2)
    assert kv.num_free_blocks == 128
    kv.check_invariants()


def test_bad_use_is_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="policy"):
        ReservationKVCacheManager(128, 1, "lifo", MAX_LEN)
    with pytest.raises(ValueError, match="cannot hold"):
        ReservationKVCacheManager(4, 8, "max", MAX_LEN)
    kv = ReservationKVCacheManager(128, 4, "pow2", MAX_LEN)
    with pytest.raises(KVCacheError, match="expect"):
        kv.allocate(0, [1, 2])
    with pytest.raises(KVCacheError, match="output length"):
        kv.can_allocate([1, 2])
    kv.expect(0, prompt_len=2, output_len=2)  # 2 + 2 = 4 slots: one block
    kv.allocate(0, [1, 2])
    kv.append_slots(0, [3, 4])
    with pytest.raises(ReservationExceededError, match="outgrow"):
        kv.append_slots(0, [5])
    assert kv.num_tokens(0) == 4  # untouched
    with pytest.raises(KVCacheError, match="swapped"):
        kv.swap_out([0])
    with pytest.raises(ValueError, match="system"):
        build_scheduler("vllm", SchedulerConfig(max_model_len=MAX_LEN), 64, 1)


# -- under the schedulers -------------------------------------------------------------------------

request_lists = st.lists(
    st.tuples(st.integers(1, 30), st.integers(1, 30), st.integers(0, 3)),  # prompt, output, at
    min_size=1,
    max_size=14,
)


def serve(scheduler, requests, added: list[str] | None = None) -> list[SequenceGroup]:
    """Add each request at its step (appending its id to `added`), step until all finished."""
    groups = [(at, make_group(p, o)) for p, o, at in requests]
    pending = sorted(groups, key=lambda g: g[0])
    step = 0
    while pending or scheduler.has_unfinished():
        while pending and pending[0][0] <= step:
            group = pending.pop(0)[1]
            scheduler.add(group)
            if added is not None:
                added.append(group.request_id)
        run_step(scheduler)
        step += 1
        assert step < 5000, "no progress"
    return [g for _, g in groups]


@settings(max_examples=20)
@given(
    policy=st.sampled_from(["max", "pow2", "oracle"]),
    block_size=st.sampled_from([1, 4, 16]),
    requests=request_lists,
    budget=st.sampled_from([8, 64]),
)
def test_orca_serves_every_request_and_returns_all_memory(policy, block_size, requests, budget):
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=6, max_model_len=MAX_LEN)
    kv = ReservationKVCacheManager(192 // block_size, block_size, policy, MAX_LEN)
    scheduler = OrcaScheduler(config, kv)
    groups = serve(scheduler, requests)
    for group, (_, output_len, _) in zip(groups, requests, strict=True):
        assert group.seqs[0].get_output_len() == output_len
    assert scheduler.num_preemptions == 0  # a reservation is never outgrown
    assert kv.num_free_blocks == kv.num_blocks and not kv.seq_ids()
    starts = [g.metrics.first_scheduled_time for g in groups]
    assert all(s is not None for s in starts)


@settings(max_examples=20)
@given(requests=request_lists, rows=st.integers(1, 3), block_size=st.sampled_from([1, 8]))
def test_static_batching_never_admits_into_a_running_batch(requests, rows, block_size):
    config = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8, max_model_len=MAX_LEN)
    kv = ReservationKVCacheManager(rows * MAX_LEN // block_size, block_size, "max", MAX_LEN)
    scheduler = StaticBatchScheduler(config, kv)
    batches: list[set[str]] = []
    schedule = scheduler.schedule

    def schedule_and_check(now: float):
        before = {g.request_id for g in scheduler.running}  # the batch still running
        out = schedule(now)
        running = {g.request_id for g in scheduler.running}
        admitted = running - before
        if admitted:
            assert not before, f"{admitted} joined the running batch {before}"
            assert len(running) <= rows  # one max-length row each
            batches.append(running)
        return out

    scheduler.schedule = schedule_and_check
    added: list[str] = []
    groups = serve(scheduler, requests, added)
    assert all(g.is_finished() for g in groups)
    assert kv.num_free_blocks == kv.num_blocks
    # The batches partition the requests in the order they arrived (first come, first served).
    position = {rid: i for i, rid in enumerate(added)}
    assert [rid for b in batches for rid in sorted(b, key=position.get)] == added


def test_orca_max_admits_fewer_requests_than_oracle_at_equal_capacity():
    """The point of the baselines: at the same capacity, over-reservation limits the batch."""
    admitted = {}
    for policy in ("max", "pow2", "oracle"):
        config = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64, max_model_len=MAX_LEN)
        scheduler = OrcaScheduler(config, ReservationKVCacheManager(256, 1, policy, MAX_LEN))
        for _ in range(20):
            scheduler.add(make_group(6, 10))  # 16 slots each
        scheduler.schedule(0.0)
        admitted[policy] = len(scheduler.running)
    assert admitted == {"max": 256 // 64, "pow2": 256 // 32, "oracle": 256 // 16}


# -- in the engine --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama_parts(max_position_embeddings=MAX_LEN, initializer_range=0.3)


@pytest.mark.parametrize("system", SYSTEMS)
def test_engine_greedy_tokens_equal_dense_under_every_system(tiny, system):
    model, _ = tiny
    engine = tiny_engine(tiny, num_gpu_blocks=40, block_size=4, num_cpu_blocks=0, seed=0)
    install(engine, system)
    assert type(engine.scheduler).__name__ == {
        "static": "StaticBatchScheduler",
        "paged": "FCFSScheduler",
    }.get(system, "OrcaScheduler")
    prompts = [[(7 * i + j) % 60 + 2 for j in range(3 + 5 * i % 17)] for i in range(6)]
    lengths = [5 + 3 * i for i in range(6)]
    ids = [
        engine.add_request(None, p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        for p, n in zip(prompts, lengths, strict=True)
    ]
    finals = engine.run_until_done()
    for request_id, prompt, n in zip(ids, prompts, lengths, strict=True):
        expected = generate_dense(model, [prompt], n)[0]
        assert finals[request_id].outputs[0].token_ids == expected
    assert_engine_drained(engine)


def test_every_system_is_built_at_the_capacity_asked_for():
    config = SchedulerConfig(max_model_len=MAX_LEN)
    for system in SYSTEMS:
        scheduler = build_scheduler(system, config, 48, 4)
        assert scheduler.kv_cache.num_blocks == 48 and scheduler.kv_cache.block_size == 4
        assert scheduler.kv_cache.num_free_blocks == 48
