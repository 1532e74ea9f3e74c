"""The model runner: one engine step's tensors, from scheduled sequences to logits.

It owns the paged KV cache (one tensor per layer on the device, and a host pool of the same
layout for swapped-out blocks). Each step it performs the swaps and copy-on-write copies the
scheduler asked for, builds and checks the flat batch once (`minipaged.runner.flat_batch`;
docs/architecture.md, "One step of the engine"), runs the model with a `PagedAttentionBackend`
(which plans the step's attention once for every layer) or replays a CPU decode step
(`DecodeProgram`), and returns the logits of the sequences that sample this step. It knows
nothing about requests, sampling or scheduling policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import partial

import torch
from torch import Tensor

from minipaged.attention.contract import AttentionMetadata
from minipaged.models.checkpoint.model_config import ModelConfig
from minipaged.models.layers import choose_gemms
from minipaged.runner.backends import (
    PagedAttentionBackend,
    allocate_kv_caches,
    get_attention_ops,
)
from minipaged.runner.cpu_decode import DecodeProgram
from minipaged.runner.flat_batch import FlatBatch, batch_tensors, flat_batch
from minipaged.sched.output import ScheduledSequence, SchedulerOutput

GiB = 1 << 30


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V, over all layers, for one block of `block_size` tokens."""
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element


def num_blocks_for_memory(
    config: ModelConfig, block_size: int, dtype: torch.dtype, memory_bytes: float
) -> int:
    """How many blocks fit in `memory_bytes` (the KV cache budget, or the swap space)."""
    return int(memory_bytes // kv_bytes_per_block(config, block_size, dtype))


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
        num_gpu_blocks: int,
        num_cpu_blocks: int = 0,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        attention_backend: str | None = None,
        heads: tuple[int, int] | None = None,
        enforce_eager: bool = False,
    ) -> None:
        """`heads`: (query heads, KV heads) of this runner's model when it is one
        tensor-parallel rank's shard; by default the config's. Decode steps of a few sequences
        run as a `DecodeProgram` where one applies (the CPU backend, a one-rank LLaMA-family
        model), unless `enforce_eager`: then every step runs the model's modules."""
        self.model = model
        choose_gemms(model)  # times the two CPU GEMMs per weight shape: once, before any step
        self.config = config
        self.block_size = block_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.ops = get_attention_ops(attention_backend, self.device)
        # A step's metadata is the same for every layer: `prepare` validates it once per step,
        # so the layers skip the checks (and their host syncs).
        self.layer_ops = replace(
            self.ops,
            paged_attention=partial(self.ops.paged_attention, validate=False),
            reshape_and_cache=partial(self.ops.reshape_and_cache, validate=False),
        )
        self.num_heads, self.num_kv_heads = heads or (config.num_heads, config.num_kv_heads)
        layer = (block_size, self.num_kv_heads, config.head_dim)
        self.kv_caches = allocate_kv_caches(
            config.num_layers, num_gpu_blocks, *layer, dtype=dtype, device=self.device
        )
        # Pinned: faster copies to and from a GPU. Not zeroed: a host block is written by the
        # swap-out that takes it before a swap-in reads it (1 GiB of pages not touched at start).
        self.host_caches = allocate_kv_caches(
            config.num_layers, num_cpu_blocks, *layer, dtype=dtype,
            pin_memory=self.device.type == "cuda", zeroed=False,
        )
        self.decode_program = (
            DecodeProgram.build(model, self.kv_caches, block_size)
            if not enforce_eager and self.ops.name == "cpu" else None
        )

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
        if cache_ops.swap_out:
            mapping = torch.tensor(cache_ops.swap_out, dtype=torch.int64)
            for device_cache, host_cache in zip(self.kv_caches, self.host_caches, strict=True):
                self.ops.swap_blocks(device_cache, host_cache, mapping)
        if cache_ops.swap_in:
            mapping = torch.tensor(cache_ops.swap_in, dtype=torch.int64)
            for device_cache, host_cache in zip(self.kv_caches, self.host_caches, strict=True):
                self.ops.swap_blocks(host_cache, device_cache, mapping)
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

    def flat_batch(self, entries: Sequence[ScheduledSequence]) -> FlatBatch:
        """The step's flat batch as lists, checked against this runner's cache."""
        return flat_batch(entries, self.block_size, self.kv_caches[0].shape[1])

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> Tensor:
        """Run one step's plan; return float32 logits [scheduled entries with needs_logits,
        vocab], in the plan's order. A replayed decode step's are the program's own buffer,
        written again by the next step: a caller that keeps logits past the next `execute`
        copies them."""
        self._move_blocks(plan)
        entries = plan.scheduled
        if not entries:
            return torch.empty(0, self.config.vocab_size, device=self.device)
        batch = self.flat_batch(entries)
        program = self.decode_program
        if program is not None and program.takes(batch):
            logits = program.run(batch)  # one row per entry
            wanted = [i for i, entry in enumerate(entries) if entry.needs_logits]
            return logits if len(wanted) == len(entries) else logits[wanted]
        input_ids, positions, metadata = batch_tensors(batch, self.device)
        attention = PagedAttentionBackend(self.kv_caches, metadata, self.layer_ops)
        hidden = self.model(input_ids, positions, attention)
        last_rows = [
            end - 1
            for entry, end in zip(entries, metadata.query_start_loc[1:].tolist(), strict=True)
            if entry.needs_logits
        ]
        return self.model.compute_logits(hidden[last_rows])
