"""The Triton cache kernels write and copy exactly what they are told, bit for bit.

`reshape_and_cache` must fill exactly the named slots and leave every other slot untouched;
`copy_blocks` must copy exactly the named blocks in every layer. Expected results are built with
plain tensor indexing on a clone, and checked against the PyTorch reference
(`minipaged.attention.reference`) too. Comparisons are on the raw bits, so NaN garbage must survive
untouched where nothing was written.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import minipaged.attention.reference as reference
from minipaged import kernels

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" \
    else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of a float tensor, so that NaN compares equal to itself."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def garbage_filled(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> Tensor:
    """Random values with NaN sprinkled in: what a cache holds before a write."""
    t = torch.randn(shape, generator=gen)
    t[torch.rand(shape, generator=gen) < 0.1] = float("nan")
    return t.to(dtype=dtype, device=DEVICE)


@settings(max_examples=20)
@given(
    block_size=st.sampled_from([8, 16, 32]),
    num_kv_heads=st.sampled_from([1, 2, 3]),
    head_dim=st.sampled_from([32, 64, 128]),
    dtype=st.sampled_from(DTYPES),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    data=st.data(),
)
def test_reshape_and_cache_writes_exactly_the_named_slots(
    block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    index_dtype: torch.dtype, data: st.DataObject,
) -> None:
    num_blocks = data.draw(st.integers(1, 6))
    num_slots = num_blocks * block_size
    # Distinct slots, some tokens skipped with -1.
    num_tokens = data.draw(st.integers(0, min(num_slots, 48)))
    slots = data.draw(st.permutations(range(num_slots)))[:num_tokens]
    skip = data.draw(st.lists(st.booleans(), min_size=num_tokens, max_size=num_tokens))
    slot_list = [-1 if s else slot for slot, s in zip(slots, skip, strict=True)]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))

    key = garbage_filled((num_tokens, num_kv_heads, head_dim), dtype, gen)
    value = garbage_filled((num_tokens, num_kv_heads, head_dim), dtype, gen)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = garbage_filled(cache_shape, dtype, gen)
    v_cache = garbage_filled(cache_shape, dtype, gen)
    slot_mapping = torch.tensor(slot_list, dtype=index_dtype, device=DEVICE)

    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slot_list):
        if slot >= 0:
            expected_k[slot // block_size, slot % block_size] = key[t]
            expected_v[slot // block_size, slot % block_size] = value[t]
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    reference.reshape_and_cache(key, value, ref_k, ref_v, slot_mapping)

    kernels.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
    assert torch.equal(bits(k_cache), bits(expected_k))
    assert torch.equal(bits(v_cache), bits(expected_v))
    assert torch.equal(bits(k_cache), bits(ref_k))
    assert torch.equal(bits(v_cache), bits(ref_v))


@settings(max_examples=15)
@given(
    block_size=st.sampled_from([8, 16, 32]),
    num_kv_heads=st.sampled_from([1, 3]),
    head_dim=st.sampled_from([32, 128]),
    dtype=st.sampled_from(DTYPES),
    num_layers=st.integers(1, 3),
    data=st.data(),
)
def test_copy_blocks_copies_exactly_what_it_is_told(
    block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, num_layers: int,
    data: st.DataObject,
) -> None:
    num_blocks = data.draw(st.integers(2, 10))
    order = data.draw(st.permutations(range(num_blocks)))
    num_dst = data.draw(st.integers(0, num_blocks // 2))
    dst = order[:num_dst]
    # Sources from the blocks that are not destinations, repeats allowed (one block shared by
    # several sequences is copied several times).
    src = [data.draw(st.sampled_from(order[num_dst:])) for _ in dst]
    mapping = torch.tensor(list(zip(src, dst, strict=True)), dtype=torch.int64,
                           device=DEVICE).reshape(-1, 2)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    caches = [garbage_filled((2, num_blocks, block_size, num_kv_heads, head_dim), dtype, gen)
              for _ in range(num_layers)]

    expected = [c.clone() for c in caches]
    for cache in expected:
        for s, d in zip(src, dst, strict=True):
            cache[:, d] = cache[:, s].clone()
    ref = [c.clone() for c in caches]
    reference.copy_blocks(ref, mapping)

    kernels.copy_blocks(caches, mapping)
    for got, want, want_ref in zip(caches, expected, ref, strict=True):
        assert torch.equal(bits(got), bits(want))
        assert torch.equal(bits(got), bits(want_ref))


def test_reshape_and_cache_reads_strided_keys() -> None:
    """Keys and values may be views into a fused QKV output, not contiguous tensors."""
    gen = torch.Generator().manual_seed(0)
    fused = garbage_filled((5, 3, 2, 32), torch.float32, gen)  # [T, (q, k, v), H_kv, D]
    key, value = fused[:, 1], fused[:, 2]
    assert not key.is_contiguous()
    k_cache = torch.zeros(2, 8, 2, 32, device=DEVICE)
    v_cache = torch.zeros(2, 8, 2, 32, device=DEVICE)
    slots = torch.tensor([3, 15, -1, 0, 8], device=DEVICE)
    kernels.reshape_and_cache(key, value, k_cache, v_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(bits(k_cache[slot // 8, slot % 8]), bits(key[t]))
            assert torch.equal(bits(v_cache[slot // 8, slot % 8]), bits(value[t]))
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 4


# --- bad input -------------------------------------------------------------------------------


def _cache_args(slots: list[int]) -> tuple:
    key = torch.randn(len(slots), 2, 32, device=DEVICE)
    k_cache = torch.zeros(4, 8, 2, 32, device=DEVICE)
    return (key, key.clone(), k_cache, k_cache.clone(),
            torch.tensor(slots, dtype=torch.int64, device=DEVICE))


@pytest.mark.parametrize(
    ("change", "phrase"),
    [
        (lambda a: (*a[:4], a[4].new_tensor([0, 32])), "outside"),
        (lambda a: (*a[:4], a[4].new_tensor([-2, 3])), "outside"),
        (lambda a: (*a[:4], a[4].new_tensor([5, 5])), "same slot twice"),
        (lambda a: (*a[:4], a[4][:1]), "slot_mapping"),
        (lambda a: (*a[:4], a[4].float()), "slot_mapping"),
        (lambda a: (a[0][:, :1], a[1][:, :1], *a[2:]), "heads"),
        (lambda a: (a[0].half(), a[1].half(), *a[2:]), "dtype"),
    ],
    ids=["slot too large", "slot below -1", "duplicate slot", "short mapping", "float mapping",
         "head mismatch", "dtype mismatch"],
)
def test_reshape_and_cache_rejects_bad_input(change, phrase: str) -> None:
    args = change(_cache_args([1, 2]))
    before = args[2].clone()
    with pytest.raises(ValueError, match=phrase):
        kernels.reshape_and_cache(*args)
    assert torch.equal(args[2], before)


@pytest.mark.parametrize(
    ("pairs", "phrase"),
    [
        ([[0, 9]], "outside"),
        ([[-1, 2]], "outside"),
        ([[0, 2], [1, 2]], "same destination"),
        ([[0, 1], [1, 2]], "copied from and copied to"),
    ],
    ids=["dst out of range", "negative src", "duplicate dst", "dst is also a src"],
)
def test_copy_blocks_rejects_bad_mapping(pairs: list[list[int]], phrase: str) -> None:
    caches = [torch.randn(2, 4, 8, 2, 32, device=DEVICE)]
    with pytest.raises(ValueError, match=phrase):
        kernels.copy_blocks(caches, torch.tensor(pairs, device=DEVICE))


def test_copy_blocks_rejects_bad_caches() -> None:
    mapping = torch.tensor([[0, 1]], device=DEVICE)
    with pytest.raises(ValueError, match="kv_caches"):
        kernels.copy_blocks([], mapping)
    with pytest.raises(ValueError, match=r"\[2, num_blocks"):
        kernels.copy_blocks([torch.randn(4, 8, 2, 32, device=DEVICE)], mapping)
    strided = torch.randn(2, 4, 8, 2, 64, device=DEVICE)[..., ::2]
    with pytest.raises(ValueError, match="contiguous"):
        kernels.copy_blocks([strided], mapping)
