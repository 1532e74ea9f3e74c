"""A step's flat batch (docs/architecture.md, "One step of the engine") as Python lists, built
and checked once (`flat_batch`): the model runner turns it into tensors (`batch_tensors`), and
a replayed decode step writes it straight into its buffers (`minipaged.runner.graphs`).

The batch holds the attention contract by construction: query spans from 0 to the token count,
each within its context, maxima that bound (the tests hold every batch built here to the
contract's own checks, `minipaged.attention.contract`). What construction cannot promise is
checked on the lists, before any kernel writes the cache: each block table covers its context
with blocks of the cache, and no two tokens write one slot. The layers' attention ops then skip
their checks and host syncs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from minipaged.attention.contract import AttentionMetadata
from minipaged.sched.output import ScheduledSequence


@dataclass(frozen=True)
class FlatBatch:
    """Every scheduled sequence's new tokens, one after another: the model's inputs and the
    attention metadata, as lists."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]  # where each new token's K and V go
    query_start_loc: list[int]  # [B + 1]: sequence i's tokens are [loc[i], loc[i + 1])
    seq_lens: list[int]  # cached + new tokens of each sequence
    block_tables: list[Sequence[int]]  # each sequence's own, not padded
    max_query_len: int
    max_seq_len: int


def flat_batch(entries: Sequence[ScheduledSequence], block_size: int,
               num_blocks: int) -> FlatBatch:
    """The flat batch of a step's `entries` over a cache of `num_blocks` blocks of
    `block_size` tokens. Raises `ValueError` naming the problem (module docstring)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    bs = block_size
    for entry in entries:
        n = len(entry.token_ids)
        end = entry.start + n
        table = entry.block_table
        if len(table) * bs < end:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {end} tokens")
        used = table[:-(-end // bs)]
        if used and (min(used) < 0 or max(used) >= num_blocks):
            raise ValueError(f"block table {list(used)} names a block outside the cache's "
                             f"{num_blocks} blocks within its {end}-token context")
        input_ids.extend(entry.token_ids)
        positions.extend(range(entry.start, end))
        slots.extend(table[pos // bs] * bs + pos % bs for pos in range(entry.start, end))
        query_start_loc.append(query_start_loc[-1] + n)
        seq_lens.append(end)
    if len(set(slots)) != len(slots):
        raise ValueError("two tokens of the step write the same cache slot")
    return FlatBatch(input_ids, positions, slots, query_start_loc, seq_lens,
                     [e.block_table for e in entries],
                     max(len(e.token_ids) for e in entries), max(seq_lens))


def batch_tensors(batch: FlatBatch,
                  device: torch.device) -> tuple[Tensor, Tensor, AttentionMetadata]:
    """input_ids and positions `[T]` (int64) and the attention metadata of `batch` on `device`,
    block tables padded with -1 to the longest."""
    width = max(len(table) for table in batch.block_tables)
    tables = [list(table) + [-1] * (width - len(table)) for table in batch.block_tables]

    def as_tensor(values: list, dtype: torch.dtype) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    metadata = AttentionMetadata(
        slot_mapping=as_tensor(batch.slot_mapping, torch.int64),
        query_start_loc=as_tensor(batch.query_start_loc, torch.int32),
        seq_lens=as_tensor(batch.seq_lens, torch.int32),
        block_tables=as_tensor(tables, torch.int32),
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
    )
    return (as_tensor(batch.input_ids, torch.int64), as_tensor(batch.positions, torch.int64),
            metadata)
