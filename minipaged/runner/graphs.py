"""Decode steps replayed: static buffers, a ladder of batch sizes, which steps replay.

vLLM, nano-vllm and mini-sglang capture a CUDA graph of the model's own forward for each of a
ladder of decode batch sizes, over static input buffers, and replay it: a decode step of 256
sequences is thousands of small kernels, whose launches would otherwise keep the GPU waiting
on Python. `StepGraphs` is that bookkeeping, the same for every platform: it owns the static
buffers (token ids, positions, slot mapping, sequence lengths, block tables, one per row of the
largest size), asks the platform to capture the forward over them for every size of the ladder
(`Platform.graph_sizes`) at start-up, largest first, so that the smaller captures reuse the
memory of the largest (one pool on CUDA, one arena on a CPU), pads a step's rows up to the next
size and replays it (`Platform.capture`: a CUDA graph, or the CPU's recorded kernel calls). The
model is never written again: what is captured is `model(...)`, whose hidden states are all a
size's capture keeps; the logits are computed once per step from the rows that sample, so no
size holds a `[size, vocab]` buffer of its own. A capture key met after start-up (the CPU's
thread count changed) is captured by the step that meets it.

A padded row decodes token 0 at position 0 of a one-token context in block 0 and writes no
K/V (slot -1): it costs its share of the step and changes nothing. The inputs are written from
the step's lists into host buffers, then copied to the device: the per-row fields whole, and
of the block tables only the rows from the first that changed to the last (on a CPU the host
buffers are the static buffers themselves, and nothing is copied).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from minipaged.attention.contract import AttentionMetadata, AttentionOps
from minipaged.platforms.base import CaptureUnsupported, Platform, Replay, logger
from minipaged.runner.backends import PagedAttentionBackend
from minipaged.runner.flat_batch import FlatBatch

# The static buffers, in the order they lie in one block of memory (`StaticBatch`).
FIELDS = (("input_ids", torch.int64), ("positions", torch.int64),
          ("slot_mapping", torch.int64), ("seq_lens", torch.int32),
          ("query_start_loc", torch.int32), ("block_tables", torch.int32))
# What a padded row holds (module docstring): token 0 at position 0 of a one-token context,
# writing no K/V (slot -1); its block table's first entry is block 0 (`StaticBatch.write`).
PADDING = {"input_ids": 0, "positions": 0, "slot_mapping": -1, "seq_lens": 1}


@dataclass
class Captured:
    """One size's replay and the buffer its forward's hidden states land in."""

    replay: Replay
    hidden: Tensor


class StaticBatch:
    """The static inputs of every captured step: `[rows]` token ids, positions, slot mapping and
    sequence lengths, `[rows + 1]` query starts (one query per row) and `[rows, max_blocks]`
    block tables, as views of one device buffer, and their host twins, as views of one host
    buffer, written through numpy without a PyTorch operator. `copies` (a GPU's platform):
    the host buffer (pinned with `pin_memory`) is copied to a buffer on `device`; else the
    device reads the host buffer itself (a CPU)."""

    def __init__(self, rows: int, max_blocks: int, device: torch.device, copies: bool = False,
                 pin_memory: bool = False) -> None:
        shapes = {"input_ids": (rows,), "positions": (rows,), "slot_mapping": (rows,),
                  "seq_lens": (rows,), "query_start_loc": (rows + 1,),
                  "block_tables": (rows, max_blocks)}
        nbytes = sum(math.prod(shapes[name]) * dtype.itemsize for name, dtype in FIELDS)
        self.host_memory = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin_memory)
        self.device_memory = (torch.zeros(nbytes, dtype=torch.uint8, device=device) if copies
                              else self.host_memory)
        self.host: dict[str, Tensor] = {}
        self.views: dict[str, Tensor] = {}  # on the device: what the captured steps read
        offset = 0
        for name, dtype in FIELDS:
            size = math.prod(shapes[name]) * dtype.itemsize
            for views, memory in ((self.host, self.host_memory),
                                  (self.views, self.device_memory)):
                views[name] = memory[offset:offset + size].view(dtype).view(shapes[name])
            offset += size
        self.arrays = {name: self.host[name].numpy() for name, _ in FIELDS}
        self.rows, self.max_blocks = rows, max_blocks
        self.tables_at = nbytes - rows * max_blocks * 4  # the block tables come last (`FIELDS`)
        self.arrays["query_start_loc"][:] = np.arange(rows + 1)
        for name, value in PADDING.items():
            self.arrays[name][:] = value
        self._sync(np.arange(rows))

    def write(self, batch: FlatBatch, rows: int) -> None:
        """`batch`'s decodes into the first rows, the rest of `rows` padded (`PADDING`), then
        the copy to the device: the per-row fields, and the tables of the rows that changed."""
        n, arrays = len(batch.input_ids), self.arrays
        for name, value in PADDING.items():
            arrays[name][:n] = getattr(batch, name)
            arrays[name][n:rows] = value
        tables = arrays["block_tables"]
        held = tables[:rows].copy()  # what the device holds
        used = min(batch.block_tables.shape[1], self.max_blocks)  # past the context: not read
        new = batch.block_tables[:, :used]
        np.copyto(tables[:n, :used], new, where=new >= 0)  # a row's -1 padding is never read
        tables[n:rows, 0] = 0
        self._sync(np.flatnonzero((tables[:rows] != held).any(axis=1)))

    def _sync(self, rows: np.ndarray) -> None:
        """Copy the per-row fields to the device, and the tables of the rows from the first of
        `rows` (ascending row indices) to the last: one copy each."""
        if self.device_memory is self.host_memory:
            return
        spans = [(0, self.tables_at)]
        if len(rows):
            row_bytes = self.max_blocks * 4
            spans.append((self.tables_at + int(rows[0]) * row_bytes,
                          self.tables_at + (int(rows[-1]) + 1) * row_bytes))
        for begin, end in spans:
            self.device_memory[begin:end].copy_(self.host_memory[begin:end], non_blocking=True)


class StepGraphs:
    """The captured decode steps of one model over one KV cache (module docstring), captured
    when it is made."""

    def __init__(self, model: nn.Module, kv_caches: Sequence[Tensor], ops: AttentionOps,
                 platform: Platform, block_size: int, max_model_len: int) -> None:
        self.model, self.kv_caches, self.ops, self.platform = model, list(kv_caches), ops, platform
        self.sizes = tuple(sorted(platform.graph_sizes))
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.inputs = StaticBatch(self.sizes[-1], self.max_blocks, kv_caches[0].device,
                                  platform.pin_memory, platform.pin_memory)
        self._captured: dict[tuple[int, object], Captured | None] = {}  # None: cannot capture
        key = platform.capture_key()
        for size in reversed(self.sizes):  # over the padded rows: nothing is written
            self._captured[size, key] = self._capture(size)

    def size_for(self, rows: int) -> int | None:
        """The smallest size of the ladder that holds `rows` decodes, or None."""
        return next((size for size in self.sizes if size >= rows), None)

    def takes(self, batch: FlatBatch) -> bool:
        """Whether `batch` is a decode step a size of the ladder holds: one token per sequence,
        contexts within `max_model_len`."""
        return (batch.max_query_len == 1 and self.size_for(len(batch.input_ids)) is not None
                and batch.max_seq_len <= self.max_model_len)

    def run(self, batch: FlatBatch) -> Tensor | None:
        """The hidden states `[rows, hidden]` of a step that `takes` accepts, its K/V written;
        None where the platform could not capture its size (the caller runs the modules). They
        are the captured buffer's rows, written again by the next replay."""
        rows = len(batch.input_ids)
        size = self.size_for(rows)
        assert size is not None
        key = (size, self.platform.capture_key())
        if self._captured.get(key, True) is None:
            return None  # the platform could not capture this size
        self.inputs.write(batch, size)
        if key in self._captured:
            self._captured[key].replay()
        else:  # a key met after start-up: the capture computes this step
            self._captured[key] = self._capture(size)
        captured = self._captured[key]
        return None if captured is None else captured.hidden[:rows]

    @torch.inference_mode()
    def _capture(self, size: int) -> Captured | None:
        device = self.inputs.views
        metadata = AttentionMetadata(
            slot_mapping=device["slot_mapping"][:size],
            query_start_loc=device["query_start_loc"][:size + 1],
            seq_lens=device["seq_lens"][:size],
            block_tables=device["block_tables"][:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,  # a bound, so that no launch depends on the step
        )
        input_ids, positions = device["input_ids"][:size], device["positions"][:size]
        attention = PagedAttentionBackend(self.kv_caches, metadata, self.ops)
        try:
            replay, hidden = self.platform.capture(
                lambda: self.model(input_ids, positions, attention))
        except CaptureUnsupported as reason:
            logger.info("decode steps of %d sequences run the modules: %s", size, reason)
            return None
        return Captured(replay, hidden)

