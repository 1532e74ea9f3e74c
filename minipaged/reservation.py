"""The baselines PagedAttention is measured against: contiguous KV reservation per request.

Before vLLM, a serving system stored each request's KV cache in one contiguous chunk reserved
when the request was admitted (Kwon et al. SOSP'23, §3 and §6.1):

* `ReservationCache` reproduces the paper's Orca variants on a buddy allocator, with
  iteration-level scheduling: **Max** reserves the model's maximum length, **Pow2** the prompt
  plus the next power of two of the true output length (over-reserving by at most 2x),
  **Oracle** exactly prompt + output. The allocator rounds every reservation up to a power of
  two on top of that.
* `StaticBatchCache` is FasterTransformer-style static batching: a fixed number of `max_seq_len`
  rows, filled once, released only when the whole batch has finished.

Both report `memory_usage()` in the same categories as `KVCacheManager` (the paper's Fig. 2):
token states, slots reserved for future tokens, internal fragmentation (past the request's
true length), external fragmentation (the allocator's rounding). They are accounting models
for the memory-waste benchmark: they know each request's true output length.
"""

from __future__ import annotations

from dataclasses import dataclass

from minipaged.kv_cache import KVCacheError, MemoryUsage, NoFreeBlocksError

POLICIES = ("max", "pow2", "oracle")


def next_power_of_two(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n!r}")
    return 1 << (n - 1).bit_length()


# --------------------------------------------------------------------------------------------
# Data types
# --------------------------------------------------------------------------------------------


@dataclass
class _Request:
    """One admitted request's contiguous reservation."""

    prompt_len: int
    output_len: int
    reserved_len: int  # slots the policy asked for
    chunk_len: int  # slots the allocator handed out (>= reserved_len)
    offset: int
    num_tokens: int  # token states held so far
    finished: bool = False

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


# --------------------------------------------------------------------------------------------
# The buddy allocator
# --------------------------------------------------------------------------------------------


class BuddyAllocator:
    """A binary buddy allocator over `num_slots` slots (Knuth, TAOCP vol. 1 §2.5).

    Requests are rounded up to a power of two; a free chunk is split in halves until it fits,
    and a freed chunk merges with its free "buddy" back up. A capacity that is not a power of
    two is covered by its binary decomposition (e.g. 15700 = 8192 + 4096 + ... + 4), each part
    aligned to its size, so buddies never straddle two parts.
    """

    def __init__(self, num_slots: int) -> None:
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be a positive integer, got {num_slots!r}")
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
        order = self._order(size)
        return any(self._free[o] for o in range(order, len(self._free)))

    def allocate(self, size: int) -> tuple[int, int]:
        """Reserve at least `size` contiguous slots; return (offset, chunk length)."""
        order = self._order(size)
        available = [o for o in range(order, len(self._free)) if self._free[o]]
        if not available:
            raise NoFreeBlocksError("buddy", 1 << order, self.num_free_slots)
        current = available[0]
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
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be a positive integer, got {size!r}")
        if size > self.num_slots:
            raise NoFreeBlocksError("buddy", size, self.num_free_slots)
        return (size - 1).bit_length()

    def _part_order(self, offset: int) -> int:
        for start, order in self._parts:
            if start <= offset < start + (1 << order):
                return order
        raise AssertionError(f"offset {offset} outside the allocator")


# --------------------------------------------------------------------------------------------
# Orca-style reservation with iteration-level scheduling
# --------------------------------------------------------------------------------------------


