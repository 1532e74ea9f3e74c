"""Paged attention in plain PyTorch: the reference backend and the KV-cache operations.

Everything that reads or writes a paged KV cache (`minipaged.attention.contract`) has a readable
PyTorch version here, the reference the Triton kernels are tested against and the backend the
engine runs on CPU:

* `paged_attention`: causal attention with K/V read through block tables (Kwon et al., SOSP'23,
  section 4.1): gather a chunk of sequences' blocks, then one batched, masked attention;
* `plan_attention` and `AttentionChunk`: how a batch is cut into those chunks, decided once per
  step and shared by every layer; `gather_context`: one chunk's gather;
* `reshape_and_cache`: write the step's new K/V into their slots;
* `copy_blocks`: the step's copy-on-write block copies (section 4.4), in every layer;
* `swap_blocks`: move blocks between the device cache and a host pool (section 4.5).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from minipaged.attention.contract import (
    AttentionOps,
    check_copy_blocks_args,
    check_paged_attention_args,
    check_reshape_and_cache_args,
    check_swap_blocks_args,
)

# The gathered K/V of a chunk should still be in the CPU's last-level cache when the attention
# reads it back: gathering a whole large batch first sends every byte out to memory and back.
# A few MiB per chunk stays cache-resident on common server CPUs (`benchmarks/cpu/attention.py`
# measures what the gather costs).
GATHER_CHUNK_BYTES = 8 << 20

# A chunk pads every context to its longest; keeping its longest at most this many times its
# shortest bounds the wasted gather and attention at 2x, for a few more, smaller chunks.
MAX_CONTEXT_RATIO = 2


@dataclass(frozen=True)
class AttentionChunk:
    """Sequences of a batch that attend together: one gather of their blocks, one attention.

    All of them have `query_len` queries, so no query is ever padded (the decodes of a step run
    together, each prefill length apart); their contexts are gathered `num_blocks` blocks each,
    the chunk's longest context, at most `MAX_CONTEXT_RATIO` times its shortest. The tensors are
    the chunk's view of the metadata, built once per step and read by every layer.
    """

    seqs: list[int]  # the chunk's sequences (rows of the batch), in the order gathered
    query_len: int
    num_blocks: int
    tokens: Tensor  # [len(seqs) * query_len] int64: their queries' rows of the flat batch
    block_ids: Tensor  # [len(seqs), num_blocks] int64; a padding -1 reads block 0
    tail: tuple[Tensor, Tensor]  # (sequence, position) of every gathered slot past an end
    visible: Tensor  # [len(seqs), 1, query_len, num_blocks * block_size] bool: keys each query sees


# ---------------------------------------------------------------------------------------------
# The plan: which sequences attend together
# ---------------------------------------------------------------------------------------------


def plan_attention(
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    k_cache: Tensor,
    *,
    chunk_bytes: int | None = None,
) -> list[AttentionChunk]:
    """Cut a batch (the metadata of `paged_attention`) into the chunks it attends in.

    Sequences are taken by query length, then context length, and a chunk grows while the next
    sequence has its query length, a context at most `MAX_CONTEXT_RATIO` times the chunk's first
    and the chunk's gathered K/V (each context padded to the longest, in k_cache's dtype) still
    fit in `chunk_bytes` (default `GATHER_CHUNK_BYTES`). A sequence too long for the budget on
    its own is a chunk of one; a sequence with no queries is in no chunk. The lengths are read on
    the host (one sync); the metadata is expected to pass `check_paged_attention_args`.
    """
    budget = GATHER_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    starts, context_lens = query_start_loc.tolist(), seq_lens.tolist()
    if not len(starts) == len(context_lens) + 1 == block_tables.shape[0] + 1:
        raise ValueError(
            f"block_tables has {block_tables.shape[0]} rows, seq_lens {len(context_lens)} "
            f"entries and query_start_loc {len(starts)}: need B, B and B + 1"
        )
    query_lens = [end - start for start, end in itertools.pairwise(starts)]
    block_size = k_cache.shape[1]
    bytes_per_block = 2 * k_cache[0].numel() * k_cache.element_size()  # K and V

    chunks: list[list[int]] = []
    by_shape = sorted(range(len(query_lens)), key=lambda i: (query_lens[i], context_lens[i]))
    for i in (i for i in by_shape if query_lens[i] > 0):
        blocks = -(-context_lens[i] // block_size)  # the longest so far: sorted by context
        if chunks and (
            query_lens[i] == query_lens[chunks[-1][0]]
            and context_lens[i] <= MAX_CONTEXT_RATIO * context_lens[chunks[-1][0]]
            and (len(chunks[-1]) + 1) * blocks * bytes_per_block <= budget
        ):
            chunks[-1].append(i)
        else:
            chunks.append([i])
    return [_chunk(seqs, starts, context_lens, block_tables, block_size) for seqs in chunks]


def _chunk(seqs: list[int], starts: list[int], context_lens: list[int], block_tables: Tensor,
           block_size: int) -> AttentionChunk:
    """The tensors of the chunk of sequences `seqs`, the last with the longest context."""
    device = block_tables.device
    query_len = starts[seqs[0] + 1] - starts[seqs[0]]
    num_blocks = -(-context_lens[seqs[-1]] // block_size)
    tokens = torch.tensor([t for i in seqs for t in range(starts[i], starts[i + 1])],
                          device=device)
    lens = torch.tensor([context_lens[i] for i in seqs], device=device)
    key_pos = torch.arange(num_blocks * block_size, device=device)
    past_end = key_pos[None, :] >= lens[:, None]  # [B, L_pad]
    # Query row r of sequence s sits at position lens[s] - Q + r and sees the keys up to its own
    # position (causal), never a slot past the sequence's end (a decode sees its whole context).
    query_pos = (lens - query_len)[:, None] + torch.arange(query_len, device=device)
    visible = (key_pos[None, None, :] <= query_pos[:, :, None])[:, None]
    return AttentionChunk(
        seqs=seqs,
        query_len=query_len,
        num_blocks=num_blocks,
        tokens=tokens,
        block_ids=block_tables[seqs, :num_blocks].clamp(min=0).long(),
        tail=torch.nonzero(past_end, as_tuple=True),
        visible=visible,
    )


# ---------------------------------------------------------------------------------------------
# Paged attention: gather a chunk's blocks, attend over them
# ---------------------------------------------------------------------------------------------


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    validate: bool = True,
    plan: list[AttentionChunk] | None = None,
) -> Tensor:
    """Causal attention of a flat varlen batch over paged K/V (the attention contract).

    q: `[T, H, D]`; k_cache, v_cache: `[num_blocks, block_size, H_kv, D]`; block_tables:
    `[B, max_blocks]` (padded with -1); seq_lens: `[B]`; query_start_loc: `[B + 1]`. The queries
    of sequence `i` are the last `query_start_loc[i+1] - query_start_loc[i]` positions of its
    `seq_lens[i]`-token context. Returns `[T, H, D]` in q's dtype, computed in float32.

    `max_query_len` / `max_seq_len` bound the batch's query and context lengths (the Triton
    kernels size their grids by them; this reference reads the lengths on the host instead).
    `validate=False` skips `check_paged_attention_args` (and its syncs). `plan` is
    `plan_attention` of these same metadata and cache shape, made once per step for all layers;
    without it the call makes its own.

    The method is the paper's (section 4.1) with the block loop vectorised, one chunk of
    sequences at a time (`plan_attention`): gather their blocks into contiguous contexts and run
    one masked attention over the chunk. Slots past a sequence's end (the tail of its last block,
    padding blocks) may hold anything, NaN included: they are zeroed after the gather and masked
    in the attention.
    """
    if validate:
        check_paged_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                   max_query_len=max_query_len, max_seq_len=max_seq_len)
    if plan is None:
        plan = plan_attention(block_tables, seq_lens, query_start_loc, k_cache)
    elif validate:
        check_plan_covers(sum(chunk.tokens.numel() for chunk in plan), q)
    out = torch.empty_like(q)
    for chunk in plan:
        out[chunk.tokens] = _attend_chunk(q[chunk.tokens], k_cache, v_cache, chunk, scale)
    return out


def check_plan_covers(num_queries: int, q: Tensor) -> None:
    """A given plan must cover exactly q's rows: one made for other metadata is refused."""
    if num_queries != q.shape[0]:
        raise ValueError(f"plan covers {num_queries} queries but q has {q.shape[0]}: it was made "
                         "for other metadata")


