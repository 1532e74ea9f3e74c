"""Attention in plain PyTorch: the dense oracle, the paged reference and the KV-cache operations.

PagedAttention (Kwon et al., SOSP'23, section 4.1) stores each sequence's keys and values in
fixed-size blocks that need not be contiguous; a per-sequence block table maps logical block `j`
(tokens `j * block_size ...`) to a physical block of the cache. This module is the readable
reference for everything that touches that cache:

* `dense_attention`: causal attention over contiguous K/V, the oracle every path is tested against;
* `paged_attention`: the same attention with K/V read through block tables (DESIGN.md, "Attention
  contract"): gather each sequence's blocks, then one batched, masked attention;
* `reshape_and_cache`: write the step's new K/V into their slots;
* `copy_blocks`: the step's copy-on-write block copies (section 4.4), in every layer;
* `swap_blocks`: move blocks between the device cache and a host pool (section 4.5);
* `get_attention_ops`: pick these functions or the Triton kernels (`minipaged.kernels`);
* `PagedAttentionBackend`: the model's attention interface over a paged KV cache.

Layouts (DESIGN.md): one KV cache per layer, `[2, num_blocks, block_size, H_kv, D]` (index 0 keys,
1 values), so `cache[0]` / `cache[1]` are the `k_cache` / `v_cache` the attention functions take.
Blocks are always addressed along dim 1 of that per-layer tensor, by `copy_blocks` and
`swap_blocks` alike; a host pool has the same layout with its own number of blocks.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
BACKENDS = ("torch", "triton")


@dataclass
class AttentionMetadata:
    """The flat batch's attention bookkeeping (DESIGN.md, "The data that flows").

    Sequence `i` owns queries `query_start_loc[i]:query_start_loc[i+1]` of the flat batch; they are
    the last positions of its `seq_lens[i]`-token context, whose keys live in the blocks listed in
    `block_tables[i]` (padded with -1). `slot_mapping[t]` is where token `t`'s new K/V is written
    (`block_id * block_size + offset`, -1 = do not write).
    """

    slot_mapping: Tensor  # [T] int64
    query_start_loc: Tensor  # [B + 1] int32
    seq_lens: Tensor  # [B] int32
    block_tables: Tensor  # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


@dataclass(frozen=True)
class AttentionOps:
    """One backend's implementation of the paged-attention operations (same signatures)."""

    name: str
    paged_attention: Callable[..., Tensor]
    reshape_and_cache: Callable[..., None]
    copy_blocks: Callable[..., None]
    swap_blocks: Callable[..., None]


# ---------------------------------------------------------------------------------------------
# The oracle
# ---------------------------------------------------------------------------------------------


