"""A toy engine around a KV cache manager, for seeing what the block tables point at.

`KVCacheManager` (`minipaged.kv`) is bookkeeping only: block tables, reference counts, hashes,
free lists. `ToyEngine` plays the rest of an engine around it the way the scheduler and the
model runner do: it makes every call that changes blocks, keeps each sequence's text and how
much of it is computed (as the engine's `Sequence` objects keep token ids), stores one character
per slot in toy "device" and "host" pools (the K/V tensors), performs every copy the manager
asks for, and checks that each sequence reads back its own text. A character is its token id
(`token_ids`), so the prefix cache sees the text.

`slot_categories` classifies every slot of a pool the way the vLLM paper's Fig. 3 does (token
states, reserved, internal and external fragmentation), for a paged manager or a contiguous
`ReservationKVCacheManager`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from minipaged.kv.manager import KVCacheManager
from minipaged.kv.reservation import ReservationKVCacheManager, reservation_len

__all__ = ["ToyEngine", "slot_categories", "token_ids"]

# The categories of a slot, in the vLLM paper's Fig. 3 (plus "free").
CATEGORIES = ("token", "reserved", "internal", "external", "free")


def token_ids(text: str) -> list[int]:
    """One token per character: its code point."""
    return [ord(c) for c in text]


class ToyEngine:
    """The calls an engine makes on a `KVCacheManager`, on text (module docstring)."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.text: dict[str, str] = {}  # each sequence's own state, not the manager's
        self.computed: dict[str, int] = {}
        self.device: dict[int, int] = {}  # slot -> character code: the toy K/V tensors
        self.host: dict[int, int] = {}

    def admit(self, seq_id: str, text: str) -> int:
        """Allocate blocks for a prompt; returns how many of its tokens the prefix cache held."""
        cached = self.manager.allocate(seq_id, token_ids(text))
        self.text[seq_id], self.computed[seq_id] = text, cached
        return cached

    def append(self, seq_id: str, text: str) -> list[tuple[int, int]]:
        """Slots for new tokens; performs and returns the copy-on-write copies."""
        self.text[seq_id] += text
        copies = self.manager.append_slots(seq_id, num_tokens=len(self.text[seq_id]))
        self.copy_pairs(copies, self.device, self.device)
        return copies

    def compute(self, seq_id: str) -> None:
        """"Run the model": write each pending character into the slot its table names, then
        tell the manager what is computed (full blocks become findable by later prompts)."""
        size, table, text = self.manager.block_size, self.manager.block_table(seq_id), \
            self.text[seq_id]
        for i in range(self.computed[seq_id], len(text)):
            self.device[table[i // size] * size + i % size] = ord(text[i])
        self.computed[seq_id] = len(text)
        self.manager.mark_computed(seq_id, token_ids(text))

    def fork(self, parent: str, child: str) -> None:
        self.manager.fork(parent, child)
        self.text[child] = self.text[parent]
        self.computed[child] = self.computed[parent]

    def free(self, seq_id: str) -> None:
        self.manager.free(seq_id)
        del self.text[seq_id], self.computed[seq_id]

    def swap_out(self, seq_ids: list[str]) -> list[tuple[int, int]]:
        """Move sequences (a group sharing blocks: each block once) to the CPU pool."""
        copies = self.manager.swap_out(seq_ids)
        self.copy_pairs(copies, self.device, self.host)
        return copies

    def swap_in(self, seq_ids: list[str]) -> list[tuple[int, int]]:
        copies = self.manager.swap_in(seq_ids)
        self.copy_pairs(copies, self.host, self.device)
        return copies

    def copy_pairs(self, pairs: Iterable[tuple[int, int]], source: dict[int, int],
                   target: dict[int, int]) -> None:
        """Copy whole blocks, `(source block, target block)`, from one pool to another."""
        size = self.manager.block_size
        for src, dst in pairs:
            for offset in range(size):
                if src * size + offset in source:
                    target[dst * size + offset] = source[src * size + offset]

    def read(self, seq_id: str) -> str:
        """The computed text of a sequence, read through its block table."""
        size, table = self.manager.block_size, self.manager.block_table(seq_id)
        pool = self.host if self.manager.is_swapped(seq_id) else self.device
        slots = (table[i // size] * size + i % size for i in range(self.computed[seq_id]))
        return "".join(chr(pool.get(slot, ord("?"))) for slot in slots)

    def check(self) -> None:
        """The manager's invariants hold and every sequence reads back its own text."""
        self.manager.check_invariants()
        for seq_id, text in self.text.items():
            got = self.read(seq_id)
            if got != text[: self.computed[seq_id]]:
                raise AssertionError(f"{seq_id} reads {got!r}, not {text!r}")


def slot_categories(
    manager: KVCacheManager | ReservationKVCacheManager,
    lengths: Mapping[str, tuple[int, int]] | None = None,
) -> list[tuple[str | None, str]]:
    """`(owner, category)` of every device slot, in order (`CATEGORIES`). For a contiguous
    manager `lengths` gives each sequence's `(prompt_len, output_len)`, which decides what its
    reservation holds for later.

    * paged: a block's slots up to the sequence's tokens hold tokens, the rest of its last block
      is internal fragmentation; nothing is reserved ahead.
    * contiguous: the chunk's first slots hold tokens, then come the slots reserved for the
      tokens still to come, then those the policy over-reserved (internal fragmentation), then
      the allocator's rounding of the chunk (external fragmentation).
    """
    size = manager.block_size
    slots: list[tuple[str | None, str]] = [(None, "free")] * (manager.num_gpu_blocks * size)
    for seq_id in manager.seq_ids():
        table, used = manager.block_table(seq_id), manager.num_slots(seq_id)
        if isinstance(manager, ReservationKVCacheManager):
            if lengths is None:
                raise ValueError("a contiguous manager's slots need the requests' lengths")
            prompt_len, output_len = lengths[seq_id]
            asked = reservation_len(manager.policy, prompt_len, output_len, manager.max_seq_len)
            asked = manager.num_blocks_for(asked) * size
            total = prompt_len + output_len
            start, chunk = table[0] * size, manager.reserved_blocks(seq_id) * size
            for i in range(chunk):
                kind = ("token" if i < used else "reserved" if i < total
                        else "internal" if i < asked else "external")
                slots[start + i] = (seq_id, kind)
        else:
            for i, block in enumerate(table):
                for offset in range(size):
                    kind = "token" if i * size + offset < used else "internal"
                    slots[block * size + offset] = (seq_id, kind)
    return slots
