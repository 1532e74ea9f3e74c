"""One sequence's block table: its logical blocks mapped to physical blocks (vLLM paper §4.2).

Logical block `i` holds the K/V of tokens `i * block_size ... (i + 1) * block_size - 1`; the
table names the physical block of each, anywhere in the GPU pool (or in the CPU pool while the
sequence is swapped out). Only the last block may be partly filled. A table shared by a fork is
copied on write (§4.4): before slots are added to a shared, partly filled last block, the table
takes a private copy of it and returns the copy for the engine to perform.

A table keeps no count of its own: the slots it covers are its blocks' fills, which the pools
hold (every sharer of a block agrees on its fill). How many tokens the sequence has is its
owner's to say, and growth is asked for as the number of tokens to cover.

A table also remembers the chained hashes of its full blocks (prefix caching): they are
extended from the computed tokens its owner reports, and its computed full blocks are offered
to the GPU pool's prefix cache (`minipaged.kv.pool`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from minipaged.kv.interface import BlockCopy, as_token_ids
from minipaged.kv.pool import ROOT_HASH, CPUPool, GPUPool, chained_hashes


@dataclass(eq=False)  # a table is itself, not its contents
class BlockTable:
    """A sequence's blocks, place (GPU or CPU pool) and block hashes."""

    gpu: GPUPool
    cpu: CPUPool
    # GPU block ids, or CPU block ids while swapped out: a tuple, replaced (not changed) when
    # a block is added, copied on write or moved, so that the same object means the same table
    blocks: tuple[int, ...]
    block_hashes: list[bytes]  # chained hashes of the full blocks known so far
    num_registered_blocks: int  # blocks [0, n) offered to the prefix cache
    on_cpu: bool = False

    @property
    def num_slots(self) -> int:
        """Token slots the table covers: every block but the last is full, the last holds its
        fill."""
        blocks, gpu = self.blocks, self.gpu
        if not blocks:
            return 0
        last = self.cpu.num_tokens[blocks[-1]] if self.on_cpu else gpu.blocks[blocks[-1]].num_tokens
        return (len(blocks) - 1) * gpu.block_size + last

    def blocks_to_append(self, num_tokens: int, covered: int | None = None) -> int:
        """Free GPU blocks `append(num_tokens)` takes: new blocks plus a copy-on-write copy
        (`covered`: `num_slots`, when the caller has it)."""
        covered = self.num_slots if covered is None else covered
        if num_tokens <= covered:
            return 0
        bs, gpu = self.gpu.block_size, self.gpu  # a copy when the last block is partial and shared:
        cow = covered % bs != 0 and gpu.blocks[self.blocks[-1]].ref_count > 1
        return -(-num_tokens // bs) - len(self.blocks) + cow

    def append(self, num_tokens: int, covered: int | None = None) -> list[BlockCopy]:
        """Cover the first `num_tokens` tokens (the caller made sure `blocks_to_append` blocks
        are free, and that the table covers no more than `covered`, its `num_slots`); returns
        the copy-on-write copy, if the last block was shared and partly filled. Within the last
        block's free slots (most decode steps) only its fill changes: the table stays the same
        object."""
        pool, blocks = self.gpu, self.blocks
        covered = self.num_slots if covered is None else covered
        if num_tokens == covered:
            return []
        copies: list[BlockCopy] = []
        if covered % pool.block_size and pool.blocks[blocks[-1]].ref_count > 1:  # copy on write
            src = blocks[-1]
            dst = pool.take_free(num_tokens=pool.blocks[src].num_tokens)
            pool.release(src)
            blocks = blocks[:-1] + (dst,)
            copies.append((src, dst))
        bs = pool.block_size
        if blocks:
            pool.set_num_tokens(blocks[-1], min(bs, num_tokens - (len(blocks) - 1) * bs))
        new = range(len(blocks), -(-num_tokens // bs))
        self.blocks = blocks + tuple(
            pool.take_free(num_tokens=min(bs, num_tokens - i * bs)) for i in new
        ) if new else blocks
        return copies

    def register_computed(self, computed: Sequence[int]) -> None:
        """Hash the full blocks of the computed prefix `computed` and offer them to the cache."""
        bs = self.gpu.block_size
        num_full = len(computed) // bs
        start = len(self.block_hashes)  # the hashes of blocks [start, num_full) are new
        if start < num_full:
            parent = self.block_hashes[-1] if self.block_hashes else ROOT_HASH
            new_tokens = as_token_ids(computed[start * bs : num_full * bs], "computed_token_ids")
            self.block_hashes.extend(chained_hashes(new_tokens, bs, parent))
        for index in range(self.num_registered_blocks, num_full):
            parent = self.block_hashes[index - 1] if index else ROOT_HASH
            tokens = computed[index * bs : (index + 1) * bs]
            self.gpu.register(self.blocks[index], self.block_hashes[index], parent, tokens)
        self.num_registered_blocks = max(self.num_registered_blocks, num_full)

    def fork(self) -> BlockTable:
        """A table sharing every block of this one (in the GPU pool)."""
        for block_id in self.blocks:
            self.gpu.take_shared(block_id)
        return replace(self, block_hashes=list(self.block_hashes))

    def release(self) -> None:
        """Drop this table's references (cached blocks stay findable until evicted)."""
        if self.on_cpu:
            for cpu_block in self.blocks:
                self.cpu.release(cpu_block)
            return
        # Last block first: the prefix, the likeliest to be shared again, is evicted last.
        for block_id in reversed(self.blocks):
            self.gpu.release(block_id)

    def check_invariants(
        self, name: str, refs: list[int], cpu_refs: list[int], fills: dict[int, int]
    ) -> None:
        """Check this table and add its references and GPU block fills to the counts the pools
        are then checked against; raise AssertionError naming the first broken invariant."""
        bs, gpu = self.gpu.block_size, self.gpu
        assert self.blocks, f"sequence {name} has no blocks"
        for index, block_id in enumerate(self.blocks):
            fill = self.cpu.num_tokens[block_id] if self.on_cpu else gpu.blocks[block_id].num_tokens
            last = index == len(self.blocks) - 1
            assert (0 < fill <= bs) if last else fill == bs, (
                f"sequence {name}: block {block_id} at position {index} holds {fill} of {bs} "
                "slots (every block but the last is full, the last is not empty)"
            )
            if self.on_cpu:
                cpu_refs[block_id] += 1
                continue
            refs[block_id] += 1
            fills[block_id] = fill
            block = self.gpu.blocks[block_id]
            if fill < bs and block.ref_count > 1:
                assert last, f"shared partial block {block_id} is not last in {name}'s table"
            if block.block_hash is not None:
                assert index < len(self.block_hashes), f"block {block_id}: unhashed position"
                parent = self.block_hashes[index - 1] if index else ROOT_HASH
                assert (block.block_hash, block.parent_hash) == (
                    self.block_hashes[index],
                    parent,
                ), f"cached block {block_id} holds another prefix than {name}'s"
        assert self.num_registered_blocks <= len(self.block_hashes) <= self.num_slots // bs, (
            f"sequence {name}: hashes or registered blocks beyond its full blocks"
        )
