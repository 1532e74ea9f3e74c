"""A binary buddy allocator: how the Orca baselines place their contiguous reservations.

The vLLM paper's Orca variants (Kwon et al. SOSP'23, §6.1) hand each request one contiguous
chunk from a buddy allocator (Knuth, TAOCP vol. 1 §2.5), which rounds every chunk up to a power
of two; the rounding is the "external fragmentation" of the paper's Fig. 2.
"""

from __future__ import annotations

from minipaged.kv.interface import KVCacheError, NoFreeBlocksError, check_count


def next_power_of_two(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n!r}")
    return 1 << (n - 1).bit_length()


class BuddyAllocator:
    """A binary buddy allocator over `num_slots` slots (Knuth, TAOCP vol. 1 §2.5).

    Requests are rounded up to a power of two; a free chunk is split in halves until it fits,
    and a freed chunk merges with its free "buddy" back up. A capacity that is not a power of
    two is covered by its binary decomposition (e.g. 15700 = 8192 + 4096 + ... + 4), each part
    aligned to its size, so buddies never straddle two parts.
    """

    def __init__(self, num_slots: int) -> None:
        check_count("num_slots", num_slots, 1)
        self.num_slots = num_slots
        top = num_slots.bit_length()
        self._free: list[set[int]] = [set() for _ in range(top)]  # order -> free chunk offsets
        self._allocated: dict[int, int] = {}  # offset -> order
        self._parts: list[tuple[int, int]] = []  # (offset, order) of the top-level chunks
        offset = 0
        for order in range(top - 1, -1, -1):
            if num_slots >> order & 1:
                self._free[order].add(offset)
                self._parts.append((offset, order))
                offset += 1 << order
        self.num_free_slots = num_slots

    def can_allocate(self, size: int) -> bool:
        return self.num_free_chunks(size) > 0

    def num_free_chunks(self, size: int) -> int:
        """How many chunks of `size` slots could be allocated now, one after the other: a free
        chunk of a higher order splits into 2 ** (difference) of them."""
        order = self._order(size)
        return sum(len(self._free[o]) << (o - order) for o in range(order, len(self._free)))

    def allocate(self, size: int) -> tuple[int, int]:
        """Reserve at least `size` contiguous slots; return (offset, chunk length)."""
        order = self._order(size)
        current = next((o for o in range(order, len(self._free)) if self._free[o]), None)
        if current is None:
            raise NoFreeBlocksError("buddy", 1 << order, self.num_free_slots)
        offset = min(self._free[current])  # lowest address first: deterministic
        self._free[current].remove(offset)
        while current > order:  # split, keeping the lower half
            current -= 1
            self._free[current].add(offset + (1 << current))
        self._allocated[offset] = order
        self.num_free_slots -= 1 << order
        return offset, 1 << order

    def free(self, offset: int) -> None:
        if offset not in self._allocated:
            raise KVCacheError(f"no chunk allocated at offset {offset}")
        order = self._allocated.pop(offset)
        self.num_free_slots += 1 << order
        part_order = self._part_order(offset)
        while order < part_order:
            buddy = offset ^ (1 << order)
            if buddy not in self._free[order]:
                break
            self._free[order].remove(buddy)
            offset = min(offset, buddy)
            order += 1
        self._free[order].add(offset)

    def largest_free_chunk(self) -> int:
        orders = [o for o, chunks in enumerate(self._free) if chunks]
        return 1 << orders[-1] if orders else 0

    def _order(self, size: int) -> int:
        check_count("size", size, 1)
        if size > self.num_slots:
            raise NoFreeBlocksError("buddy", size, self.num_free_slots)
        return (size - 1).bit_length()

    def _part_order(self, offset: int) -> int:
        for start, order in self._parts:
            if start <= offset < start + (1 << order):
                return order
        raise AssertionError(f"offset {offset} outside the allocator")
