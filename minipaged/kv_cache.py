"""The KV cache manager: PagedAttention's memory half (vLLM paper, Kwon et al. SOSP'23, §4.1-4.5).

The KV cache is cut into fixed-size *blocks* of `block_size` token slots. Each sequence owns a
*block table* mapping its logical blocks (tokens `i * block_size ... (i + 1) * block_size - 1`)
to physical blocks anywhere in the pool, like pages of virtual memory (§4.1-4.3). Waste is
bounded by the unfilled tail of each sequence's last block.

Blocks are shared with reference counts: within a request by `fork` (parallel sampling, beam
search, §4.4) and across requests by *prefix caching* (§4.4, "shared prefix"). A shared block is
never written: `append_slots` copies a shared, partly filled last block first (copy-on-write)
and returns the copies for the engine to perform. When device blocks run out, a whole sequence
group can be swapped to a host pool and back (§4.5).

This module is pure bookkeeping: it holds no tensors. The engine performs the copies it returns
and writes the K/V of new tokens to the slots the block tables name.

**The rule that keeps prefix caching correct.** A block's hash becomes findable only when the
engine says its K/V has really been computed: `mark_computed(seq_id, num_computed_tokens)`,
called after each step, registers the full blocks lying wholly below `num_computed_tokens`.
Allocation alone never publishes a hash, so

* two sequences admitted in the same step with the same prompt never hit on each other's
  still-empty blocks (each computes its own; the second block with an already-registered hash
  simply stays private);
* a prompt whose every block is cached still recomputes its last block, because a hit never
  covers the last prompt token (its logits are needed), and hits are whole blocks;
* a sequence preempted by recomputation (`free`, later `allocate` of prompt + generated tokens)
  hits on its own freed blocks, which stay reusable in the free queue until evicted.

Swapping in does not publish hashes either: the next `mark_computed` re-registers them.

**The order the engine performs the returned copies in, within one step:** swap-out copies
first (they read blocks that this step may hand to others), then swap-in copies, then
copy-on-write copies, then the forward pass writes new K/V.

Deviation from DESIGN.md: `append_slots` takes the new token ids rather than a count, because
prefix caching must hash full blocks of generated tokens too.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from numbers import Integral

SeqId = int  # any hashable id works; a list or tuple passed where one id is expected is a group

# The chained hash's root: the "previous block hash" of a sequence's first block.
ROOT_HASH = bytes(16)


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


class KVCacheError(ValueError):
    """A request the manager cannot honour: unknown or duplicate sequence, bad tokens, ..."""


class NoFreeBlocksError(RuntimeError):
    """Not enough free blocks for the call; the manager's state is left untouched."""

    def __init__(self, pool: str, needed: int, available: int) -> None:
        super().__init__(f"need {needed} free {pool} blocks but only {available} are free")
        self.pool = pool
        self.needed = needed
        self.available = available


# --------------------------------------------------------------------------------------------
# Accounting (shared with minipaged.reservation's baselines)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryUsage:
    """Where a KV cache's token slots are at one moment, in the categories of the vLLM paper's
    Fig. 2: slots holding token states, and the waste among allocated slots:

    * `reserved_slots`: reserved for tokens the request will still generate;
    * `internal_fragmentation_slots`: allocated but never to be used (over-reservation past the
      request's true length, or the unfilled tail of a paged block);
    * `external_fragmentation_slots`: lost to the memory allocator (a buddy allocator rounding a
      reservation up to a power of two).

    Slots not allocated at all are `free_slots`.
    """

    total_slots: int
    token_slots: int
    reserved_slots: int = 0
    internal_fragmentation_slots: int = 0
    external_fragmentation_slots: int = 0

    @property
    def allocated_slots(self) -> int:
        return (
            self.token_slots
            + self.reserved_slots
            + self.internal_fragmentation_slots
            + self.external_fragmentation_slots
        )

    @property
    def free_slots(self) -> int:
        return self.total_slots - self.allocated_slots

    @property
    def token_fraction_of_allocated(self) -> float:
        """Fraction of allocated slots holding token states (1.0 when nothing is allocated)."""
        allocated = self.allocated_slots
        return self.token_slots / allocated if allocated else 1.0

    @property
    def token_fraction_of_total(self) -> float:
        """Fraction of the whole KV cache holding token states."""
        return self.token_slots / self.total_slots


