"""Write new keys and values into the paged KV cache, one slot per token.

The model computes K/V for the step's new tokens as a flat `[T, H_kv, D]` batch; each token's
slot (`block_id * block_size + offset`, from the block manager's block tables) says where its
K/V live from now on. Slot -1 means "do not write" (a token whose K/V are already cached, or
padding). This is vLLM's `reshape_and_cache` (Kwon et al., SOSP'23, section 4.1).

Program: a tile of tokens, each with all its KV heads and head dims.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from minipaged.attention.contract import check_reshape_and_cache_args

from .launch import KernelLaunch, pow2_at_least, run_launches, token_tile


# One compiled program for every batch size (Triton would specialise 1 and multiples of 16).
@triton.jit(do_not_specialize=["num_tokens"])
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    num_tokens,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TOKEN_TILE: tl.constexpr,
):
    """Copy TOKEN_TILE tokens' [H_kv, D] keys and values into their slots; skip slot -1."""
    tokens = tl.program_id(0) * TOKEN_TILE + tl.arange(0, TOKEN_TILE)
    slots = tl.load(slot_mapping_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    write = slots >= 0
    block = tl.where(write, slots, 0) // BLOCK_SIZE
    offset = tl.where(write, slots, 0) % BLOCK_SIZE

    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    # [tokens, heads, dims] index grids.
    t3 = tokens[:, None, None]
    h3 = heads[None, :, None]
    d3 = dims[None, None, :]
    mask = write[:, None, None] & (h3 < NUM_KV_HEADS) & (d3 < HEAD_DIM)
    b3 = block[:, None, None]
    o3 = offset[:, None, None]

    key = tl.load(key_ptr + t3 * stride_kt + h3 * stride_kh + d3 * stride_kd, mask=mask)
    tl.store(k_cache_ptr + b3 * stride_kcb + o3 * stride_kcs + h3 * stride_kch + d3 * stride_kcd,
             key, mask=mask)
    value = tl.load(value_ptr + t3 * stride_vt + h3 * stride_vh + d3 * stride_vd, mask=mask)
    tl.store(v_cache_ptr + b3 * stride_vcb + o3 * stride_vcs + h3 * stride_vch + d3 * stride_vcd,
             value, mask=mask)


def reshape_and_cache(
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    *,
    validate: bool = True,
) -> None:
    """Write `key[t]`, `value[t]` ([T, H_kv, D]) into slot `slot_mapping[t]` of the caches
    ([num_blocks, block_size, H_kv, D]).

    In place; tokens whose slot is -1 are skipped, every other slot is left untouched. Raises
    `ValueError` on inconsistent arguments (the reference's checks, shared); `validate=False`
    skips them and their host sync.
    """
    if validate:
        check_reshape_and_cache_args(key, value, k_cache, v_cache, slot_mapping)
    run_launches(reshape_and_cache_launches(key, value, k_cache, v_cache, slot_mapping))


def reshape_and_cache_launches(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> list[KernelLaunch]:
    """The one launch `reshape_and_cache` makes (none for no tokens), on validated arguments.

    Works on meta tensors too, which is how `minipaged.kernels.triton.aot` compiles it for a GPU.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return []
    heads_pad = pow2_at_least(num_kv_heads)
    head_dim_pad = pow2_at_least(head_dim)
    tile = token_tile(heads_pad * head_dim_pad, num_tokens)
    return [KernelLaunch(
        "reshape_and_cache", _reshape_and_cache_kernel, (triton.cdiv(num_tokens, tile),),
        (key, value, k_cache, v_cache, slot_mapping, num_tokens,
         *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride()),
        dict(NUM_KV_HEADS=num_kv_heads, HEADS_PAD=heads_pad,
             HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
             BLOCK_SIZE=k_cache.shape[1], TOKEN_TILE=tile),
    )]
