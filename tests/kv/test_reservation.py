"""Tests of the reservation baselines' memory: the buddy allocator, reservation sizes per policy
and the Fig. 2 accounting of the Orca variants and static batching (vLLM paper §3, §6.1)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minipaged.kv.buddy import BuddyAllocator, next_power_of_two
from minipaged.kv.interface import KVCacheError, MemoryUsage, NoFreeBlocksError
from minipaged.kv.reservation import (
    ReservationExceededError,
    ReservationKVCacheManager,
    reservation_len,
)
from minipaged.sim.traces import alpaca_like, sharegpt_like

# --------------------------------------------------------------------------------------------
# Buddy allocator
# --------------------------------------------------------------------------------------------


class BuddyMachine(RuleBasedStateMachine):
    """Random allocate/free on an odd-sized region; chunks must stay disjoint, aligned powers
    of two, and everything must merge back once freed."""

    def __init__(self) -> None:
        super().__init__()
        self.capacity = 100  # 64 + 32 + 4
        self.buddy = BuddyAllocator(self.capacity)
        self.chunks: dict[int, tuple[int, int]] = {}  # offset -> (requested, chunk length)

    @rule(size=st.integers(1, 70))
    def allocate(self, size: int) -> None:
        expected_ok = self.buddy.can_allocate(size)
        try:
            offset, length = self.buddy.allocate(size)
        except NoFreeBlocksError:
            assert not expected_ok
            return
        assert expected_ok
        assert length == next_power_of_two(size)
        self.chunks[offset] = (size, length)

    @precondition(lambda self: self.chunks)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        offset = data.draw(st.sampled_from(sorted(self.chunks)))
        self.buddy.free(offset)
        del self.chunks[offset]

    @invariant()
    def chunks_are_disjoint_aligned_and_counted(self) -> None:
        used = set()
        for offset, (_, length) in self.chunks.items():
            span = set(range(offset, offset + length))
            assert not used & span and offset + length <= self.capacity
            used |= span
            # Aligned to its size within its part of the decomposition 64 | 32 | 4.
            part_start = 0 if offset < 64 else 64 if offset < 96 else 96
            assert (offset - part_start) % length == 0
        assert self.buddy.num_free_slots == self.capacity - len(used)

    def teardown(self) -> None:
        for offset in list(self.chunks):
            self.buddy.free(offset)
        assert self.buddy.largest_free_chunk() == 64  # fully merged again
        assert self.buddy.num_free_slots == self.capacity


BuddyMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30)
TestBuddyMachine = BuddyMachine.TestCase


def test_buddy_fragmentation_with_the_papers_capacity() -> None:
    buddy = BuddyAllocator(15_700)
    for _ in range(7):  # 8192 + 4096 + 2048 hold seven 2048-slot chunks
        buddy.allocate(2048)
    assert buddy.num_free_slots == 15_700 - 7 * 2048
    assert not buddy.can_allocate(2048)  # 1364 free slots, none of them a 2048 chunk
    with pytest.raises(NoFreeBlocksError):
        buddy.allocate(2048)


def test_buddy_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="num_slots"):
        BuddyAllocator(0)
    buddy = BuddyAllocator(16)
    with pytest.raises(ValueError, match="size"):
        buddy.allocate(0)
    with pytest.raises(KVCacheError, match="no chunk"):
        buddy.free(3)


# --------------------------------------------------------------------------------------------
# Reservations: sizes and the Fig. 2 accounting
# --------------------------------------------------------------------------------------------

MAX_LEN = 64


def reserve(kv: ReservationKVCacheManager, rid, prompt_len: int, output_len: int) -> None:
    """Admit a request the way `OrcaScheduler` does: announce it, then allocate its prompt."""
    kv.expect(rid, prompt_len, output_len)
    kv.allocate(rid, [1] * prompt_len)


@pytest.mark.parametrize(
    ("policy", "reserved", "chunk"),
    [
        ("oracle", 10 + 7, 32),  # exactly prompt + output; the allocator rounds 17 up to 32
        ("pow2", 10 + 8, 32),  # output 7 over-reserved to 8
        ("max", 2048, 2048),  # the model's maximum length
    ],
)
def test_reservation_accounting_of_one_request(policy: str, reserved: int, chunk: int) -> None:
    kv = ReservationKVCacheManager(4096, 1, policy, max_seq_len=2048)
    reserve(kv, "r", prompt_len=10, output_len=7)
    kv.append_slots("r", num_tokens=13)
    usage = kv.memory_usage()
    assert usage.token_slots == 13  # prompt + 3 generated
    assert usage.reserved_slots == 4  # 4 tokens still to generate
    assert usage.internal_fragmentation_slots == reserved - 17
    assert usage.external_fragmentation_slots == chunk - reserved
    assert usage.free_slots == 4096 - chunk
    assert usage.token_fraction_of_allocated == pytest.approx(13 / chunk)
    with pytest.raises(KVCacheError, match="exceed its length"):
        kv.append_slots("r", num_tokens=18)
    kv.free("r")
    assert kv.memory_usage().allocated_slots == 0


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
    reserve(kv, 0, prompt_len=10, output_len=20)
    assert kv.reserved_blocks(0) == chunk_blocks
    usage = kv.memory_usage()
    assert usage.token_slots == 10
    assert usage.reserved_slots == 20
    assert usage.internal_fragmentation_slots == reserved_blocks * block_size - 30
    assert usage.external_fragmentation_slots == (chunk_blocks - reserved_blocks) * block_size
    assert kv.num_free_blocks == 256 // block_size - chunk_blocks


@given(
    prompt_len=st.integers(1, 1000),
    output_len=st.integers(1, 1000),
)
def test_policies_reserve_exactly_at_most_twice_or_the_maximum(prompt_len, output_len):
    max_len = 2048
    oracle = reservation_len("oracle", prompt_len, output_len, max_len)
    pow2 = reservation_len("pow2", prompt_len, output_len, max_len)
    assert oracle == prompt_len + output_len
    assert oracle <= pow2 <= min(max_len, prompt_len + 2 * output_len - 1)  # over by < 2x
    assert reservation_len("max", prompt_len, output_len, max_len) == max_len


@settings(max_examples=40)
@given(
    requests=st.lists(
        st.tuples(st.integers(1, 600), st.integers(1, 600), st.integers(0, 600)),
        min_size=1,
        max_size=12,
    )
)
def test_reservation_categories_add_up_and_policies_are_ordered(requests) -> None:
    caches = {p: ReservationKVCacheManager(15_700, 1, p) for p in ("max", "pow2", "oracle")}
    for policy, kv in caches.items():
        admitted = []
        for i, (prompt, output, generated) in enumerate(requests):
            kv.expect(i, prompt, output)
            if kv.can_allocate(i, [1] * prompt):
                kv.allocate(i, [1] * prompt)
                kv.append_slots(i, num_tokens=prompt + min(generated, output))
                admitted.append(i)
        usage = kv.memory_usage()
        assert usage.allocated_slots == 15_700 - kv.allocator.num_free_slots
        expected_tokens = sum(
            requests[i][0] + min(requests[i][2], requests[i][1]) for i in admitted
        )
        assert usage.token_slots == expected_tokens
        if policy == "oracle":
            assert usage.internal_fragmentation_slots == 0
    # One request alone: the tighter the reservation, the larger the useful fraction.
    prompt, output, generated = requests[0]
    fractions = []
    for policy in ("max", "pow2", "oracle"):
        kv = ReservationKVCacheManager(4096, 1, policy)
        reserve(kv, "r", prompt, output)
        kv.append_slots("r", num_tokens=prompt + min(generated, output))
        fractions.append(kv.memory_usage().token_fraction_of_allocated)
    assert fractions[0] <= fractions[1] <= fractions[2]


@settings(max_examples=15)
@given(
    policy=st.sampled_from(["max", "pow2", "oracle"]),
    requests=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 24)), min_size=1, max_size=30),
    data=st.data(),
)
def test_one_slot_blocks_account_exactly_like_the_papers_definitions(policy, requests, data):
    """Admit in order while a buddy allocator driven alongside fits the request, grow, free in a
    random order: the same free slots and, slot for slot, the paper's categories."""
    capacity = 300
    kv = ReservationKVCacheManager(capacity, 1, policy, MAX_LEN)
    reference = BuddyAllocator(capacity)
    live: dict[int, list[int]] = {}  # rid -> [prompt, output, used, offset]
    for rid, (prompt_len, output_len) in enumerate(requests):
        kv.expect(rid, prompt_len, output_len)
        reserved = reservation_len(policy, prompt_len, output_len, MAX_LEN)
        fits = reference.can_allocate(reserved)
        assert kv.can_allocate(rid, [1] * prompt_len) == fits
        if fits:
            kv.allocate(rid, [1] * prompt_len)
            offset, _ = reference.allocate(reserved)
            grow = data.draw(st.integers(0, output_len), label="grow")
            kv.append_slots(rid, num_tokens=prompt_len + grow)
            live[rid] = [prompt_len, output_len, prompt_len + grow, offset]
        if live and data.draw(st.booleans(), label="free one"):
            victim = data.draw(st.sampled_from(sorted(live)), label="victim")
            kv.free(victim)
            reference.free(live.pop(victim)[3])
        kv.check_invariants()
        tokens = reserved_slots = internal = external = 0
        for p, o, used, _ in live.values():
            asked = reservation_len(policy, p, o, MAX_LEN)
            tokens += used
            reserved_slots += p + o - used
            internal += asked - (p + o)
            external += next_power_of_two(asked) - asked
        expected = MemoryUsage(capacity, tokens, reserved_slots, internal, external)
        assert kv.memory_usage() == expected
        assert kv.num_free_blocks == reference.num_free_slots


