"""Hypothesis strategies for paged-attention tests: the lengths of varlen batches.

The builders these lengths feed (a shuffled, NaN-poisoned paged cache from contiguous K/V, the
dense oracle's answer, the per-dtype tolerances) are public, in `minipaged.testing.paged_examples`,
so the notebooks use them too. Import the strategies from any test module in `tests/` as

    from paged_utils import lengths, seq_and_query_lens

(pytest puts `tests/` on `sys.path` because the folder has no `__init__.py`).
"""

from __future__ import annotations

from hypothesis import strategies as st


def lengths(block_size: int, max_len: int | None = None) -> st.SearchStrategy[int]:
    """Context lengths that stress block boundaries: 1, bs - 1, bs, bs + 1, or any up to max_len."""
    max_len = max_len if max_len is not None else 4 * block_size + 3
    edges = [n for n in (1, block_size - 1, block_size, block_size + 1) if 1 <= n <= max_len]
    return st.one_of(st.sampled_from(edges), st.integers(1, max_len))


@st.composite
def seq_and_query_lens(
    draw: st.DrawFn, block_size: int, max_seqs: int = 4, max_len: int | None = None
) -> tuple[list[int], list[int]]:
    """(seq_lens, query_lens) of a varlen batch: query lengths from 1 (decode) to the full context
    (a plain prefill), with the ends drawn often."""
    num_seqs = draw(st.integers(1, max_seqs))
    seq_lens = [draw(lengths(block_size, max_len)) for _ in range(num_seqs)]
    query_lens = [
        draw(st.one_of(st.just(1), st.just(n), st.integers(1, n))) for n in seq_lens
    ]
    return seq_lens, query_lens
