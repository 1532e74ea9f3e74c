"""The comparison notebook 03 runs its hand-written block manager through: it passes a manager
that does what `KVCacheManager` does, and stops at the first call of one that does not."""

from __future__ import annotations

import pytest

from minipaged.kv import KVCacheManager
from teaching.block_check import compare_on_random_operations


class Wrapped:
    """`KVCacheManager` itself behind the hand-written interface: the comparison must pass."""

    def __init__(self, num_blocks: int, block_size: int, copy_on_write: bool = True) -> None:
        self.real = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.num_blocks, self.copy_on_write = num_blocks, copy_on_write

    @property
    def tables(self) -> dict[str, list[int]]:
        return {s: self.real.block_table(s) for s in self.real.seq_ids()}

    @property
    def refs(self) -> list[int]:
        return [self.real.ref_count(b) for b in range(self.num_blocks)]

    @property
    def free_blocks(self) -> range:
        return range(self.real.num_free_blocks)

    def allocate(self, seq: str, num_tokens: int) -> None:
        self.real.allocate(seq, [0] * num_tokens)

    def append(self, seq: str, num_tokens: int) -> list[tuple[int, int]]:
        copies = self.real.append_slots(seq, num_tokens=num_tokens)
        return copies if self.copy_on_write else []  # a manager that forgets to say so

    def fork(self, parent: str, child: str) -> None:
        self.real.fork(parent, child)

    def free(self, seq: str) -> None:
        self.real.free(seq)


def test_an_equal_manager_passes_and_every_kind_of_call_is_made():
    made = compare_on_random_operations(Wrapped(32, 4), 32, 4, num_operations=400, seed=1)
    assert all(count > 0 for count in made.values()), made


def test_a_manager_that_hides_its_copies_is_caught():
    with pytest.raises(AssertionError, match="copies"):
        compare_on_random_operations(Wrapped(32, 4, copy_on_write=False), 32, 4,
                                     num_operations=400, seed=1)
