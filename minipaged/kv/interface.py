"""What a KV cache manager offers the scheduler: the KV layer's interface (vLLM paper §4.2-4.5).

Two managers implement `KVManager`: `minipaged.kv.manager.KVCacheManager` (paged blocks, shared
with reference counts, prefix caching, a CPU pool for swapping) and
`minipaged.kv.reservation.ReservationKVCacheManager` (one contiguous chunk per request, the Orca
and static-batching baselines of the paper's §6.1). The scheduler is written against this
protocol only, so the baselines run through the very scheduling code of the paged system.

**What a manager owns: blocks, nothing else.** Block tables, block fills (how many slots of
each block hold tokens), reference counts, block hashes, the free lists and the CPU pool. A
sequence's token ids, its length and how many of its tokens are computed belong to its
`Sequence` (`minipaged.sampling.sequence`); a call that needs them is given them: `allocate` the
prompt's ids, `append_slots` the length to cover, `mark_computed` the computed prefix's ids.

**The two pools** are vLLM's: the *GPU pool* (`num_gpu_blocks` blocks, the device's KV cache,
where attention reads) and the *CPU pool* (`num_cpu_blocks` blocks, the host's swap space for
swapped-out blocks), named so in `EngineConfig` and the model runner too. Unqualified counts
(`num_free_blocks`, `watermark_blocks`) are the GPU pool's.

Every mutating call either succeeds or raises with the state untouched: `NoFreeBlocksError`
when a pool is short, `KVCacheError` (a `ValueError`) for a request that makes no sense.

The calls return the block copies the engine performs, within one step in this order: swap-out
copies first (they read blocks that this step may hand to others), then swap-in copies, then
copy-on-write copies; then the forward pass writes the new K/V.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Generic, NoReturn, Protocol, TypeVar

SeqId = Hashable  # the scheduler uses `Sequence.seq_id`; tests use strings too
BlockCopy = tuple[int, int]  # (source block, destination block) of a copy the engine performs
_State = TypeVar("_State")

# -- errors ---------------------------------------------------------------------------------------


class KVCacheError(ValueError):
    """A request the manager cannot honour: unknown or duplicate sequence, bad tokens, ..."""


class NoFreeBlocksError(RuntimeError):
    """Not enough free blocks for the call; the manager's state is left untouched."""

    def __init__(self, pool: str, needed: int, available: int) -> None:
        super().__init__(f"need {needed} free {pool} blocks but only {available} are free")
        self.pool = pool
        self.needed = needed
        self.available = available


