"""Tests of the KV cache manager (vLLM paper §4.1-4.5).

The centre is a `hypothesis.stateful` machine that plays the engine: it owns the sequences'
tokens (as the engine's `Sequence`s do), allocates prompts drawn from a two-letter alphabet (so
prefixes are shared and the prefix cache hits), appends, forks, frees, swaps, and "computes"
tokens by writing them into a shadow copy of the slots, performing every copy the manager
returns. After each step it reads every sequence back through its block table: if
copy-on-write, swapping or a prefix-cache hit ever pointed a sequence at the wrong slot, the
tokens read back differ. It also checks that the manager keeps no token ids of its own (only
the cached blocks' contents, which a hit is confirmed against).
"""

from __future__ import annotations

import inspect
import math
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import minipaged.kv.pool as block_pool_module
from minipaged.kv.interface import KVCacheError, KVManager, NoFreeBlocksError
from minipaged.kv.manager import KVCacheManager
from minipaged.kv.pool import ROOT_HASH, FreeBlockQueue, hash_block
from minipaged.kv.reservation import ReservationKVCacheManager

BS = 3  # odd, so block boundaries fall everywhere
NUM_BLOCKS = 16
NUM_CPU_BLOCKS = 9
# The machine's two token ids: far above any block id or count, so a token id held anywhere in
# the manager is recognisable.
TOKEN_BASE = 10**9
TOKENS = (TOKEN_BASE, TOKEN_BASE + 1)

tokens_strategy = st.lists(st.sampled_from(TOKENS), min_size=1, max_size=10)
new_tokens_strategy = st.lists(st.sampled_from(TOKENS), min_size=1, max_size=4)


def snapshot(m: KVCacheManager) -> tuple:
    """Everything a failed call must leave unchanged."""
    return (
        {s: (m.block_table(s), m.num_slots(s), m.is_swapped(s)) for s in m.seq_ids()},
        m.num_free_blocks,
        m.num_free_cpu_blocks,
        [m.ref_count(b) for b in range(m.num_gpu_blocks)],
        m.num_cached_blocks,
    )


def ints_reachable(obj: object) -> Iterator[int]:
    """Every int stored anywhere in `obj`'s object graph (each container visited once, each
    stored int counted where it is stored)."""
    seen: set[int] = set()
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, int) and not isinstance(item, bool):
            yield item
            continue
        if isinstance(item, (str, bytes, float, bool, type(None))) or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        elif hasattr(item, "__dict__"):
            stack.extend(vars(item).values())


