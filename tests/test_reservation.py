"""Tests of the reservation baselines: the buddy allocator and the Fig. 2 accounting of the
Orca variants and static batching (vLLM paper §3, §6.1)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minipaged.kv_cache import KVCacheError, NoFreeBlocksError
from minipaged.reservation import (
    BuddyAllocator,
    ReservationCache,
    StaticBatchCache,
    next_power_of_two,
)
from minipaged.traces import alpaca_like, sharegpt_like

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
# Orca-style reservation accounting
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "reserved", "chunk"),
    [
        ("oracle", 10 + 7, 32),  # exactly prompt + output; the allocator rounds 17 up to 32
        ("pow2", 10 + 8, 32),  # output 7 over-reserved to 8
        ("max", 2048, 2048),  # the model's maximum length
    ],
)
def test_reservation_accounting_of_one_request(policy: str, reserved: int, chunk: int) -> None:
    cache = ReservationCache(num_slots=4096, policy=policy)
    cache.allocate("r", prompt_len=10, output_len=7)
    cache.append("r", 3)
    usage = cache.memory_usage()
    assert usage.token_slots == 13  # prompt + 3 generated
    assert usage.reserved_slots == 4  # 4 tokens still to generate
    assert usage.internal_fragmentation_slots == reserved - 17
    assert usage.external_fragmentation_slots == chunk - reserved
    assert usage.free_slots == 4096 - chunk
    assert usage.token_fraction_of_allocated == pytest.approx(13 / chunk)
    with pytest.raises(KVCacheError, match="exceed its length"):
        cache.append("r", 5)
    cache.free("r")
    assert cache.memory_usage().allocated_slots == 0


@settings(max_examples=40)
@given(
    requests=st.lists(
        st.tuples(st.integers(1, 600), st.integers(1, 600), st.integers(0, 600)),
        min_size=1,
        max_size=12,
    )
)
def test_reservation_categories_add_up_and_policies_are_ordered(requests) -> None:
    caches = {p: ReservationCache(num_slots=15_700, policy=p) for p in ("max", "pow2", "oracle")}
    for policy, cache in caches.items():
        admitted = []
        for i, (prompt, output, generated) in enumerate(requests):
            if cache.can_allocate(prompt, output):
                cache.allocate(i, prompt, output)
                cache.append(i, min(generated, output))
                admitted.append(i)
        usage = cache.memory_usage()
        assert usage.allocated_slots == 15_700 - cache.allocator.num_free_slots
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
        cache = ReservationCache(num_slots=4096, policy=policy)
        cache.allocate("r", prompt, output)
        cache.append("r", min(generated, output))
        fractions.append(cache.memory_usage().token_fraction_of_allocated)
    assert fractions[0] <= fractions[1] <= fractions[2]


def test_reservation_rejects_bad_requests() -> None:
    cache = ReservationCache(num_slots=4096, policy="oracle", max_seq_len=2048)
    with pytest.raises(KVCacheError, match="exceeds max_seq_len"):
        cache.allocate("r", 2000, 100)
    with pytest.raises(ValueError, match="policy"):
        ReservationCache(num_slots=4096, policy="lru")
    cache.allocate("r", 10, 10)
    with pytest.raises(KVCacheError, match="already allocated"):
        cache.allocate("r", 10, 10)
    with pytest.raises(KVCacheError, match="unknown request"):
        cache.free("s")


# --------------------------------------------------------------------------------------------
# Static batching
# --------------------------------------------------------------------------------------------


def test_static_batch_holds_rows_until_the_whole_batch_finishes() -> None:
    cache = StaticBatchCache(num_slots=3 * 100 + 50, max_seq_len=100)
    assert cache.batch_size == 3
    cache.allocate("a", 10, 5)
    cache.allocate("b", 20, 30)
    cache.append("a")  # decoding starts: the batch is closed
    assert not cache.can_allocate(5, 5)
    with pytest.raises(KVCacheError, match="has started"):
        cache.allocate("c", 5, 5)
    cache.append("a", 4)
    cache.free("a")  # finished, but its row stays allocated
    usage = cache.memory_usage()
    assert usage.token_slots == 20
    assert usage.reserved_slots == 30
    assert usage.internal_fragmentation_slots == 100 + (100 - 50)  # a's dead row + b's tail
    assert usage.free_slots == 350 - 200
    cache.free("b")
    assert cache.memory_usage().allocated_slots == 0 and cache.can_allocate(5, 5)


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
