"""A step's flat batch (docs/architecture.md, "One step of the engine") as Python lists, built
and checked once (`flat_batch`): the model runner turns it into tensors (`batch_tensors`), and
a replayed decode step writes it straight into its buffers (`minipaged.runner.graphs`).

The batch holds the attention contract by construction: query spans from 0 to the token count,
each within its context, maxima that bound (the tests hold every batch built here to the
contract's own checks, `minipaged.attention.contract`). What construction cannot promise is
checked on the lists, before any kernel writes the cache: each block table covers its context
with blocks of the cache, and no two tokens write one slot. The layers' attention ops then skip
their checks and host syncs. The block tables persist from step to step (`BlockTables`): a
step's Python work is its new tokens', not its tables'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from minipaged.attention.contract import AttentionMetadata
from minipaged.sched.output import ScheduledSequence


@dataclass(frozen=True)
class FlatBatch:
    """Every scheduled sequence's new tokens, one after another: the model's inputs and the
    attention metadata, as lists, and the block tables as one array."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]  # where each new token's K and V go
    query_start_loc: list[int]  # [B + 1]: sequence i's tokens are [loc[i], loc[i + 1])
    seq_lens: list[int]  # cached + new tokens of each sequence
    block_tables: np.ndarray  # [B, longest table] int32, padded with -1
    max_query_len: int
    max_seq_len: int


class BlockTables:
    """The block tables of the steps, kept from step to step (vLLM v1's persistent batch): one
    int32 row per table, written when a step first names it. A table is the scheduler's
    immutable tuple (`ScheduledSequence.block_table`), the same object until a block is added,
    copied or moved, so a decode step that fills no block writes no row; a step gathers its
    rows. A row also knows how many of its leading blocks lie in the cache, so that a step
    checks a table against the cache without reading it."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.array = np.full((64, 64), -1, dtype=np.int32)
        # id of a table (held, so that the id stays its own) -> its row, it, its leading
        # blocks within the cache
        self.rows: dict[int, tuple[int, tuple[int, ...], int]] = {}
        self.free_rows: list[int] = []

    def row(self, table: tuple[int, ...]) -> tuple[int, int]:
        """The row of `table`, written if it is new, and its leading blocks in the cache."""
        known = self.rows.get(id(table))
        if known is None:
            row, width = self.free_rows.pop() if self.free_rows else len(self.rows), len(table)
            if row >= self.array.shape[0] or width > self.array.shape[1]:  # about doubled
                self.array = np.pad(self.array, ((0, row + 1), (0, width)), constant_values=-1)
            self.array[row] = table + (-1,) * (self.array.shape[1] - width)
            within = next((i for i, b in enumerate(table) if not 0 <= b < self.num_blocks), width)
            known = self.rows[id(table)] = (row, table, within)
        return known[0], known[2]

    def gather(self, rows: list[int], tables: Sequence[Sequence[int]]) -> np.ndarray:
        """The rows of a step's tables, padded with -1 to the longest. Once the rows outnumber
        the step's, those of tables no step names now (replaced, finished) are let go."""
        out = self.array[rows, : max(map(len, tables))]
        if len(self.rows) > 2 * len(rows) + 64:
            self.free_rows += [self.rows.pop(k)[0] for k in self.rows.keys() - set(map(id, tables))]
        return out


def flat_batch(entries: Sequence[ScheduledSequence], block_size: int, num_blocks: int,
               tables: BlockTables | None = None) -> FlatBatch:
    """The flat batch of a step's `entries` over a cache of `num_blocks` blocks of
    `block_size` tokens, with the rows of `tables` (the runner's, kept from step to step; by
    default new ones). Raises `ValueError` naming the problem (module docstring)."""
    tables, bs = tables or BlockTables(num_blocks), block_size
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc, seq_lens, rows = [0], [], []
    for entry in entries:
        start, table, end = entry.start, entry.block_table, entry.start + len(entry.token_ids)
        if len(table) * bs < end:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {end} tokens")
        known = tables.rows.get(id(table))  # most steps: a table seen before, its row kept
        row, within = (known[0], known[2]) if known else tables.row(table)
        if within * bs < end:
            raise ValueError(f"block table {list(table[:-(-end // bs)])} names a block outside "
                             f"the cache's {num_blocks} blocks within its {end}-token context")
        rows.append(row)
        input_ids += entry.token_ids
        positions += range(start, end)
        slots += ([table[start // bs] * bs + start % bs] if end - start == 1  # a decode's
                  else [table[pos // bs] * bs + pos % bs for pos in range(start, end)])
        query_start_loc.append(query_start_loc[-1] + end - start)
        seq_lens.append(end)
    if len(set(slots)) != len(slots):
        raise ValueError("two tokens of the step write the same cache slot")
    return FlatBatch(input_ids, positions, slots, query_start_loc, seq_lens,
                     tables.gather(rows, [e.block_table for e in entries]),
                     max(len(e.token_ids) for e in entries), max(seq_lens))


def batch_tensors(batch: FlatBatch,
                  device: torch.device) -> tuple[Tensor, Tensor, AttentionMetadata]:
    """input_ids and positions `[T]` (int64) and the attention metadata of `batch` on `device`,
    block tables padded with -1 to the longest."""

    def as_tensor(values: list, dtype: torch.dtype) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    metadata = AttentionMetadata(
        slot_mapping=as_tensor(batch.slot_mapping, torch.int64),
        query_start_loc=as_tensor(batch.query_start_loc, torch.int32),
        seq_lens=as_tensor(batch.seq_lens, torch.int32),
        block_tables=torch.from_numpy(batch.block_tables).to(device),
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
    )
    return (as_tensor(batch.input_ids, torch.int64), as_tensor(batch.positions, torch.int64),
            metadata)
