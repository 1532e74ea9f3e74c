"""The model runner: one engine step's tensors, from scheduled sequences to logits.

It owns the model (made fast for its device by a platform at load: `minipaged.runner.platforms`) and
the paged KV cache (one tensor per layer on the device, and a host pool of the same layout for
swapped-out blocks), sized from the memory left once the weights are placed and the largest
step has run. Each step it performs the swaps and copy-on-write copies the scheduler asked for,
builds and checks the flat batch once (`minipaged.runner.flat_batch`; docs/architecture.md,
"One step of the engine"), runs the model with a `PagedAttentionBackend` (which plans the
step's attention once for every layer) or replays a captured decode step (`StepGraphs`), and
returns the logits of the sequences that sample this step. It knows nothing about requests,
sampling or scheduling policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import cached_property, partial

import torch
from torch import Tensor

from minipaged.attention.contract import AttentionMetadata
from minipaged.models.checkpoint.model_config import ModelConfig
from minipaged.models.layers import check_input_ranges
from minipaged.runner.backends import (
    PagedAttentionBackend,
    ProfileAttention,
    allocate_kv_caches,
    get_platform,
)
from minipaged.runner.flat_batch import BlockTables, FlatBatch, batch_tensors, flat_batch
from minipaged.runner.graphs import StepGraphs
from minipaged.runner.platforms import Platform, logger
from minipaged.sched.output import ScheduledSequence, SchedulerOutput

GiB = 1 << 30


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype,
                       num_kv_heads: int | None = None) -> int:
    """Bytes of K and V, over all layers, for one block of `block_size` tokens (of
    `num_kv_heads` heads: a tensor-parallel rank's; by default the config's)."""
    element = torch.tensor([], dtype=dtype).element_size()
    heads = config.num_kv_heads if num_kv_heads is None else num_kv_heads
    return 2 * config.num_layers * block_size * heads * config.head_dim * element


def num_blocks_for_memory(config: ModelConfig, block_size: int, dtype: torch.dtype,
                          memory_bytes: float, num_kv_heads: int | None = None) -> int:
    """How many blocks fit in `memory_bytes` (the KV cache budget, or the swap space)."""
    return int(memory_bytes // kv_bytes_per_block(config, block_size, dtype, num_kv_heads))


def blocks_that_fit(
    model_config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    gpu_memory_utilization: float,
    kv_cache_memory: float,
) -> int:
    """KV blocks for the memory left: on CUDA what `gpu_memory_utilization` leaves of the
    device's free memory, elsewhere `kv_cache_memory` GiB."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - (1 - gpu_memory_utilization) * total
    else:
        budget = kv_cache_memory * GiB
    blocks = num_blocks_for_memory(model_config, block_size, dtype, budget)
    if blocks < 1:
        raise ValueError("no memory left for even one KV block; lower the model size")
    return blocks


