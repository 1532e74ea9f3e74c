"""Copy whole KV-cache blocks, in every layer: the data movement behind copy-on-write.

When a sequence that shares a block with another (parallel sampling, beam search, a shared
prefix) is about to write into it, the block manager gives it a fresh block and asks for the
shared block's contents to be copied there first (Kwon et al., SOSP'23, section 4.4). All of a
step's copies arrive as one `[N, 2]` (source, destination) mapping and are done in one call.

Program: one chunk of one block's keys or values; one launch per layer's cache tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._launch import check_storage_dtype, interpreting, pow2_at_least


@triton.jit
def _copy_blocks_kernel(
    cache_ptr, block_mapping_ptr,
    stride_kv, stride_block,
    BLOCK_NUMEL: tl.constexpr, CHUNK: tl.constexpr,
):
    """Copy chunk `program_id(2)` of the keys (0) or values (1) of pair `program_id(0)`."""
    pair = tl.program_id(0)
    kv = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    src = tl.load(block_mapping_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(block_mapping_ptr + 2 * pair + 1).to(tl.int64)
    elems = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = elems < BLOCK_NUMEL
    data = tl.load(cache_ptr + kv * stride_kv + src * stride_block + elems, mask=ok)
    tl.store(cache_ptr + kv * stride_kv + dst * stride_block + elems, data, mask=ok)


def check_copy_blocks_args(kv_caches: list[Tensor], block_mapping: Tensor) -> None:
    """Raise `ValueError` naming the problem unless the caches and mapping fit together."""
    if not kv_caches:
        raise ValueError("kv_caches is empty: expected one [2, num_blocks, ...] tensor per layer")
    first = kv_caches[0]
    for i, cache in enumerate(kv_caches):
        if cache.dim() != 5 or cache.shape[0] != 2:
            raise ValueError(
                f"kv_caches[{i}] must be [2, num_blocks, block_size, H_kv, D], "
                f"got {tuple(cache.shape)}"
            )
        if cache.shape != first.shape or cache.dtype != first.dtype or cache.device != first.device:
            raise ValueError(f"kv_caches[{i}] differs from kv_caches[0] in shape, dtype or device")
        if not cache.is_contiguous():
            raise ValueError(f"kv_caches[{i}] must be contiguous")
    check_storage_dtype("kv_caches", first)
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be [N, 2], got {tuple(block_mapping.shape)}")
    if block_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_mapping must be an integer tensor, got {block_mapping.dtype}")
    if block_mapping.device != first.device:
        raise ValueError(f"block_mapping is on {block_mapping.device}, caches on {first.device}")
    num_blocks = first.shape[1]
    if block_mapping.numel() and bool(
        ((block_mapping < 0) | (block_mapping >= num_blocks)).any()
    ):
        raise ValueError(f"block_mapping names a block outside 0..{num_blocks - 1}")
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    if dst.unique().numel() != dst.numel():
        raise ValueError("block_mapping copies into the same destination block twice")
    if bool(torch.isin(dst, src).any()):
        raise ValueError(
            "block_mapping uses a block as both a source and a destination: the copies run in "
            "parallel, so the result would depend on their order"
        )


def copy_blocks(kv_caches: list[Tensor], block_mapping: Tensor) -> None:
    """For each row (src, dst) of `block_mapping`, copy block src to block dst in every layer.

    `kv_caches`: one `[2, num_blocks, block_size, H_kv, D]` tensor per layer (keys, values),
    modified in place. Destinations must be distinct and never a source of the same call.
    """
    check_copy_blocks_args(kv_caches, block_mapping)
    num_pairs = block_mapping.shape[0]
    if num_pairs == 0:
        return
    mapping = block_mapping.contiguous()
    block_numel = kv_caches[0][0, 0].numel()
    chunk = min(pow2_at_least(block_numel), (1 << 16) if interpreting() else 4096)
    grid = (num_pairs, 2, triton.cdiv(block_numel, chunk))
    for cache in kv_caches:
        _copy_blocks_kernel[grid](
            cache, mapping, cache.stride(0), cache.stride(1),
            BLOCK_NUMEL=block_numel, CHUNK=chunk,
        )
