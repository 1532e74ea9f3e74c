"""Layer 4 -- the KV cache manager (the vLLM paper, section 4): a pool of fixed-size blocks,
per-sequence block tables, reference counts, copy-on-write, prefix caching and swapping from
the GPU pool to the CPU pool; and the reservation baselines the paper compares against.
"""

from __future__ import annotations

from minipaged.kv.interface import KVCacheError, KVManager, MemoryUsage, NoFreeBlocksError
from minipaged.kv.manager import KVCacheManager
from minipaged.kv.reservation import ReservationExceededError, ReservationKVCacheManager

__all__ = [
    "KVCacheError",
    "KVCacheManager",
    "KVManager",
    "MemoryUsage",
    "NoFreeBlocksError",
    "ReservationExceededError",
    "ReservationKVCacheManager",
]