def dense_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Causal attention of one sequence over contiguous K/V: the oracle.

    q: [n, H, D], the last n positions of a context of L tokens; k, v: [L, H_kv, D].
    Returns [n, H, D]. Query heads are grouped onto KV heads (GQA: H % H_kv == 0).
    Computed in float32 whatever the input dtype, and returned in q's dtype.
    """
    n, num_heads, _ = q.shape
    context_len, num_kv_heads, _ = k.shape
    if n > context_len:
        raise ValueError(f"{n} queries but only {context_len} context tokens")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_heads}) not a multiple of KV heads ({num_kv_heads})")
    group = num_heads // num_kv_heads
    qf = q.float().transpose(0, 1)  # [H, n, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (qf @ kf.transpose(1, 2)) * scale  # [H, n, L]
    query_pos = torch.arange(context_len - n, context_len, device=q.device)[:, None]
    key_pos = torch.arange(context_len, device=q.device)[None, :]
    scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vf  # [H, n, D]
    return out.transpose(0, 1).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# Validation, shared with the Triton launchers so that both backends reject the same inputs
# ---------------------------------------------------------------------------------------------


def check_paged_attention_args(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> None:
    """Validate the attention contract's inputs; raise `ValueError` naming the problem.

    Shared by the PyTorch reference and the Triton launchers so both reject the same inputs.
    Checks shapes, dtypes and devices, then the metadata's values (one host sync, so callers on
    a hot path may skip it). `max_query_len` / `max_seq_len`, when given, must bound the real
    maxima: an implementation that sizes its work by them would otherwise drop queries or keys.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, H_kv, D], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"head_dim mismatch: q has {head_dim}, the KV cache {cache_head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})"
        )
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    if q.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"dtype mismatch: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}"
        )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc)):
        if t.dtype not in INDEX_DTYPES:
            raise ValueError(f"{name} must be an int32 or int64 tensor, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [B, max_blocks], got {tuple(block_tables.shape)}")
    num_seqs = block_tables.shape[0]
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must be [{num_seqs}], got {tuple(seq_lens.shape)}")
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"query_start_loc must be [{num_seqs + 1}], got {tuple(query_start_loc.shape)}"
        )
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    if int(query_start_loc[0]) != 0 or int(query_start_loc[-1]) != num_tokens:
        raise ValueError(
            f"query_start_loc must run from 0 to the number of query tokens ({num_tokens}), "
            f"got {int(query_start_loc[0])}..{int(query_start_loc[-1])}"
        )
    if bool((query_lens < 0).any()):
        raise ValueError("query_start_loc must be non-decreasing")
    if bool((query_lens > seq_lens).any()):
        i = int(torch.nonzero(query_lens > seq_lens)[0])
        raise ValueError(
            f"sequence {i} has {int(query_lens[i])} queries but a context of only "
            f"{int(seq_lens[i])} tokens"
        )
    blocks_needed = (seq_lens + block_size - 1) // block_size
    if bool((blocks_needed > block_tables.shape[1]).any()):
        i = int(torch.nonzero(blocks_needed > block_tables.shape[1])[0])
        raise ValueError(
            f"sequence {i} has {int(seq_lens[i])} tokens, more than its block table covers "
            f"({block_tables.shape[1]} blocks of {block_size})"
        )
    used = torch.arange(block_tables.shape[1], device=q.device)[None, :] < blocks_needed[:, None]
    ids = block_tables[used]
    if ids.numel() and bool(((ids < 0) | (ids >= k_cache.shape[0])).any()):
        raise ValueError(
            f"block_tables name a block outside the cache's {k_cache.shape[0]} blocks "
            "within a sequence's context"
        )
    if num_seqs and max_query_len is not None and max_query_len < int(query_lens.max()):
        raise ValueError(
            f"max_query_len={max_query_len} but a sequence has {int(query_lens.max())} queries"
        )
    if num_seqs and max_seq_len is not None and max_seq_len < int(seq_lens.max()):
        raise ValueError(
            f"max_seq_len={max_seq_len} but a sequence has {int(seq_lens.max())} tokens"
        )


def check_reshape_and_cache_args(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Validate `reshape_and_cache`'s inputs; raise `ValueError` naming the problem (one sync)."""
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            f"key and value must both be [T, H_kv, D], got {tuple(key.shape)} and "
            f"{tuple(value.shape)}"
        )
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, H_kv, D], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"key has {key.shape[1]} heads of dim {key.shape[2]} but the cache holds "
            f"{k_cache.shape[2]} heads of dim {k_cache.shape[3]}"
        )
    dtypes = {key.dtype, value.dtype, k_cache.dtype, v_cache.dtype}
    if len(dtypes) != 1:
        raise ValueError(
            f"dtype mismatch: key {key.dtype}, value {value.dtype}, k_cache {k_cache.dtype}, "
            f"v_cache {v_cache.dtype}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous (written through a flat view)")
    for name, t in (("value", value), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("slot_mapping", slot_mapping)):
        if t.device != key.device:
            raise ValueError(f"{name} is on {t.device} but key is on {key.device}")
    if slot_mapping.dtype not in INDEX_DTYPES:
        raise ValueError(f"slot_mapping must be an int32 or int64 tensor, got {slot_mapping.dtype}")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(
            f"slot_mapping must be [{key.shape[0]}] (one slot per token), got "
            f"{tuple(slot_mapping.shape)}"
        )
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if bool(((slot_mapping < -1) | (slot_mapping >= num_slots)).any()):
        raise ValueError(f"slot_mapping has slots outside -1..{num_slots - 1}")
    written = slot_mapping[slot_mapping >= 0]
    if torch.unique(written).numel() != written.numel():
        raise ValueError("slot_mapping names the same slot twice")


