"""One sequence's block table: its logical blocks mapped to physical blocks (vLLM paper §4.2).

Logical block `i` holds the K/V of tokens `i * block_size ... (i + 1) * block_size - 1`; the
table names the physical block of each, anywhere in the device pool (or in the host pool while
the sequence is swapped out). Only the last block may be partly filled. A table shared by a
fork is copied on write (§4.4): before slots are added to a shared, partly filled last block,
the table takes a private copy of it and returns the copy for the engine to perform.

A table also remembers the chained hashes of its full blocks (prefix caching): they are
extended from the computed tokens its owner reports, and its computed full blocks are offered
to the pool's prefix cache (`minipaged.kv.pool`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from minipaged.kv.interface import BlockCopy, as_token_ids
from minipaged.kv.pool import ROOT_HASH, BlockPool, HostPool, chained_hashes


class BlockTable:
    """A sequence's blocks, slot count, place (device or host) and block hashes."""

    def __init__(
        self,
        pool: BlockPool,
        blocks: list[int],
        num_tokens: int,
        block_hashes: list[bytes],
        num_registered_blocks: int,
    ) -> None:
        self.pool = pool
        self.blocks = blocks  # device block ids, or host block ids while on the host
        self.num_tokens = num_tokens  # token slots the table covers
        self.on_host = False
        self.block_hashes = block_hashes  # chained hashes of the full blocks known so far
        self.num_registered_blocks = num_registered_blocks  # [0, n) offered to the prefix cache

    @property
    def last_block_is_shared_and_partial(self) -> bool:
        return (
            self.num_tokens % self.pool.block_size != 0
            and self.pool.blocks[self.blocks[-1]].ref_count > 1
        )

    def blocks_to_append(self, n: int) -> int:
        """Free device blocks `append(n)` takes: new blocks plus a copy-on-write copy."""
        if n == 0:
            return 0
        new_blocks = math.ceil((self.num_tokens + n) / self.pool.block_size) - len(self.blocks)
        return new_blocks + int(self.last_block_is_shared_and_partial)

    def append(self, n: int) -> list[BlockCopy]:
        """Cover `n` more slots (the caller made sure `blocks_to_append(n)` blocks are free);
        returns the copy-on-write copy, if the last block was shared and partly filled."""
        pool = self.pool
        copies: list[BlockCopy] = []
        if n and self.last_block_is_shared_and_partial:
            src = self.blocks[-1]
            dst = pool.take_free()
            pool.set_num_tokens(dst, pool.blocks[src].num_tokens)
            pool.release(src)
            self.blocks[-1] = dst
            copies.append((src, dst))
        bs = pool.block_size
        new_len = self.num_tokens + n
        if self.blocks and n:
            pool.set_num_tokens(self.blocks[-1], min(bs, new_len - (len(self.blocks) - 1) * bs))
        for index in range(len(self.blocks), math.ceil(new_len / bs)):
            block_id = pool.take_free()
            pool.set_num_tokens(block_id, min(bs, new_len - index * bs))
            self.blocks.append(block_id)
        self.num_tokens = new_len
        return copies

    def register_computed(self, computed: Sequence[int]) -> None:
        """Hash the full blocks of the computed prefix `computed` and offer them to the cache."""
        bs = self.pool.block_size
        num_full = len(computed) // bs
        if len(self.block_hashes) < num_full:
            start = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else ROOT_HASH
            new_tokens = as_token_ids(computed[start * bs : num_full * bs], "computed_token_ids")
            self.block_hashes.extend(chained_hashes(new_tokens, bs, 0, parent))
        for index in range(self.num_registered_blocks, num_full):
            parent = self.block_hashes[index - 1] if index else ROOT_HASH
            tokens = computed[index * bs : (index + 1) * bs]
            self.pool.register(self.blocks[index], self.block_hashes[index], parent, tokens)
        self.num_registered_blocks = max(self.num_registered_blocks, num_full)

    def fork(self) -> BlockTable:
        """A table sharing every block of this one (on the device)."""
        for block_id in self.blocks:
            self.pool.take_shared(block_id)
        return BlockTable(
            self.pool,
            list(self.blocks),
            self.num_tokens,
            list(self.block_hashes),
            self.num_registered_blocks,
        )

    def release(self, host: HostPool) -> None:
        """Drop this table's references (cached blocks stay findable until evicted)."""
        if self.on_host:
            for host_block in self.blocks:
                host.release(host_block)
            return
        # Last block first: the prefix, the likeliest to be shared again, is evicted last.
        for block_id in reversed(self.blocks):
            self.pool.release(block_id)

    def check_invariants(
        self, name: str, host: HostPool, refs: list[int], host_refs: list[int], fills: dict
    ) -> None:
        """Check this table and add its references and block fills to the counts the pools
        are then checked against; raise AssertionError naming the first broken invariant."""
        bs, n = self.pool.block_size, self.num_tokens
        assert n > 0, f"sequence {name} has no tokens"
        assert len(self.blocks) == math.ceil(n / bs), (
            f"sequence {name}: {n} tokens need {math.ceil(n / bs)} blocks, "
            f"table has {len(self.blocks)}"
        )
        assert self.num_registered_blocks <= len(self.block_hashes) <= n // bs, (
            f"sequence {name}: hashes or registered blocks beyond its full blocks"
        )
        for index, block_id in enumerate(self.blocks):
            fill = min(bs, n - index * bs)
            if self.on_host:
                host_refs[block_id] += 1
                assert host.num_tokens[block_id] == fill, (
                    f"host block {block_id}: fill {host.num_tokens[block_id]} != {fill}"
                )
                continue
            refs[block_id] += 1
            assert fills.setdefault(block_id, fill) == fill, (
                f"block {block_id} shared by sequences that disagree on its fill"
            )
            block = self.pool.blocks[block_id]
            if fill < bs and block.ref_count > 1:
                assert index == len(self.blocks) - 1, (
                    f"shared partial block {block_id} is not last in {name}'s table"
                )
            if block.block_hash is not None:
                assert index < len(self.block_hashes), f"block {block_id}: unhashed position"
                parent = self.block_hashes[index - 1] if index else ROOT_HASH
                assert (block.block_hash, block.parent_hash) == (
                    self.block_hashes[index],
                    parent,
                ), f"cached block {block_id} holds another prefix than {name}'s"
