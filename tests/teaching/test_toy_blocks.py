"""The toy engine of notebook 03 and the Fig. 3 slot categories: the toy reads back every
sequence's own text through any mix of calls, and the categories count what the managers'
own accounting counts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.kv import KVCacheManager, ReservationKVCacheManager
from teaching.toy_blocks import ToyEngine, slot_categories, token_ids


def test_the_toy_reads_back_each_sequence_through_fork_prefix_hits_and_swaps():
    toy = ToyEngine(KVCacheManager(num_gpu_blocks=16, block_size=4, num_cpu_blocks=8))
    toy.admit("A", "Be brief. Why?")
    toy.compute("A")
    assert toy.admit("B", "Be brief. How?") == 8  # two full blocks found by their hash
    toy.compute("B")
    toy.fork("B", "C")
    assert toy.append("C", "!") != []  # the shared partial block is copied first
    toy.compute("C")
    toy.swap_out(["B", "C"])
    toy.check()
    toy.swap_in(["B", "C"])
    toy.check()
    assert toy.read("C") == "Be brief. How?!"
    toy.free("A")
    toy.check()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("ABC"), st.text("xyz", min_size=1, max_size=5)),
                min_size=1, max_size=20))
def test_random_appends_read_back(steps):
    toy = ToyEngine(KVCacheManager(num_gpu_blocks=64, block_size=3))
    for seq, text in steps:
        if seq not in toy.text:
            toy.admit(seq, text)
        else:
            toy.append(seq, text)
        toy.compute(seq)
        toy.check()


def test_a_wrong_slot_is_caught():
    toy = ToyEngine(KVCacheManager(num_gpu_blocks=4, block_size=2))
    toy.admit("A", "abc")
    toy.compute("A")
    toy.device[toy.manager.block_table("A")[0] * 2] = ord("z")
    with pytest.raises(AssertionError, match="reads 'zbc'"):
        toy.check()


@pytest.mark.parametrize("policy", ["max", "pow2", "oracle"])
def test_reservation_categories_count_what_memory_usage_counts(policy):
    lengths = {"A": (4, 6), "B": (5, 3), "C": (1, 9)}
    m = ReservationKVCacheManager(128, 1, policy, max_seq_len=24)
    for seq, (prompt, output) in lengths.items():
        m.expect(seq, prompt, output)
        m.allocate(seq, token_ids("x" * prompt))
        m.append_slots(seq, num_tokens=prompt + 1)
    slots = slot_categories(m, lengths)
    use = m.memory_usage()
    count = {k: sum(kind == k for _, kind in slots) for k in ("token", "reserved", "internal",
                                                               "external")}
    assert count == {"token": use.token_slots, "reserved": use.reserved_slots,
                     "internal": use.internal_fragmentation_slots,
                     "external": use.external_fragmentation_slots}
    assert sum(kind == "free" for _, kind in slots) == use.free_slots


def test_paged_categories_are_tokens_and_last_block_tails():
    m = KVCacheManager(num_gpu_blocks=8, block_size=4)
    m.allocate("A", token_ids("hello"))  # 5 tokens: 2 blocks, 3 slots of tail
    slots = slot_categories(m)
    assert [k for _, k in slots].count("token") == 5
    assert [k for _, k in slots].count("internal") == 3 == m.memory_usage(
    ).internal_fragmentation_slots
    contiguous = ReservationKVCacheManager(8, 1, "max", max_seq_len=8)
    contiguous.expect("A", 2, 2)
    contiguous.allocate("A", [1, 2])
    with pytest.raises(ValueError, match="lengths"):
        slot_categories(contiguous)