def _check_block_mapping(block_mapping: Tensor, num_src: int, num_dst: int) -> None:
    """A `[N, 2]` integer tensor of (src, dst) block ids in range, each dst named once."""
    if block_mapping.dtype not in INDEX_DTYPES:
        raise ValueError(
            f"block_mapping must be an int32 or int64 tensor, got {block_mapping.dtype}"
        )
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(
            f"block_mapping must be [N, 2] (src, dst), got {tuple(block_mapping.shape)}"
        )
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    if bool(((src < 0) | (src >= num_src)).any()):
        raise ValueError(f"block_mapping names a source block outside 0..{num_src - 1}")
    if bool(((dst < 0) | (dst >= num_dst)).any()):
        raise ValueError(f"block_mapping names a destination block outside 0..{num_dst - 1}")
    if torch.unique(dst).numel() != dst.numel():
        raise ValueError("block_mapping names the same destination block twice")


def _check_layer_cache(name: str, cache: Tensor) -> None:
    if cache.dim() != 5 or cache.shape[0] != 2:
        raise ValueError(
            f"{name} must be [2, num_blocks, block_size, H_kv, D], got {tuple(cache.shape)}"
        )


def check_copy_blocks_args(kv_caches: Sequence[Tensor], block_mapping: Tensor) -> None:
    """Validate `copy_blocks`' inputs; raise `ValueError` naming the problem (one sync)."""
    if len(kv_caches) == 0:
        raise ValueError("kv_caches is empty: need one [2, num_blocks, ...] cache per layer")
    for i, cache in enumerate(kv_caches):
        _check_layer_cache(f"kv_caches[{i}]", cache)
        if cache.shape != kv_caches[0].shape or cache.dtype != kv_caches[0].dtype:
            raise ValueError(
                f"kv_caches[{i}] is {tuple(cache.shape)} {cache.dtype}, layer 0 is "
                f"{tuple(kv_caches[0].shape)} {kv_caches[0].dtype}"
            )
        if cache.device != block_mapping.device:
            raise ValueError(
                f"kv_caches[{i}] is on {cache.device} but block_mapping on {block_mapping.device}"
            )
    num_blocks = kv_caches[0].shape[1]
    _check_block_mapping(block_mapping, num_blocks, num_blocks)
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    if bool(torch.isin(dst, src).any()):
        raise ValueError("a block is both copied from and copied to in one copy_blocks call")


# ---------------------------------------------------------------------------------------------
# Paged attention
# ---------------------------------------------------------------------------------------------

# Gathered K/V are copied a chunk of sequences at a time, each chunk small enough to stay in the
# CPU's last-level cache between the gather and the attention that reads it back. Gathering the
# whole batch at once sent it out to memory and back: 2.5x the time of dense decode at context
# 512 in `benchmarks/attention_cpu.py`. On that machine (32 MiB of L3), chunks of 4-8 MiB were
# best (about 1.45x), 3 MiB or 12 MiB and up worse.
GATHER_CHUNK_BYTES = 8 << 20

# The chunks are copied into a reused buffer rather than a fresh tensor per call: on CPU a fresh
# multi-megabyte tensor costs page faults on first touch, which took longer than the gather
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