class ModelRunner:
    """Runs a model over a paged KV cache, one flat batch per step."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: ModelConfig,
        *,
        block_size: int,
        num_gpu_blocks: int | None = None,
        num_cpu_blocks: int = 0,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        attention_backend: str | None = None,
        heads: tuple[int, int] | None = None,
        enforce_eager: bool = False,
        quantization: str | None = None,
        platform: Platform | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory: float = 4.0,
    ) -> None:
        """`model`, the plain model (on `device`), is made fast there by `platform` (by default
        the device's: `get_platform`), which swaps its modules and may quantise it. Without
        `num_gpu_blocks` the KV cache takes what the platform measures is left once the weights
        are placed and a step of `max_num_batched_tokens` tokens over `max_num_seqs` sequences
        has run (`gpu_memory_utilization` of a GPU; `kv_cache_memory` GiB of a CPU's memory).
        Decode steps of the platform's `graph_sizes` are replayed from captures of the model's
        forward (`StepGraphs`), unless `enforce_eager`. `heads`: (query heads, KV heads) of a
        tensor-parallel rank's shard; by default the config's."""
        self.device = torch.device(device)
        self.platform = platform or get_platform(self.device, attention_backend, enforce_eager,
                                                 max_num_seqs)
        self.model = self.platform.load(model, quantization)
        self.config = config
        self.block_size = block_size
        self.dtype = dtype
        self.ops = self.platform.attention
        # A step's metadata is the same for every layer: `prepare` validates it once per step,
        # so the layers skip the checks (and their host syncs).
        self.layer_ops = replace(
            self.ops,
            paged_attention=partial(self.ops.paged_attention, validate=False),
            reshape_and_cache=partial(self.ops.reshape_and_cache, validate=False),
        )
        self.num_heads, self.num_kv_heads = heads or (config.num_heads, config.num_kv_heads)
        layer = (block_size, self.num_kv_heads, config.head_dim)
        if num_gpu_blocks is None:
            budget = self.platform.kv_cache_bytes(
                partial(self.profile_run, max_num_batched_tokens, max_num_seqs),
                gpu_memory_utilization, kv_cache_memory)
            num_gpu_blocks = num_blocks_for_memory(config, block_size, dtype, budget,
                                                   self.num_kv_heads)
            if num_gpu_blocks < 1:
                raise ValueError("no memory left for even one KV block once the weights are "
                                 "placed: lower the model size or raise gpu_memory_utilization")
            logger.info("KV cache: %d blocks of %d tokens (%d tokens) in %.2f GiB",
                        num_gpu_blocks, block_size, num_gpu_blocks * block_size, budget / GiB)
        self.num_gpu_blocks, self.num_cpu_blocks = num_gpu_blocks, num_cpu_blocks
        self.kv_caches = allocate_kv_caches(
            config.num_layers, num_gpu_blocks, *layer, dtype=dtype, device=self.device
        )
        # Pinned: faster copies to and from a GPU. Not zeroed: a host block is written by the
        # swap-out that takes it before a swap-in reads it (1 GiB of pages not touched at start).
        self.host_caches = allocate_kv_caches(
            config.num_layers, num_cpu_blocks, *layer, dtype=dtype,
            pin_memory=self.device.type == "cuda", zeroed=False,
        )
        self.graphs = (
            StepGraphs(self.model, self.kv_caches, self.layer_ops, self.platform, block_size,
                       min(max_model_len or config.max_position_embeddings,
                           config.max_position_embeddings))
            if not enforce_eager and self.platform.graph_sizes else None
        )

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_seqs: int) -> None:
        """A forward of the largest step the scheduler may plan (`num_tokens` tokens, logits
        of `num_seqs` of them) without a KV cache: what the memory accounting measures."""
        num_tokens = max(1, min(num_tokens, self.config.max_position_embeddings))
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        hidden = self.model(input_ids, positions, ProfileAttention())
        self.model.compute_logits(hidden[: max(1, min(num_seqs, num_tokens))])

    def close(self) -> None:
        """Release what outlives the runner's memory: nothing here (a tensor-parallel runner
        stops its worker processes)."""

    # -- block movements ----------------------------------------------------------------------

    def apply_cache_ops(self, plan: SchedulerOutput) -> None:
        """The plan's block movements on their own, outside a step (profilers time swaps this
        way); `execute` performs them before its compute."""
        self._move_blocks(plan)

    def _move_blocks(self, cache_ops: SchedulerOutput) -> None:
        """Swap out, then swap in, then copy: a block freed by a swap-out may be reused at
        once."""
        for blocks, to_host in ((cache_ops.swap_out, True), (cache_ops.swap_in, False)):
            if blocks:
                mapping = torch.tensor(blocks, dtype=torch.int64)
                for device_cache, host_cache in zip(self.kv_caches, self.host_caches, strict=True):
                    src, dst = (device_cache, host_cache) if to_host else (host_cache, device_cache)
                    self.ops.swap_blocks(src, dst, mapping)
        if cache_ops.copy:
            mapping = torch.tensor(cache_ops.copy, dtype=torch.int64, device=self.device)
            self.ops.copy_blocks(self.kv_caches, mapping)

    # -- the flat batch -----------------------------------------------------------------------

    def prepare(
        self, entries: Sequence[ScheduledSequence]
    ) -> tuple[Tensor, Tensor, AttentionMetadata]:
        """input_ids, positions and the attention metadata of a step, built and checked once
        for every layer (`flat_batch`: `ValueError` naming the problem)."""
        return batch_tensors(self.flat_batch(entries), self.device)

    @cached_property
    def block_tables(self) -> BlockTables:
        """The block tables of the steps, kept from one to the next (`BlockTables`)."""
        return BlockTables(self.num_gpu_blocks)

    def flat_batch(self, entries: Sequence[ScheduledSequence]) -> FlatBatch:
        """The step's flat batch, checked against this runner's cache."""
        batch = flat_batch(entries, self.block_size, self.num_gpu_blocks, self.block_tables)
        check_input_ranges(self.config, (min(batch.input_ids), max(batch.input_ids)),
                           (min(batch.positions), max(batch.positions)))
        return batch

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> Tensor:
        """Run one step's plan; return float32 logits [scheduled entries with needs_logits,
        vocab], in the plan's order. A replayed decode step's are its captured buffer, written
        again by the next step: a caller that keeps logits past the next `execute` copies
        them."""
        self._move_blocks(plan)
        entries = plan.scheduled
        if not entries:
            return torch.empty(0, self.config.vocab_size, device=self.device)
        batch = self.flat_batch(entries)
        if self.graphs is not None and self.graphs.takes(batch):
            logits = self.graphs.run(batch)  # one row per entry
            if logits is not None:
                wanted = [i for i, entry in enumerate(entries) if entry.needs_logits]
                return logits if len(wanted) == len(entries) else logits[wanted]
        input_ids, positions, metadata = batch_tensors(batch, self.device)
        attention = PagedAttentionBackend(self.kv_caches, metadata, self.layer_ops)
        hidden = self.model(input_ids, positions, attention)
        ends = zip(entries, batch.query_start_loc[1:], strict=True)
        return self.model.compute_logits(hidden[[end - 1 for e, end in ends if e.needs_logits]])