def check_count(name: str, value: object, low: int) -> None:
    """A `ValueError` unless `value` (a manager's size argument `name`) is an int >= `low`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def as_token_ids(token_ids: Iterable[int], what: str) -> list[int]:
    """`token_ids` as a list of ints, or a `KVCacheError` naming `what` and the bad value."""
    tokens = list(token_ids)
    for t in tokens:  # a plain int skips the slow ABC check (every full block's tokens)
        if type(t) is not int and (not isinstance(t, Integral) or isinstance(t, bool)) or t < 0:
            raise KVCacheError(f"{what} must be non-negative integers, got {t!r}")
    return [int(t) for t in tokens]


def check_growth(num_tokens: object, covered: int) -> int:
    """`covered`, the slots a sequence's blocks cover, after checking that `num_tokens` is a
    length it may grow to: an integer, no smaller (a sequence's tokens are only ever appended,
    and its blocks never shrink)."""
    if type(num_tokens) is not int and (  # the common case first: a plain int
        not isinstance(num_tokens, Integral) or isinstance(num_tokens, bool)
    ):
        raise KVCacheError(f"num_tokens must be an integer, got {num_tokens!r}")
    if num_tokens < covered:
        raise KVCacheError(
            f"num_tokens is the sequence's length to cover, at least the {covered} tokens "
            f"its blocks cover already, got {num_tokens}"
        )
    return covered


def too_many_computed(seq_id: SeqId, num_computed: int, num_slots: int) -> KVCacheError:
    """`mark_computed`'s error where a computed prefix of `num_computed` tokens runs past the
    `num_slots` slots appended to the sequence (the check itself stays in the step's path)."""
    return KVCacheError(
        f"sequence {seq_id!r}: {num_computed} computed tokens but only {num_slots} slots "
        "(num_computed_tokens must not exceed the slots appended)"
    )


class SeqTable(dict[SeqId, _State]):
    """A manager's sequences: id -> its state (a block table, a chunk). Looking up an id that
    holds nothing raises `KVCacheError` naming it, so that every lookup checks it for free."""

    def __missing__(self, seq_id: SeqId) -> NoReturn:
        raise KVCacheError(f"unknown sequence {seq_id!r}")

    def check_new(self, seq_id: SeqId) -> None:
        """A `KVCacheError` when `seq_id` holds blocks already (`allocate`, `fork`)."""
        if seq_id in self:
            raise KVCacheError(f"sequence {seq_id!r} is already allocated")


class ManagerBase(Generic[_State]):
    """What both managers share: the GPU pool's sizes, checked, and their sequences (`_seqs`:
    id -> a block table, or a place in a chunk)."""

    def __init__(self, num_gpu_blocks: int, block_size: int) -> None:
        check_count("num_gpu_blocks", num_gpu_blocks, 1)
        check_count("block_size", block_size, 1)
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self._seqs: SeqTable[_State] = SeqTable()

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def seq_ids(self) -> list[SeqId]:
        return list(self._seqs)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


# -- accounting -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryUsage:
    """Where a KV cache's token slots are at one moment, in the categories of the vLLM paper's
    Fig. 2: slots holding token states, and the waste among allocated slots:

    * `reserved_slots`: reserved for tokens the request will still generate;
    * `internal_fragmentation_slots`: allocated but never to be used (over-reservation past the
      request's true length, the unfilled tail of a paged block, a finished request's row);
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
        waste = self.internal_fragmentation_slots + self.external_fragmentation_slots
        return self.token_slots + self.reserved_slots + waste

    @property
    def free_slots(self) -> int:
        return self.total_slots - self.allocated_slots

    @property
    def token_fraction_of_allocated(self) -> float:
        """Fraction of allocated slots holding token states (1.0 when nothing is allocated)."""
        allocated = self.allocated_slots
        return self.token_slots / allocated if allocated else 1.0


# -- the protocol ---------------------------------------------------------------------------------


class KVManager(Protocol):
    """The block bookkeeping a scheduler needs; see the module docstring for who owns what.

    A list or tuple of ids passed to the swap calls is a group that shares blocks (a request's
    parallel samples or beams): it moves all at once, each shared block copied once.
    """

    block_size: int  # token slots per block
    num_gpu_blocks: int  # blocks in the GPU pool
    num_cpu_blocks: int  # blocks in the CPU pool (0: nothing is swapped)
    watermark_blocks: int  # GPU blocks admission leaves free, so running sequences can grow

    @property
    def num_free_blocks(self) -> int:
        """Free GPU blocks."""

    def __contains__(self, seq_id: object) -> bool:
        """Whether the sequence holds blocks (in the GPU or the CPU pool)."""

    def seq_ids(self) -> list[SeqId]:
        """Every sequence holding blocks."""

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks that `num_tokens` token slots fill."""

    def blocks_for_request(self, prompt_len: int, max_len: int, width: int) -> int:
        """The most GPU blocks one request can hold at once: `width` sequences (parallel
        samples or beams) grown from one prompt to at most `max_len` tokens each. A request
        needing more than `num_gpu_blocks` can never run."""

    # -- admission and growth ---------------------------------------------------------------------

    def can_allocate(self, seq_id: SeqId, token_ids: Sequence[int]) -> bool:
        """Whether `allocate(seq_id, token_ids)` would succeed now and leave the watermark's
        blocks free."""

    def allocate(self, seq_id: SeqId, token_ids: Sequence[int]) -> int:
        """Give a new sequence slots for its prompt (`token_ids`, needed to look the prefix
        cache up); return how many leading tokens are already computed (cached). Never the last
        token: its logits must be computed."""

    def num_blocks_to_append(self, seq_id: SeqId, *, num_tokens: int) -> int:
        """Free GPU blocks `append_slots(seq_id, num_tokens=num_tokens)` would take (new blocks
        and copies)."""

    def can_append(self, seq_id: SeqId, *, num_tokens: int) -> bool:
        """Whether `append_slots(seq_id, num_tokens=num_tokens)` would find its blocks (no
        watermark applies)."""

    def append_slots(self, seq_id: SeqId, *, num_tokens: int) -> list[BlockCopy]:
        """Slots for the sequence's first `num_tokens` tokens (its length: keyword-only, so that
        it is never read as a number of new tokens), those not covered yet about to be
        computed; returns the copy-on-write copies (src, dst) the engine performs before
        writing into them. A table never shrinks."""

    def mark_computed(self, seq_id: SeqId, computed_token_ids: Sequence[int]) -> None:
        """The forward pass wrote the K/V of the sequence's first `len(computed_token_ids)`
        tokens (these ids, from the sequence's owner): full blocks among them may now be found
        by other prompts."""

    # -- sharing and freeing ----------------------------------------------------------------------

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """A new sequence `child_id` continuing from all of `parent_id`'s tokens (vLLM §4.4)."""

    def free(self, seq_id: SeqId) -> None:
        """Drop the sequence and give back the blocks nobody else references."""

    # -- swapping (§4.5) --------------------------------------------------------------------------

    def can_swap_out(self, seq_ids: SeqId | Sequence[SeqId]) -> bool:
        """Whether the CPU pool can take the sequence's (or group's) blocks."""

    def swap_out(self, seq_ids: SeqId | Sequence[SeqId]) -> list[BlockCopy]:
        """Move a sequence or group to the CPU pool; returns the (GPU, CPU) copies."""

    def can_swap_in(self, seq_ids: SeqId | Sequence[SeqId]) -> bool:
        """Whether the GPU pool can take a swapped sequence or group back, watermark kept."""

    def num_blocks_to_swap_in(self, num_tokens: Mapping[SeqId, int]) -> int:
        """Free GPU blocks a swapped group (each sequence -> the length it must then cover)
        takes to come back and grow to those lengths, shared blocks counted once."""

    def swap_in(self, seq_ids: SeqId | Sequence[SeqId]) -> list[BlockCopy]:
        """Bring a swapped sequence or group back; returns the (CPU, GPU) copies."""

    # -- queries ----------------------------------------------------------------------------------

    def block_table(self, seq_id: SeqId) -> tuple[int, ...]:
        """The sequence's physical block ids, logical block 0 first (immutable)."""

    def memory_usage(self) -> MemoryUsage:
        """The GPU pool's slots by the paper's Fig. 2 categories."""

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken structural invariant."""