def test_parallel_samples_each_get_a_chunk_reserved_at_admission():
    kv = ReservationKVCacheManager(128, 1, "oracle", MAX_LEN)
    kv.expect(0, prompt_len=5, output_len=11, width=3)  # 16 slots each
    kv.allocate(0, [1] * 5)
    assert kv.num_free_blocks == 128 - 3 * 16
    kv.mark_computed(0, [1] * 5)
    kv.fork(0, 1)
    kv.fork(0, 2)
    assert kv.num_slots(2) == 5
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


def test_reservation_rejects_bad_requests() -> None:
    kv = ReservationKVCacheManager(4096, 1, "oracle", max_seq_len=2048)
    with pytest.raises(KVCacheError, match="exceeds max_seq_len"):
        kv.expect("r", 2000, 100)
    with pytest.raises(ValueError, match="policy"):
        ReservationKVCacheManager(4096, 1, "lru")
    reserve(kv, "r", 10, 10)
    with pytest.raises(KVCacheError, match="already allocated"):
        reserve(kv, "r", 10, 10)
    with pytest.raises(KVCacheError, match="unknown sequence"):
        kv.free("s")


def test_bad_use_is_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="policy"):
        ReservationKVCacheManager(128, 1, "lifo", MAX_LEN)
    with pytest.raises(ValueError, match="cannot hold"):
        ReservationKVCacheManager(4, 8, "max", MAX_LEN)
    kv = ReservationKVCacheManager(128, 4, "pow2", MAX_LEN)
    with pytest.raises(KVCacheError, match="expect"):
        kv.allocate(0, [1, 2])
    with pytest.raises(KVCacheError, match="output length"):
        kv.can_allocate(0, [1, 2])
    kv.expect(0, prompt_len=2, output_len=2)  # 2 + 2 = 4 slots: one block
    kv.allocate(0, [1, 2])
    kv.append_slots(0, num_tokens=4)
    with pytest.raises(ReservationExceededError, match="outgrow"):
        kv.append_slots(0, num_tokens=5)
    assert kv.num_slots(0) == 4  # untouched
    with pytest.raises(KVCacheError, match="length to cover"):
        kv.append_slots(0, num_tokens=3)  # a length, never a number of new tokens
    with pytest.raises(KVCacheError, match="swapped"):
        kv.swap_out([0])