def gather_blocks(cache: Tensor, block_ids: Tensor, out: Tensor) -> Tensor:
    """Copy the listed blocks of `cache` into `out`, one contiguous context per sequence.

    cache: `[num_blocks, block_size, H_kv, D]`; block_ids: `[B, n]` valid block ids; `out` holds
    `B * n` blocks. Returns `out` viewed as `[B, n * block_size, H_kv, D]`: sequence `i`'s
    tokens in order, as a contiguous cache would hold them. A block is one contiguous run of
    memory, so this is one `index_select` of whole blocks.
    """
    num_seqs, num_blocks = block_ids.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    flat_cache = cache.view(cache.shape[0], -1)  # a row per block
    rows = out.view(num_seqs * num_blocks, flat_cache.shape[1])
    torch.index_select(flat_cache, 0, block_ids.reshape(-1), out=rows)
    return out.view(num_seqs, num_blocks * block_size, num_kv_heads, head_dim)


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
) -> Tensor:
    """Causal attention of a flat varlen batch over paged K/V (DESIGN.md, "Attention contract").

    q: `[T, H, D]`; k_cache, v_cache: `[num_blocks, block_size, H_kv, D]`; block_tables:
    `[B, max_blocks]` (padded with -1); seq_lens: `[B]`; query_start_loc: `[B + 1]`. The queries
    of sequence `i` are the last `query_start_loc[i+1] - query_start_loc[i]` positions of its
    `seq_lens[i]`-token context. Returns `[T, H, D]` in q's dtype, computed in float32.

    `max_query_len` / `max_seq_len` bound the batch's query and context lengths (the Triton
    kernels size their grids by them; this reference reads the lengths on the host instead).
    `validate=False` skips `check_paged_attention_args` (and its syncs).

    The method is the paper's (section 4.1) with the block loop vectorised, a chunk of sequences
    at a time: gather their blocks into contiguous contexts and run one masked attention over
    the chunk. A chunk holds sequences with the same number of queries (decodes together, each
    prefill length apart), so no query is padded, and its gathered K/V fit in
    `GATHER_CHUNK_BYTES`. Sequences are taken by query length, then context length, so that
    padding each chunk's contexts to its longest adds little. Slots past a sequence's end (the
    tail of its last block, padding blocks) may hold anything, NaN included: they are zeroed
    after the gather and masked in the attention.
    """
    if validate:
        check_paged_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                   max_query_len=max_query_len, max_seq_len=max_seq_len)
    if q.shape[0] == 0:
        return q.new_empty(q.shape)
    block_size = k_cache.shape[1]
    # The chunks are planned on the host (the Triton kernels need no such sync).
    starts = query_start_loc.tolist()
    query_lens = [end - start for start, end in itertools.pairwise(starts)]
    context_lens = seq_lens.tolist()
    order = sorted(range(len(context_lens)), key=lambda i: (query_lens[i], context_lens[i]))
    bytes_per_block = 2 * k_cache[0].numel() * k_cache.element_size()  # K and V
    chunks = _plan_chunks([query_lens[i] for i in order], [context_lens[i] for i in order],
                          block_size, bytes_per_block)
    # Padding entries (-1) read block 0; whatever they read is zeroed and masked.
    block_ids = block_tables.clamp(min=0).long()
    key_pos = torch.arange(block_ids.shape[1] * block_size, device=q.device)
    past_end = key_pos[None, :] >= seq_lens[:, None]  # [B, max_blocks * block_size]
    out = torch.empty_like(q)
    for first, end, num_blocks in chunks:
        seqs = torch.tensor(order[first:end], device=q.device)
        tokens = torch.tensor(
            [t for i in order[first:end] for t in range(starts[i], starts[i + 1])],
            device=q.device,
        )
        out[tokens] = _attend_chunk(
            q[tokens], k_cache, v_cache, block_ids[seqs, :num_blocks], seq_lens[seqs],
            past_end[seqs, :num_blocks * block_size], scale,
        )
    return out


