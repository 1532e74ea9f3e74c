"""The systems PagedAttention is measured against, as objects the real scheduler code can drive.

The vLLM paper (Kwon et al. SOSP'23, §6.1) compares vLLM with

* **Orca (Max / Pow2 / Oracle)**: iteration-level scheduling like vLLM's, but each request's KV
  cache is one contiguous chunk reserved when the request is admitted, sized to the model's
  maximum length (Max), to the prompt plus the next power of two of the true output length
  (Pow2), or to exactly prompt plus output (Oracle). A buddy allocator hands out the chunks,
  rounding every one up to a power of two (§6.1, footnote on Orca's allocator).
* **FasterTransformer**: no iteration-level scheduling. A batch of up to B earliest requests
  is formed, B as large as memory allows with every row reserved for the maximum length, and
  runs to completion before the next batch is formed (static batching).

`minipaged.reservation` models these as accounting objects for the memory-waste benchmark. This
module turns them into drop-in parts of the serving stack, so the baselines run through the same
`FCFSScheduler` mechanics, the same simulator and the same engine as the paged system:

* `ReservationKVCacheManager` speaks `KVCacheManager`'s interface (allocate, append_slots,
  mark_computed, fork, free, block_table, num_free_blocks, ...) on top of `BuddyAllocator`
  reservations. A sequence's block table is its chunk's consecutive blocks, so the engine's
  attention reads and writes a real contiguous region of the KV tensor.
* `OrcaScheduler` is `FCFSScheduler` unchanged except for admission: the reservation depends on
  the request's length, which only the `SequenceGroup` knows, so `add` tells the cache manager
  (`expect`) and the admission check asks it by sequence id (`can_reserve`).
* `StaticBatchScheduler` forms a batch only when none is running and never admits into a
  running batch.

Reservations are whole blocks: `ceil(reservation_len / block_size)` blocks, then rounded up to a
power of two by the buddy allocator. With `block_size=1` this is exactly Orca's token-granular
reservation (and equals `ReservationCache`); the engine needs its own block size, which adds at
most `block_size - 1` slots per request.

A reservation is never outgrown when the expected output length is the request's `max_tokens`
(as with `ignore_eos`, the benchmarks' set-up), so Orca never preempts; growing past it raises
`ReservationExceededError`. `fork` gives the child a chunk of its own that the request reserved
at admission (Orca has no sharing) but copies no K/V: it serves the simulator's accounting, not
the engine's parallel sampling.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from minipaged.kv_cache import KVCacheError, KVCacheManager, MemoryUsage, NoFreeBlocksError
from minipaged.reservation import POLICIES, BuddyAllocator, next_power_of_two
from minipaged.scheduler import FCFSScheduler, SchedulerConfig, SchedulerOutput, _Budget
from minipaged.sequence import SequenceGroup, SequenceStatus

if TYPE_CHECKING:
    from minipaged.engine import LLMEngine

SeqId = int

# -- errors and data types ------------------------------------------------------------------------


class ReservationExceededError(KVCacheError):
    """A sequence grew past the contiguous chunk reserved for it at admission."""


def reservation_len(policy: str, prompt_len: int, output_len: int, max_seq_len: int) -> int:
    """Token slots a policy reserves for a request (vLLM paper §6.1), before any rounding.

    The same definition as `ReservationCache.reservation_len`; tests check they agree.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if prompt_len < 1 or output_len < 1:
        raise ValueError(f"prompt_len and output_len must be >= 1, got {prompt_len}, {output_len}")
    if prompt_len + output_len > max_seq_len:
        raise ValueError(
            f"prompt {prompt_len} + output {output_len} exceeds max_seq_len {max_seq_len}"
        )
    if policy == "max":
        return max_seq_len
    if policy == "pow2":
        return min(max_seq_len, prompt_len + next_power_of_two(output_len))
    return prompt_len + output_len


@dataclass
class _Expected:
    """What admission must reserve for a request: its lengths and how many sequences it runs."""

    prompt_len: int
    output_len: int
    width: int

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


@dataclass
class _Chunk:
    """One contiguous reservation: `num_blocks` blocks from `offset`, of which `reserved_blocks`
    were asked for (the rest is the buddy allocator's rounding)."""

    offset: int
    num_blocks: int
    reserved_blocks: int


@dataclass
class _Request:
    """A request's reservation: one chunk per sequence it may run, reserved all at once."""

    expected: _Expected
    reservation_len: int
    chunks: list[_Chunk]
    spare: list[_Chunk]  # reserved chunks no sequence holds yet (unforked samples, freed beams)
    members: dict[SeqId, _Chunk] = field(default_factory=dict)


