"""Write new keys and values into the paged KV cache, one slot per token.

The model computes K/V for the step's new tokens as a flat `[T, H_kv, D]` batch; each token's
slot (`block_id * block_size + offset`, from the block manager's block tables) says where its
K/V live from now on. Slot -1 means "do not write" (a token whose K/V are already cached, or
padding). This is vLLM's `reshape_and_cache` (Kwon et al., SOSP'23, section 4.1).

Program: a tile of tokens, each with all its KV heads and head dims.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._launch import check_storage_dtype, interpreting, pow2_at_least


@triton.jit
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


def check_reshape_and_cache_args(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Raise `ValueError` naming the problem unless the arguments fit together."""
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
            f"key has [H_kv, D] = {list(key.shape[1:])}, the cache {list(k_cache.shape[2:])}"
        )
    if not key.dtype == value.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(
            f"dtype mismatch: key {key.dtype}, value {value.dtype}, k_cache {k_cache.dtype}, "
            f"v_cache {v_cache.dtype}"
        )
    check_storage_dtype("key", key)
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be an integer tensor, got {slot_mapping.dtype}")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    for name, t in (("value", value), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("slot_mapping", slot_mapping)):
        if t.device != key.device:
            raise ValueError(f"{name} is on {t.device} but key is on {key.device}")
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if slot_mapping.numel() and bool(((slot_mapping < -1) | (slot_mapping >= num_slots)).any()):
        raise ValueError(f"slot_mapping holds a slot outside -1..{num_slots - 1}")
    written = slot_mapping[slot_mapping >= 0]
    if written.unique().numel() != written.numel():
        raise ValueError("slot_mapping names the same slot twice: which write wins is undefined")


def reshape_and_cache(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Write `key[t]`, `value[t]` ([T, H_kv, D]) into slot `slot_mapping[t]` of the caches.

    In place; tokens whose slot is -1 are skipped, every other slot is left untouched.
    """
    check_reshape_and_cache_args(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    heads_pad = pow2_at_least(num_kv_heads)
    head_dim_pad = pow2_at_least(head_dim)
    # About 4K elements per program on a GPU; the interpreter prefers few, large programs.
    elements = (1 << 16) if interpreting() else 4096
    token_tile = min(pow2_at_least(elements // (heads_pad * head_dim_pad)),
                     pow2_at_least(num_tokens))
    _reshape_and_cache_kernel[(triton.cdiv(num_tokens, token_tile),)](
        key, value, k_cache, v_cache, slot_mapping,
        num_tokens,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=heads_pad,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=k_cache.shape[1], TOKEN_TILE=token_tile,
    )
