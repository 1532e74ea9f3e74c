"""The baselines' KV memory: one contiguous reservation per request (vLLM paper §3, §6.1).

Before vLLM, a serving system stored each request's KV cache in one contiguous chunk reserved
when the request was admitted. **Orca** reserves the maximum length (Max), the prompt plus the
next power of two of the output length (Pow2, at most 2x over), or exactly prompt plus output
(Oracle), each chunk from a buddy allocator (`minipaged.kv.buddy`). **FasterTransformer** batches
statically: rows of the maximum length, held until the whole batch has finished
(`static_batch=True`: a finished request's chunk stays allocated, dead).

`ReservationKVCacheManager` is a `minipaged.kv.interface.KVManager`, so the baselines run under
the very schedulers of the paged system (`minipaged.sched.baselines`) and in the memory-waste
benchmark. Reservations are whole blocks (with `block_size=1` token-exact, as in the paper);
a sequence's block table is its chunk's first blocks, a real contiguous region of the KV tensor.

A reservation depends on the request's length, which only the scheduler knows: it announces a
request with `expect` before `can_allocate` (`OrcaScheduler.add`), with `max_tokens` as the
output length -- the oracle's knowledge when requests run with `ignore_eos`, as in the
benchmarks. Growing past a reservation raises `ReservationExceededError`. There is no prefix
cache, no swapping and no sharing: `fork` gives the child a chunk the request reserved for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from minipaged.kv.buddy import BuddyAllocator, next_power_of_two
from minipaged.kv.interface import (
    BlockCopy,
    KVCacheError,
    ManagerBase,
    MemoryUsage,
    NoFreeBlocksError,
    SeqId,
    check_count,
    check_growth,
    too_many_computed,
)

POLICIES = ("max", "pow2", "oracle")

# -- errors and data types ------------------------------------------------------------------------


class ReservationExceededError(KVCacheError):
    """A sequence grew past the contiguous chunk reserved for it at admission."""


def reservation_len(policy: str, prompt_len: int, output_len: int, max_seq_len: int) -> int:
    """Token slots a policy reserves for a request (vLLM paper §6.1), before any rounding;
    `KVCacheError` for lengths no reservation can hold."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if prompt_len < 1 or output_len < 1:
        raise KVCacheError(f"prompt and output must be >= 1 token, got {prompt_len}, {output_len}")
    if prompt_len + output_len > max_seq_len:
        raise KVCacheError(
            f"prompt {prompt_len} + output {output_len} exceeds max_seq_len {max_seq_len}"
        )
    if policy == "max":
        return max_seq_len
    if policy == "pow2":
        return min(max_seq_len, prompt_len + next_power_of_two(output_len))
    return prompt_len + output_len


@dataclass
class _Expected:
    """What admission must reserve for a request: its lengths, how many sequences it runs, and
    the blocks of each one's chunk (the policy's reservation, before the buddy rounding)."""

    prompt_len: int
    output_len: int
    width: int
    blocks: int

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
    chunks: list[_Chunk]
    spare: list[_Chunk]  # reserved chunks no sequence holds (unforked samples, freed beams)
    members: set[SeqId] = field(default_factory=set)


@dataclass
class _Member:
    """A sequence in its request's chunk, and how many of the chunk's slots hold its tokens
    (the chunk's fill: a chunk has no blocks of its own to keep it)."""

    request: _Request
    chunk: _Chunk
    num_slots: int


# -- the KV manager -------------------------------------------------------------------------------


