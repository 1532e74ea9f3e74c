"""`BlockTable` on its own: random appends, forks and releases over one device pool.

After every operation the tables' own invariants and the pool's (reference counts equal table
references, the free queue holds exactly the unreferenced blocks, fills agree) are checked,
and each operation's effect is compared with what the vLLM paper (§4.2, §4.4) says it is.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.kv.block_table import BlockTable
from minipaged.kv.pool import BlockPool, HostPool

NUM_BLOCKS = 64


def check(pool: BlockPool, host: HostPool, tables: list[BlockTable]) -> None:
    refs, host_refs, fills = [0] * pool.num_blocks, [0] * host.num_blocks, {}
    for i, table in enumerate(tables):
        table.check_invariants(str(i), host, refs, host_refs, fills)
    pool.check_invariants(refs, fills)


operations = st.lists(
    st.tuples(st.sampled_from(["new", "append", "fork", "release"]), st.integers(0, 99),
              st.integers(1, 12)),
    min_size=1, max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(block_size=st.sampled_from([1, 2, 4, 8]), ops=operations)
def test_appends_forks_and_releases_keep_every_count_exact(block_size, ops):
    pool, host = BlockPool(NUM_BLOCKS, block_size), HostPool(0)
    tables: list[BlockTable] = []
    for op, pick, n in ops:
        if op == "new" or not tables:
            op = "new"
        table = tables[pick % len(tables)] if tables else None
        if op == "new" or op == "append":
            if op == "new":
                table = BlockTable(pool, [], 0, [], 0)
            needed = table.blocks_to_append(n)
            if needed > len(pool.free):
                continue  # the scheduler would not schedule it
            was_shared_partial = table.num_tokens > 0 and table.last_block_is_shared_and_partial
            old_last = table.blocks[-1] if table.blocks else None
            free_before, tokens_before = len(pool.free), table.num_tokens
            copies = table.append(n)
            assert len(pool.free) == free_before - needed  # blocks_to_append is what it takes
            assert table.num_tokens == tokens_before + n
            assert len(table.blocks) == math.ceil(table.num_tokens / block_size)
            # Copy-on-write exactly when the last block was shared and partly filled.
            assert bool(copies) == was_shared_partial
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
            tables.append(child)
        else:
            tables.remove(table)
            table.release(host)
        check(pool, host, tables)
    for table in tables:
        table.release(host)
    check(pool, host, [])
    assert len(pool.free) == NUM_BLOCKS  # every block came back


def test_a_fork_then_an_append_copies_only_the_shared_partial_block():
    pool, host = BlockPool(8, 4), HostPool(0)
    parent = BlockTable(pool, [], 0, [], 0)
    parent.append(6)  # one full block, one holding 2 of 4 slots
    child = parent.fork()
    (copy,) = child.append(1)
    assert copy[0] == parent.blocks[-1] and copy[1] == child.blocks[-1] != parent.blocks[-1]
    assert child.blocks[0] == parent.blocks[0]  # the full block stays shared
    assert pool.blocks[parent.blocks[-1]].num_tokens == 2  # the parent's fill is untouched
    assert pool.blocks[child.blocks[-1]].num_tokens == 3
    assert parent.append(2) == []  # its last block is its own again: written in place
    check(pool, host, [parent, child])
