"""`BlockTable` on its own: random appends, forks and releases over one GPU pool.

After every operation the tables' own invariants and the pool's (reference counts equal table
references, the free queue holds exactly the unreferenced blocks, every block but a table's
last is full) are checked, and each operation's effect is compared with what the vLLM paper
(§4.2, §4.4) says it is. The test keeps each table's length itself, as a sequence does, and
checks the table's blocks cover exactly that.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.kv.block_table import BlockTable
from minipaged.kv.pool import CPUPool, GPUPool

NUM_BLOCKS = 64


def check(pool: GPUPool, cpu: CPUPool, tables: list[BlockTable]) -> None:
    refs, cpu_refs, fills = [0] * pool.num_blocks, [0] * cpu.num_blocks, {}
    for i, table in enumerate(tables):
        table.check_invariants(str(i), refs, cpu_refs, fills)
    pool.check_invariants(refs, fills)


operations = st.lists(
    st.tuples(st.sampled_from(["new", "append", "fork", "release"]), st.integers(0, 99),
              st.integers(1, 12)),
    min_size=1, max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(block_size=st.sampled_from([1, 2, 4, 8]), ops=operations)
def test_appends_forks_and_releases_keep_every_count_exact(block_size, ops):
    pool, cpu = GPUPool(NUM_BLOCKS, block_size), CPUPool(0)
    tables: list[BlockTable] = []
    lengths: dict[BlockTable, int] = {}  # each table's sequence's length, kept by its "owner"
    for op, pick, n in ops:
        if op == "new" or not tables:
            op = "new"
        table = tables[pick % len(tables)] if tables else None
        if op == "new" or op == "append":
            if op == "new":
                table = BlockTable(pool, cpu, (), [], 0)
            tokens_before = lengths.get(table, 0)
            needed = table.blocks_to_append(tokens_before + n)
            if needed > len(pool.free):
                continue  # the scheduler would not schedule it
            was_shared_partial = (tokens_before % block_size != 0
                                  and pool.blocks[table.blocks[-1]].ref_count > 1)
            old_last = table.blocks[-1] if table.blocks else None
            blocks_before = table.blocks
            free_before = len(pool.free)
            copies = table.append(tokens_before + n)
            lengths[table] = tokens_before + n
            assert len(pool.free) == free_before - needed  # blocks_to_append is what it takes
            assert table.num_slots == tokens_before + n
            assert len(table.blocks) == math.ceil(table.num_slots / block_size)
            # Copy-on-write exactly when the last block was shared and partly filled.
            assert bool(copies) == was_shared_partial
            # A table that took no block is the same object: the runner rewrites no row for it.
            assert (table.blocks is blocks_before) == (needed == 0)
            if copies:  # the old last block, to the private block now in its place
                last_index = math.ceil(tokens_before / block_size) - 1
                assert copies == [(old_last, table.blocks[last_index])]
                assert table.blocks[last_index] != old_last
            if op == "new":
                tables.append(table)
        elif op == "fork":
            child = table.fork()
            assert child.blocks == table.blocks and child is not table
            assert all(pool.blocks[b].ref_count >= 2 for b in table.blocks)
            assert child.num_slots == table.num_slots
            tables.append(child)
            lengths[child] = lengths[table]
        else:
            tables.remove(table)
            del lengths[table]
            table.release()
        check(pool, cpu, tables)
    for table in tables:
        table.release()
    check(pool, cpu, [])
    assert len(pool.free) == NUM_BLOCKS  # every block came back


def test_a_fork_then_an_append_copies_only_the_shared_partial_block():
    pool, cpu = GPUPool(8, 4), CPUPool(0)
    parent = BlockTable(pool, cpu, (), [], 0)
    parent.append(6)  # one full block, one holding 2 of 4 slots
    child = parent.fork()
    (copy,) = child.append(7)
    assert copy[0] == parent.blocks[-1] and copy[1] == child.blocks[-1] != parent.blocks[-1]
    assert child.blocks[0] == parent.blocks[0]  # the full block stays shared
    assert pool.blocks[parent.blocks[-1]].num_tokens == 2  # the parent's fill is untouched
    assert pool.blocks[child.blocks[-1]].num_tokens == 3
    assert parent.append(8) == []  # its last block is its own again: written in place
    assert (parent.num_slots, child.num_slots) == (8, 7)
    check(pool, cpu, [parent, child])
