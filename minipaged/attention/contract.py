"""The attention contract: what every paged-attention backend agrees on.

PagedAttention (Kwon et al., SOSP'23, section 4.1) stores each sequence's keys and values in
fixed-size blocks that need not be contiguous; a per-sequence block table maps logical block `j`
(tokens `j * block_size ...`) to a physical block of the cache. Two backends implement the
operations on that cache: the PyTorch reference (`minipaged.attention.reference`) and the Triton
kernels (`minipaged.kernels`). Both build on this module, and only on it:

* `AttentionMetadata`: the flat batch's bookkeeping, the same for every layer of a step;
* `AttentionOps`: the interface, one backend's four operations with the same signatures;
* `dense_attention`: causal attention over contiguous K/V, the oracle both are tested against;
* the argument checks, so that both backends reject the same inputs with the same `ValueError`.

Layouts (docs/architecture.md, "The KV cache in memory"): one KV cache per layer,
`[2, num_blocks, block_size, H_kv, D]` (index 0 keys, 1 values), so `cache[0]` / `cache[1]` are
the `k_cache` / `v_cache` the attention functions take. Blocks are addressed along dim 1 of that
per-layer tensor; a host pool has the same layout with its own number of blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass
class AttentionMetadata:
    """The flat batch's attention bookkeeping (docs/architecture.md, "One step of the engine").

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


@dataclass(frozen=True)
class AttentionOps:
    """One backend's paged-attention operations, with the same signatures in every backend.

    `plan`, for a backend that has one, is work done once per step for every layer:
    `plan(block_tables, seq_lens, query_start_loc, k_cache)` returns what that backend's
    `paged_attention` accepts as `plan=` instead of working it out again from the metadata (the
    PyTorch reference's chunks of sequences). The Triton kernels need none: a layer is one
    varlen launch.
    """

    name: str
    paged_attention: Callable[..., Tensor]
    reshape_and_cache: Callable[..., None]
    copy_blocks: Callable[..., None]
    swap_blocks: Callable[..., None]
    plan: Callable[..., object] | None = None


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
    # K and V repeated per query head: [H, L, D] each
    kf, vf = (t.float().repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
    scores = (qf @ kf.transpose(1, 2)) * scale  # [H, n, L]
    query_pos = torch.arange(context_len - n, context_len, device=q.device)[:, None]
    key_pos = torch.arange(context_len, device=q.device)[None, :]
    scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vf  # [H, n, D]
    return out.transpose(0, 1).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# Argument checks, shared by every backend so that all reject the same inputs
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

    Checks shapes, dtypes and devices, then the metadata's values (one host sync, so callers on
    a hot path may skip it). `max_query_len` / `max_seq_len`, when given, must bound the real
    maxima: an implementation that sizes its work by them would otherwise drop queries or keys.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, D], got shape {tuple(q.shape)}")
    check_kv_cache_pair(k_cache, v_cache)
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
        check_index_tensor(name, t)
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
    for name, bound, lens, what in (("max_query_len", max_query_len, query_lens, "queries"),
                                    ("max_seq_len", max_seq_len, seq_lens, "tokens")):
        if num_seqs and bound is not None and bound < int(lens.max()):
            raise ValueError(f"{name}={bound} but a sequence has {int(lens.max())} {what}")


def check_reshape_and_cache_args(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Validate `reshape_and_cache`'s inputs; raise `ValueError` naming the problem (one sync)."""
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            f"key and value must both be [T, H_kv, D], got {tuple(key.shape)} and "
            f"{tuple(value.shape)}"
        )
    check_kv_cache_pair(k_cache, v_cache)
    if key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"key has {key.shape[1]} heads of dim {key.shape[2]} but the cache holds "
            f"{k_cache.shape[2]} heads of dim {k_cache.shape[3]}"
        )
    if len({key.dtype, value.dtype, k_cache.dtype, v_cache.dtype}) != 1:
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
    check_index_tensor("slot_mapping", slot_mapping)
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


def check_copy_blocks_args(kv_caches: Sequence[Tensor], block_mapping: Tensor) -> None:
    """Validate `copy_blocks`' inputs; raise `ValueError` naming the problem (one sync)."""
    if len(kv_caches) == 0:
        raise ValueError("kv_caches is empty: need one [2, num_blocks, ...] cache per layer")
    for i, cache in enumerate(kv_caches):
        check_layer_cache(f"kv_caches[{i}]", cache)
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
    check_block_mapping(block_mapping, num_blocks, num_blocks)
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    if bool(torch.isin(dst, src).any()):
        raise ValueError("a block is both copied from and copied to in one copy_blocks call")


def check_swap_blocks_args(src: Tensor, dst: Tensor, block_mapping: Tensor) -> None:
    """Validate `swap_blocks`' inputs (one layer's device cache and host pool, either way)."""
    check_layer_cache("src", src)
    check_layer_cache("dst", dst)
    if src.shape[2:] != dst.shape[2:] or src.dtype != dst.dtype:
        raise ValueError(
            f"src {tuple(src.shape)} {src.dtype} and dst {tuple(dst.shape)} {dst.dtype} "
            "must have the same block shape and dtype"
        )
    check_block_mapping(block_mapping, src.shape[1], dst.shape[1])


# -- the checks' building blocks ----------------------------------------------------------------


def check_index_tensor(name: str, t: Tensor) -> None:
    """An int32 or int64 tensor, the index dtypes every backend reads."""
    if t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be an int32 or int64 tensor, got {t.dtype}")


def check_kv_cache_pair(k_cache: Tensor, v_cache: Tensor) -> None:
    """The two halves of a layer's cache: `[num_blocks, block_size, H_kv, D]` each, alike."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, H_kv, D], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )


def check_layer_cache(name: str, cache: Tensor) -> None:
    """One layer's whole cache (or host pool): `[2, num_blocks, block_size, H_kv, D]`."""
    if cache.dim() != 5 or cache.shape[0] != 2:
        raise ValueError(
            f"{name} must be [2, num_blocks, block_size, H_kv, D], got {tuple(cache.shape)}"
        )


def check_block_mapping(block_mapping: Tensor, num_src: int, num_dst: int) -> None:
    """A `[N, 2]` integer tensor of (src, dst) block ids in range, each dst named once."""
    check_index_tensor("block_mapping", block_mapping)
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
