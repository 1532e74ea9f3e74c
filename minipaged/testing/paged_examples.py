"""Worked examples of paged attention: contiguous K/V in, a scrambled paged cache out.

The tests (`tests/paged_utils.py` adds hypothesis strategies on top) and the notebooks build
their paged-attention inputs here. The one idea: an example describes sequences by their
contiguous keys and values, exactly what `dense_attention` (the oracle of
`minipaged.attention.contract`) consumes, and `make_paged_cache` scatters them into a paged KV
cache the way a real engine leaves it after a while: physical blocks in a shuffled order, more
blocks than needed, block tables padded with -1, and garbage (NaN by default) in every slot that
no sequence owns -- unused blocks and the tail of each sequence's last block. An implementation
that reads one slot it should not read produces NaN and fails the comparison with
`dense_reference`, within `tolerance(dtype)`.

Shapes are the attention contract's: caches `[num_blocks, block_size, H_kv, D]`,
`block_tables [B, max_blocks]` int32, `seq_lens [B]` int32, `query_start_loc [B + 1]` int32.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from minipaged.attention.contract import dense_attention

# Comparison tolerances against the float32 oracle, per dtype. float32: both sides compute in
# float32 and differ only by summation order. float16 / bfloat16: both sides compute in float32
# from the same low-precision inputs and round once at the end, so they differ by at most about
# one unit in the last place of the output dtype (float16: 2**-10 relative, bfloat16: 2**-7, and
# Triton's interpreter truncates bfloat16 stores instead of rounding to nearest), plus the
# float32 noise carried through that rounding.
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2},
}


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
        return int(slot_mapping(self.block_tables, self.block_size, seq, [position])[0])


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


def random_block_tables(
    seq_lens: Sequence[int],
    block_size: int,
    *,
    extra_blocks: int = 3,
    extra_table_columns: int = 1,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, int]:
    """Block tables `[B, max_blocks]` (int32) for sequences of `seq_lens` tokens, and the number
    of blocks of their pool.

    The pool has the blocks the sequences need plus `extra_blocks`, handed out in a random order.
    The tables get `extra_table_columns` more columns than the longest sequence needs, all -1 (as
    is every column past a sequence's last block).
    """
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    physical = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.full((len(seq_lens), max(blocks_per_seq) + extra_table_columns), -1,
                        dtype=torch.int32)
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = torch.tensor([physical.pop() for _ in range(n)], dtype=torch.int32)
    return tables, num_blocks


def slot_mapping(block_tables: Tensor, block_size: int, seq: int,
                 positions: Iterable[int]) -> Tensor:
    """The slots (`block_id * block_size + offset`, int64) of tokens `positions` of `seq`."""
    table = block_tables[seq].tolist()
    return torch.tensor([table[p // block_size] * block_size + p % block_size for p in positions],
                        dtype=torch.int64, device=block_tables.device)


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

    The blocks are laid out by `random_block_tables`; every slot not holding one of the given
    tokens is filled with `garbage`.
    """
    if len(keys) != len(values) or not keys:
        raise ValueError("need the same, non-zero number of key and value tensors")
    _, num_kv_heads, head_dim = keys[0].shape
    dtype, device = keys[0].dtype, keys[0].device
    seq_lens = [k.shape[0] for k in keys]
    block_tables, num_blocks = random_block_tables(
        seq_lens, block_size, extra_blocks=extra_blocks,
        extra_table_columns=extra_table_columns, generator=generator,
    )
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, garbage, dtype=dtype, device=device)
    v_cache = torch.full(shape, garbage, dtype=dtype, device=device)
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        slots = slot_mapping(block_tables, block_size, i, range(seq_lens[i])).to(device)
        k_cache.flatten(0, 1)[slots] = k  # flatten: a view of the slots, [blocks * size, H_kv, D]
        v_cache.flatten(0, 1)[slots] = v
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
    cache = make_paged_cache(keys, values, block_size, garbage=garbage, generator=gen)
    return AttentionCase(
        q=q,
        keys=keys,
        values=values,
        cache=cache,
        query_start_loc=torch.tensor([0, *query_lens], device=device).cumsum(0, dtype=torch.int32),
        scale=head_dim**-0.5,
    )


def dense_reference(case: AttentionCase) -> Tensor:
    """The oracle's answer for a case: `dense_attention` per sequence, concatenated ([T, H, D])."""
    starts = case.query_start_loc.tolist()
    bounds = zip(starts[:-1], starts[1:], case.keys, case.values, strict=True)
    outs = [dense_attention(case.q[lo:hi], k, v, case.scale) for lo, hi, k, v in bounds]
    return torch.cat(outs, dim=0)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """`rtol`/`atol` keyword arguments for `torch.testing.assert_close` at this dtype."""
    return TOLERANCES[dtype]
