"""The attention contract's Triton entry point: decode kernel or prefill kernel.

`paged_attention` has the signature of the PyTorch reference (`minipaged.attention.reference`), so
either backend can serve the model. A batch of pure decodes (one query per sequence) goes to the
split-K decode kernel, which keeps a GPU busy when queries are few and contexts long; anything
else (prefills, cached-prefix prefills, mixed batches) goes to the varlen prefill kernel.
"""

from __future__ import annotations

from torch import Tensor

from .decode import paged_decode_attention
from .prefill import paged_prefill_attention


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    validate: bool = True,
) -> Tensor:
    """Causal attention of a flat batch of queries over paged K/V -> [T, H, D].

    q [T, H, D]; k_cache, v_cache [num_blocks, block_size, H_kv, D]; block_tables [B, max_blocks]
    (padded with -1); seq_lens [B]; query_start_loc [B + 1]. The queries of sequence i are the
    last query_start_loc[i+1] - query_start_loc[i] positions of its seq_lens[i] context
    (docs/architecture.md, "The attention contract"). Raises `ValueError` on inconsistent arguments;
    `validate=False` skips those checks (and their host syncs). Passing `max_query_len` and
    `max_seq_len` saves another sync.
    """
    # The kernel launchers validate everything; this only picks one of them.
    if max_query_len is None:
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        max_query_len = int(query_lens.max()) if query_lens.numel() else 0
    # T == B with no sequence above one query means every sequence has exactly one.
    if max_query_len == 1 and q.shape[0] == block_tables.shape[0]:
        return paged_decode_attention(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
            max_query_len=1, max_seq_len=max_seq_len, validate=validate,
        )
    return paged_prefill_attention(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
        max_query_len=max_query_len, max_seq_len=max_seq_len, validate=validate,
    )