@dataclass
class _Seq:
    request: _Request
    chunk: _Chunk
    num_tokens: int
    num_computed: int = 0


# -- the cache manager ----------------------------------------------------------------------------


class ReservationKVCacheManager:
    """Orca's contiguous per-request reservation behind `KVCacheManager`'s interface.

    `num_blocks` blocks of `block_size` slots; `policy` is "max", "pow2" or "oracle";
    `max_seq_len` is what Max reserves (and the longest request). Prefix caching, swapping and
    sharing do not exist here: `allocate` reports no cached tokens, swaps are refused (the
    scheduler then preempts by recomputation), and `fork` takes a chunk of its own.
    """

    def __init__(
        self, num_blocks: int, block_size: int, policy: str = "max", max_seq_len: int = 2048
    ) -> None:
        for name, value in (
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("max_seq_len", max_seq_len),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if math.ceil(max_seq_len / block_size) > num_blocks:
            raise ValueError(
                f"{num_blocks} blocks of {block_size} tokens cannot hold even one request of "
                f"max_seq_len {max_seq_len}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.policy = policy
        self.max_seq_len = max_seq_len
        self.allocator = BuddyAllocator(num_blocks)
        # KVCacheManager's knobs, fixed: no admission watermark, no host pool, no prefix cache.
        self.watermark_blocks = 0
        self.num_host_blocks = 0
        self.num_free_host_blocks = 0
        self.enable_prefix_caching = False
        self.prefix_cache_hits = 0
        self.prefix_cache_misses = 0
        self._expected: dict[SeqId, _Expected] = {}
        self._seqs: dict[SeqId, _Seq] = {}

    # -- queries ----------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no chunk covers (they may be too scattered for the next reservation)."""
        return self.allocator.num_free_slots

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def seq_ids(self) -> list[SeqId]:
        return list(self._seqs)

    def num_blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def num_tokens(self, seq_id: SeqId) -> int:
        return self._seq(seq_id).num_tokens

    def num_computed_tokens(self, seq_id: SeqId) -> int:
        return self._seq(seq_id).num_computed

    def block_table(self, seq_id: SeqId) -> list[int]:
        """The chunk's first blocks, as many as the sequence's tokens fill: consecutive ids."""
        seq = self._seq(seq_id)
        return list(range(seq.chunk.offset, seq.chunk.offset + self.num_blocks_for(seq.num_tokens)))

    def is_swapped(self, seq_id: SeqId) -> bool:
        self._seq(seq_id)
        return False

    def reserved_blocks(self, seq_id: SeqId) -> int:
        """Blocks of the sequence's chunk (after the allocator's rounding)."""
        return self._seq(seq_id).chunk.num_blocks

    # -- admission --------------------------------------------------------------------------------

    def expect(self, seq_id: SeqId, prompt_len: int, output_len: int, width: int = 1) -> None:
        """Announce a request before its admission: its first sequence, prompt and output
        lengths (the oracle's knowledge; `max_tokens` with `ignore_eos`) and how many sequences
        it runs at once (parallel samples or beams), each of which gets a chunk."""
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        output_len = min(output_len, self.max_seq_len - prompt_len)
        reservation_len(self.policy, prompt_len, output_len, self.max_seq_len)  # validates
        self._expected[seq_id] = _Expected(prompt_len, output_len, width)

    def can_reserve(self, seq_id: SeqId) -> bool:
        """Whether the expected request of `seq_id` fits now: all its chunks, contiguous each."""
        expected = self._expectation(seq_id)
        blocks = self._reservation_blocks(expected)
        return self._fits([blocks] * expected.width)

    def can_allocate(self, tokens: int | Sequence[int], seq_id: SeqId | None = None) -> bool:
        """Whether a prompt could be admitted now. Orca's reservation depends on the request's
        length: give `seq_id` of an `expect`ed request; without it only "max" can answer."""
        if seq_id is not None:
            return self.can_reserve(seq_id)
        if self.policy != "max":
            raise KVCacheError(
                f"policy {self.policy!r} sizes a reservation by the request's output length: "
                "call expect(seq_id, ...) and can_allocate(tokens, seq_id) / can_reserve(seq_id)"
            )
        return self._fits([self.num_blocks_for(self.max_seq_len)])

    def allocate(self, seq_id: SeqId, token_ids: Sequence[int]) -> int:
        """Reserve the expected request's chunks and place the prompt in the first one.

        Returns 0: nothing is ever cached. Raises `NoFreeBlocksError` (state untouched) when
        a chunk does not fit.
        """
        if seq_id in self._seqs:
            raise KVCacheError(f"sequence {seq_id!r} is already allocated")
        tokens = list(token_ids)
        if not tokens:
            raise KVCacheError(f"sequence {seq_id!r}: a prompt needs at least one token")
        expected = self._expectation(seq_id)
        if len(tokens) > expected.total_len:
            raise ReservationExceededError(
                f"sequence {seq_id!r}: {len(tokens)} tokens exceed the {expected.total_len} "
                "expected for its request"
            )
        blocks = self._reservation_blocks(expected)
        if not self._fits([blocks] * expected.width):
            raise NoFreeBlocksError("contiguous", blocks * expected.width, self.num_free_blocks)
        chunks = []
        for _ in range(expected.width):
            offset, size = self.allocator.allocate(blocks)
            chunks.append(_Chunk(offset, size, blocks))
        request = _Request(
            expected,
            reservation_len(
                self.policy, expected.prompt_len, expected.output_len, self.max_seq_len
            ),
            chunks,
            spare=chunks[1:],
        )
        self._add_member(request, seq_id, chunks[0], len(tokens), 0)
        del self._expected[seq_id]
        return 0

    # -- growth -----------------------------------------------------------------------------------

    def num_blocks_to_append(self, seq_id: SeqId, n: int = 1) -> int:
        """Always 0: the chunk already holds the whole request (growing past it raises)."""
        self._check_room(self._seq(seq_id), n, seq_id)
        return 0

    def can_append(self, seq_id: SeqId, n: int = 1) -> bool:
        seq = self._seq(seq_id)
        return seq.num_tokens + n <= seq.chunk.num_blocks * self.block_size

    def append_slots(self, seq_id: SeqId, new_token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Record tokens written into the chunk; never any copy-on-write."""
        seq = self._seq(seq_id)
        n = len(list(new_token_ids))
        self._check_room(seq, n, seq_id)
        seq.num_tokens += n
        return []

    def mark_computed(self, seq_id: SeqId, num_computed_tokens: int) -> None:
        seq = self._seq(seq_id)
        if not seq.num_computed <= num_computed_tokens <= seq.num_tokens:
            raise KVCacheError(
                f"sequence {seq_id!r}: num_computed_tokens must be between {seq.num_computed} "
                f"and {seq.num_tokens}, got {num_computed_tokens}"
            )
        seq.num_computed = num_computed_tokens

    # -- fork and free ----------------------------------------------------------------------------

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """Give `child_id` a spare chunk of the parent's request holding a copy of the parent's
        tokens (no blocks are shared: Orca cannot share). Raises `NoFreeBlocksError` when the
        request has no spare chunk (it runs more sequences than its width)."""
        if child_id in self._seqs:
            raise KVCacheError(f"sequence {child_id!r} is already allocated")
        parent = self._seq(parent_id)
        request = parent.request
        if not request.spare:
            raise NoFreeBlocksError("spare chunk of the request", 1, 0)
        chunk = request.spare.pop()
        self._add_member(request, child_id, chunk, parent.num_tokens, parent.num_computed)

    def free(self, seq_id: SeqId) -> None:
        """Drop the sequence; its chunk goes back to its request, and the request's chunks go
        back to the allocator when its last sequence is freed."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        request = seq.request
        del request.members[seq_id]
        request.spare.append(seq.chunk)
        if not request.members:
            for chunk in request.chunks:
                self.allocator.free(chunk.offset)

    # -- swapping: Orca has none ------------------------------------------------------------------

    def can_swap_out(self, seq_ids: SeqId | Sequence[SeqId]) -> bool:
        return False

    def can_swap_in(self, seq_ids: SeqId | Sequence[SeqId]) -> bool:
        return False

    def swap_out(self, seq_ids: SeqId | Sequence[SeqId]) -> list[tuple[int, int]]:
        raise KVCacheError("contiguous reservations are not swapped (no host pool)")

    def swap_in(self, seq_ids: SeqId | Sequence[SeqId]) -> list[tuple[int, int]]:
        raise KVCacheError("contiguous reservations are not swapped (no host pool)")

    # -- accounting -------------------------------------------------------------------------------

    def memory_usage(self) -> MemoryUsage:
        """Slots by the vLLM paper's Fig. 2 categories: token states; reserved for tokens still
        to come; internal fragmentation (the policy's over-reservation and block rounding);
        external fragmentation (the buddy allocator's rounding)."""
        bs = self.block_size
        tokens = reserved = internal = external = 0
        for request in self._requests():
            total = request.expected.total_len
            held = {id(self._seqs[s].chunk): self._seqs[s].num_tokens for s in request.members}
            for chunk in request.chunks:
                used = held.get(id(chunk), 0)
                tokens += used
                reserved += max(total - used, 0)
                internal += chunk.reserved_blocks * bs - max(total, used)
                external += (chunk.num_blocks - chunk.reserved_blocks) * bs
        return MemoryUsage(
            total_slots=self.num_blocks * bs,
            token_slots=tokens,
            reserved_slots=reserved,
            internal_fragmentation_slots=internal,
            external_fragmentation_slots=external,
        )

    def check_invariants(self) -> None:
        """Chunks are disjoint, inside the pool, account for every used block, and hold their
        sequences' tokens; raise AssertionError describing the first broken invariant."""
        covered = [0] * self.num_blocks
        chunk_blocks = 0
        for request in self._requests():
            assert len(request.chunks) == request.expected.width, "a request lost a chunk"
            assert len(request.members) + len(request.spare) == len(request.chunks), (
                "every chunk of a request is held by exactly one sequence or spare"
            )
            for chunk in request.chunks:
                assert chunk.num_blocks == next_power_of_two(chunk.reserved_blocks), (
                    f"chunk at {chunk.offset}: {chunk.num_blocks} blocks for "
                    f"{chunk.reserved_blocks} reserved is not the buddy rounding"
                )
                assert chunk.offset % chunk.num_blocks == 0, "a buddy chunk is aligned"
                assert 0 <= chunk.offset and chunk.offset + chunk.num_blocks <= self.num_blocks
                for b in range(chunk.offset, chunk.offset + chunk.num_blocks):
                    covered[b] += 1
                chunk_blocks += chunk.num_blocks
            for seq_id in request.members:
                seq = self._seqs[seq_id]
                assert seq.request is request
                capacity = seq.chunk.num_blocks * self.block_size
                assert 0 <= seq.num_computed <= seq.num_tokens <= capacity, (
                    f"sequence {seq_id!r} overflows its chunk"
                )
        assert all(c <= 1 for c in covered), "two chunks overlap"
        assert chunk_blocks == self.num_used_blocks, (
            f"chunks cover {chunk_blocks} blocks but the allocator has {self.num_used_blocks} used"
        )

    # -- internals --------------------------------------------------------------------------------

    def _seq(self, seq_id: SeqId) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KVCacheError(f"unknown sequence {seq_id!r}") from None

    def _expectation(self, seq_id: SeqId) -> _Expected:
        try:
            return self._expected[seq_id]
        except KeyError:
            raise KVCacheError(
                f"sequence {seq_id!r}: no expected length; call expect() when the request "
                "arrives (OrcaScheduler does)"
            ) from None

    def _requests(self) -> list[_Request]:
        seen: dict[int, _Request] = {}
        for seq in self._seqs.values():
            seen.setdefault(id(seq.request), seq.request)
        return list(seen.values())

    def _reservation_blocks(self, expected: _Expected) -> int:
        length = reservation_len(
            self.policy, expected.prompt_len, expected.output_len, self.max_seq_len
        )
        return self.num_blocks_for(length)

    def _fits(self, sizes: list[int]) -> bool:
        """Whether chunks of these sizes can all be allocated now (tried, then given back)."""
        taken = []
        try:
            for size in sizes:
                if not self.allocator.can_allocate(size):
                    return False
                taken.append(self.allocator.allocate(size)[0])
            return True
        finally:
            for offset in taken:
                self.allocator.free(offset)

    def _check_room(self, seq: _Seq, n: int, seq_id: SeqId) -> None:
        if n < 0:
            raise KVCacheError(f"number of tokens to append must be >= 0, got {n}")
        capacity = seq.chunk.num_blocks * self.block_size
        if seq.num_tokens + n > capacity:
            raise ReservationExceededError(
                f"sequence {seq_id!r}: {seq.num_tokens + n} tokens outgrow its reservation of "
                f"{capacity} slots (policy {self.policy!r}); expect() a longer output"
            )

    def _add_member(
        self, request: _Request, seq_id: SeqId, chunk: _Chunk, num_tokens: int, num_computed: int
    ) -> None:
        if num_tokens > chunk.num_blocks * self.block_size:
            raise ReservationExceededError(f"sequence {seq_id!r} does not fit its chunk")
        request.members[seq_id] = chunk
        self._seqs[seq_id] = _Seq(request, chunk, num_tokens, num_computed)


# -- the schedulers -------------------------------------------------------------------------------


class OrcaScheduler(FCFSScheduler):
    """Orca: FCFS iteration-level scheduling over contiguous reservations.

    The policy is `FCFSScheduler`'s, unchanged. Only admission differs, because the size of a
    reservation depends on the request's length: `add` announces it to the cache manager and the
    admission check asks whether the request's chunks fit. The expected output length is
    `max_tokens` (capped by the context): the oracle's knowledge when requests run with
    `ignore_eos`, as in the benchmarks. With a plain `KVCacheManager` this is `FCFSScheduler`.
    """

    def add(self, group: SequenceGroup) -> None:
        super().add(group)
        if isinstance(self.kv_cache, ReservationKVCacheManager):
            seq = group.seqs[0]
            prompt_len = seq.get_prompt_len()
            output_len = min(
                group.sampling_params.max_tokens, self.config.max_model_len - prompt_len
            )
            self.kv_cache.expect(seq.seq_id, prompt_len, output_len, group.max_width)

    def _can_allocate(self, seqs: list) -> bool:
        if isinstance(self.kv_cache, ReservationKVCacheManager):
            return self.kv_cache.can_reserve(seqs[0].seq_id)
        return super()._can_allocate(seqs)


class StaticBatchScheduler(OrcaScheduler):
    """Static batching (FasterTransformer with a Triton-like batcher, vLLM paper §6.1).

    When no batch is running, up to `max_num_seqs` of the earliest waiting requests are admitted
    while the KV cache can hold them (with `ReservationKVCacheManager(policy="max")`: every
    row reserves the maximum length). The batch then runs -- prefills chunked within the token
    budget, one decode token per sequence per step -- and no request joins it until every one
    of its requests has finished.
    """

    def schedule(self, now: float) -> SchedulerOutput:
        self._now = now
        out = SchedulerOutput()
        if not self.running and not self.swapped:
            self._admit_batch()
        budget = _Budget(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        self._schedule_running(out, budget)
        return out

    @property
    def batch_open(self) -> bool:
        """Whether a batch is running (new requests must wait for it to finish)."""
        return bool(self.running or self.swapped)

    def _admit_batch(self) -> None:
        """Move the earliest waiting requests into the (empty) running batch, FCFS."""
        num_seqs = 0
        while self.waiting:
            group = self.waiting[0]
            seqs = group.get_seqs(SequenceStatus.WAITING)
            width = group.max_width
            if num_seqs + width > self.config.max_num_seqs or not self._can_allocate(seqs):
                return
            self.waiting.popleft()
            self._allocate(group, seqs)
            self.running.append(group)
            num_seqs += width


# -- the five systems of the vLLM paper's Fig. 12, by name ----------------------------------------

SYSTEMS = ("static", "orca-max", "orca-pow2", "orca-oracle", "paged")


def build_scheduler(
    system: str,
    config: SchedulerConfig,
    num_blocks: int,
    block_size: int,
    num_host_blocks: int = 0,
    enable_prefix_caching: bool = False,
) -> FCFSScheduler:
    """The scheduler (holding its KV cache manager) of one of `SYSTEMS`, at a given capacity.

    "paged" is `FCFSScheduler` over `KVCacheManager` (minipaged itself); "orca-*" is
    `OrcaScheduler` over a reservation of that policy; "static" is `StaticBatchScheduler` with
    every row reserved for `config.max_model_len` tokens. The host pool and prefix caching only
    exist for "paged".
    """
    if system == "paged":
        kv = KVCacheManager(
            num_blocks,
            block_size,
            num_host_blocks=num_host_blocks,
            enable_prefix_caching=enable_prefix_caching,
        )
        return FCFSScheduler(config, kv)
    if system == "static":
        kv = ReservationKVCacheManager(num_blocks, block_size, "max", config.max_model_len)
        return StaticBatchScheduler(config, kv)
    if system.startswith("orca-") and system[len("orca-") :] in POLICIES:
        policy = system[len("orca-") :]
        kv = ReservationKVCacheManager(num_blocks, block_size, policy, config.max_model_len)
        return OrcaScheduler(config, kv)
    raise ValueError(f"system must be one of {SYSTEMS}, got {system!r}")


def install(engine: LLMEngine, system: str) -> None:
    """Make an idle `LLMEngine` serve as `system`: replace its scheduler and KV cache manager
    with ones of the same capacity and block size (the runner's KV tensors stay)."""
    if engine.has_unfinished_requests():
        raise ValueError("install a baseline into an idle engine")
    old = engine.kv_cache
    scheduler = build_scheduler(
        system,
        engine.scheduler.config,
        old.num_blocks,
        old.block_size,
        num_host_blocks=old.num_host_blocks,
        enable_prefix_caching=old.enable_prefix_caching,
    )
    engine.kv_cache = scheduler.kv_cache
    engine.scheduler = scheduler
