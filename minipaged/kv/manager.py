"""The KV cache manager: PagedAttention's memory half (vLLM paper, Kwon et al. SOSP'23, §4.1-4.5).

The KV cache is cut into fixed-size *blocks* of `block_size` token slots. Each sequence owns a
*block table* mapping its logical blocks (tokens `i * block_size ... (i + 1) * block_size - 1`)
to physical blocks anywhere in the pool, like pages of virtual memory (§4.1-4.3). Waste is
bounded by the unfilled tail of each sequence's last block.

Blocks are shared with reference counts: within a request by `fork` (parallel sampling, beam
search, §4.4) and across requests by *prefix caching* (§4.4, "shared prefix"). A shared block is
never written: `append_slots` copies a shared, partly filled last block first (copy-on-write)
and returns the copies for the engine to perform. When GPU blocks run out, a whole sequence
group can be swapped to the CPU pool and back (§4.5). The blocks themselves, their fills, their
hashes and the free queue are `minipaged.kv.pool`'s.

**The two pools** keep vLLM's names: the *GPU pool* (`num_gpu_blocks` blocks), the device's KV
cache, where attention reads and writes; and the *CPU pool* (`num_cpu_blocks`), the host's swap
space for swapped-out blocks. On a CPU-only machine the "GPU pool" is the device cache in host
memory all the same: the names say which pool, not which chip. Unqualified counts (`ref_count`,
`num_free_blocks`) are the GPU pool's; the CPU pool's say so (`cpu_ref_count`,
`num_free_cpu_blocks`).

**No token counts.** The manager keeps no sequence's length: the slots a table covers are its
blocks' fills, and growth is asked for as the number of tokens to cover, which the sequence's
owner knows (`append_slots(seq_id, num_tokens=...)`).

**The rule that keeps prefix caching correct.** A block's hash becomes findable only when the
engine says its K/V has really been computed: `mark_computed(seq_id, computed_token_ids)`,
called after each step with the sequence's computed prefix, registers the full blocks lying
wholly inside it. Allocation alone never publishes a hash, so

* two sequences admitted in the same step with the same prompt never hit on each other's
  still-empty blocks (each computes its own; the second block with an already-registered hash
  simply stays private);
* a prompt whose every block is cached still recomputes its last block, because a hit never
  covers the last prompt token (its logits are needed), and hits are whole blocks;
* a sequence preempted by recomputation (`free`, later `allocate` of prompt + generated tokens)
  hits on its own freed blocks, which stay reusable in the free queue until evicted;
* swapped-in blocks are offered to the cache again at the next `mark_computed`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from minipaged.kv.block_table import BlockTable
from minipaged.kv.interface import (
    BlockCopy,
    KVCacheError,
    ManagerBase,
    MemoryUsage,
    NoFreeBlocksError,
    SeqId,
    as_token_ids,
    check_count,
    check_growth,
    too_many_computed,
)
from minipaged.kv.pool import CPUPool, GPUPool, chained_hashes, distinct_blocks


class KVCacheManager(ManagerBase[BlockTable]):
    """Block tables, copy-on-write, prefix caching and swapping over a GPU and a CPU pool;
    implements `minipaged.kv.interface.KVManager` (see the module docstring for the pools'
    names and the prefix-caching rule)."""

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
    ) -> None:
        super().__init__(num_gpu_blocks, block_size)
        check_count("num_cpu_blocks", num_cpu_blocks, 0)
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark!r}")
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark = watermark
        # Blocks admission keeps free so running sequences can grow without instant preemption.
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self._gpu = GPUPool(num_gpu_blocks, block_size)
        self._cpu = CPUPool(num_cpu_blocks)
        # Prefix-cache counters, in blocks looked up by `allocate`.
        self.prefix_cache_hits = 0
        self.prefix_cache_misses = 0

    # -- queries ----------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._gpu.free)

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self._cpu.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_gpu_blocks - len(self._gpu.free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose hash is registered (in use or free but not yet evicted)."""
        return len(self._gpu.cache)

    @property
    def prefix_cache_hit_rate(self) -> float:
        looked_up = self.prefix_cache_hits + self.prefix_cache_misses
        return self.prefix_cache_hits / looked_up if looked_up else 0.0

    def block_table(self, seq_id: SeqId) -> tuple[int, ...]:
        """The sequence's physical block ids (CPU block ids while it is swapped out): the
        table's own tuple, the same object until a block is added, copied or moved."""
        return self._seqs[seq_id].blocks

    def num_slots(self, seq_id: SeqId) -> int:
        """Token slots the sequence's table covers: its blocks' fills (for pictures and tests;
        the sequence's own length is its owner's)."""
        return self._seqs[seq_id].num_slots

    def is_swapped(self, seq_id: SeqId) -> bool:
        return self._seqs[seq_id].on_cpu

    def ref_count(self, block_id: int) -> int:
        return self._gpu.blocks[block_id].ref_count

    def cpu_ref_count(self, cpu_block_id: int) -> int:
        return self._cpu.ref_counts[cpu_block_id]

    def blocks_for_request(self, prompt_len: int, max_len: int, width: int) -> int:
        """The prompt's full blocks are shared by every sample; the rest of each is its own. A
        sequence never writes the K/V of its last token (it is sampled, and the sequence ends),
        so `max_len - 1` slots each: a request that samples one token writes none past its
        prompt, and its samples share even the prompt's last, partial block."""
        if max_len - 1 <= prompt_len:
            return self.num_blocks_for(prompt_len)
        shared = prompt_len // self.block_size if width > 1 else 0
        return shared + width * (self.num_blocks_for(max_len - 1) - shared)

    def memory_usage(self) -> MemoryUsage:
        """GPU slots holding tokens; the rest of the used blocks is internal fragmentation."""
        token_slots = self._gpu.num_token_slots
        return MemoryUsage(
            total_slots=self.num_gpu_blocks * self.block_size,
            token_slots=token_slots,
            internal_fragmentation_slots=self.num_used_blocks * self.block_size - token_slots,
        )

    # -- admission and growth ---------------------------------------------------------------------

    def can_allocate(self, seq_id: SeqId, token_ids: Sequence[int]) -> bool:
        """Whether `allocate` would succeed and leave at least the watermark's blocks free
        (a prefix hit on a block in use takes no free block)."""
        needed = self._plan_prompt(seq_id, token_ids)[3]
        return self.num_free_blocks - needed >= self.watermark_blocks

    def allocate(self, seq_id: SeqId, token_ids: Sequence[int]) -> int:
        """Give a new sequence blocks for its whole prompt, reusing prefix-cache hits.

        Returns the number of leading tokens whose K/V is already cached (whole blocks, never
        the last token): the engine computes only the rest. Raises `NoFreeBlocksError` (state
        untouched) when the pool is short; the watermark is `can_allocate`'s business.
        """
        tokens, hashes, hits, needed = self._plan_prompt(seq_id, token_ids)
        if needed > self.num_free_blocks:
            raise NoFreeBlocksError("GPU", needed, self.num_free_blocks)
        if self.enable_prefix_caching:  # looked up: the full blocks before the last token
            self.prefix_cache_hits += len(hits)
            self.prefix_cache_misses += (len(tokens) - 1) // self.block_size - len(hits)
        for block_id in hits:
            self._gpu.take_shared(block_id)
        table = BlockTable(self._gpu, self._cpu, tuple(hits), hashes, len(hits))
        table.append(len(tokens))
        self._seqs[seq_id] = table
        return len(hits) * self.block_size

    def num_blocks_to_append(self, seq_id: SeqId, *, num_tokens: int) -> int:
        """Free blocks `append_slots(seq_id, num_tokens=num_tokens)` would take (new blocks
        plus a copy-on-write copy); the scheduler sums them over a group whose sequences must
        grow together."""
        table = self._gpu_table(seq_id)
        return table.blocks_to_append(num_tokens, check_growth(num_tokens, table.num_slots))

    def can_append(self, seq_id: SeqId, *, num_tokens: int) -> bool:
        """Whether `append_slots` would find enough free blocks to cover `num_tokens` tokens.

        The watermark is not applied: it is the reserve kept at admission precisely so that
        running sequences can keep growing (as in vLLM).
        """
        return self.num_blocks_to_append(seq_id, num_tokens=num_tokens) <= self.num_free_blocks

    def append_slots(self, seq_id: SeqId, *, num_tokens: int) -> list[BlockCopy]:
        """Grow the sequence's table to cover its first `num_tokens` tokens (its length, from
        its owner; nothing to do when covered already); return the copy-on-write pairs.

        If the last block is partly filled and shared (after `fork`), it is first replaced by a
        private copy: the engine must copy block `src` to `dst` for every returned pair before
        writing the new tokens. Raises `NoFreeBlocksError` (state untouched) when short.
        """
        table = self._gpu_table(seq_id)
        covered = check_growth(num_tokens, table.num_slots)
        needed = table.blocks_to_append(num_tokens, covered)
        if needed and needed > self.num_free_blocks:
            raise NoFreeBlocksError("GPU", needed, self.num_free_blocks)
        return table.append(num_tokens, covered)

    def mark_computed(self, seq_id: SeqId, computed_token_ids: Sequence[int]) -> None:
        """Record that the K/V of the sequence's computed prefix `computed_token_ids` (from its
        owner) is written, and publish the hashes of the full blocks wholly inside it."""
        table = self._gpu_table(seq_id)
        if len(computed_token_ids) > table.num_slots:
            raise too_many_computed(seq_id, len(computed_token_ids), table.num_slots)
        full = len(computed_token_ids) // self.block_size  # most steps fill no block: no call
        if self.enable_prefix_caching and full > table.num_registered_blocks:
            table.register_computed(computed_token_ids)

    # -- fork and free ----------------------------------------------------------------------------

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """Make `child_id` share every block of `parent_id` (parallel sampling, beam search).

        Fork after the parent's slots are computed (the engine forks after sampling): shared
        blocks are read-only, and the first append into a shared partial block copies it.
        """
        self._seqs.check_new(child_id)
        self._seqs[child_id] = self._gpu_table(parent_id).fork()

    def free(self, seq_id: SeqId) -> None:
        """Drop the sequence; blocks no longer referenced return to the free queue (cached ones
        stay findable until evicted)."""
        self._seqs[seq_id].release()
        del self._seqs[seq_id]

    # -- swapping ---------------------------------------------------------------------------------

    def can_swap_out(self, seq_ids: SeqId | Sequence[SeqId]) -> bool:
        return len(self._group(seq_ids, on_cpu=False)[1]) <= self.num_free_cpu_blocks

    def swap_out(self, seq_ids: SeqId | Sequence[SeqId]) -> list[BlockCopy]:
        """Move a sequence, or a group sharing blocks (pass a list), to the CPU pool.

        Each distinct GPU block is copied once; returns the (GPU, CPU) copies to perform. GPU
        blocks left unreferenced are freed (cached ones stay findable).
        """
        group, uses = self._group(seq_ids, on_cpu=False)
        if len(uses) > self.num_free_cpu_blocks:
            raise NoFreeBlocksError("CPU", len(uses), self.num_free_cpu_blocks)
        cpu_tables, copies = self._cpu.move_out([t.blocks for t in group], self._gpu)
        for table, blocks in zip(group, cpu_tables, strict=True):
            table.blocks, table.on_cpu = tuple(blocks), True
        return copies

    def can_swap_in(self, seq_ids: SeqId | Sequence[SeqId]) -> bool:
        """Whether `swap_in` would leave at least the watermark's blocks free."""
        needed = len(self._group(seq_ids, on_cpu=True)[1])
        return self.num_free_blocks - needed >= self.watermark_blocks

    def num_blocks_to_swap_in(self, num_tokens: Mapping[SeqId, int]) -> int:
        """Free GPU blocks a swapped-out group (its ids -> the tokens each must then cover)
        takes to come back and grow: each shared CPU block once, plus new blocks and at most one
        copy-on-write copy a sequence (its last block, partly filled and shared)."""
        group, uses = self._group(list(num_tokens), on_cpu=True)
        growth = 0
        for table, wanted in zip(group, num_tokens.values(), strict=True):
            covered = check_growth(wanted, table.num_slots)
            growth += self.num_blocks_for(wanted) - len(table.blocks)
            if wanted > covered and covered % self.block_size and uses[table.blocks[-1]] > 1:
                growth += 1
        return len(uses) + growth

    def swap_in(self, seq_ids: SeqId | Sequence[SeqId]) -> list[BlockCopy]:
        """Bring a swapped-out sequence or group back; returns the (CPU, GPU) copies.

        The swapped-in blocks are offered to the prefix cache again at the next `mark_computed`.
        """
        group, uses = self._group(seq_ids, on_cpu=True)
        if len(uses) > self.num_free_blocks:
            raise NoFreeBlocksError("GPU", len(uses), self.num_free_blocks)
        gpu_tables, copies = self._cpu.move_in([t.blocks for t in group], self._gpu)
        for table, blocks in zip(group, gpu_tables, strict=True):
            table.blocks, table.on_cpu, table.num_registered_blocks = tuple(blocks), False, 0
        return copies

    # -- invariants -------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Check every structural invariant; raise AssertionError describing the first broken:
        each table on its own, then ref counts equal to table references in both pools."""
        refs = [0] * self.num_gpu_blocks
        cpu_refs = [0] * self.num_cpu_blocks
        fills: dict[int, int] = {}
        for seq_id, table in self._seqs.items():
            table.check_invariants(repr(seq_id), refs, cpu_refs, fills)
        self._gpu.check_invariants(refs, fills)
        self._cpu.check_invariants(cpu_refs)

    # -- internals --------------------------------------------------------------------------------

    def _gpu_table(self, seq_id: SeqId) -> BlockTable:
        table = self._seqs[seq_id]
        if table.on_cpu:
            raise KVCacheError(f"sequence {seq_id!r} is swapped out; swap it in first")
        return table

    def _plan_prompt(
        self, seq_id: SeqId, token_ids: Sequence[int]
    ) -> tuple[list[int], list[bytes], list[int], int]:
        """A new sequence's prompt, checked; its chained block hashes (none without prefix
        caching), its prefix-cache hits, and the free blocks allocating it takes (a hit on a
        block in use takes none)."""
        self._seqs.check_new(seq_id)
        tokens = as_token_ids(token_ids, "token_ids")
        if not tokens:
            raise KVCacheError(f"sequence {seq_id!r}: a prompt needs at least one token")
        hashes = chained_hashes(tokens, self.block_size) if self.enable_prefix_caching else []
        hits = self._gpu.cached_prefix(tokens, hashes)
        needed = self._gpu.num_to_take(self.num_blocks_for(len(tokens)) - len(hits), hits)
        return tokens, hashes, hits, needed

    def _group(
        self, seq_ids: SeqId | Sequence[SeqId], on_cpu: bool
    ) -> tuple[list[BlockTable], dict[int, int]]:
        """The tables of a group all `on_cpu` (or all not), and its distinct blocks -> their
        references from within the group (`distinct_blocks`)."""
        ids = list(seq_ids) if isinstance(seq_ids, (list, tuple)) else [seq_ids]
        if not ids:
            raise KVCacheError("empty sequence group")
        if len(set(ids)) != len(ids):
            raise KVCacheError(f"sequence group {ids!r} repeats an id")
        group = [self._seqs[i] for i in ids]
        for seq_id, table in zip(ids, group, strict=True):
            if table.on_cpu != on_cpu:
                where = "swapped out" if table.on_cpu else "in the GPU pool"
                raise KVCacheError(f"sequence {seq_id!r} is already {where}")
        return group, distinct_blocks(t.blocks for t in group)