# --------------------------------------------------------------------------------------------
# Data types
# --------------------------------------------------------------------------------------------


@dataclass
class _Block:
    """A physical device block. Prefix-cache fields are set only while its hash is registered."""

    block_id: int
    ref_count: int = 0
    num_tokens: int = 0  # slots holding tokens (all sharers of a block agree on it)
    block_hash: bytes | None = None
    parent_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass
class _Sequence:
    """One sequence's view: its tokens, where they live, how far the engine has computed."""

    token_ids: list[int]
    block_table: list[int]  # device block ids, or host block ids while swapped out
    on_host: bool = False
    num_computed: int = 0  # tokens whose K/V the engine has written (mark_computed)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks
    num_registered_blocks: int = 0  # blocks [0, n) already offered to the prefix cache


class FreeBlockQueue:
    """Free device blocks in eviction order, with O(1) removal from anywhere.

    The front is taken first. Blocks without a cached hash go to the front (nothing is lost by
    reusing them); blocks with a hash go to the back, so the cached block freed longest ago is
    evicted first (LRU).
    """

    def __init__(self, block_ids: Iterable[int] = ()) -> None:
        self._queue: OrderedDict[int, None] = OrderedDict((b, None) for b in block_ids)

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._queue

    def __iter__(self) -> Iterator[int]:
        return iter(self._queue)

    def push_front(self, block_id: int) -> None:
        self._queue[block_id] = None
        self._queue.move_to_end(block_id, last=False)

    def push_back(self, block_id: int) -> None:
        self._queue[block_id] = None

    def pop_front(self) -> int:
        block_id, _ = self._queue.popitem(last=False)
        return block_id

    def remove(self, block_id: int) -> None:
        del self._queue[block_id]


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """The chained hash of a full block: BLAKE2b over (previous block's hash, token ids).

    Deterministic in every process (unlike Python's `hash`), so caches could be shared.
    """
    payload = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.blake2b(parent_hash + payload, digest_size=16).digest()


def _as_token_list(token_ids: Iterable[int], what: str) -> list[int]:
    tokens = list(token_ids)
    for t in tokens:
        if not isinstance(t, Integral) or isinstance(t, bool) or t < 0:
            raise KVCacheError(f"{what} must be non-negative integers, got {t!r}")
    return [int(t) for t in tokens]


# --------------------------------------------------------------------------------------------
# The manager
# --------------------------------------------------------------------------------------------