# --------------------------------------------------------------------------------------------
# Static batching
# --------------------------------------------------------------------------------------------


def test_static_batch_holds_rows_until_the_whole_batch_finishes() -> None:
    # 448 = 256 + 128 + 64 slots: three rows of 128 (the 64-slot part holds none).
    kv = ReservationKVCacheManager(3 * 128 + 64, 1, "max", max_seq_len=128, static_batch=True)
    assert kv.allocator.num_free_chunks(128) == 3
    reserve(kv, "a", 10, 5)
    reserve(kv, "b", 20, 30)
    kv.append_slots("a", num_tokens=15)
    kv.free("a")  # finished, but its row stays allocated
    usage = kv.memory_usage()
    assert usage.token_slots == 20
    assert usage.reserved_slots == 30
    assert usage.internal_fragmentation_slots == 128 + (128 - 50)  # a's dead row + b's tail
    assert usage.free_slots == 448 - 256
    kv.check_invariants()
    kv.free("b")
    assert kv.memory_usage().allocated_slots == 0
    kv.expect("c", 5, 5)
    assert kv.can_allocate("c", [1] * 5)
    kv.check_invariants()


# --------------------------------------------------------------------------------------------
# The workloads the baselines are measured on
# --------------------------------------------------------------------------------------------


def test_traces_match_the_papers_length_statistics() -> None:
    share = sharegpt_like(5000, rate=2.0, seed=0)
    prompts = np.array([r.prompt_len for r in share])
    outputs = np.array([r.output_len for r in share])
    # vLLM paper Fig. 11: ShareGPT input mean 161 / median ~35, output mean 338 / median ~271.
    assert 140 < prompts.mean() < 185 and 28 <= np.median(prompts) <= 42
    assert 310 < outputs.mean() < 365 and 245 <= np.median(outputs) <= 295
    assert (prompts + outputs).max() <= 2048 and prompts.min() >= 1 and outputs.min() >= 1
    arrivals = np.array([r.arrival_time for r in share])
    assert np.all(np.diff(arrivals) >= 0)
    assert np.diff(arrivals).mean() == pytest.approx(1 / 2.0, rel=0.1)  # Poisson, rate 2
    alpaca = alpaca_like(5000, seed=0)
    assert 17 < np.mean([r.prompt_len for r in alpaca]) < 21  # paper: 19.31
    assert 53 < np.mean([r.output_len for r in alpaca]) < 63  # paper: 58.45
    assert alpaca_like(50, seed=3) == alpaca_like(50, seed=3)
    assert alpaca_like(50, seed=3) != alpaca_like(50, seed=4)
