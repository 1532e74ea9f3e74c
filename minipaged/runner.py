"""The model runner: one engine step's tensors, from scheduled sequences to logits.

It owns the paged KV cache (one tensor per layer on the device, and a host pool of the same
layout for swapped-out blocks). Each step it performs the swaps and copy-on-write copies the
scheduler asked for, builds the flat batch of DESIGN.md ("The data that flows"), runs the model
with a `PagedAttentionBackend`, and returns the logits of the sequences that sample this step.
It knows nothing about requests, sampling or scheduling policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from itertools import accumulate

import torch
from torch import Tensor

from minipaged.attention import (
    AttentionMetadata,
    AttentionOps,
    PagedAttentionBackend,
    check_paged_attention_args,
    check_reshape_and_cache_args,
    get_attention_ops,
)
from minipaged.config import ModelConfig

GiB = 1 << 30


@dataclass(frozen=True)
class BatchEntry:
    """One sequence's share of a step: compute `token_ids` at positions `start_position...`.

    `block_table` must already cover `start_position + len(token_ids)` tokens. Only entries with
    `needs_logits` (a prefill that completes this step, or a decode) produce a row of logits.
    """

    token_ids: Sequence[int]
    start_position: int
    block_table: Sequence[int]
    needs_logits: bool = True


@dataclass(frozen=True)
class CacheOps:
    """The block movements of a step, performed before its compute (DESIGN.md, SchedulerOutput)."""

    swap_in: Sequence[tuple[int, int]] = ()  # (host block, device block)
    swap_out: Sequence[tuple[int, int]] = ()  # (device block, host block)
    copy: Sequence[tuple[int, int]] = ()  # (source block, destination block), copy-on-write


def attention_groups(query_lens: Sequence[int], seq_lens: Sequence[int]) -> list[list[int]]:
    """Which sequences of a step attend together, in one call of the PyTorch reference.

    The reference pads every sequence of a call to the call's longest query and longest context
    (one dense batched attention): a step mixing a 512-token prefill with 60 decodes would pad
    each decode to 512 queries, and one long context pads all the short ones. So, as vLLM v0 ran
    prefills and decodes as separate attention calls, each prefill attends on its own, and the
    decodes go in groups of similar context length (a group's longest at most twice its
    shortest), which bounds the padding at 2x for a few more calls.
    """
    decodes = sorted((i for i, n in enumerate(query_lens) if n == 1), key=lambda i: seq_lens[i])
    groups: list[list[int]] = []
    for i in decodes:
        if groups and seq_lens[i] <= 2 * seq_lens[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups + [[i] for i, n in enumerate(query_lens) if n > 1]


class GroupedPagedAttention(PagedAttentionBackend):
    """`PagedAttentionBackend` that writes the step's K/V at once, then attends group by group.

    `groups` holds, per group, the group's token indices in the flat batch and its own metadata
    (see `attention_groups`). With no groups it is the plain backend.
    """

    def __init__(
        self,
        kv_caches: Sequence[Tensor],
        metadata: AttentionMetadata,
        ops: AttentionOps,
        groups: Sequence[tuple[Tensor, AttentionMetadata]] = (),
    ) -> None:
        super().__init__(kv_caches, metadata, ops)
        self.groups = list(groups)

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        if len(self.groups) <= 1:
            return super().__call__(layer_idx, q, k, v, scale)
        cache = self.kv_caches[layer_idx]
        self.ops.reshape_and_cache(k, v, cache[0], cache[1], self.metadata.slot_mapping)
        out = q.new_empty(q.shape)
        for tokens, md in self.groups:
            out[tokens] = self.ops.paged_attention(
                q[tokens], cache[0], cache[1], md.block_tables, md.seq_lens,
                md.query_start_loc, scale, max_query_len=md.max_query_len,
                max_seq_len=md.max_seq_len,
            )
        return out


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V, over all layers, for one block of `block_size` tokens."""
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element