class KVCacheManager:
    """Block pool, free queue, reference counts, block tables, copy-on-write, prefix cache and a
    host pool for swapping (see the module docstring for the prefix-caching rule)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int = 0,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
    ) -> None:
        for name, value, low in (
            ("num_blocks", num_blocks, 1),
            ("block_size", block_size, 1),
            ("num_host_blocks", num_host_blocks, 0),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark = watermark
        # Blocks admission keeps free so running sequences can grow without instant preemption.
        self.watermark_blocks = int(watermark * num_blocks)

        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free = FreeBlockQueue(range(num_blocks))
        self._cache: dict[bytes, int] = {}  # registered hash -> device block id
        self._host_ref = [0] * num_host_blocks
        self._host_num_tokens = [0] * num_host_blocks
        self._host_free: list[int] = list(range(num_host_blocks - 1, -1, -1))  # pop() from end
        self._seqs: dict[SeqId, _Sequence] = {}
        self._num_token_slots = 0  # sum of num_tokens over used device blocks

        # Prefix-cache counters, in blocks looked up by `allocate`.
        self.prefix_cache_hits = 0
        self.prefix_cache_misses = 0

    # ----------------------------------------------------------------------------- queries --

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._host_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose hash is registered (in use or free but not yet evicted)."""
        return len(self._cache)

    @property
    def prefix_cache_hit_rate(self) -> float:
        looked_up = self.prefix_cache_hits + self.prefix_cache_misses
        return self.prefix_cache_hits / looked_up if looked_up else 0.0

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def seq_ids(self) -> list[SeqId]:
        return list(self._seqs)

    def block_table(self, seq_id: SeqId) -> list[int]:
        """The sequence's physical block ids (host block ids while it is swapped out)."""
        return list(self._seq(seq_id).block_table)

    def num_tokens(self, seq_id: SeqId) -> int:
        return len(self._seq(seq_id).token_ids)

    def token_ids(self, seq_id: SeqId) -> list[int]:
        return list(self._seq(seq_id).token_ids)

    def num_computed_tokens(self, seq_id: SeqId) -> int:
        return self._seq(seq_id).num_computed

    def is_swapped(self, seq_id: SeqId) -> bool:
        return self._seq(seq_id).on_host

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def host_ref_count(self, host_block_id: int) -> int:
        return self._host_ref[host_block_id]

    def num_blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def memory_usage(self) -> MemoryUsage:
        """Device slots holding tokens; the rest of the used blocks is internal fragmentation."""
        used_slots = self.num_used_blocks * self.block_size
        return MemoryUsage(
            total_slots=self.num_blocks * self.block_size,
            token_slots=self._num_token_slots,
            internal_fragmentation_slots=used_slots - self._num_token_slots,
        )

    # ----------------------------------------------------------------- admission and growth --

    def can_allocate(self, tokens: int | Sequence[int]) -> bool:
        """Whether `allocate` of this prompt (a length, or token ids to count cache hits) would
        leave at least the watermark's blocks free."""
        if isinstance(tokens, Integral):
            if tokens <= 0:
                raise KVCacheError(f"a prompt needs at least one token, got {tokens}")
            needed = self.num_blocks_for(int(tokens))
        else:
            token_list = _as_token_list(tokens, "token_ids")
            if not token_list:
                raise KVCacheError("a prompt needs at least one token, got none")
            needed = self._free_blocks_needed_for(token_list, self._hash_full_blocks(token_list))
        return self.num_free_blocks - needed >= self.watermark_blocks

    def allocate(self, seq_id: SeqId, token_ids: Sequence[int]) -> int:
        """Give a new sequence blocks for its whole prompt, reusing prefix-cache hits.

        Returns the number of leading tokens whose K/V is already cached (whole blocks, never
        the last token): the engine computes only the rest. Raises `NoFreeBlocksError` (state
        untouched) when the pool is short; the watermark is `can_allocate`'s business.
        """
        if seq_id in self._seqs:
            raise KVCacheError(f"sequence {seq_id!r} is already allocated")
        tokens = _as_token_list(token_ids, "token_ids")
        if not tokens:
            raise KVCacheError(f"sequence {seq_id!r}: a prompt needs at least one token")
        hashes = self._hash_full_blocks(tokens)
        hits = self._find_cached_prefix(tokens, hashes)
        needed = self._free_blocks_needed_for(tokens, hashes, hits)
        if needed > self.num_free_blocks:
            raise NoFreeBlocksError("device", needed, self.num_free_blocks)

        if self.enable_prefix_caching:
            eligible = (len(tokens) - 1) // self.block_size
            self.prefix_cache_hits += len(hits)
            self.prefix_cache_misses += eligible - len(hits)
        for block_id in hits:
            self._acquire_cached(block_id)
        table = list(hits)
        for index in range(len(hits), self.num_blocks_for(len(tokens))):
            block_id = self._acquire_free()
            fill = min(self.block_size, len(tokens) - index * self.block_size)
            self._set_num_tokens(block_id, fill)
            table.append(block_id)
        self._seqs[seq_id] = _Sequence(
            token_ids=tokens,
            block_table=table,
            num_computed=len(hits) * self.block_size,
            block_hashes=hashes,
            num_registered_blocks=len(hits),
        )
        return len(hits) * self.block_size

    def can_append(self, seq_id: SeqId, n: int = 1) -> bool:
        """Whether `append_slots` of `n` tokens would find enough free blocks.

        The watermark is not applied: it is the reserve kept at admission precisely so that
        running sequences can keep growing (as in vLLM).
        """
        return self._blocks_needed_to_append(self._device_seq(seq_id), n) <= self.num_free_blocks

    def num_blocks_to_append(self, seq_id: SeqId, n: int = 1) -> int:
        """Free blocks `append_slots` of `n` tokens would take (new blocks plus a copy-on-write
        copy); the scheduler sums them over a group whose sequences must grow together."""
        return self._blocks_needed_to_append(self._device_seq(seq_id), n)

    def append_slots(self, seq_id: SeqId, new_token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Grow the sequence's table for tokens about to be written; return copy-on-write pairs.

        If the last block is partly filled and shared (after `fork`), it is first replaced by a
        private copy: the engine must copy block `src` to `dst` for every returned pair before
        writing the new tokens. Raises `NoFreeBlocksError` (state untouched) when short.
        """
        seq = self._device_seq(seq_id)
        new_tokens = _as_token_list(new_token_ids, "new_token_ids")
        needed = self._blocks_needed_to_append(seq, len(new_tokens))
        if needed > self.num_free_blocks:
            raise NoFreeBlocksError("device", needed, self.num_free_blocks)

        copies: list[tuple[int, int]] = []
        table = seq.block_table
        if self._last_block_is_shared_and_partial(seq):
            src = table[-1]
            dst = self._acquire_free()
            self._set_num_tokens(dst, self._blocks[src].num_tokens)
            self._release(src)
            table[-1] = dst
            copies.append((src, dst))
        seq.token_ids.extend(new_tokens)
        new_len = len(seq.token_ids)
        last_fill = min(self.block_size, new_len - (len(table) - 1) * self.block_size)
        self._set_num_tokens(table[-1], last_fill)
        for index in range(len(table), self.num_blocks_for(new_len)):
            block_id = self._acquire_free()
            self._set_num_tokens(block_id, min(self.block_size, new_len - index * self.block_size))
            table.append(block_id)
        return copies

    def mark_computed(self, seq_id: SeqId, num_computed_tokens: int) -> None:
        """Record that the K/V of the sequence's first `num_computed_tokens` tokens is written,
        and publish the hashes of the full blocks that are now wholly computed."""
        seq = self._device_seq(seq_id)
        if not seq.num_computed <= num_computed_tokens <= len(seq.token_ids):
            raise KVCacheError(
                f"sequence {seq_id!r}: num_computed_tokens must be between the previous value "
                f"({seq.num_computed}) and the number of tokens ({len(seq.token_ids)}), "
                f"got {num_computed_tokens}"
            )
        seq.num_computed = num_computed_tokens
        if self.enable_prefix_caching:
            self._register_computed_blocks(seq)

    # ------------------------------------------------------------------------ fork and free --

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """Make `child_id` share every block of `parent_id` (parallel sampling, beam search).

        The parent's tokens must all be computed: a child never inherits pending writes.
        """
        if child_id in self._seqs:
            raise KVCacheError(f"sequence {child_id!r} is already allocated")
        parent = self._device_seq(parent_id)
        if parent.num_computed != len(parent.token_ids):
            raise KVCacheError(
                f"sequence {parent_id!r} has {len(parent.token_ids) - parent.num_computed} "
                "uncomputed tokens; call mark_computed before fork"
            )
        for block_id in parent.block_table:
            self._blocks[block_id].ref_count += 1
        self._seqs[child_id] = _Sequence(
            token_ids=list(parent.token_ids),
            block_table=list(parent.block_table),
            num_computed=parent.num_computed,
            block_hashes=list(parent.block_hashes),
            num_registered_blocks=parent.num_registered_blocks,
        )

    def free(self, seq_id: SeqId) -> None:
        """Drop the sequence; blocks no longer referenced return to the free queue (cached ones
        stay findable until evicted)."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        if seq.on_host:
            for host_block in seq.block_table:
                self._release_host(host_block)
        else:
            # Last block first: the prefix, the likeliest to be shared again, is evicted last.
            for block_id in reversed(seq.block_table):
                self._release(block_id)

    # ----------------------------------------------------------------------------- swapping --

    def can_swap_out(self, seq_ids: SeqId | Sequence[SeqId]) -> bool:
        group = self._group(seq_ids, on_host=False)
        return len(self._distinct_blocks(group)) <= self.num_free_host_blocks

    def swap_out(self, seq_ids: SeqId | Sequence[SeqId]) -> list[tuple[int, int]]:
        """Move a sequence, or a group sharing blocks (pass a list), to the host pool.

        Each distinct device block is copied once; returns the (device, host) copies to
        perform. Device blocks left unreferenced are freed (cached ones stay findable).
        """
        group = self._group(seq_ids, on_host=False)
        distinct = self._distinct_blocks(group)
        if len(distinct) > self.num_free_host_blocks:
            raise NoFreeBlocksError("host", len(distinct), self.num_free_host_blocks)
        mapping: dict[int, int] = {}
        for block_id, refs in distinct.items():
            host_block = self._host_free.pop()
            self._host_ref[host_block] = refs
            self._host_num_tokens[host_block] = self._blocks[block_id].num_tokens
            mapping[block_id] = host_block
        for seq in group:
            for block_id in reversed(seq.block_table):
                self._release(block_id)
            seq.block_table = [mapping[b] for b in seq.block_table]
            seq.on_host = True
        return list(mapping.items())

    def can_swap_in(self, seq_ids: SeqId | Sequence[SeqId]) -> bool:
        """Whether `swap_in` would leave at least the watermark's blocks free."""
        group = self._group(seq_ids, on_host=True)
        return self.num_free_blocks - len(self._distinct_blocks(group)) >= self.watermark_blocks

    def swap_in(self, seq_ids: SeqId | Sequence[SeqId]) -> list[tuple[int, int]]:
        """Bring a swapped-out sequence or group back; returns the (host, device) copies.

        The swapped-in blocks are offered to the prefix cache again at the next `mark_computed`.
        """
        group = self._group(seq_ids, on_host=True)
        distinct = self._distinct_blocks(group)
        if len(distinct) > self.num_free_blocks:
            raise NoFreeBlocksError("device", len(distinct), self.num_free_blocks)
        mapping: dict[int, int] = {}
        for host_block, refs in distinct.items():
            block_id = self._acquire_free()
            self._blocks[block_id].ref_count = refs
            self._set_num_tokens(block_id, self._host_num_tokens[host_block])
            mapping[host_block] = block_id
        for seq in group:
            for host_block in seq.block_table:
                self._release_host(host_block)
            seq.block_table = [mapping[h] for h in seq.block_table]
            seq.on_host = False
            seq.num_registered_blocks = 0
        return list(mapping.items())

    # ------------------------------------------------------------------------- invariants --

    def check_invariants(self) -> None:
        """Check every structural invariant; raise AssertionError describing the first broken."""
        bs = self.block_size
        refs = [0] * self.num_blocks
        host_refs = [0] * self.num_host_blocks
        fills: dict[int, int] = {}
        for seq_id, seq in self._seqs.items():
            n = len(seq.token_ids)
            assert n > 0, f"sequence {seq_id!r} has no tokens"
            assert len(seq.block_table) == self.num_blocks_for(n), (
                f"sequence {seq_id!r}: {n} tokens need {self.num_blocks_for(n)} blocks, "
                f"table has {len(seq.block_table)}"
            )
            assert 0 <= seq.num_computed <= n, f"sequence {seq_id!r}: num_computed out of range"
            assert seq.num_registered_blocks <= seq.num_computed // bs, (
                f"sequence {seq_id!r}: blocks offered to the prefix cache beyond computed tokens"
            )
            for index, block_id in enumerate(seq.block_table):
                fill = min(bs, n - index * bs)
                if seq.on_host:
                    host_refs[block_id] += 1
                    assert self._host_num_tokens[block_id] == fill, (
                        f"host block {block_id}: fill {self._host_num_tokens[block_id]} != {fill}"
                    )
                    continue
                refs[block_id] += 1
                assert fills.setdefault(block_id, fill) == fill, (
                    f"block {block_id} shared by sequences that disagree on its fill"
                )
                block = self._blocks[block_id]
                if fill < bs and block.ref_count > 1:
                    assert index == len(seq.block_table) - 1, (
                        f"shared partial block {block_id} is not last in {seq_id!r}'s table"
                    )
                if block.token_ids is not None:
                    own = tuple(seq.token_ids[index * bs : (index + 1) * bs])
                    assert own == block.token_ids, (
                        f"cached block {block_id} holds other tokens than sequence {seq_id!r}"
                    )
        for block in self._blocks:
            b = block.block_id
            assert block.ref_count == refs[b], (
                f"block {b}: ref count {block.ref_count} but {refs[b]} block-table references"
            )
            assert (b in self._free) == (block.ref_count == 0), (
                f"block {b}: ref count {block.ref_count} but in free queue: {b in self._free}"
            )
            if block.ref_count:
                assert block.num_tokens == fills[b], f"block {b}: num_tokens {block.num_tokens}"
            if block.block_hash is not None:
                assert self._cache.get(block.block_hash) == b, f"block {b}: hash not registered"
                assert block.token_ids is not None and len(block.token_ids) == bs, (
                    f"block {b}: a registered block must be full"
                )
        assert self.num_free_blocks + sum(1 for r in refs if r) == self.num_blocks, (
            "free and used blocks do not partition the pool"
        )
        for h, b in self._cache.items():
            assert self._blocks[b].block_hash == h, f"cache entry for block {b} has a stale hash"
        token_slots = sum(fills.values())
        assert self._num_token_slots == token_slots, (
            f"token-slot counter {self._num_token_slots} != {token_slots}"
        )
        unreferenced_host = [h for h in range(self.num_host_blocks) if not host_refs[h]]
        assert sorted(self._host_free) == unreferenced_host, (
            "host free list does not hold exactly the unreferenced host blocks"
        )
        for h in range(self.num_host_blocks):
            assert self._host_ref[h] == host_refs[h], (
                f"host block {h}: ref count {self._host_ref[h]} but {host_refs[h]} references"
            )

    # -------------------------------------------------------------------------- internals --

    def _seq(self, seq_id: SeqId) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KVCacheError(f"unknown sequence {seq_id!r}") from None

    def _device_seq(self, seq_id: SeqId) -> _Sequence:
        seq = self._seq(seq_id)
        if seq.on_host:
            raise KVCacheError(f"sequence {seq_id!r} is swapped out; swap it in first")
        return seq

    def _group(self, seq_ids: SeqId | Sequence[SeqId], on_host: bool) -> list[_Sequence]:
        ids = list(seq_ids) if isinstance(seq_ids, (list, tuple)) else [seq_ids]
        if not ids:
            raise KVCacheError("empty sequence group")
        if len(set(ids)) != len(ids):
            raise KVCacheError(f"sequence group {ids!r} repeats an id")
        group = [self._seq(i) for i in ids]
        for seq_id, seq in zip(ids, group, strict=True):
            if seq.on_host != on_host:
                where = "swapped out" if seq.on_host else "on the device"
                raise KVCacheError(f"sequence {seq_id!r} is already {where}")
        return group

    @staticmethod
    def _distinct_blocks(group: list[_Sequence]) -> dict[int, int]:
        """Each distinct block of the group's tables -> references from within the group."""
        counts: dict[int, int] = {}
        for seq in group:
            for block_id in seq.block_table:
                counts[block_id] = counts.get(block_id, 0) + 1
        return counts

    def _hash_full_blocks(
        self, tokens: list[int], start: int = 0, parent: bytes = ROOT_HASH
    ) -> list[bytes]:
        """Chained hashes of the full blocks `start, start + 1, ...` (`parent`: block start-1's)."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hashes = []
        for index in range(start, len(tokens) // bs):
            parent = hash_block(parent, tokens[index * bs : (index + 1) * bs])
            hashes.append(parent)
        return hashes

    def _find_cached_prefix(self, tokens: list[int], hashes: list[bytes]) -> list[int]:
        """Blocks caching the prompt's leading full blocks, stopping at the first miss and never
        covering the last token. Each hit is confirmed against the stored tokens and parent."""
        bs = self.block_size
        hits: list[int] = []
        parent = ROOT_HASH
        for index in range(min(len(hashes), (len(tokens) - 1) // bs)):
            block_id = self._cache.get(hashes[index])
            if block_id is None:
                break
            block = self._blocks[block_id]
            if block.parent_hash != parent or block.token_ids != tuple(
                tokens[index * bs : (index + 1) * bs]
            ):
                break  # a hash collision: treat as a miss
            hits.append(block_id)
            parent = hashes[index]
        return hits

    def _free_blocks_needed_for(
        self, tokens: list[int], hashes: list[bytes], hits: list[int] | None = None
    ) -> int:
        """Free-queue blocks `allocate` would consume: new blocks plus free cached hits."""
        if hits is None:
            hits = self._find_cached_prefix(tokens, hashes)
        num_new = self.num_blocks_for(len(tokens)) - len(hits)
        return num_new + sum(1 for b in hits if self._blocks[b].ref_count == 0)

    def _last_block_is_shared_and_partial(self, seq: _Sequence) -> bool:
        return (
            len(seq.token_ids) % self.block_size != 0
            and self._blocks[seq.block_table[-1]].ref_count > 1
        )

    def _blocks_needed_to_append(self, seq: _Sequence, n: int) -> int:
        if not isinstance(n, Integral) or n < 0:
            raise KVCacheError(f"number of tokens to append must be >= 0, got {n!r}")
        if n == 0:
            return 0
        new_blocks = self.num_blocks_for(len(seq.token_ids) + n) - len(seq.block_table)
        return new_blocks + int(self._last_block_is_shared_and_partial(seq))

    def _register_computed_blocks(self, seq: _Sequence) -> None:
        bs = self.block_size
        num_full = seq.num_computed // bs
        if len(seq.block_hashes) < num_full:
            parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_HASH
            computed = seq.token_ids[: num_full * bs]
            seq.block_hashes.extend(self._hash_full_blocks(computed, len(seq.block_hashes), parent))
        for index in range(seq.num_registered_blocks, num_full):
            block = self._blocks[seq.block_table[index]]
            block_hash = seq.block_hashes[index]
            if block.block_hash is not None or block_hash in self._cache:
                continue  # already cached, or another block caches these tokens: stay private
            block.block_hash = block_hash
            block.parent_hash = seq.block_hashes[index - 1] if index else ROOT_HASH
            block.token_ids = tuple(seq.token_ids[index * bs : (index + 1) * bs])
            self._cache[block_hash] = block.block_id
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    def _set_num_tokens(self, block_id: int, num_tokens: int) -> None:
        block = self._blocks[block_id]
        self._num_token_slots += num_tokens - block.num_tokens
        block.num_tokens = num_tokens

    def _acquire_cached(self, block_id: int) -> None:
        """Take one more reference to a cached block, reviving it from the free queue."""
        block = self._blocks[block_id]
        if block.ref_count == 0:
            self._free.remove(block_id)
            self._num_token_slots += block.num_tokens
        block.ref_count += 1

    def _acquire_free(self) -> int:
        """Pop the front of the free queue, evicting its cached hash; returns it empty, ref 1."""
        block = self._blocks[self._free.pop_front()]
        if block.block_hash is not None:
            del self._cache[block.block_hash]
            block.block_hash = block.parent_hash = block.token_ids = None
        block.ref_count = 1
        block.num_tokens = 0
        return block.block_id

    def _release(self, block_id: int) -> None:
        block = self._blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._num_token_slots -= block.num_tokens
            if block.block_hash is None:
                self._free.push_front(block_id)
            else:
                self._free.push_back(block_id)

    def _release_host(self, host_block: int) -> None:
        self._host_ref[host_block] -= 1
        if self._host_ref[host_block] == 0:
            self._host_free.append(host_block)
