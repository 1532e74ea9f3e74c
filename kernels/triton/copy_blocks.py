"""Copy whole KV-cache blocks, in every layer: the data movement behind copy-on-write.

When a sequence that shares a block with another (parallel sampling, beam search, a shared
prefix) is about to write into it, the block manager gives it a fresh block and asks for the
shared block's contents to be copied there first (Kwon et al., SOSP'23, section 4.4). All of a
step's copies arrive as one `[N, 2]` (source, destination) mapping and are done in one call.

Program: one chunk of one block's keys or values; one launch per layer's cache tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import triton
import triton.language as tl
from torch import Tensor

from minipaged.attention.contract import check_copy_blocks_args

from .launch import KernelLaunch, pow2_at_least, run_launches, tile_elements


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


def copy_blocks(
    kv_caches: Sequence[Tensor], block_mapping: Tensor, *, validate: bool = True
) -> None:
    """For each row (src, dst) of `block_mapping` [N, 2], copy block src to block dst in every
    layer.

    `kv_caches`: one contiguous `[2, num_blocks, block_size, H_kv, D]` tensor per layer (keys,
    values), modified in place. Destinations must be distinct and never a source of the same
    call, since the copies run in parallel. Raises `ValueError` on inconsistent arguments (the
    reference's checks, shared); `validate=False` skips them and their host sync.
    """
    if validate:
        check_copy_blocks_args(kv_caches, block_mapping)
        for i, cache in enumerate(kv_caches):
            if not cache.is_contiguous():
                raise ValueError(f"kv_caches[{i}] must be contiguous (blocks copied as flat runs)")
    run_launches(copy_blocks_launches(kv_caches, block_mapping))


def copy_blocks_launches(kv_caches: Sequence[Tensor], block_mapping: Tensor) -> list[KernelLaunch]:
    """One launch per layer's cache (none for no pairs), on validated arguments.

    Works on meta tensors too, which is how `minipaged.kernels.triton.aot` compiles it for a GPU.
    """
    num_pairs = block_mapping.shape[0]
    if num_pairs == 0:
        return []
    mapping = block_mapping.contiguous()
    block_numel = kv_caches[0][0, 0].numel()
    chunk = min(pow2_at_least(block_numel), tile_elements())
    grid = (num_pairs, 2, triton.cdiv(block_numel, chunk))
    return [
        KernelLaunch("copy_blocks", _copy_blocks_kernel, grid,
                     (cache, mapping, cache.stride(0), cache.stride(1)),
                     dict(BLOCK_NUMEL=block_numel, CHUNK=chunk))
        for cache in kv_caches
    ]
