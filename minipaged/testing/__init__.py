"""Layer 16 -- the oracles the tests and notebooks compare against: dense attention and dense
generation, and random paged layouts. Nothing in the engine imports them.
"""

from __future__ import annotations

from minipaged.testing.dense import generate_dense
from minipaged.testing.paged_examples import (
    make_attention_case,
    make_paged_cache,
    random_block_tables,
)

__all__ = [
    "generate_dense",
    "make_attention_case",
    "make_paged_cache",
    "random_block_tables",
]
