"""How big the KV cache is, and the batch that memory allows (the vLLM paper, §2.3 and Fig. 1).

Every token a model has seen keeps its keys and values in every layer: `2 x layers x KV heads x
head dim x bytes per value`. The memory left once the weights are placed, divided by that, is
how many tokens can be in flight at once; divided by the tokens each request holds (or has
reserved for it), how many requests a step can batch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OPT_13B", "OPT_13B_A100_CACHE_BYTES", "OPT_13B_A100_CACHE_TOKENS", "KVShape",
           "kv_bytes_per_token", "requests_that_fit", "thousands"]


@dataclass(frozen=True)
class KVShape:
    """What sizes one token's KV cache: a model's layers, KV heads and head dimension."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int


# The vLLM paper's model: 40 layers of 40 heads of 128 dimensions (hidden 5,120), float16.
OPT_13B = KVShape("OPT-13B", num_layers=40, num_kv_heads=40, head_dim=128)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype_bytes: int) -> int:
    """Bytes of keys and values one token keeps: `2 x layers x KV heads x head dim x bytes`."""
    for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("dtype_bytes", dtype_bytes)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def requests_that_fit(token_slots: int, tokens_per_request: int) -> int:
    """Requests whose KV cache fits `token_slots` when each holds `tokens_per_request`."""
    if tokens_per_request < 1:
        raise ValueError(f"tokens_per_request must be >= 1, got {tokens_per_request}")
    return max(0, token_slots) // tokens_per_request


def thousands(count: int) -> str:
    """A count the way the paper writes it: 15,728 -> "15.7K"."""
    return f"{count / 1000:.1f}K"


# The vLLM paper's Table 1: OPT-13B (26 GB of float16 weights) on one A100-40GB leaves 12 GB
# for the KV cache. That memory over 800 KB a token is the one cache figure the notebooks use:
# 15,728 token slots, the paper's "15.7K".
OPT_13B_A100_CACHE_BYTES = 12 * 2**30
OPT_13B_A100_CACHE_TOKENS = OPT_13B_A100_CACHE_BYTES // kv_bytes_per_token(
    OPT_13B.num_layers, OPT_13B.num_kv_heads, OPT_13B.head_dim, 2)
