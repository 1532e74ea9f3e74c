"""The KV caches, and what the model attends through.

* `allocate_kv_caches`: one `[2, num_blocks, block_size, H_kv, D]` cache per layer;
* `PagedAttentionBackend`: the model's `AttentionBackend` (`minipaged.models.layers`) over those
  caches, with a platform's attention operations (`minipaged.platforms`);
* `ProfileAttention`: no cache at all, for the memory profile of a step;
* `unchecked`: a backend's operations without their per-call checks, for the layers of a step
  whose metadata was checked once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import partial

import torch
from torch import Tensor

from minipaged.attention.contract import AttentionMetadata, AttentionOps, check_layer_cache
from minipaged.attention.reference import REFERENCE_OPS


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    pin_memory: bool = False,
    zeroed: bool = True,
) -> list[Tensor]:
    """One `[2, num_blocks, block_size, H_kv, D]` cache per layer: a device cache, or a host
    pool (`pin_memory=True` for fast copies to and from a CUDA device). `zeroed=False` leaves
    the memory as allocated, for a pool whose blocks are always written before they are read:
    on the CPU its pages are then not touched, nor resident, until used."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    allocate = torch.zeros if zeroed else torch.empty
    return [allocate(shape, dtype=dtype, device=device, pin_memory=pin_memory)
            for _ in range(num_layers)]


class PagedAttentionBackend:
    """The model's `AttentionBackend` (`minipaged.models.registry`) over a paged KV cache.

    Holds every layer's cache (`[2, num_blocks, block_size, H_kv, D]`), the step's
    `AttentionMetadata` (replace `metadata` before each step) and the operations of one backend.
    A layer's call stores the new K/V in that layer's cache, then attends over the whole context.
    Setting `metadata` also makes the backend's plan of the step (`AttentionOps.plan`), once for
    every layer.
    """

    def __init__(
        self,
        kv_caches: Sequence[Tensor],
        metadata: AttentionMetadata | None = None,
        ops: AttentionOps | None = None,
    ):
        if len(kv_caches) == 0:
            raise ValueError("kv_caches is empty: need one cache per layer")
        for i, cache in enumerate(kv_caches):
            check_layer_cache(f"kv_caches[{i}]", cache)
        self.kv_caches = list(kv_caches)
        self.ops = ops if ops is not None else REFERENCE_OPS
        self.metadata = metadata

    @property
    def metadata(self) -> AttentionMetadata | None:
        """The step's attention metadata, the same for every layer (None: no step yet)."""
        return self._metadata

    @metadata.setter
    def metadata(self, metadata: AttentionMetadata | None) -> None:
        self._metadata = metadata
        self._plan = None
        if metadata is not None and self.ops.plan is not None:
            self._plan = self.ops.plan(metadata.block_tables, metadata.seq_lens,
                                       metadata.query_start_loc, self.kv_caches[0][0])

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """Store `k`, `v [T, H_kv, D]` in layer `layer_idx`'s cache; return attention [T, H, D]."""
        md = self.metadata
        if md is None:
            raise ValueError("PagedAttentionBackend has no AttentionMetadata for this step")
        if not 0 <= layer_idx < len(self.kv_caches):
            raise ValueError(f"layer_idx {layer_idx} outside 0..{len(self.kv_caches) - 1}")
        cache = self.kv_caches[layer_idx]
        self.ops.reshape_and_cache(k, v, cache[0], cache[1], md.slot_mapping)
        planned = {} if self._plan is None else {"plan": self._plan}
        return self.ops.paged_attention(
            q, cache[0], cache[1], md.block_tables, md.seq_lens, md.query_start_loc, scale,
            max_query_len=md.max_query_len, max_seq_len=md.max_seq_len, **planned,
        )


class ProfileAttention:
    """An `AttentionBackend` with no KV cache, for a forward that only measures memory: each
    layer's output has the queries' shape (attention's workspace is small beside a step's
    projections)."""

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        return torch.zeros_like(q)


def unchecked(ops: AttentionOps) -> AttentionOps:
    """`ops` with the paged attention and the KV write skipping their checks: a step's metadata
    is the same for every layer, and the runner validates it once per step (the checks cost
    host syncs on a device)."""
    return replace(ops, paged_attention=partial(ops.paged_attention, validate=False),
                   reshape_and_cache=partial(ops.reshape_and_cache, validate=False))