def num_blocks_for_memory(
    config: ModelConfig, block_size: int, dtype: torch.dtype, memory_bytes: float
) -> int:
    """How many blocks fit in `memory_bytes` (the KV cache budget, or the swap space)."""
    return int(memory_bytes // kv_bytes_per_block(config, block_size, dtype))


class ModelRunner:
    """Runs a model over a paged KV cache, one flat batch per step."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: ModelConfig,
        *,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int = 0,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        attention_backend: str | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.block_size = block_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.ops = get_attention_ops(attention_backend, self.device)
        # A step's metadata is the same for every layer: `check_metadata` validates it once per
        # step, so the layers skip the checks (and their host syncs), 30 times per step here.
        self.layer_ops = replace(
            self.ops,
            paged_attention=partial(self.ops.paged_attention, validate=False),
            reshape_and_cache=partial(self.ops.reshape_and_cache, validate=False),
        )
        layer_shape = (2, num_gpu_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.kv_caches = [
            torch.zeros(layer_shape, dtype=dtype, device=self.device)
            for _ in range(config.num_layers)
        ]
        host_shape = (2, num_cpu_blocks, block_size, config.num_kv_heads, config.head_dim)
        pin = self.device.type == "cuda"
        self.host_caches = [
            torch.zeros(host_shape, dtype=dtype, pin_memory=pin) for _ in range(config.num_layers)
        ]

    # -- block movements ----------------------------------------------------------------------

    def apply_cache_ops(self, cache_ops: CacheOps) -> None:
        """Swap out, then swap in, then copy: a block freed by a swap-out may be reused at once."""
        from minipaged.attention import swap_blocks

        if cache_ops.swap_out:
            mapping = torch.tensor(cache_ops.swap_out, dtype=torch.int64)
            for device_cache, host_cache in zip(self.kv_caches, self.host_caches, strict=True):
                swap_blocks(device_cache, host_cache, mapping)
        if cache_ops.swap_in:
            mapping = torch.tensor(cache_ops.swap_in, dtype=torch.int64)
            for device_cache, host_cache in zip(self.kv_caches, self.host_caches, strict=True):
                swap_blocks(host_cache, device_cache, mapping)
        if cache_ops.copy:
            mapping = torch.tensor(cache_ops.copy, dtype=torch.int64, device=self.device)
            self.ops.copy_blocks(self.kv_caches, mapping)

    # -- the flat batch -----------------------------------------------------------------------

    def prepare(self, entries: Sequence[BatchEntry]) -> tuple[Tensor, Tensor, AttentionMetadata]:
        """Build input_ids, positions and the attention metadata of a step."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        bs = self.block_size
        for entry in entries:
            n = len(entry.token_ids)
            end = entry.start_position + n
            if len(entry.block_table) * bs < end:
                raise ValueError(
                    f"block table of {len(entry.block_table)} blocks cannot hold {end} tokens"
                )
            input_ids.extend(entry.token_ids)
            for pos in range(entry.start_position, end):
                positions.append(pos)
                slots.append(entry.block_table[pos // bs] * bs + pos % bs)
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(end)
        max_blocks = max(len(e.block_table) for e in entries)
        tables = [list(e.block_table) + [-1] * (max_blocks - len(e.block_table)) for e in entries]

        def as_tensor(values: list, dtype: torch.dtype) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        metadata = AttentionMetadata(
            slot_mapping=as_tensor(slots, torch.int64),
            query_start_loc=as_tensor(query_start_loc, torch.int32),
            seq_lens=as_tensor(seq_lens, torch.int32),
            block_tables=as_tensor(tables, torch.int32),
            max_query_len=max(len(e.token_ids) for e in entries),
            max_seq_len=max(seq_lens),
        )
        return as_tensor(input_ids, torch.int64), as_tensor(positions, torch.int64), metadata

    def group_metadata(
        self, entries: Sequence[BatchEntry], metadata: AttentionMetadata
    ) -> list[tuple[Tensor, AttentionMetadata]]:
        """Token indices and metadata of each `attention_groups` group; none for a backend
        whose kernels do not pad (Triton: one varlen launch for the whole batch)."""
        if self.ops.name != "torch":
            return []
        query_lens = [len(e.token_ids) for e in entries]
        seq_lens = [e.start_position + n for e, n in zip(entries, query_lens, strict=True)]
        starts = list(accumulate(query_lens, initial=0))
        groups = []
        for members in attention_groups(query_lens, seq_lens):
            tokens = [t for i in members for t in range(starts[i], starts[i + 1])]
            token_index = torch.tensor(tokens, dtype=torch.int64, device=self.device)
            seq_index = torch.tensor(members, dtype=torch.int64, device=self.device)
            group_starts = list(accumulate((query_lens[i] for i in members), initial=0))
            groups.append((token_index, AttentionMetadata(
                slot_mapping=metadata.slot_mapping[token_index],
                query_start_loc=torch.tensor(group_starts, dtype=torch.int32, device=self.device),
                seq_lens=metadata.seq_lens[seq_index],
                block_tables=metadata.block_tables[seq_index],
                max_query_len=max(query_lens[i] for i in members),
                max_seq_len=max(seq_lens[i] for i in members),
            )))
        return groups

    def check_metadata(self, metadata: AttentionMetadata, num_tokens: int) -> None:
        """Validate a step's attention metadata against the cache (`ValueError` naming the
        problem), with the attention backends' own checks, once instead of once per layer."""
        cfg, cache = self.config, self.kv_caches[0]
        like = dict(dtype=self.dtype, device=self.device)
        q = torch.empty(num_tokens, cfg.num_heads, cfg.head_dim, **like)
        kv = torch.empty(num_tokens, cfg.num_kv_heads, cfg.head_dim, **like)
        check_paged_attention_args(
            q, cache[0], cache[1], metadata.block_tables, metadata.seq_lens,
            metadata.query_start_loc, max_query_len=metadata.max_query_len,
            max_seq_len=metadata.max_seq_len,
        )
        check_reshape_and_cache_args(kv, kv, cache[0], cache[1], metadata.slot_mapping)

    @torch.inference_mode()
    def execute(self, entries: Sequence[BatchEntry], cache_ops: CacheOps = CacheOps()) -> Tensor:
        """Run one step; return float32 logits [num entries with needs_logits, vocab]."""
        self.apply_cache_ops(cache_ops)
        if not entries:
            return torch.empty(0, self.config.vocab_size, device=self.device)
        input_ids, positions, metadata = self.prepare(entries)
        self.check_metadata(metadata, len(input_ids))
        groups = self.group_metadata(entries, metadata)
        attention = GroupedPagedAttention(self.kv_caches, metadata, self.layer_ops, groups)
        hidden = self.model(input_ids, positions, attention)
        last_rows = [
            end - 1
            for entry, end in zip(entries, metadata.query_start_loc[1:].tolist(), strict=True)
            if entry.needs_logits
        ]
        return self.model.compute_logits(hidden[last_rows])