class _ContiguousCache:
    """What both baselines share: per-request bookkeeping and the Fig. 2 accounting."""

    def __init__(self, num_slots: int, max_seq_len: int) -> None:
        if not isinstance(max_seq_len, int) or max_seq_len < 2:
            raise ValueError(f"max_seq_len must be an integer >= 2, got {max_seq_len!r}")
        if not isinstance(num_slots, int) or num_slots < max_seq_len:
            raise ValueError(
                f"num_slots must be an integer >= max_seq_len ({max_seq_len}), got {num_slots!r}"
            )
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self._requests: dict[object, _Request] = {}

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._requests

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def append(self, req_id: object, n: int = 1) -> None:
        """Record `n` more token states written into the request's reservation."""
        request = self._get(req_id)
        if request.finished:
            raise KVCacheError(f"request {req_id!r} has finished")
        if request.num_tokens + n > request.total_len:
            raise KVCacheError(
                f"request {req_id!r} would exceed its length {request.total_len} "
                f"(prompt {request.prompt_len} + output {request.output_len})"
            )
        request.num_tokens += n

    def memory_usage(self) -> MemoryUsage:
        tokens = reserved = internal = external = 0
        for r in self._requests.values():
            if r.finished:  # a static batch holds a finished request's row: all dead state
                internal += r.chunk_len
                continue
            tokens += r.num_tokens
            reserved += r.total_len - r.num_tokens
            internal += r.reserved_len - r.total_len
            external += r.chunk_len - r.reserved_len
        return MemoryUsage(
            total_slots=self.num_slots,
            token_slots=tokens,
            reserved_slots=reserved,
            internal_fragmentation_slots=internal,
            external_fragmentation_slots=external,
        )

    def _get(self, req_id: object) -> _Request:
        try:
            return self._requests[req_id]
        except KeyError:
            raise KVCacheError(f"unknown request {req_id!r}") from None

    def _check_new(self, req_id: object, prompt_len: int, output_len: int) -> None:
        if req_id in self._requests:
            raise KVCacheError(f"request {req_id!r} is already allocated")
        if prompt_len < 1 or output_len < 1:
            raise KVCacheError(
                f"prompt_len and output_len must be >= 1, got {prompt_len}, {output_len}"
            )
        if prompt_len + output_len > self.max_seq_len:
            raise KVCacheError(
                f"prompt {prompt_len} + output {output_len} exceeds max_seq_len {self.max_seq_len}"
            )


class ReservationCache(_ContiguousCache):
    """Orca-style contiguous reservation (policy "max", "pow2" or "oracle") on a buddy allocator."""

    def __init__(self, num_slots: int, policy: str, max_seq_len: int = 2048) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        super().__init__(num_slots, max_seq_len)
        self.policy = policy
        self.allocator = BuddyAllocator(num_slots)

    def reservation_len(self, prompt_len: int, output_len: int) -> int:
        """Slots the policy reserves for a request (before the allocator's rounding)."""
        if self.policy == "max":
            return self.max_seq_len
        if self.policy == "pow2":
            return min(self.max_seq_len, prompt_len + next_power_of_two(output_len))
        return prompt_len + output_len

    def can_allocate(self, prompt_len: int, output_len: int) -> bool:
        return self.allocator.can_allocate(self.reservation_len(prompt_len, output_len))

    def allocate(self, req_id: object, prompt_len: int, output_len: int) -> None:
        """Reserve the request's chunk and record its prompt's token states."""
        self._check_new(req_id, prompt_len, output_len)
        reserved = self.reservation_len(prompt_len, output_len)
        offset, chunk = self.allocator.allocate(reserved)
        self._requests[req_id] = _Request(
            prompt_len, output_len, reserved, chunk, offset, prompt_len
        )

    def free(self, req_id: object) -> None:
        request = self._get(req_id)
        self.allocator.free(request.offset)
        del self._requests[req_id]


class StaticBatchCache(_ContiguousCache):
    """Static batching (FasterTransformer-like): `num_slots // max_seq_len` rows of
    `max_seq_len` slots. Rows are filled only while the batch has not started decoding; a
    finished request keeps its row until every request of the batch has finished."""

    def __init__(self, num_slots: int, max_seq_len: int = 2048) -> None:
        super().__init__(num_slots, max_seq_len)
        self.batch_size = num_slots // max_seq_len
        self._started = False

    def can_allocate(self, prompt_len: int, output_len: int) -> bool:
        return not self._started and len(self._requests) < self.batch_size

    def allocate(self, req_id: object, prompt_len: int, output_len: int) -> None:
        self._check_new(req_id, prompt_len, output_len)
        if self._started:
            raise KVCacheError("the static batch has started; wait until it finishes")
        if len(self._requests) >= self.batch_size:
            raise NoFreeBlocksError("batch row", 1, 0)
        offset = len(self._requests) * self.max_seq_len
        self._requests[req_id] = _Request(
            prompt_len, output_len, self.max_seq_len, self.max_seq_len, offset, prompt_len
        )

    def append(self, req_id: object, n: int = 1) -> None:
        super().append(req_id, n)
        self._started = True  # decoding has begun: the batch is closed

    def free(self, req_id: object) -> None:
        """Mark the request finished; the batch's rows are released when all have finished."""
        self._get(req_id).finished = True
        if all(r.finished for r in self._requests.values()):
            self._requests.clear()
            self._started = False
