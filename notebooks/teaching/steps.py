"""Reading an engine's steps as the notebooks print and draw them.

An engine hands every step observer (`LLMEngine.add_step_observer`) a `StepRecord`: the
sequences the step computed, how many tokens each, and whether they were a prompt (a prefill
chunk) or one decoded token. These functions read a list of them, from the real engine or the
simulator alike (its steps are engine steps), through the records' public fields only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["first_step", "idle_slot_steps", "prefill_chunks", "slot_lanes", "step_work"]


class Work(Protocol):  # a `ScheduledSequence`, as far as these functions read it
    request_id: str
    seq_id: int
    is_prefill: bool

    @property
    def num_new_tokens(self) -> int: ...


class Record(Protocol):  # a `StepRecord`, as far as these functions read it
    index: int

    @property
    def scheduled(self) -> Sequence[Work]: ...


def step_work(record: Record) -> str:
    """The step's batch as `request:tokens` with P for a prompt chunk, D for a decode, in batch
    order: `"short:1D, long:63P"`."""
    return ", ".join(f"{w.request_id}:{w.num_new_tokens}{'P' if w.is_prefill else 'D'}"
                     for w in record.scheduled)


def idle_slot_steps(records: Sequence[Record], num_slots: int) -> int:
    """How many (step, slot) pairs computed nothing: `num_slots` sequences fit in a step
    (`max_num_seqs`), and every step that ran fewer left the rest idle."""
    return sum(num_slots - len(record.scheduled) for record in records)


def slot_lanes(records: Sequence[Record], num_slots: int) -> list[list[str | None]]:
    """Per step, what each of the batch's `num_slots` slots computed: a request id, or None for
    an idle slot. A sequence keeps the slot it first got for as long as it is in every step;
    one that was not in the last step takes the lowest free slot. Raises `ValueError` if a step
    ran more sequences than there are slots."""
    held: dict[tuple[str, int], int] = {}
    lanes = []
    for record in records:
        current = [(w.request_id, w.seq_id) for w in record.scheduled]
        if len(current) > num_slots:
            raise ValueError(f"step {record.index} ran {len(current)} sequences in "
                             f"{num_slots} slots")
        held = {key: slot for key, slot in held.items() if key in current}
        for key in current:
            if key not in held:
                held[key] = min(set(range(num_slots)) - set(held.values()))
        row: list[str | None] = [None] * num_slots
        for (request_id, _), slot in held.items():
            row[slot] = request_id
        lanes.append(row)
    return lanes


def prefill_chunks(records: Sequence[Record], request_id: str) -> list[tuple[int, int]]:
    """(step index, tokens) of every prompt chunk `request_id` computed, in order."""
    return [(record.index, work.num_new_tokens) for record in records
            for work in record.scheduled if work.request_id == request_id and work.is_prefill]


def first_step(records: Sequence[Record], request_id: str) -> int | None:
    """The index of the first step that computed anything of `request_id` (None: none did)."""
    return next((record.index for record in records
                 if any(w.request_id == request_id for w in record.scheduled)), None)
