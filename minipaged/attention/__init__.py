"""Layer 5 -- paged attention in PyTorch: the contract every backend keeps, the reference
that reads K/V through block tables, KV writes, block copies and swaps (`REFERENCE_OPS`).
The platforms' backends keep the same contract (`minipaged.platforms`).
"""

from __future__ import annotations

from minipaged.attention.contract import AttentionMetadata, AttentionOps, dense_attention
from minipaged.attention.reference import (
    REFERENCE_OPS,
    copy_blocks,
    paged_attention,
    reshape_and_cache,
    swap_blocks,
)

__all__ = [
    "REFERENCE_OPS",
    "AttentionMetadata",
    "AttentionOps",
    "copy_blocks",
    "dense_attention",
    "paged_attention",
    "reshape_and_cache",
    "swap_blocks",
]
