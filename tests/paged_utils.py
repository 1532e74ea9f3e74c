"""Reusable builders for paged-attention tests: contiguous K/V in, a scrambled paged cache out.

Shared by `tests/test_attention.py` (the PyTorch reference) and the Triton kernel tests. Import it
from any test module in `tests/` as

    from paged_utils import make_attention_case, dense_reference, tolerance, lengths

(pytest puts `tests/` on `sys.path` because the folder has no `__init__.py`).

The one idea: a test describes sequences by their contiguous keys and values, exactly what
`minipaged.attention.dense_attention` (the oracle) consumes, and `make_paged_cache` scatters them
into a paged KV cache the way a real engine would leave it after a while: physical blocks in a
shuffled order, more blocks than needed, block tables padded with -1, and garbage (NaN by default)
in every slot that no sequence owns -- unused blocks and the tail of each sequence's last block.
An implementation that reads one slot it should not read produces NaN and fails the comparison.

Shapes follow DESIGN.md ("The data that flows"): caches `[num_blocks, block_size, H_kv, D]`,
`block_tables [B, max_blocks]` int32, `seq_lens [B]` int32, `query_start_loc [B + 1]` int32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from torch import Tensor

from minipaged.attention import dense_attention

# Comparison tolerances against the float32 oracle, per dtype. float32: both sides compute in
# float32 and differ only by summation order. float16 / bfloat16: both sides compute in float32
# from the same low-precision inputs and round once at the end, so they differ by at most about
# one unit in the last place of the output dtype (float16: 2**-10 relative, bfloat16: 2**-7, and
# Triton's interpreter truncates bfloat16 stores instead of rounding -- TOOLCHAIN.md), plus the
# float32 noise carried through that rounding.
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2},
}


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """`rtol`/`atol` keyword arguments for `torch.testing.assert_close` at this dtype."""
    return TOLERANCES[dtype]


@dataclass
class PagedCache:
    """Contiguous K/V scattered into a paged cache (see the module docstring)."""

    k_cache: Tensor  # [num_blocks, block_size, H_kv, D]
    v_cache: Tensor  # [num_blocks, block_size, H_kv, D]
    block_tables: Tensor  # [B, max_blocks] int32, padded with -1
    seq_lens: Tensor  # [B] int32

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]

    def slot(self, seq: int, position: int) -> int:
        """The flat slot (`block_id * block_size + offset`) holding token `position` of `seq`."""
        block_id = int(self.block_tables[seq, position // self.block_size])
        return block_id * self.block_size + position % self.block_size


@dataclass
class AttentionCase:
    """One varlen batch for `paged_attention`, plus the contiguous K/V the oracle needs."""

    q: Tensor  # [T, H, D]
    keys: list[Tensor]  # per sequence [seq_len_i, H_kv, D]
    values: list[Tensor]  # per sequence [seq_len_i, H_kv, D]
    cache: PagedCache
    query_start_loc: Tensor  # [B + 1] int32
    scale: float

    @property
    def max_query_len(self) -> int:
        return int((self.query_start_loc[1:] - self.query_start_loc[:-1]).max())

    @property
    def max_seq_len(self) -> int:
        return int(self.cache.seq_lens.max())

    def args(self) -> tuple:
        """Positional arguments of `paged_attention(q, k_cache, v_cache, block_tables, seq_lens,
        query_start_loc, scale)`."""
        c = self.cache
        return (self.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens,
                self.query_start_loc, self.scale)


def make_paged_cache(
    keys: Sequence[Tensor],
    values: Sequence[Tensor],
    block_size: int,
    *,
    extra_blocks: int = 3,
    extra_table_columns: int = 1,
    garbage: float = float("nan"),
    generator: torch.Generator | None = None,
) -> PagedCache:
    """Scatter per-sequence contiguous K/V ([L_i, H_kv, D] each) into a shuffled paged cache.

    Physical blocks are a random permutation of `needed + extra_blocks` blocks; every slot not
    holding one of the given tokens is filled with `garbage`. Block tables get
    `extra_table_columns` more columns than the longest sequence needs, all -1 (as is every
    column past a sequence's last block).
    """
    if len(keys) != len(values) or not keys:
        raise ValueError("need the same, non-zero number of key and value tensors")
    _, num_kv_heads, head_dim = keys[0].shape
    dtype, device = keys[0].dtype, keys[0].device
    seq_lens = [k.shape[0] for k in keys]
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    physical = torch.randperm(num_blocks, generator=generator).tolist()

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, garbage, dtype=dtype, device=device)
    v_cache = torch.full(shape, garbage, dtype=dtype, device=device)
    max_blocks = max(blocks_per_seq) + extra_table_columns
    block_tables = torch.full((len(keys), max_blocks), -1, dtype=torch.int32)
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        for j in range(blocks_per_seq[i]):
            block_id = physical.pop()
            block_tables[i, j] = block_id
            lo, hi = j * block_size, min((j + 1) * block_size, seq_lens[i])
            k_cache[block_id, : hi - lo] = k[lo:hi]
            v_cache[block_id, : hi - lo] = v[lo:hi]
    return PagedCache(
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )


def make_attention_case(
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    garbage: float = float("nan"),
) -> AttentionCase:
    """Random q/K/V for sequences of `seq_lens` tokens whose last `query_lens` are queries."""
    if len(seq_lens) != len(query_lens):
        raise ValueError("seq_lens and query_lens must have the same length")
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    keys = [randn(n, num_kv_heads, head_dim) for n in seq_lens]
    values = [randn(n, num_kv_heads, head_dim) for n in seq_lens]
    q = randn(sum(query_lens), num_heads, head_dim)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    cache = make_paged_cache(keys, values, block_size, garbage=garbage, generator=gen)
    return AttentionCase(
        q=q,
        keys=keys,
        values=values,
        cache=cache,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        scale=head_dim**-0.5,
    )


def dense_reference(case: AttentionCase) -> Tensor:
    """The oracle's answer for a case: `dense_attention` per sequence, concatenated ([T, H, D])."""
    starts = case.query_start_loc.tolist()
    outs = [
        dense_attention(case.q[starts[i] : starts[i + 1]], k, v, case.scale)
        for i, (k, v) in enumerate(zip(case.keys, case.values, strict=True))
    ]
    return torch.cat(outs, dim=0)


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
