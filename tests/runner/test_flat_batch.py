"""The flat batch (`flat_batch`, `batch_tensors`) against a plain reference, and its checks.

The reference expands each block table into one slot per token (the definition of a block table)
and lays the batch out sequence after sequence. Every batch built must also pass the attention
contract's own checks (it holds them by construction), and what construction cannot promise --
blocks within the cache, no slot written twice -- is refused with an error naming it.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import scheduled

from minipaged.attention.contract import check_paged_attention_args, check_reshape_and_cache_args
from minipaged.runner.flat_batch import BlockTables, batch_tensors, flat_batch
from minipaged.sched.output import ScheduledSequence

VOCAB = 64


@st.composite
def batches(draw):
    """Random entries over a pool of blocks: any start (prefix cached or chunked prefill), any
    number of new tokens, block tables in any order and possibly longer than needed."""
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    num_blocks = 48
    entries = []
    for _ in range(draw(st.integers(1, 6))):
        end = draw(st.integers(1, 40))
        start = draw(st.integers(0, end - 1))
        needed = -(-end // block_size)
        extra = draw(st.integers(0, 2))
        table = draw(
            st.lists(
                st.integers(0, num_blocks - 1),
                min_size=needed + extra,
                max_size=needed + extra,
                unique=True,
            )
        )
        n = end - start
        tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
        entries.append(scheduled(tokens, start, table, draw(st.booleans())))
    return block_size, num_blocks, entries


def reference_flat_batch(entries: list[ScheduledSequence], block_size: int) -> dict[str, list]:
    """The flat batch by definition: a block table lists a sequence's slots block by block."""
    ref = {"input_ids": [], "positions": [], "slot_mapping": [], "query_start_loc": [0]}
    ref["seq_lens"], ref["block_tables"] = [], []
    width = max(len(e.block_table) for e in entries)
    for e in entries:
        slots = [b * block_size + offset for b in e.block_table for offset in range(block_size)]
        context = e.start + len(e.token_ids)
        ref["input_ids"] += list(e.token_ids)
        ref["positions"] += list(range(e.start, context))
        ref["slot_mapping"] += slots[e.start : context]
        ref["query_start_loc"].append(ref["query_start_loc"][-1] + len(e.token_ids))
        ref["seq_lens"].append(context)
        ref["block_tables"].append(list(e.block_table) + [-1] * (width - len(e.block_table)))
    return ref


@given(batches())
@settings(max_examples=60)
def test_the_flat_batch_equals_the_reference_and_holds_the_contract(batch):
    block_size, num_blocks, entries = batch
    ref = reference_flat_batch(entries, block_size)
    if len(set(ref["slot_mapping"])) < len(ref["slot_mapping"]):  # tables sharing a block
        with pytest.raises(ValueError, match="same cache slot"):
            flat_batch(entries, block_size, num_blocks)
        return
    batch = flat_batch(entries, block_size, num_blocks)
    assert batch.input_ids == ref["input_ids"] and batch.slot_mapping == ref["slot_mapping"]
    input_ids, positions, md = batch_tensors(batch, torch.device("cpu"))
    assert input_ids.tolist() == ref["input_ids"] and input_ids.dtype == torch.int64
    assert positions.tolist() == ref["positions"] and positions.dtype == torch.int64
    assert md.slot_mapping.tolist() == ref["slot_mapping"] and md.slot_mapping.dtype == torch.int64
    assert md.query_start_loc.tolist() == ref["query_start_loc"]
    assert md.query_start_loc.dtype == torch.int32
    assert md.seq_lens.tolist() == ref["seq_lens"] and md.seq_lens.dtype == torch.int32
    assert md.block_tables.tolist() == ref["block_tables"] and md.block_tables.dtype == torch.int32
    assert md.max_query_len == max(len(e.token_ids) for e in entries)
    assert md.max_seq_len == max(ref["seq_lens"])
    # valid by construction: the attention contract's own checks accept it
    cache = torch.zeros(num_blocks, block_size, 2, 8)  # 2 KV heads of 8 dims
    q = torch.empty(len(input_ids), 4, 8)
    kv = torch.empty(len(input_ids), 2, 8)
    check_paged_attention_args(q, cache, cache, md.block_tables, md.seq_lens,
                               md.query_start_loc, max_query_len=md.max_query_len,
                               max_seq_len=md.max_seq_len)
    check_reshape_and_cache_args(kv, kv, cache, cache, md.slot_mapping)


@given(st.data())
@settings(max_examples=30)
def test_block_tables_kept_from_step_to_step_give_the_batch_of_new_ones(data):
    """A runner keeps its block tables' rows from step to step (`BlockTables`): whatever the
    steps (the same tables again, tables replaced by new tuples, rows let go once they pile
    up), each step's batch is the one built from scratch, errors included."""
    block_size, num_blocks, entries = data.draw(batches())
    kept = BlockTables(num_blocks)

    def outcome(step: list[ScheduledSequence], tables: BlockTables | None) -> object:
        try:
            batch = flat_batch(step, block_size, num_blocks, tables)
        except ValueError as error:
            return str(error)
        return batch.input_ids, batch.slot_mapping, batch.block_tables.tolist()

    for _ in range(data.draw(st.integers(1, 40))):
        if data.draw(st.booleans()):  # new tuples, as when blocks are added or moved
            entries = [e._replace(block_table=tuple(list(e.block_table))) for e in entries]
        step = data.draw(st.permutations(entries))[: data.draw(st.integers(1, len(entries)))]
        assert outcome(step, kept) == outcome(step, None)
    assert len(kept.rows) <= 2 * len(entries) + 64 + len(entries)  # let go of, not kept


def test_a_block_table_too_short_is_refused():
    with pytest.raises(ValueError, match="cannot hold 9 tokens"):
        flat_batch([scheduled([1, 2, 3], 6, [0, 1])], 4, 8)


@pytest.mark.parametrize("table", [[9], [-1], [0, 8]])
def test_a_block_outside_the_cache_is_refused(table):
    with pytest.raises(ValueError, match="outside the cache's 8 blocks"):
        flat_batch([scheduled([1, 2, 3, 4, 5], 0, table + [3])], 4, 8)


def test_a_bad_block_beyond_the_context_is_taken():
    """Blocks past a sequence's context are not read or written: the table may hold anything
    there (a table the scheduler has grown ahead)."""
    batch = flat_batch([scheduled([1, 2, 3], 0, [2, 99])], 4, 8)
    assert batch_tensors(batch, torch.device("cpu"))[2].block_tables.tolist() == [[2, 99]]


def test_two_tokens_writing_one_slot_are_refused():
    with pytest.raises(ValueError, match="same cache slot"):
        flat_batch([scheduled([1], 2, [5]), scheduled([7], 2, [5])], 4, 8)


