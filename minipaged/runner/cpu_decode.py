"""A decode step replayed: the CPU's answer to CUDA graphs, for a few sequences at a time.

At one request a decode step is memory-bound: it reads every weight once, which on a CPU takes
~10-25 ms for SmolLM2 (`benchmarks/decode_cpu.py`). Run through the model's modules, the same
step also pays Python for every call: 30 layers of module calls, checks of shapes and dtypes,
new tensors, one `ctypes` call per kernel, ~0.3 ms a layer, as much as the bandwidth itself.
CUDA has graphs for this (capture a step's kernel launches once, replay them); vLLM and
nano-vllm replay a captured graph per batch size. `DecodeProgram` does the same with the CPU
kernels of `minipaged.kernels.cpu`: for each row count it binds every kernel of the step to
static buffers once (`bind_*`, `GemvPlan.bind`), and a step writes its flat batch's lists
(`FlatBatch`) into those buffers, makes the bound calls in order in one call into C
(`KernelCalls`: the embedding and rotary look-ups, the layers, the head) and hands back its
float32 logits buffer. Between the kernels a step runs no PyTorch operator: after the weights
have streamed through the caches, each operator's first call costs 0.1-0.3 ms of cache misses
in its dispatch code.

A step of a LLaMA-family model (one rank, no per-head q/k norm) that only decodes, with at most
`max_rows` sequences (the fewest rows any layer's few-row path takes), runs this way; any other
step runs the model's modules. Each layer is what `minipaged.models.llama` computes:

    h = rms_norm(x);  q, k, v = qkv(h);  q, k = rotary(q), rotary(k);  cache k, v
    x += o(paged_decode(q));  h = rms_norm(x);  x += down(silu(gate(h)) * up(h))

then the final norm and, where the head has a few-row path at that many rows, the head (else
the model's `compute_logits` takes the final hidden states). The kernels are those the modules
call at a few rows, so the logits equal the modules' bit for bit; a residual add goes into the
same call as the norm after it (`bind_add_rms_norm`), which adds and rounds as PyTorch's add
does.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from minipaged.kernels.cpu.calls import KernelCalls, kernel_calls_available
from minipaged.kernels.cpu.gemv import GemvPlan
from minipaged.kernels.cpu.native import (
    bind_paged_decode,
    bind_write_kv,
    native_decode_available,
    native_decode_supports,
    profiled,
)
from minipaged.kernels.cpu.norm_rotary import (
    bind_add_rms_norm,
    bind_gather_rows,
    bind_rms_norm,
    bind_rotary,
    bind_silu_mul,
    bind_to_float32,
    norm_rotary_available,
)
from minipaged.models.layers import (
    WEIGHT_FIELDS,
    Linear,
    VersionedWeights,
    check_input_ranges,
)
from minipaged.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from minipaged.runner.flat_batch import FlatBatch

PROFILER_NAME = "minipaged::decode_program"  # a replayed step, as torch's profiler lists it
DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class LayerPlans:
    """One decoder layer's kernels and weights, as the program binds them."""

    input_norm: Tensor
    qkv: GemvPlan
    scale: float  # the attention's, as the layer's module holds it
    o: GemvPlan
    post_norm: Tensor
    gate_up: GemvPlan
    down: GemvPlan


@dataclass
class StepInputs:
    """A replay's integer inputs, each a static tensor and a `ctypes` array over its memory,
    which a list is written into without a PyTorch operator."""

    input_ids: Tensor  # [rows] int64
    positions: Tensor  # [rows] int64
    slot_mapping: Tensor  # [rows] int64
    seq_lens: Tensor  # [rows] int32
    block_tables: Tensor  # [rows, max_blocks] int32, each row's first blocks written

    def __post_init__(self) -> None:
        self.views = {name: _c_array(getattr(self, name)) for name in (
            "input_ids", "positions", "slot_mapping", "seq_lens", "block_tables")}

    def write(self, batch: FlatBatch) -> None:
        """The batch's lists into the buffers (as many rows as the buffers have)."""
        views = self.views
        views["input_ids"][:] = batch.input_ids
        views["positions"][:] = batch.positions
        views["slot_mapping"][:] = batch.slot_mapping
        views["seq_lens"][:] = batch.seq_lens
        tables, width = views["block_tables"], self.block_tables.shape[1]
        for row, table in enumerate(batch.block_tables):
            tables[row * width:row * width + len(table)] = table


