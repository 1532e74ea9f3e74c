"""Check a hand-written block manager against `KVCacheManager` (`minipaged.kv`) on random
operations: allocate, append, fork, free, with copy-on-write when a shared block is written.

Notebook 03 writes its own block manager in a few lines; `compare_on_random_operations` drives
it and the real manager (prefix caching off, so that only the paper's core is compared) with the
same random calls and checks after each call that both hold the same block tables, the same
reference counts and the same number of free blocks, and returned the same copy-on-write copies.
Block ids can match id for id because both take the front of the free list and give freed
blocks back to its front, the last block of a table first.
"""

from __future__ import annotations

import random
from typing import Protocol

from minipaged.kv import KVCacheManager

__all__ = ["BlockManager", "compare_on_random_operations"]


class BlockManager(Protocol):
    """What the comparison calls and reads on a hand-written manager."""

    tables: dict[str, list[int]]
    refs: list[int]
    free_blocks: object  # any container of the free block ids (its `len` is read)

    def allocate(self, seq: str, num_tokens: int) -> None: ...
    def append(self, seq: str, num_tokens: int) -> list[tuple[int, int]]: ...
    def fork(self, parent: str, child: str) -> None: ...
    def free(self, seq: str) -> None: ...


def compare_on_random_operations(mine: BlockManager, num_blocks: int, block_size: int,
                                 num_operations: int, seed: int = 0) -> dict[str, int]:
    """Apply `num_operations` random calls to `mine` and to a fresh `KVCacheManager` of
    `num_blocks` blocks of `block_size`; raise AssertionError at the first difference. Only
    calls the pool has room for are made. Returns how many calls of each kind were made
    (`"copy-on-write"`: the appends that copied a block)."""
    real = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
    rng, lengths, made = random.Random(seed), {}, dict.fromkeys(
        ("allocate", "append", "fork", "free", "copy-on-write"), 0)
    for step in range(num_operations):
        kind = rng.choice(["allocate", "append", "append", "fork", "free"] if lengths
                          else ["allocate"])
        seq = rng.choice(sorted(lengths)) if lengths else None
        copies: tuple[list, list] = ([], [])
        if kind == "allocate":
            seq, n = f"s{step}", rng.randint(1, 3 * block_size)
            if real.num_blocks_for(n) > real.num_free_blocks:
                continue
            real.allocate(seq, [0] * n)
            mine.allocate(seq, n)
            lengths[seq] = n
        elif kind == "append":
            n = lengths[seq] + rng.randint(1, block_size + 1)
            if not real.can_append(seq, num_tokens=n):
                continue
            copies = (real.append_slots(seq, num_tokens=n), mine.append(seq, n))
            lengths[seq] = n
        elif kind == "fork":
            real.fork(seq, f"s{step}")
            mine.fork(seq, f"s{step}")
            lengths[f"s{step}"] = lengths[seq]
        else:
            real.free(seq)
            mine.free(seq)
            del lengths[seq]
        made[kind] += 1
        made["copy-on-write"] += bool(copies[0])
        where = f"after call {step} ({kind} {seq})"
        assert [tuple(c) for c in copies[0]] == [tuple(c) for c in copies[1]], (
            f"{where}: copies {copies[0]} against {copies[1]}")
        assert ({s: list(t) for s, t in mine.tables.items()}
                == {s: list(real.block_table(s)) for s in real.seq_ids()}), (
            f"{where}: block tables differ")
        assert list(mine.refs) == [real.ref_count(b) for b in range(num_blocks)], (
            f"{where}: reference counts differ")
        assert len(mine.free_blocks) == real.num_free_blocks, f"{where}: free blocks differ"
        real.check_invariants()
    return made