# --------------------------------------------------------------------------------------------
# The stateful machine
# --------------------------------------------------------------------------------------------


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = KVCacheManager(NUM_BLOCKS, BS, NUM_CPU_BLOCKS, watermark=0.0)
        self.tokens: dict[int, list[int]] = {}
        self.written: dict[int, int] = {}  # tokens whose K/V the simulated engine has written
        self.gpu: dict[int, int] = {}  # shadow of GPU slots: slot -> token written there
        self.cpu: dict[int, int] = {}  # shadow of CPU slots
        self.history: list[list[int]] = []  # token lists seen, to re-use as shared prefixes
        self.next_id = 0

    # --- helpers --------------------------------------------------------------------------

    def _gpu_ids(self) -> list[int]:
        return [s for s in self.tokens if not self.m.is_swapped(s)]

    def _cpu_ids(self) -> list[int]:
        return [s for s in self.tokens if self.m.is_swapped(s)]

    def _computed_gpu_ids(self) -> list[int]:
        return [s for s in self._gpu_ids() if self.written[s] == len(self.tokens[s])]

    def _copy(self, src_pool: dict, src: int, dst_pool: dict, dst: int) -> None:
        for offset in range(BS):
            value = src_pool.get(src * BS + offset)
            if value is None:
                dst_pool.pop(dst * BS + offset, None)
            else:
                dst_pool[dst * BS + offset] = value

    def _write_pending(self, sid: int, upto: int | None = None) -> None:
        """The engine writes tokens [written, upto) to their slots and reports them computed."""
        upto = len(self.tokens[sid]) if upto is None else upto
        table = self.m.block_table(sid)
        for i in range(self.written[sid], upto):
            self.gpu[table[i // BS] * BS + i % BS] = self.tokens[sid][i]
        self.m.mark_computed(sid, self.tokens[sid][:upto])
        self.written[sid] = upto

    def _allocate(self, prompt: list[int]) -> None:
        before = snapshot(self.m)
        sid = self.next_id
        expected_ok = self.m.can_allocate(sid, prompt)  # watermark 0: exactly "enough blocks"
        try:
            cached = self.m.allocate(sid, prompt)
        except NoFreeBlocksError:
            assert not expected_ok
            assert snapshot(self.m) == before
            return
        assert expected_ok
        self.next_id += 1
        assert cached % BS == 0 and 0 <= cached <= len(prompt) - 1
        self.tokens[sid] = list(prompt)
        self.written[sid] = cached  # a hit claims these slots already hold the tokens
        self.history.append(list(prompt))

    # --- rules ----------------------------------------------------------------------------

    @rule(prompt=tokens_strategy)
    def allocate(self, prompt: list[int]) -> None:
        self._allocate(prompt)

    @precondition(lambda self: self.history)
    @rule(data=st.data(), suffix=st.lists(st.sampled_from(TOKENS), max_size=4))
    def allocate_shared_prefix(self, data: st.DataObject, suffix: list[int]) -> None:
        """A prompt extending one seen before: a prefix-cache hit when its blocks survive."""
        base = data.draw(st.sampled_from(self.history))
        cut = data.draw(st.integers(0, len(base)))
        prompt = base[:cut] + suffix
        if prompt:
            self._allocate(prompt)

    @precondition(lambda self: self._gpu_ids())
    @rule(data=st.data(), new=new_tokens_strategy)
    def append_slots(self, data: st.DataObject, new: list[int]) -> None:
        sid = data.draw(st.sampled_from(self._gpu_ids()))
        before = snapshot(self.m)
        length = len(self.tokens[sid]) + len(new)
        expected_ok = self.m.can_append(sid, num_tokens=length)
        try:
            copies = self.m.append_slots(sid, num_tokens=length)
        except NoFreeBlocksError:
            assert not expected_ok
            assert snapshot(self.m) == before
            return
        assert expected_ok
        for src, dst in copies:
            self._copy(self.gpu, src, self.gpu, dst)
        self.tokens[sid].extend(new)

    @precondition(lambda self: self._gpu_ids())
    @rule(data=st.data())
    def compute(self, data: st.DataObject) -> None:
        """The engine writes some pending tokens' K/V (a whole or chunked prefill, a decode)."""
        sid = data.draw(st.sampled_from(self._gpu_ids()))
        self._write_pending(sid, data.draw(st.integers(self.written[sid], len(self.tokens[sid]))))

    @precondition(lambda self: self._computed_gpu_ids())
    @rule(data=st.data(), token=st.sampled_from(TOKENS))
    def decode_step(self, data: st.DataObject, token: int) -> None:
        """The common engine step: one new token, written at once (copy-on-write after fork)."""
        sid = data.draw(st.sampled_from(self._computed_gpu_ids()))
        length = len(self.tokens[sid]) + 1
        if not self.m.can_append(sid, num_tokens=length):
            with pytest.raises(NoFreeBlocksError):
                self.m.append_slots(sid, num_tokens=length)
            return
        for src, dst in self.m.append_slots(sid, num_tokens=length):
            self._copy(self.gpu, src, self.gpu, dst)
        self.tokens[sid].append(token)
        self._write_pending(sid)

    @precondition(lambda self: self._computed_gpu_ids())
    @rule(data=st.data(), tokens=st.tuples(st.sampled_from(TOKENS), st.sampled_from(TOKENS)))
    def fork_and_diverge(self, data: st.DataObject, tokens: tuple[int, int]) -> None:
        """Parallel sampling: fork, then parent and child each decode their own token."""
        sid = data.draw(st.sampled_from(self._computed_gpu_ids()))
        child = self.next_id
        self.m.fork(sid, child)
        self.next_id += 1
        self.tokens[child] = list(self.tokens[sid])
        self.written[child] = self.written[sid]
        for seq, token in zip((child, sid), tokens, strict=True):
            length = len(self.tokens[seq]) + 1
            if self.m.can_append(seq, num_tokens=length):
                for src, dst in self.m.append_slots(seq, num_tokens=length):
                    self._copy(self.gpu, src, self.gpu, dst)
                self.tokens[seq].append(token)
                self._write_pending(seq)

    @precondition(lambda self: self._computed_gpu_ids())
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        """A fork as the engine does it: after sampling, when the parent is fully computed."""
        sid = data.draw(st.sampled_from(self._computed_gpu_ids()))
        child = self.next_id
        self.m.fork(sid, child)
        self.next_id += 1
        self.tokens[child] = list(self.tokens[sid])
        self.written[child] = self.written[sid]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.m.free(sid)
        del self.tokens[sid], self.written[sid]

    @precondition(lambda self: self._gpu_ids())
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        group = data.draw(st.lists(st.sampled_from(self._gpu_ids()), min_size=1, unique=True))
        before = snapshot(self.m)
        expected_ok = self.m.can_swap_out(group)
        try:
            copies = self.m.swap_out(group)
        except NoFreeBlocksError:
            assert not expected_ok
            assert snapshot(self.m) == before
            return
        assert expected_ok
        assert len({d for d, _ in copies}) == len(copies), "a shared block was swapped twice"
        for gpu_block, cpu_block in copies:
            self._copy(self.gpu, gpu_block, self.cpu, cpu_block)

    @precondition(lambda self: self._cpu_ids())
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        group = data.draw(st.lists(st.sampled_from(self._cpu_ids()), min_size=1, unique=True))
        before = snapshot(self.m)
        expected_ok = self.m.can_swap_in(group)  # watermark 0: exactly "enough blocks"
        try:
            copies = self.m.swap_in(group)
        except NoFreeBlocksError:
            assert not expected_ok
            assert snapshot(self.m) == before
            return
        assert expected_ok
        for cpu_block, gpu_block in copies:
            self._copy(self.cpu, cpu_block, self.gpu, gpu_block)

    # --- invariants -----------------------------------------------------------------------

    @invariant()
    def manager_invariants_hold(self) -> None:
        self.m.check_invariants()

    @invariant()
    def tables_and_ref_counts_match(self) -> None:
        refs: dict[int, int] = {}
        cpu_refs: dict[int, int] = {}
        fills: dict[int, int] = {}
        for sid, tokens in self.tokens.items():
            table = self.m.block_table(sid)
            assert self.m.num_slots(sid) == len(tokens)  # the blocks' fills cover the tokens
            assert len(table) == math.ceil(len(tokens) / BS)
            counter = cpu_refs if self.m.is_swapped(sid) else refs
            for i, b in enumerate(table):
                counter[b] = counter.get(b, 0) + 1
                if not self.m.is_swapped(sid):
                    fills[b] = min(BS, len(tokens) - i * BS)
        for b in range(NUM_BLOCKS):
            assert self.m.ref_count(b) == refs.get(b, 0)
        for h in range(NUM_CPU_BLOCKS):
            assert self.m.cpu_ref_count(h) == cpu_refs.get(h, 0)
        # Free and used blocks partition each pool.
        assert self.m.num_free_blocks == NUM_BLOCKS - len(refs)
        assert self.m.num_free_cpu_blocks == NUM_CPU_BLOCKS - len(cpu_refs)
        # Accounting: shared blocks hold their token states once.
        usage = self.m.memory_usage()
        assert usage.token_slots == sum(fills.values())
        assert usage.allocated_slots == len(refs) * BS
        assert usage.total_slots == NUM_BLOCKS * BS

    @invariant()
    def manager_holds_blocks_not_tokens(self) -> None:
        """The only token ids in the manager are the contents of its cached blocks."""
        held = [i for i in ints_reachable(self.m) if i >= TOKEN_BASE]
        assert len(held) == self.m.num_cached_blocks * BS

    @invariant()
    def slots_read_back_equal_tokens(self) -> None:
        for sid, tokens in self.tokens.items():
            pool = self.cpu if self.m.is_swapped(sid) else self.gpu
            table = self.m.block_table(sid)
            read_back = [pool.get(table[i // BS] * BS + i % BS) for i in range(self.written[sid])]
            assert read_back == tokens[: self.written[sid]], f"sequence {sid} lost its K/V"

    def teardown(self) -> None:
        for sid in list(self.tokens):
            self.m.free(sid)
        self.m.check_invariants()
        assert self.m.num_free_blocks == NUM_BLOCKS
        assert self.m.num_free_cpu_blocks == NUM_CPU_BLOCKS


KVCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestKVCacheMachine = KVCacheMachine.TestCase


# --------------------------------------------------------------------------------------------
# Regression tests for the known failure cases of small engines
# --------------------------------------------------------------------------------------------


class Owner:
    """The tokens of each sequence, kept by the test as the engine's `Sequence`s keep them:
    `compute` reports a sequence's computed prefix to the manager."""

    def __init__(self, m: KVCacheManager) -> None:
        self.m = m
        self.tokens: dict[str, list[int]] = {}

    def allocate(self, sid: str, prompt: list[int]) -> int:
        cached = self.m.allocate(sid, prompt)
        self.tokens[sid] = list(prompt)
        return cached

    def append(self, sid: str, new: list[int]) -> list[tuple[int, int]]:
        copies = self.m.append_slots(sid, num_tokens=len(self.tokens[sid]) + len(new))
        self.tokens[sid] += new
        return copies

    def compute(self, sid: str, upto: int | None = None) -> None:
        self.m.mark_computed(sid, self.tokens[sid][:upto])

    def fork(self, parent: str, child: str) -> None:
        self.m.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])


def test_entire_prompt_hit_still_computes_the_last_block() -> None:
    m = KVCacheManager(num_gpu_blocks=8, block_size=4)
    own = Owner(m)
    prompt = list(range(8))  # exactly two full blocks, both cached after A
    own.allocate("a", prompt)
    own.compute("a")
    a_table = m.block_table("a")
    assert own.allocate("b", prompt) == 4  # not 8: the last token's logits must be computed
    b_table = m.block_table("b")
    assert b_table[0] == a_table[0]
    assert b_table[1] != a_table[1]  # a private block: B's last-token write touches no sharer
    own.compute("b")  # B's duplicate of a cached block stays private
    m.check_invariants()
    m.free("a")
    m.free("b")
    assert own.allocate("c", prompt) == 4
    assert own.allocate("d", list(range(4))) == 0  # a one-block prompt can never hit
    m.check_invariants()


def test_no_hit_on_blocks_another_sequence_fills_in_the_same_step() -> None:
    m = KVCacheManager(num_gpu_blocks=8, block_size=4)
    own = Owner(m)
    prompt = list(range(9))
    assert own.allocate("a", prompt) == 0
    # Same step: A's K/V is not written yet, so B must compute its own.
    assert own.allocate("b", prompt) == 0
    assert not set(m.block_table("a")) & set(m.block_table("b"))
    own.compute("a")
    own.compute("b")
    assert own.allocate("c", prompt) == 8  # a later step hits A's now-computed blocks
    assert m.block_table("c")[:2] == m.block_table("a")[:2]
    m.check_invariants()


def test_partly_computed_prompt_publishes_only_computed_blocks() -> None:
    m = KVCacheManager(num_gpu_blocks=8, block_size=4)
    own = Owner(m)
    prompt = list(range(13))
    own.allocate("a", prompt)
    own.compute("a", 6)  # a chunked prefill: block 0 done, block 1 half done
    assert own.allocate("b", prompt) == 4
    own.compute("a", 13)
    assert own.allocate("c", prompt) == 12


def test_preempted_sequence_hits_its_own_freed_blocks() -> None:
    m = KVCacheManager(num_gpu_blocks=10, block_size=4)
    own = Owner(m)
    prompt = list(range(10))
    own.allocate("a", prompt)
    own.compute("a")
    for t in range(100, 106):  # six decode steps
        own.append("a", [t])
        own.compute("a")
    tokens, table = own.tokens["a"], m.block_table("a")
    assert len(tokens) == 16
    m.free("a")  # preempted by recomputation
    own.allocate("other", [7] * 8)  # takes the never-cached blocks first
    own.compute("other")
    assert not set(m.block_table("other")) & set(table[:3])
    cached = own.allocate("a", tokens)  # recompute: prompt + generated tokens
    assert cached == 12  # blocks 0-2 survive; the block with the last token is recomputed
    assert m.block_table("a")[:3] == table[:3]
    m.check_invariants()


def test_swapped_out_blocks_stay_cached_and_swap_in_is_a_fresh_copy() -> None:
    m = KVCacheManager(num_gpu_blocks=6, block_size=4, num_cpu_blocks=4)
    own = Owner(m)
    prompt = list(range(9))
    own.allocate("a", prompt)
    own.compute("a")
    gpu_table = m.block_table("a")
    copies = m.swap_out("a")
    assert tuple(d for d, _ in copies) == gpu_table
    assert m.num_free_blocks == 6
    assert own.allocate("b", prompt) == 8  # the swapped-out blocks still hold A's K/V
    assert m.block_table("b")[:2] == gpu_table[:2]
    back = m.swap_in("a")
    assert [h for h, _ in back] == [h for _, h in copies]
    assert not set(m.block_table("a")) & set(m.block_table("b"))
    m.check_invariants()


# --------------------------------------------------------------------------------------------
# Copy-on-write, fork, group swapping
# --------------------------------------------------------------------------------------------


def test_fork_shares_blocks_and_copy_on_write_splits_the_last_one() -> None:
    m = KVCacheManager(num_gpu_blocks=8, block_size=4)
    own = Owner(m)
    own.allocate("p", list(range(6)))
    own.compute("p")
    own.fork("p", "c")
    shared = m.block_table("p")
    assert m.block_table("c") == shared and all(m.ref_count(b) == 2 for b in shared)
    copies = own.append("c", [42])
    assert len(copies) == 1 and copies[0][0] == shared[1]
    assert m.block_table("c") == (shared[0], copies[0][1])
    assert own.append("p", [43]) == []  # the parent now owns its last block alone
    assert m.ref_count(shared[0]) == 2 and m.ref_count(shared[1]) == 1
    m.check_invariants()


def test_fork_at_a_block_boundary_needs_no_copy() -> None:
    m = KVCacheManager(num_gpu_blocks=8, block_size=4)
    own = Owner(m)
    own.allocate("p", list(range(8)))
    own.compute("p")
    own.fork("p", "c")
    assert own.append("c", [1]) == [] and own.append("p", [2]) == []
    assert m.block_table("c")[:2] == m.block_table("p")[:2]


def test_group_swap_copies_each_shared_block_once() -> None:
    m = KVCacheManager(num_gpu_blocks=8, block_size=4, num_cpu_blocks=8)
    own = Owner(m)
    own.allocate("p", list(range(6)))
    own.compute("p")
    for child in ("c1", "c2"):
        own.fork("p", child)
    out = m.swap_out(["p", "c1", "c2"])
    assert len(out) == 2  # two distinct blocks, shared three ways
    assert all(m.cpu_ref_count(h) == 3 for _, h in out)
    assert m.num_free_blocks == 8
    back = m.swap_in(["p", "c1", "c2"])
    assert len(back) == 2 and all(m.ref_count(d) == 3 for _, d in back)
    m.check_invariants()


# --------------------------------------------------------------------------------------------
# Free queue and prefix-cache hashing
# --------------------------------------------------------------------------------------------


def test_free_queue_is_o1_and_ordered() -> None:
    q = FreeBlockQueue(range(4))
    q.remove(2)
    q.push_back(2)
    q.push_front(3)
    assert list(q) == [3, 0, 1, 2]
    assert q.pop_front() == 3 and len(q) == 3 and 3 not in q


def test_eviction_takes_uncached_blocks_then_least_recently_freed() -> None:
    m = KVCacheManager(num_gpu_blocks=4, block_size=2, watermark=0.0)
    own = Owner(m)
    own.allocate("a", [1, 1, 1])  # block 0 full (cacheable), block 1 partial
    own.allocate("b", [2, 2, 2])
    own.compute("a")
    own.compute("b")
    a_full, b_full = m.block_table("a")[0], m.block_table("b")[0]
    m.free("a")
    m.free("b")
    assert m.num_cached_blocks == 2
    own.allocate("c", [9, 9])  # one block: an uncached one, so both cached blocks survive
    assert m.block_table("c")[0] not in (a_full, b_full) and m.num_cached_blocks == 2
    own.allocate("d", [8, 8, 8, 8])  # two blocks: the last uncached one, then A's (freed first)
    assert a_full in m.block_table("d") and b_full not in m.block_table("d")
    m.free("c")
    assert own.allocate("e", [2, 2, 2]) == 2  # B's block is still a hit
    m.check_invariants()


def test_hit_is_confirmed_against_tokens_on_a_hash_collision(monkeypatch) -> None:
    monkeypatch.setattr(block_pool_module, "hash_block", lambda parent, tokens: b"x" * 16)
    m = KVCacheManager(num_gpu_blocks=8, block_size=2)
    own = Owner(m)
    own.allocate("a", [1, 2, 3])
    own.compute("a")
    assert own.allocate("b", [5, 6, 7]) == 0  # same (fake) hash, other tokens: a miss
    assert own.allocate("c", [1, 2, 9]) == 2
    m.check_invariants()


def test_block_hash_is_chained_and_the_same_in_every_process() -> None:
    first = hash_block(ROOT_HASH, [1, 2, 3])
    assert hash_block(first, [4, 5, 6]) != hash_block(ROOT_HASH, [4, 5, 6])
    assert hash_block(ROOT_HASH, [1, 2, 3]) == first
    code = (
        "from minipaged.kv.pool import ROOT_HASH, hash_block;"
        "print(hash_block(ROOT_HASH, [1, 2, 3]).hex())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONHASHSEED": "12345"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == first.hex()


def test_hit_and_miss_counters() -> None:
    m = KVCacheManager(num_gpu_blocks=16, block_size=2)
    own = Owner(m)
    own.allocate("a", [1, 2, 3, 4, 5])  # two eligible blocks, cache empty
    assert (m.prefix_cache_hits, m.prefix_cache_misses) == (0, 2)
    own.compute("a")
    own.allocate("b", [1, 2, 3, 9, 9])  # first block hits, second differs
    assert (m.prefix_cache_hits, m.prefix_cache_misses) == (1, 3)
    assert m.prefix_cache_hit_rate == pytest.approx(0.25)


def test_prefix_caching_can_be_disabled() -> None:
    m = KVCacheManager(num_gpu_blocks=8, block_size=2, enable_prefix_caching=False)
    own = Owner(m)
    own.allocate("a", [1, 2, 3])
    own.compute("a")
    assert own.allocate("b", [1, 2, 3]) == 0 and m.num_cached_blocks == 0


# --------------------------------------------------------------------------------------------
# Exhaustion, watermark and bad input
# --------------------------------------------------------------------------------------------


def test_exhaustion_reports_and_leaves_state_untouched() -> None:
    m = KVCacheManager(num_gpu_blocks=4, block_size=2, num_cpu_blocks=1, watermark=0.0)
    own = Owner(m)
    own.allocate("a", [1, 2, 3])
    own.compute("a")
    own.fork("a", "b")
    own.allocate("c", [4, 5])
    assert m.num_free_blocks == 1
    before = snapshot(m)
    assert not m.can_allocate("d", [1] * 5)
    with pytest.raises(NoFreeBlocksError) as info:
        own.allocate("d", [1, 1, 1, 1, 1])
    assert (info.value.needed, info.value.available) == (3, 1)
    assert not m.can_append("a", num_tokens=6)  # copy-on-write block + one more
    with pytest.raises(NoFreeBlocksError):
        own.append("a", [7, 7, 7])
    assert not m.can_swap_out(["a", "b"])  # two distinct blocks, one CPU block
    with pytest.raises(NoFreeBlocksError):
        m.swap_out(["a", "b"])
    assert snapshot(m) == before
    assert "d" not in m
    m.check_invariants()
    m.swap_out("c")  # fits the CPU pool; now the GPU pool cannot take C's blocks back later
    own.allocate("e", [3, 3, 3, 3])
    assert not m.can_swap_in("c")
    with pytest.raises(NoFreeBlocksError):
        m.swap_in("c")
    m.check_invariants()


def test_watermark_applies_to_admission_not_to_growth() -> None:
    m = KVCacheManager(num_gpu_blocks=10, block_size=2, watermark=0.2)  # keep 2 blocks at admission
    own = Owner(m)
    assert m.watermark_blocks == 2
    assert m.can_allocate("a", [0] * 16) and not m.can_allocate("a", [0] * 17)
    own.allocate("a", [0] * 16)  # allocate itself only needs the blocks
    assert m.can_append("a", num_tokens=20) and not m.can_append("a", num_tokens=21)
    own.append("a", [1] * 4)
    assert m.num_free_blocks == 0


def test_bad_input_is_rejected_with_clear_errors() -> None:
    m = KVCacheManager(num_gpu_blocks=4, block_size=2, num_cpu_blocks=2)
    with pytest.raises(KVCacheError, match="at least one token"):
        m.allocate("a", [])
    with pytest.raises(KVCacheError, match="non-negative integers"):
        m.allocate("a", [1, -2])
    m.allocate("a", [1, 2, 3])
    with pytest.raises(KVCacheError, match="already allocated"):
        m.allocate("a", [1])
    with pytest.raises(KVCacheError, match="unknown sequence"):
        m.append_slots("zzz", num_tokens=1)
    with pytest.raises(KVCacheError, match="num_computed_tokens"):
        m.mark_computed("a", [1, 2, 3, 4])
    with pytest.raises(KVCacheError, match="at least the 3 tokens"):
        m.append_slots("a", num_tokens=2)  # a length, never a number of new tokens
    with pytest.raises(KVCacheError, match="must be an integer"):
        m.append_slots("a", num_tokens=4.0)
    with pytest.raises(TypeError):
        m.append_slots("a", 1)  # keyword-only: a stale count of new tokens fails loudly
    m.swap_out("a")
    with pytest.raises(KVCacheError, match="swapped out"):
        m.append_slots("a", num_tokens=4)
    with pytest.raises(KVCacheError, match="already swapped out"):
        m.swap_out("a")
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_gpu_blocks=4, block_size=0)
    with pytest.raises(ValueError, match="watermark"):
        KVCacheManager(num_gpu_blocks=4, block_size=2, watermark=1.5)


# --------------------------------------------------------------------------------------------
# The KV-manager protocol
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "manager",
    [KVCacheManager(8, 4, num_cpu_blocks=4), ReservationKVCacheManager(8, 4, "max", 32)],
    ids=["paged", "reservation"],
)
def test_both_managers_implement_the_kv_protocol(manager) -> None:
    """Every member of `KVManager` exists on both managers, methods with the same parameters
    (names and kinds), so the scheduler can drive either."""
    members = {
        name: value
        for name, value in vars(KVManager).items()
        if not name.startswith("_") or name == "__contains__"
    }
    assert {"allocate", "append_slots", "mark_computed", "fork", "free", "swap_out"} <= set(members)
    def parameters(function) -> list[tuple[str, object]]:
        return [(p.name, p.kind) for p in inspect.signature(function).parameters.values()]

    for name, value in members.items():
        assert hasattr(manager, name), f"{type(manager).__name__} lacks {name}"
        if callable(value):
            got, want = parameters(getattr(type(manager), name)), parameters(value)
            assert got == want, f"{type(manager).__name__}.{name}{got} != {want}"
    for name in KVManager.__annotations__:
        assert isinstance(getattr(manager, name), int), f"{name} is not an int"
    assert isinstance(manager.num_free_blocks, int)


@settings(max_examples=200, deadline=None)
@given(prompt_len=st.integers(1, 20), new_tokens=st.integers(1, 9), width=st.integers(1, 4),
       block_size=st.integers(1, 5))
def test_blocks_for_request_is_the_most_a_request_holds(prompt_len, new_tokens, width,
                                                         block_size):
    """Played out: the prompt allocated, its samples forked from it, each growing by a slot for
    every token but its last (sampled, never written), the samples' tails apart; the most blocks
    held at once is what admission counts. One new token writes nothing past the prompt, so its
    samples share even the prompt's partial last block."""
    kv = KVCacheManager(64, block_size, num_cpu_blocks=0)
    kv.allocate(0, list(range(prompt_len)))
    for child in range(1, width):
        kv.fork(0, child)
    most = kv.num_used_blocks
    for step in range(1, new_tokens):
        for seq in range(width):
            kv.append_slots(seq, num_tokens=prompt_len + step)
        most = max(most, kv.num_used_blocks)
    assert most == kv.blocks_for_request(prompt_len, prompt_len + new_tokens, width)