def _attend_chunk(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_ids: Tensor,
                  seq_lens: Tensor, past_end: Tensor, scale: float) -> Tensor:
    """`paged_attention` over a few sequences with the same number of queries, whose gathered
    K/V fit in the CPU's cache.

    q: `[B * Q, H, D]`, sequence after sequence; block_ids: `[B, n]` valid block ids covering
    every context; past_end: `[B, n * block_size]`, the slots past each sequence's end.
    Returns `[B * Q, H, D]`.
    """
    num_seqs = seq_lens.shape[0]
    num_tokens, num_heads, head_dim = q.shape
    query_len = num_tokens // num_seqs
    keys, values = _gather_context(k_cache, v_cache, block_ids, past_end)
    if query_len == 1:  # decodes: the last position sees its whole context
        visible = ~past_end[:, None, :]
    else:
        # Query row r of sequence s sits at position seq_lens[s] - Q + r and sees the keys up
        # to its own position (causal), never a slot past the sequence's end.
        key_pos = torch.arange(past_end.shape[1], device=q.device)
        query_pos = (seq_lens - query_len)[:, None] + torch.arange(query_len, device=q.device)
        visible = key_pos[None, None, :] <= query_pos[:, :, None]  # [B, Q, L_pad]
    out = F.scaled_dot_product_attention(  # GQA: query heads share KV heads
        q.float().view(num_seqs, query_len, num_heads, head_dim).transpose(1, 2),
        keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=visible[:, None], scale=scale, enable_gqa=True,
    )  # [B, H, Q, D]
    return out.transpose(1, 2).reshape(num_tokens, num_heads, head_dim).to(q.dtype)