class ReservationKVCacheManager(ManagerBase[_Member]):
    """Contiguous reservations in `num_gpu_blocks` blocks of `block_size` slots: `policy` "max",
    "pow2" or "oracle"; `max_seq_len` is what Max reserves (and the longest request); with
    `static_batch`, chunks come back only once no sequence is left."""

    watermark_blocks = 0  # no admission reserve: a reservation is never outgrown
    num_cpu_blocks = 0  # no CPU pool: nothing is swapped

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        policy: str = "max",
        max_seq_len: int = 2048,
        static_batch: bool = False,
    ) -> None:
        super().__init__(num_gpu_blocks, block_size)
        check_count("max_seq_len", max_seq_len, 1)
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if next_power_of_two(self.num_blocks_for(max_seq_len)) > num_gpu_blocks:
            raise ValueError(
                f"{num_gpu_blocks} blocks of {block_size} tokens cannot hold even one chunk of "
                f"max_seq_len {max_seq_len} (rounded up to a power of two)"
            )
        self.policy = policy
        self.max_seq_len = max_seq_len
        self.static_batch = static_batch
        self.allocator = BuddyAllocator(num_gpu_blocks)
        self._expected: dict[SeqId, _Expected] = {}
        self._dead: list[_Request] = []  # finished requests a static batch still holds

    # -- queries ----------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no chunk covers (they may be too scattered for the next reservation)."""
        return self.allocator.num_free_slots

    def blocks_for_request(self, prompt_len: int, max_len: int, width: int) -> int:
        """`width` chunks of the policy's reservation, each rounded up to a power of two."""
        output_len = min(max_len, self.max_seq_len) - prompt_len
        reserved = reservation_len(self.policy, prompt_len, output_len, self.max_seq_len)
        return width * next_power_of_two(self.num_blocks_for(reserved))

    def num_slots(self, seq_id: SeqId) -> int:
        """Slots of the sequence's chunk holding its tokens (for pictures and tests)."""
        return self._seqs[seq_id].num_slots

    def block_table(self, seq_id: SeqId) -> tuple[int, ...]:
        """The chunk's first blocks, as many as the sequence's tokens fill: consecutive ids."""
        member = self._seqs[seq_id]
        start = member.chunk.offset
        return tuple(range(start, start + self.num_blocks_for(member.num_slots)))

    def reserved_blocks(self, seq_id: SeqId) -> int:
        """Blocks of the sequence's chunk (after the allocator's rounding)."""
        return self._seqs[seq_id].chunk.num_blocks

    # -- admission --------------------------------------------------------------------------------

    def expect(self, seq_id: SeqId, prompt_len: int, output_len: int, width: int = 1) -> None:
        """Announce a request before its admission: its first sequence, prompt and output
        lengths (the oracle's knowledge; `max_tokens` with `ignore_eos`) and how many sequences
        it runs at once (parallel samples or beams), each of which gets a chunk."""
        check_count("width", width, 1)
        reserved = reservation_len(self.policy, prompt_len, output_len, self.max_seq_len)
        blocks = self.num_blocks_for(reserved)
        self._expected[seq_id] = _Expected(prompt_len, output_len, width, blocks)

    def can_allocate(self, seq_id: SeqId, token_ids: Sequence[int]) -> bool:
        """Whether all the chunks of the `expect`ed request of `seq_id` fit now."""
        expected = self._expectation(seq_id)
        return self.allocator.num_free_chunks(expected.blocks) >= expected.width

    def allocate(self, seq_id: SeqId, token_ids: Sequence[int]) -> int:
        """Reserve the expected request's chunks and place the prompt in the first one.

        Returns 0: nothing is ever cached. Raises `NoFreeBlocksError` (state untouched) when
        a chunk does not fit.
        """
        self._seqs.check_new(seq_id)
        num_tokens = len(token_ids)
        if not num_tokens:
            raise KVCacheError(f"sequence {seq_id!r}: a prompt needs at least one token")
        expected = self._expectation(seq_id)
        if num_tokens > expected.total_len:
            raise ReservationExceededError(
                f"sequence {seq_id!r}: {num_tokens} tokens exceed the {expected.total_len} "
                "expected for its request"
            )
        blocks = expected.blocks
        if self.allocator.num_free_chunks(blocks) < expected.width:
            raise NoFreeBlocksError("contiguous", blocks * expected.width, self.num_free_blocks)
        chunks = [_Chunk(*self.allocator.allocate(blocks), blocks) for _ in range(expected.width)]
        request = _Request(expected, chunks, spare=chunks[1:], members={seq_id})
        self._seqs[seq_id] = _Member(request, chunks[0], num_tokens)
        del self._expected[seq_id]
        return 0

    # -- growth -----------------------------------------------------------------------------------

    def num_blocks_to_append(self, seq_id: SeqId, *, num_tokens: int) -> int:
        """Always 0: the chunk already holds the whole request (growing past it raises)."""
        self._check_room(seq_id, num_tokens)
        return 0

    def can_append(self, seq_id: SeqId, *, num_tokens: int) -> bool:
        return num_tokens <= self._seqs[seq_id].request.expected.total_len

    def append_slots(self, seq_id: SeqId, *, num_tokens: int) -> list[BlockCopy]:
        """Record that the chunk holds the sequence's first `num_tokens` tokens; never any
        copy-on-write."""
        self._check_room(seq_id, num_tokens)
        self._seqs[seq_id].num_slots = num_tokens
        return []

    def mark_computed(self, seq_id: SeqId, computed_token_ids: Sequence[int]) -> None:
        """Nothing to publish (no prefix cache); checks the prefix fits the sequence's slots."""
        num_slots = self._seqs[seq_id].num_slots
        if len(computed_token_ids) > num_slots:
            raise too_many_computed(seq_id, len(computed_token_ids), num_slots)

    # -- fork and free ----------------------------------------------------------------------------

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """Give `child_id` a spare chunk of the parent's request holding a copy of the parent's
        tokens (no blocks are shared: Orca cannot share). Raises `NoFreeBlocksError` when the
        request has no spare chunk (it runs more sequences than its width)."""
        self._seqs.check_new(child_id)
        parent = self._seqs[parent_id]
        request = parent.request
        if not request.spare:
            raise NoFreeBlocksError("spare chunk of the request", 1, 0)
        request.members.add(child_id)
        self._seqs[child_id] = _Member(request, request.spare.pop(), parent.num_slots)

    def free(self, seq_id: SeqId) -> None:
        """Drop the sequence; its chunk goes back to its request, and the request's chunks go
        back to the allocator when its last sequence is freed (in a static batch: when the
        batch's last sequence is)."""
        member = self._seqs[seq_id]
        del self._seqs[seq_id]
        request = member.request
        request.members.remove(seq_id)
        request.spare.append(member.chunk)
        if request.members:
            return
        self._dead.append(request)
        if self.static_batch and self._seqs:
            return
        for dead in self._dead:
            for chunk in dead.chunks:
                self.allocator.free(chunk.offset)
        self._dead.clear()

    # -- swapping: the baselines have none --------------------------------------------------------

    def can_swap_out(self, seq_ids: SeqId | Sequence[SeqId]) -> bool:
        return False

    can_swap_in = can_swap_out

    def swap_out(self, seq_ids: SeqId | Sequence[SeqId]) -> list[BlockCopy]:
        raise KVCacheError("contiguous reservations are not swapped (no CPU pool)")

    swap_in = swap_out

    def num_blocks_to_swap_in(self, num_tokens: Mapping[SeqId, int]) -> int:
        raise KVCacheError("contiguous reservations are not swapped (no CPU pool)")

    # -- accounting -------------------------------------------------------------------------------

    def memory_usage(self) -> MemoryUsage:
        """Slots by the vLLM paper's Fig. 2 categories: token states; reserved for tokens still
        to come; internal fragmentation (the policy's over-reservation, block rounding, the dead
        rows of a static batch); external fragmentation (the buddy allocator's rounding)."""
        bs = self.block_size
        tokens = reserved = internal = external = 0
        for request in self._live_requests() + self._dead:
            # A dead request (no sequence left) has no tokens to come: its chunks are all waste.
            total = request.expected.total_len if request.members else 0
            held = {id(m.chunk): m.num_slots for m in map(self._seqs.get, request.members)}
            for chunk in request.chunks:
                used = held.get(id(chunk), 0)
                tokens += used
                reserved += total - used
                internal += chunk.reserved_blocks * bs - total
                external += (chunk.num_blocks - chunk.reserved_blocks) * bs
        return MemoryUsage(
            total_slots=self.num_gpu_blocks * bs,
            token_slots=tokens,
            reserved_slots=reserved,
            internal_fragmentation_slots=internal,
            external_fragmentation_slots=external,
        )

    def check_invariants(self) -> None:
        """Chunks are disjoint, inside the pool, account for every used block, and hold their
        sequences' tokens; raise AssertionError describing the first broken invariant."""
        covered = [0] * self.num_gpu_blocks  # chunks over each block
        for request in self._live_requests() + self._dead:
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
                assert 0 <= chunk.offset and chunk.offset + chunk.num_blocks <= self.num_gpu_blocks
                for b in range(chunk.offset, chunk.offset + chunk.num_blocks):
                    covered[b] += 1
            for seq_id in request.members:
                member = self._seqs[seq_id]
                assert member.request is request
                total = request.expected.total_len
                assert 0 < member.num_slots <= total, f"sequence {seq_id!r} outgrew its length"
        assert not self._dead or self.static_batch, "dead chunks outside a static batch"
        assert all(c <= 1 for c in covered), "two chunks overlap"
        used = self.num_gpu_blocks - self.num_free_blocks
        assert sum(covered) == used, f"chunks cover {sum(covered)} blocks, the allocator {used}"

    # -- internals --------------------------------------------------------------------------------

    def _expectation(self, seq_id: SeqId) -> _Expected:
        try:
            return self._expected[seq_id]
        except KeyError:
            raise KVCacheError(
                f"sequence {seq_id!r}: no expected output length to size its reservation by; "
                "call expect() when the request arrives (OrcaScheduler does)"
            ) from None

    def _live_requests(self) -> list[_Request]:
        """The requests with a sequence left, each once, in order of their first sequence."""
        return list({id(m.request): m.request for m in self._seqs.values()}.values())

    def _check_room(self, seq_id: SeqId, num_tokens: int) -> None:
        member = self._seqs[seq_id]
        check_growth(num_tokens, member.num_slots)
        total = member.request.expected.total_len
        if num_tokens > total:
            raise ReservationExceededError(
                f"sequence {seq_id!r}: {num_tokens} tokens would exceed its length "
                f"{total} (prompt + expected output), which its reservation was sized for: a "
                "sequence cannot outgrow it; expect() a longer output"
            )
