"""The physical blocks under `KVCacheManager`: the GPU pool with its free queue and prefix
cache, and the CPU pool that swapped-out blocks go to (vLLM paper §4.2-4.5).

The GPU pool knows, for each block, how many sequences reference it and how many of its
slots hold tokens (its fill); a full block whose K/V is computed may also carry a *block hash*,
which makes it findable by later prompts with the same prefix (§4.4, "shared prefix"). A hash is
chained -- BLAKE2b over (the previous block's hash, the block's token ids) -- so equal hashes
mean equal prefixes, and every hit is still confirmed against the block's stored token ids.
A freed cached block stays findable until the `FreeBlockQueue` evicts it (LRU).

Which sequence uses which block is the manager's business (`minipaged.kv.manager`); this module
only counts.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

# The chained hash's root: the "previous block hash" of a sequence's first block.
ROOT_HASH = bytes(16)
# A group's tables moved to the other pool, and the (source, destination) copies (`moved`).
Moved = tuple[list[list[int]], list[tuple[int, int]]]

# -- data types -----------------------------------------------------------------------------------


@dataclass
class Block:
    """A physical block of the GPU pool. Prefix-cache fields are set only while its hash is
    registered."""

    block_id: int
    ref_count: int = 0
    num_tokens: int = 0  # slots holding tokens (all sharers of a block agree on it)
    block_hash: bytes | None = None
    parent_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None  # the content a hit is confirmed against


class FreeBlockQueue(OrderedDict[int, None]):
    """Free GPU blocks in eviction order, with O(1) removal from anywhere: an ordered dict of
    block ids (its `len`, `in` and iteration are the queue's).

    The front is taken first. Blocks without a cached hash go to the front (nothing is lost by
    reusing them); blocks with a hash go to the back, so the cached block freed longest ago is
    evicted first (LRU).
    """

    def __init__(self, block_ids: Iterable[int] = ()) -> None:
        super().__init__((b, None) for b in block_ids)

    def push_front(self, block_id: int) -> None:
        self[block_id] = None
        self.move_to_end(block_id, last=False)

    def push_back(self, block_id: int) -> None:
        self[block_id] = None

    def pop_front(self) -> int:
        return self.popitem(last=False)[0]

    def remove(self, block_id: int) -> None:
        del self[block_id]


# -- hashing --------------------------------------------------------------------------------------


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """The chained hash of a full block: BLAKE2b over (previous block's hash, token ids).

    Deterministic in every process (unlike Python's `hash`), so caches could be shared.
    """
    payload = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.blake2b(parent_hash + payload, digest_size=16).digest()


def chained_hashes(
    token_ids: Sequence[int], block_size: int, parent: bytes = ROOT_HASH
) -> list[bytes]:
    """Hashes of the full blocks of `token_ids`; `parent` is the hash of the block before the
    first (none: `ROOT_HASH`)."""
    hashes = []
    for index in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[index * block_size : (index + 1) * block_size])
        hashes.append(parent)
    return hashes


def distinct_blocks(tables: Iterable[list[int]]) -> dict[int, int]:
    """Each distinct block of a group's tables -> the references to it from within the group."""
    return Counter(block_id for table in tables for block_id in table)


def moved(
    tables: list[list[int]], take: Callable[[int, int], int], release: Callable[[int], None]
) -> Moved:
    """A group's tables moved to the other pool: each distinct block copied once, to the block
    `take(its references, it)` gives there, then every reference released, each table's last
    block first (a GPU table's prefix is evicted last); the new tables and the copies."""
    mapping = {block: take(refs, block) for block, refs in distinct_blocks(tables).items()}
    for table in tables:
        for block in reversed(table):
            release(block)
    return [[mapping[b] for b in table] for table in tables], list(mapping.items())


# -- the GPU pool ---------------------------------------------------------------------------------


class GPUPool:
    """The GPU pool's blocks: reference counts, slot fills, the free queue and the prefix
    cache."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free = FreeBlockQueue(range(num_blocks))
        self.cache: dict[bytes, int] = {}  # registered hash -> block id
        self.num_token_slots = 0  # sum of num_tokens over used blocks

    def take_free(self, ref_count: int = 1, num_tokens: int = 0) -> int:
        """Pop the front of the free queue, evicting its cached hash; returns it with
        `ref_count` references and `num_tokens` slots filled."""
        block = self.blocks[self.free.pop_front()]
        if block.block_hash is not None:
            del self.cache[block.block_hash]
            block.block_hash = block.parent_hash = block.token_ids = None
        block.ref_count = ref_count
        block.num_tokens = num_tokens
        self.num_token_slots += num_tokens
        return block.block_id

    def take_shared(self, block_id: int) -> None:
        """One more reference to a block: a fork's, or a prefix hit reviving a free one."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.free.remove(block_id)
            self.num_token_slots += block.num_tokens
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        """Drop one reference; an unreferenced block joins the free queue (cached: at the back)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.num_token_slots -= block.num_tokens
            if block.block_hash is None:
                self.free.push_front(block_id)
            else:
                self.free.push_back(block_id)

    def set_num_tokens(self, block_id: int, num_tokens: int) -> None:
        block = self.blocks[block_id]
        self.num_token_slots += num_tokens - block.num_tokens
        block.num_tokens = num_tokens

    # -- the prefix cache -------------------------------------------------------------------------

    def cached_prefix(self, token_ids: Sequence[int], hashes: Sequence[bytes]) -> list[int]:
        """Blocks caching a prompt's leading full blocks (`hashes`: their chained hashes), up to
        the first miss and never covering the last token. A hit is confirmed against the block's
        parent hash and tokens: a hash collision is a miss."""
        bs = self.block_size
        hits: list[int] = []
        parent = ROOT_HASH
        for index in range(min(len(hashes), (len(token_ids) - 1) // bs)):
            block_id = self.cache.get(hashes[index])
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.parent_hash != parent or block.token_ids != tuple(
                token_ids[index * bs : (index + 1) * bs]
            ):
                break
            hits.append(block_id)
            parent = hashes[index]
        return hits

    def num_to_take(self, num_fresh: int, hits: Sequence[int]) -> int:
        """Free blocks that `num_fresh` new blocks plus these prefix hits take from the queue."""
        return num_fresh + sum(1 for b in hits if self.blocks[b].ref_count == 0)

    def register(
        self, block_id: int, block_hash: bytes, parent_hash: bytes, token_ids: Sequence[int]
    ) -> None:
        """Make a full, computed block findable, unless it or another block caches these tokens
        already (then it stays private)."""
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self.cache:
            return
        block.block_hash = block_hash
        block.parent_hash = parent_hash
        block.token_ids = tuple(token_ids)
        self.cache[block_hash] = block_id

    def check_invariants(self, refs: list[int], fills: dict[int, int]) -> None:
        """Given the references and fills the block tables imply, check the pool's counts, free
        queue and cache; raise AssertionError describing the first broken invariant."""
        for block in self.blocks:
            b = block.block_id
            assert block.ref_count == refs[b], (
                f"block {b}: ref count {block.ref_count} but {refs[b]} block-table references"
            )
            assert (b in self.free) == (block.ref_count == 0), (
                f"block {b}: ref count {block.ref_count} but in free queue: {b in self.free}"
            )
            if block.ref_count:
                assert block.num_tokens == fills[b], f"block {b}: num_tokens {block.num_tokens}"
            if block.block_hash is not None:
                assert self.cache.get(block.block_hash) == b, f"block {b}: hash not registered"
                assert block.token_ids is not None and len(block.token_ids) == self.block_size, (
                    f"block {b}: a registered block must be full"
                )
        assert len(self.free) + sum(1 for r in refs if r) == self.num_blocks, (
            "free and used blocks do not partition the pool"
        )
        for h, b in self.cache.items():
            assert self.blocks[b].block_hash == h, f"cache entry for block {b} has a stale hash"
        token_slots = sum(fills.values())
        assert self.num_token_slots == token_slots, (
            f"token-slot counter {self.num_token_slots} != {token_slots}"
        )


# -- the CPU pool ---------------------------------------------------------------------------------


class CPUPool:
    """The CPU pool's blocks, holding swapped-out K/V: reference counts and fills, lowest id
    taken first."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.num_tokens = [0] * num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() from the end

    def take(self, ref_count: int, num_tokens: int) -> int:
        cpu_block = self.free.pop()
        self.ref_counts[cpu_block] = ref_count
        self.num_tokens[cpu_block] = num_tokens
        return cpu_block

    def release(self, cpu_block: int) -> None:
        self.ref_counts[cpu_block] -= 1
        if self.ref_counts[cpu_block] == 0:
            self.free.append(cpu_block)

    def move_out(self, tables: list[list[int]], gpu: GPUPool) -> Moved:
        """Copy the distinct GPU blocks of a group's tables here (the caller checked there is
        room) and release them on the GPU; returns the CPU tables and the (GPU, CPU) copies."""
        return moved(tables, lambda refs, b: self.take(refs, gpu.blocks[b].num_tokens), gpu.release)

    def move_in(self, tables: list[list[int]], gpu: GPUPool) -> Moved:
        """The reverse: fresh GPU blocks for a group's CPU tables (the caller checked there is
        room); returns the GPU tables and the (CPU, GPU) copies."""
        return moved(tables, lambda refs, h: gpu.take_free(refs, self.num_tokens[h]), self.release)

    def check_invariants(self, refs: list[int]) -> None:
        """Given the references the block tables imply, check the counts and the free list."""
        unreferenced = [h for h in range(self.num_blocks) if not refs[h]]
        assert sorted(self.free) == unreferenced, (
            "CPU free list does not hold exactly the unreferenced CPU blocks"
        )
        for h in range(self.num_blocks):
            assert self.ref_counts[h] == refs[h], (
                f"CPU block {h}: ref count {self.ref_counts[h]} but {refs[h]} references"
            )