def _plan_chunks(query_lens: list[int], context_lens: list[int], block_size: int,
                 bytes_per_block: int) -> list[tuple[int, int, int]]:
    """Cut a list of sequences, in order, into runs of one query length whose gathered K/V,
    each padded to the run's longest context, fit in `GATHER_CHUNK_BYTES`.

    Returns `(first, end, num_blocks)` per run: list entries `first:end`, `num_blocks` blocks
    each. A sequence too long for the budget on its own is a run of one. One query length per
    run means no query is padded: decodes run together, each prefill length apart.
    """
    chunks = []
    first, blocks = 0, 0
    for i, length in enumerate(context_lens):
        grown = max(blocks, -(-length // block_size))
        too_big = (i + 1 - first) * grown * bytes_per_block > GATHER_CHUNK_BYTES
        if i > first and (too_big or query_lens[i] != query_lens[first]):
            chunks.append((first, i, blocks))
            first, grown = i, -(-length // block_size)
        blocks = grown
    chunks.append((first, len(context_lens), blocks))
    return chunks


def _gather_context(k_cache: Tensor, v_cache: Tensor, block_ids: Tensor,
                    past_end: Tensor) -> tuple[Tensor, Tensor]:
    """Keys and values `[B, L_pad, H_kv, D]` (float32) of a chunk of sequences, read through
    `block_ids [B, n]`, with every slot past a sequence's end (`past_end [B, L_pad]`) zeroed.

    Masking alone would not be enough: a masked score is still computed (NaN * 0 is NaN), and
    a zero probability times a NaN value is NaN.
    """
    numel = block_ids.numel() * k_cache[0].numel()
    buffer = _gather_buffer(2 * numel, k_cache.dtype, k_cache.device)
    keys = gather_blocks(k_cache, block_ids, buffer[:numel]).float()
    values = gather_blocks(v_cache, block_ids, buffer[numel:]).float()
    tail_seq, tail_pos = torch.nonzero(past_end, as_tuple=True)  # few: write only those
    keys[tail_seq, tail_pos] = 0.0
    values[tail_seq, tail_pos] = 0.0
    return keys, values


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
    if block_mapping.shape[0] == 0:
        return
    src, dst = block_mapping[:, 0].long(), block_mapping[:, 1].long()
    for cache in kv_caches:
        cache[:, dst] = cache[:, src]


def swap_blocks(src: Tensor, dst: Tensor, block_mapping: Tensor, *, validate: bool = True) -> None:
    """Copy block `s` of `src` to block `d` of `dst` for every `(s, d)` row of `block_mapping`.

    src, dst: one layer's caches, `[2, num_blocks, block_size, H_kv, D]` (blocks along dim 1, as
    in `copy_blocks`), possibly on different devices and with different numbers of blocks: the
    device cache and its host pool (section 4.5, swapping). `block_mapping` lives on the CPU or
    on `src`'s device. Call it once per layer.
    """
    if validate:
        _check_layer_cache("src", src)
        _check_layer_cache("dst", dst)
        if src.shape[2:] != dst.shape[2:] or src.dtype != dst.dtype:
            raise ValueError(
                f"src {tuple(src.shape)} {src.dtype} and dst {tuple(dst.shape)} {dst.dtype} "
                "must have the same block shape and dtype"
            )
        _check_block_mapping(block_mapping, src.shape[1], dst.shape[1])
    if block_mapping.shape[0] == 0:
        return
    src_ids = block_mapping[:, 0].long().to(src.device)
    dst_ids = block_mapping[:, 1].long().to(dst.device)
    dst[:, dst_ids] = src[:, src_ids].to(dst.device)


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> list[Tensor]:
    """One zeroed `[2, num_blocks, block_size, H_kv, D]` cache per layer (a device cache or a
    host pool)."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


# ---------------------------------------------------------------------------------------------
# Choosing a backend
# ---------------------------------------------------------------------------------------------

TORCH_OPS = AttentionOps(
    name="torch",
    paged_attention=paged_attention,
    reshape_and_cache=reshape_and_cache,
    copy_blocks=copy_blocks,
    swap_blocks=swap_blocks,
)


def get_attention_ops(
    backend: str | None = None, device: str | torch.device | None = None
) -> AttentionOps:
    """The paged-attention operations of `backend`: "torch" (this module), "triton"
    (`minipaged.kernels`, imported only now) or None / "auto": Triton on a CUDA device, torch
    otherwise. `device` defaults to torch's default device.

    Swapping is a plain copy between devices, so both backends share `swap_blocks`.
    """
    if backend is None or backend == "auto":
        device = torch.device(device) if device is not None else torch.get_default_device()
        backend = "triton" if device.type == "cuda" else "torch"
    if backend == "torch":
        return TORCH_OPS
    if backend == "triton":
        kernels = importlib.import_module("minipaged.kernels")
        return AttentionOps(
            name="triton",
            paged_attention=kernels.paged_attention,
            reshape_and_cache=kernels.reshape_and_cache,
            copy_blocks=kernels.copy_blocks,
            swap_blocks=swap_blocks,
        )
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS} or 'auto'")


# ---------------------------------------------------------------------------------------------
# The model's attention interface over a paged KV cache
# ---------------------------------------------------------------------------------------------


class PagedAttentionBackend:
    """The model's `AttentionBackend` (`minipaged.model`) over a paged KV cache.

    Holds every layer's cache (`[2, num_blocks, block_size, H_kv, D]`), the step's
    `AttentionMetadata` (replace `metadata` before each step) and the operations of one backend.
    A layer's call stores the new K/V in that layer's cache, then attends over the whole context.
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
            _check_layer_cache(f"kv_caches[{i}]", cache)
        self.kv_caches = list(kv_caches)
        self.metadata = metadata
        self.ops = ops if ops is not None else get_attention_ops(device=kv_caches[0].device)

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """Store `k`, `v [T, H_kv, D]` in layer `layer_idx`'s cache; return attention [T, H, D]."""
        md = self.metadata
        if md is None:
            raise ValueError("PagedAttentionBackend has no AttentionMetadata for this step")
        if not 0 <= layer_idx < len(self.kv_caches):
            raise ValueError(f"layer_idx {layer_idx} outside 0..{len(self.kv_caches) - 1}")
        cache = self.kv_caches[layer_idx]
        self.ops.reshape_and_cache(k, v, cache[0], cache[1], md.slot_mapping)
        return self.ops.paged_attention(
            q, cache[0], cache[1], md.block_tables, md.seq_lens, md.query_start_loc, scale,
            max_query_len=md.max_query_len, max_seq_len=md.max_seq_len,
        )
