"""The model runner: one engine step's tensors, from scheduled sequences to logits.

It owns the model (made fast for its device by a platform at load: `minipaged.platforms`) and
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
from functools import cached_property, partial

import torch
from torch import Tensor, nn

from minipaged.attention.contract import AttentionMetadata
from minipaged.models.checkpoint.model_config import ModelConfig
from minipaged.models.layers import check_input_ranges
from minipaged.platforms import Platform, get_platform, logger
from minipaged.platforms.base import GiB
from minipaged.runner.backends import (
    PagedAttentionBackend,
    ProfileAttention,
    allocate_kv_caches,
    unchecked,
)
from minipaged.runner.config import RunnerConfig
from minipaged.runner.flat_batch import BlockTables, FlatBatch, batch_tensors, flat_batch
from minipaged.runner.graphs import StepGraphs
from minipaged.sched.output import ScheduledSequence, SchedulerOutput


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


class ModelRunner:
    """Runs a model over a paged KV cache, one flat batch per step."""

    def __init__(self, model: nn.Module, model_config: ModelConfig,
                 config: RunnerConfig | None = None, *, platform: Platform | None = None,
                 heads: tuple[int, int] | None = None, loaded: bool = False) -> None:
        """`model`, the plain model, is placed on the config's device in its dtype and made
        fast there by `platform` (by default the config's: `get_platform`), which swaps its
        modules and may quantise it. Then the KV cache is sized (`blocks_that_fit`, unless the
        config gives `num_gpu_blocks`) and allocated, with a host pool of `num_cpu_blocks` (by
        default `swap_space` GiB). Decode steps of the platform's `graph_sizes` are replayed
        from captures of the model's forward (`StepGraphs`), unless `enforce_eager`. `heads`:
        (query heads, KV heads) of a tensor-parallel rank's shard; by default the model's.
        `loaded`: `platform` has already made `model` its own (a tensor-parallel rank's does,
        before the ranks meet)."""
        self.config = config = config or RunnerConfig()
        self.model_config, self.block_size = model_config, config.block_size
        self.device, dtype = config.torch_device, config.torch_dtype
        self.platform = platform = platform or get_platform(config)
        self.model = model if loaded else platform.load(model.to(self.device, dtype).eval(),
                                                        config.quantization)
        self.model.checks_values = False  # `flat_batch` checks every batch on the host
        self.ops, self.layer_ops = platform.attention, unchecked(platform.attention)
        self.num_heads, self.num_kv_heads = heads or (model_config.num_heads,
                                                      model_config.num_kv_heads)
        self.num_gpu_blocks = config.num_gpu_blocks or self.blocks_that_fit()
        self.num_cpu_blocks = config.num_cpu_blocks
        if self.num_cpu_blocks is None:  # the whole model's heads: every rank holds as many
            self.num_cpu_blocks = num_blocks_for_memory(model_config, self.block_size, dtype,
                                                        config.swap_space * GiB)
        layer = (self.block_size, self.num_kv_heads, model_config.head_dim)
        self.kv_caches = allocate_kv_caches(model_config.num_layers, self.num_gpu_blocks, *layer,
                                            dtype=dtype, device=self.device)
        # Not zeroed: a host block is written by the swap-out that takes it before a swap-in
        # reads it (1 GiB of pages not touched at start).
        self.host_caches = allocate_kv_caches(model_config.num_layers, self.num_cpu_blocks,
                                              *layer, dtype=dtype, zeroed=False,
                                              pin_memory=platform.pin_memory)
        context = model_config.max_position_embeddings
        self.graphs = (
            StepGraphs(self.model, self.kv_caches, self.layer_ops, platform, self.block_size,
                       min(config.max_model_len or context, context))
            if not config.enforce_eager and platform.graph_sizes else None
        )

    def blocks_that_fit(self) -> int:
        """KV blocks of this runner's heads in what the platform grants once the weights are
        placed (`Platform.kv_cache_bytes`: a share of a GPU's memory, `kv_cache_memory` GiB of
        a CPU's), given the profiles of a step of `max_num_batched_tokens` tokens over
        `max_num_seqs` sequences (with its logits) and, where decode steps are captured, of the
        largest one (the memory its capture keeps)."""
        config = self.config
        profiles = [partial(self.profile_run, config.max_num_batched_tokens, config.max_num_seqs)]
        if self.platform.graph_sizes and not config.enforce_eager:
            largest = max(self.platform.graph_sizes)
            profiles.append(partial(self.profile_run, largest, largest))
        budget = self.platform.kv_cache_bytes(profiles, config)
        blocks = num_blocks_for_memory(self.model_config, self.block_size, config.torch_dtype,
                                       budget, self.num_kv_heads)
        if blocks < 1:
            raise ValueError("no memory left for even one KV block once the weights are "
                             "placed: lower the model size or raise gpu_memory_utilization")
        logger.info("KV cache: %d blocks of %d tokens (%d tokens) in %.2f GiB",
                    blocks, self.block_size, blocks * self.block_size, budget / GiB)
        return blocks

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_seqs: int) -> None:
        """A forward of the largest step the scheduler may plan (`num_tokens` tokens, logits
        of `num_seqs` of them) without a KV cache: what the memory accounting measures."""
        num_tokens = max(1, min(num_tokens, self.model_config.max_position_embeddings))
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
        check_input_ranges(self.model_config, (min(batch.input_ids), max(batch.input_ids)),
                           (min(batch.positions), max(batch.positions)))
        return batch

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> Tensor:
        """Run one step's plan; return float32 logits [scheduled entries with needs_logits,
        vocab], in the plan's order: of a replayed decode step, computed from the captured
        hidden states of those rows."""
        self._move_blocks(plan)
        entries = plan.scheduled
        if not entries:
            return torch.empty(0, self.model_config.vocab_size, device=self.device)
        batch = self.flat_batch(entries)
        if self.graphs is not None and self.graphs.takes(batch):
            hidden = self.graphs.run(batch)  # one row per entry
            if hidden is not None:
                wanted = [i for i, entry in enumerate(entries) if entry.needs_logits]
                return self.model.compute_logits(hidden if len(wanted) == len(entries)
                                                  else hidden[wanted])
        input_ids, positions, metadata = batch_tensors(batch, self.device)
        attention = PagedAttentionBackend(self.kv_caches, metadata, self.layer_ops)
        hidden = self.model(input_ids, positions, attention)
        ends = zip(entries, batch.query_start_loc[1:], strict=True)
        return self.model.compute_logits(hidden[[end - 1 for e, end in ends if e.needs_logits]])