@dataclass
class Replay:
    """A row count's static buffers and its step's kernel calls bound to them: a step writes
    its inputs, runs `calls` and reads `logits` (or, without a bound head, `hidden`). The calls
    point into every buffer: the replay keeps them alive."""

    inputs: StepInputs
    x: Tensor  # [rows, hidden]: the residual stream; the embedding goes in here
    hidden: Tensor  # [rows, hidden]: the final norm's output
    logits: Tensor | None  # [rows, vocab] float32: the head's, where it is bound
    calls: KernelCalls
    scratch: list[Tensor]  # the buffers between the kernels


class DecodeProgram:
    """Decode steps of `model` over `kv_caches`, replayed from bound kernel calls (module
    docstring). Build it with `DecodeProgram.build`, which says None where it does not apply."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: Sequence[Tensor],
                 layers: list[LayerPlans], max_rows: int, max_blocks: int) -> None:
        self.model, self.kv_caches, self.layers = model, list(kv_caches), layers
        self.max_rows, self.max_blocks = max_rows, max_blocks
        self.dtype = layers[0].qkv.dtype
        self.final_norm = model.norm.weight
        # the look-ups before the first layer: the embedding's rows where they are the dtype's
        # (an int8 embedding dequantises its rows in its module), the rotary angles' rows
        embedding = model.embed_tokens
        self.embedding = (embedding.weight if isinstance(embedding, nn.Embedding)
                          and embedding.weight.dtype == self.dtype else None)
        self.cos = model.rotary.cos.to(self.dtype).contiguous()
        self.sin = model.rotary.sin.to(self.dtype).contiguous()
        self._replays: dict[tuple[int, int], Replay] = {}  # by rows and threads
        self._watched = self._watch_list()
        self._bound_generation = VersionedWeights.generation

    @classmethod
    def build(cls, model: torch.nn.Module, kv_caches: Sequence[Tensor],
              block_size: int) -> DecodeProgram | None:
        """The program of `model` (after `choose_gemms` planned its few-row paths) over these
        caches, or None where it does not apply: not a one-rank LLaMA-family model without
        per-head q/k norms, a layer without a few-row path, the kernels not built, or a cache
        the decode kernel does not take."""
        if not (isinstance(model, LlamaForCausalLM) and not model.config.qk_norm
                and norm_rotary_available() and native_decode_available()
                and kernel_calls_available()
                and kv_caches and kv_caches[0].dtype in DTYPES
                and native_decode_supports(kv_caches[0][0], model.config.num_heads)):
            return None
        planned = [_layer_plans(layer) for layer in model.layers]
        if any(plans is None for plans in planned):
            return None
        layers = [plans for plans, _ in planned]
        max_rows = min(rows for _, rows in planned)
        dtypes = {plans.qkv.dtype for plans in layers}
        if dtypes != {kv_caches[0].dtype} or model.norm.weight.dtype != kv_caches[0].dtype:
            return None
        max_blocks = -(-model.config.max_position_embeddings // block_size)
        return cls(model, kv_caches, layers, max_rows, max_blocks)  # type: ignore[arg-type]

    def _watch_list(self) -> list[tuple[VersionedWeights, str, object]]:
        """(holder, field, the object it holds now) for every weight the bound calls read and
        every few-row plan they were bound from."""
        modules: list[VersionedWeights] = [self.model.norm, self.model.lm_head]
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            modules += [layer.input_layernorm, layer.post_attention_layernorm, attn.q_proj,
                        attn.k_proj, attn.v_proj, attn.qkv, attn.o_proj, mlp.gate_proj,
                        mlp.up_proj, mlp.gate_up, mlp.down_proj]
        return [(module, name, getattr(module, name)) for module in modules
                for name in WEIGHT_FIELDS if hasattr(module, name)]

    def _weights_as_bound(self) -> bool:
        """Whether every watched holder holds the weights and plans the calls were bound to:
        at once where none was given one since (`VersionedWeights.generation` has not moved),
        else by looking each up (a weight put back is the one bound). After `choose_gemms`
        plans again, steps run the modules, which take the new plans."""
        generation = VersionedWeights.generation
        if generation == self._bound_generation:
            return True
        if all(getattr(module, name) is held for module, name, held in self._watched):
            self._bound_generation = generation
            return True
        return False

    def takes(self, batch: FlatBatch) -> bool:
        """Whether a step of this flat batch is a replayable decode: one token per sequence, at
        most `max_rows` of them, block tables that fit the buffers, the model's weights and
        few-row plans those the calls were bound to."""
        return (
            batch.max_query_len == 1 and len(batch.input_ids) <= self.max_rows
            and max(len(table) for table in batch.block_tables) <= self.max_blocks
            and self._weights_as_bound()
            and (self.embedding is None or self.model.embed_tokens.weight is self.embedding)
        )

    def run(self, batch: FlatBatch) -> Tensor:
        """The float32 logits `[T, vocab]` of every row of a step that `takes` accepts, as the
        model's `compute_logits` of its forward's hidden states gives them (its K/V written
        into the caches). With the head bound they are the replay's own buffer, written again
        by its next step (as a CUDA graph's outputs are): a caller that keeps them copies them.
        Raises `ModelInputError` for a token id or position outside the model's."""
        ids, positions = batch.input_ids, batch.positions
        check_input_ranges(self.model.config, (min(ids), max(ids)),
                           (min(positions), max(positions)))
        key = (len(ids), torch.get_num_threads())
        replay = self._replays.get(key)
        if replay is None:
            replay = self._replays[key] = self._bind(len(ids))
        with profiled(PROFILER_NAME):
            replay.inputs.write(batch)
            if self.embedding is None:
                replay.x.copy_(self.model.embed_tokens(replay.inputs.input_ids))
            replay.calls.run()
        if replay.logits is None:
            return self.model.compute_logits(replay.hidden)
        return replay.logits

    def _bind(self, rows: int) -> Replay:
        """Static buffers for `rows` decodes, and every kernel of the step bound to them."""
        config, dtype = self.model.config, self.dtype
        head_dim, hidden = config.head_dim, config.hidden_size
        num_heads, num_kv_heads = config.num_heads, config.num_kv_heads
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim

        def buffer(*shape: int, of: torch.dtype = dtype) -> Tensor:
            return torch.zeros(*shape, dtype=of)

        inputs = StepInputs(buffer(rows, of=torch.int64), buffer(rows, of=torch.int64),
                            buffer(rows, of=torch.int64), buffer(rows, of=torch.int32),
                            buffer(rows, self.max_blocks, of=torch.int32))
        slot_mapping, block_tables = inputs.slot_mapping, inputs.block_tables
        seq_lens = inputs.seq_lens
        x, h = buffer(rows, hidden), buffer(rows, hidden)
        cos, sin = buffer(rows, head_dim), buffer(rows, head_dim)
        final = buffer(rows, hidden)
        decoded = torch.arange(rows, dtype=torch.int32)  # row i is sequence i's decode
        qkv = buffer(rows, q_size + 2 * kv_size)
        q, k = buffer(rows, num_heads, head_dim), buffer(rows, num_kv_heads, head_dim)
        q_in = qkv[:, :q_size].view(rows, num_heads, head_dim)
        k_in = qkv[:, q_size:q_size + kv_size].view(rows, num_kv_heads, head_dim)
        v = qkv[:, q_size + kv_size:].view(rows, num_kv_heads, head_dim)
        attended, projected = buffer(rows, num_heads, head_dim), buffer(rows, hidden)
        gate_up = buffer(rows, 2 * self.layers[0].down.in_features)
        gate, up = gate_up.chunk(2, dim=1)
        act = buffer(rows, self.layers[0].down.in_features)
        eps = config.norm_eps
        replay_scratch: list[Tensor] = []
        calls = [bind_gather_rows(self.cos, inputs.positions, cos),
                 bind_gather_rows(self.sin, inputs.positions, sin)]
        if self.embedding is not None:
            calls.append(bind_gather_rows(self.embedding, inputs.input_ids, x))
        for index, (plans, cache) in enumerate(zip(self.layers, self.kv_caches, strict=True)):
            calls += [
                # the previous layer's last residual add goes in with this layer's first norm
                bind_rms_norm(x, plans.input_norm, eps, h) if index == 0
                else bind_add_rms_norm(x, projected, plans.input_norm, eps, h),
                plans.qkv.bind(h, qkv),
                bind_rotary(q_in, cos, sin, q),
                bind_rotary(k_in, cos, sin, k),
                bind_write_kv(k, v, cache[0], cache[1], slot_mapping),
                bind_paged_decode(attended, q, cache[0], cache[1], block_tables, seq_lens,
                                  decoded, decoded, plans.scale),
                plans.o.bind(attended.view(rows, q_size), projected),
                bind_add_rms_norm(x, projected, plans.post_norm, eps, h),
                plans.gate_up.bind(h, gate_up),
                bind_silu_mul(gate, up, act),
                plans.down.bind(act, projected),
            ]
        calls.append(bind_add_rms_norm(x, projected, self.final_norm, eps, final))
        head, logits = self._head(rows), None
        if head is not None:  # float32 logits, as `compute_logits` gives them
            logits = buffer(rows, config.vocab_size, of=torch.float32)
            if dtype == torch.float32:
                calls.append(head.bind(final, logits))
            else:
                rounded = buffer(rows, config.vocab_size)
                calls += [head.bind(final, rounded), bind_to_float32(rounded, logits)]
                replay_scratch.append(rounded)
        return Replay(inputs, x, final, logits, KernelCalls(calls), replay_scratch
                      + [cos, sin, h, decoded, qkv, q, k, attended, projected, gate_up, act])

    def _head(self, rows: int) -> GemvPlan | None:
        """The head's few-row plan where it takes `rows` rows, the model's dtype in and out."""
        head = self.model.lm_head
        path = head.few_rows if type(head) is Linear else None
        if path is None or rows > path.max_rows or path.plan.dtype != self.dtype:
            return None
        return path.plan


def _layer_plans(layer: LlamaDecoderLayer) -> tuple[LayerPlans, int] | None:
    """The layer's few-row kernel plans and the most rows all of them take, or None where one
    of its projections has none (the kernel not faster there, or not built) or the layer is a
    tensor-parallel shard."""
    attn, mlp = layer.self_attn, layer.mlp
    paths = (attn.qkv.path, attn.o_proj.few_rows, mlp.gate_up.path, mlp.down_proj.few_rows)
    if (any(path is None for path in paths) or type(attn.o_proj) is not Linear
            or type(mlp.down_proj) is not Linear):
        return None
    qkv, o, gate_up, down = (path.plan for path in paths)
    plans = LayerPlans(layer.input_layernorm.weight, qkv, attn.scale, o,
                       layer.post_attention_layernorm.weight, gate_up, down)
    return plans, min(path.max_rows for path in paths)


def _c_array(tensor: Tensor) -> ctypes.Array:
    """A contiguous int64 or int32 tensor's elements as a `ctypes` array over its memory."""
    kind = ctypes.c_int64 if tensor.dtype == torch.int64 else ctypes.c_int32
    return (kind * tensor.numel()).from_address(tensor.data_ptr())