def _attend_chunk(q: Tensor, k_cache: Tensor, v_cache: Tensor, chunk: AttentionChunk,
                  scale: float) -> Tensor:
    """`paged_attention` over one chunk; q: `[B * Q, H, D]`, sequence after sequence."""
    keys, values = gather_context(k_cache, v_cache, chunk)
    out = F.scaled_dot_product_attention(  # GQA: query heads share KV heads
        q.float().view(len(chunk.seqs), chunk.query_len, *q.shape[1:]).transpose(1, 2),
        keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=chunk.visible, scale=scale, enable_gqa=True,
    )  # [B, H, Q, D]
    return out.transpose(1, 2).reshape(q.shape).to(q.dtype)


def gather_context(k_cache: Tensor, v_cache: Tensor, chunk: AttentionChunk,
                   dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Keys and values `[B, L_pad, H_kv, D]` (in `dtype`) of a chunk's sequences: each sequence's
    tokens in order, as a contiguous cache would hold them, every slot past its end zeroed.

    A block is one contiguous run of memory, so the gather is one `index_select` of whole blocks
    into a reused buffer. Masking alone would not be enough for the slots past the end: a masked
    score is still computed (NaN * 0 is NaN), and a zero probability times a NaN value is NaN.
    """
    numel = chunk.block_ids.numel() * k_cache[0].numel()
    buffer = _gather_buffer(2 * numel, k_cache.dtype, k_cache.device)
    keys = _gather_blocks(k_cache, chunk.block_ids, buffer[:numel]).to(dtype)
    values = _gather_blocks(v_cache, chunk.block_ids, buffer[numel:]).to(dtype)
    if chunk.tail[0].numel():
        keys[chunk.tail] = 0.0
        values[chunk.tail] = 0.0
    return keys, values


def _gather_blocks(cache: Tensor, block_ids: Tensor, out: Tensor) -> Tensor:
    """Blocks `block_ids [B, n]` of `cache` copied into `out`, viewed `[B, n * block_size, ...]`."""
    num_seqs, num_blocks = block_ids.shape
    flat_cache = cache.view(cache.shape[0], -1)  # a row per block
    rows = out.view(num_seqs * num_blocks, flat_cache.shape[1])
    torch.index_select(flat_cache, 0, block_ids.reshape(-1), out=rows)
    return out.view(num_seqs, num_blocks * cache.shape[1], *cache.shape[2:])


# The chunks are copied into a reused buffer rather than a fresh tensor per call: on CPU a fresh
# multi-megabyte tensor costs page faults on first touch, which take longer than the gather
# itself. minipaged runs one step at a time, so one buffer per (device, dtype) is enough; it only
# grows. A buffer made under `torch.inference_mode` cannot be written outside it, so each mode
# has its own.
_GATHER_BUFFERS: dict[tuple[torch.device, torch.dtype, bool], Tensor] = {}


def _gather_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    key = (device, dtype, torch.is_inference_mode_enabled())
    buffer = _GATHER_BUFFERS.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = torch.empty(numel, dtype=dtype, device=device)
        _GATHER_BUFFERS[key] = buffer
    return buffer[:numel]


# ---------------------------------------------------------------------------------------------
# Writing and moving KV blocks
# ---------------------------------------------------------------------------------------------


def reshape_and_cache(
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    *,
    validate: bool = True,
) -> None:
    """Write the step's new keys and values into their cache slots, in place.

    key, value: `[T, H_kv, D]`; k_cache, v_cache: `[num_blocks, block_size, H_kv, D]`;
    slot_mapping: `[T]`, token t goes to slot `block_id * block_size + offset`; -1 skips the
    token (its K/V are already cached). Every other slot is left untouched.
    """
    if validate:
        check_reshape_and_cache_args(key, value, k_cache, v_cache, slot_mapping)
    num_kv_heads, head_dim = k_cache.shape[2:]
    write = slot_mapping >= 0
    slots = slot_mapping[write].long()
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key[write])
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value[write])


def copy_blocks(
    kv_caches: Sequence[Tensor], block_mapping: Tensor, *, validate: bool = True
) -> None:
    """Copy block `src` to block `dst` for every `(src, dst)` row of `block_mapping`, in every
    layer's cache (`[2, num_blocks, block_size, H_kv, D]` each): keys and values alike.

    These are the copies of copy-on-write (section 4.4): a sequence about to write into a block
    it shares gets a private copy first. All copies of a step happen in one call. A block may not
    be both a source and a destination, so the order of the copies does not matter.
    """
    if validate:
        check_copy_blocks_args(kv_caches, block_mapping)
    src, dst = block_mapping[:, 0].long(), block_mapping[:, 1].long()
    for cache in kv_caches:
        cache[:, dst] = cache[:, src]


def swap_blocks(src: Tensor, dst: Tensor, block_mapping: Tensor, *, validate: bool = True) -> None:
    """Copy block `s` of `src` to block `d` of `dst` for every `(s, d)` row of `block_mapping`.

    src, dst: one layer's caches, `[2, num_blocks, block_size, H_kv, D]` (blocks along dim 1, as
    in `copy_blocks`), possibly on different devices and with different numbers of blocks: the
    device cache and its host pool (section 4.5, swapping). `block_mapping` lives on the CPU or
    on `src`'s device. Call it once per layer. Swapping is a plain copy between devices, so every
    backend uses this one.
    """
    if validate:
        check_swap_blocks_args(src, dst, block_mapping)
    src_ids = block_mapping[:, 0].long().to(src.device)
    dst_ids = block_mapping[:, 1].long().to(dst.device)
    dst[:, dst_ids] = src[:, src_ids].to(dst.device)


# The reference as a backend: what `attention_backend="torch"` runs.
REFERENCE_OPS = AttentionOps(
    name="torch",
    paged_attention=paged_attention,
    reshape_and_cache=reshape_and_cache,
    copy_blocks=copy_blocks,
    swap_blocks=swap_blocks,
    plan=plan_attention,
)
