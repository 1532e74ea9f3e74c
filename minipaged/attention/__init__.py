"""Layer 5 -- paged attention in PyTorch: the contract every backend keeps, the reference
that reads K/V through block tables, KV writes, block copies and swaps; the CPU's backend.
"""

from __future__ import annotations

from minipaged.attention.contract import AttentionMetadata, AttentionOps, dense_attention
from minipaged.attention.cpu import cpu_paged_attention
from minipaged.attention.reference import (
    copy_blocks,
    paged_attention,
    reshape_and_cache,
    swap_blocks,
)

__all__ = [
    "AttentionMetadata",
    "AttentionOps",
    "copy_blocks",
    "cpu_paged_attention",
    "dense_attention",
    "paged_attention",
    "reshape_and_cache",
    "swap_blocks",
]
