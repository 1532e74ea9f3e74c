"""The native paged-attention kernels (`csrc/paged_decode.c`: decode, and the KV write), built
and loaded as every kernel of this layer is (`minipaged.kernels.cpu.build`).

PyTorch has no operator that attends over K/V scattered in blocks, so the PyTorch backends copy
every sequence's blocks out of the cache before attending (`attention.gather_context`): on a
CPU that copy costs as much as the attention itself (`benchmarks/cpu/roofline.py`). The kernel reads
the blocks in place instead.

`native_decode_available()` says whether the kernel could be built here (it is built then, once
per process); without a compiler the CPU backend attends the PyTorch way and says so in the log.
`paged_decode` runs it on `torch.get_num_threads()` OpenMP threads. `bind_write_kv` stores a
step's new keys and values in their slots in one call: PyTorch's way (a mask of the written
slots, an index, two `index_copy_`) is six operators a layer, each costing more than the copy
at a decode.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from minipaged.kernels.cpu.build import F32, I32, I64, POINTER, build_native, native_loader
from minipaged.kernels.cpu.calls import ENTRY, KernelCall, require_native

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
DTYPES = (torch.float32, torch.bfloat16)  # what the kernel reads and writes
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 64, 256, 256  # the kernel's fixed buffers
PROFILER_NAME = "minipaged::paged_decode"  # its calls, as torch's profiler lists them
WRITE_PROFILER_NAME = "minipaged::write_kv"


def build_native_decode(compiler: str | None = None, cache_dir: Path | None = None) -> Path | None:
    """`build_native` of `csrc/paged_decode.c`: without it, CPU paged decode gathers blocks the
    PyTorch way."""
    return build_native(SOURCE, compiler, cache_dir)




class PagedDecodeArgs(ctypes.Structure):
    """`paged_decode_args` of `csrc/paged_decode.c`, field for field."""

    _fields_ = [("q", POINTER), ("k_cache", POINTER), ("v_cache", POINTER), ("out", POINTER),
                ("block_tables", POINTER), ("max_blocks", I64), ("seq_lens", POINTER),
                ("rows", POINTER), ("seqs", POINTER), ("n", I64), ("h", I32), ("hkv", I32),
                ("d", I32), ("bs", I32), ("scale", F32), ("bf16", I32), ("threads", I32)]


class WriteKvArgs(ctypes.Structure):
    """`write_kv_args` of `csrc/paged_decode.c`, field for field."""

    _fields_ = [("key", POINTER), ("key_stride", I64), ("value", POINTER),
                ("value_stride", I64), ("k_cache", POINTER), ("v_cache", POINTER),
                ("slot_mapping", POINTER), ("t", I64), ("width", I64), ("elem", I32)]


# The kernels, built and loaded once per process (`native_loader`); None without.
_library = native_loader(SOURCE, {"paged_decode_call": ENTRY, "write_kv_call": ENTRY})


def native_decode_available() -> bool:
    """Whether the native kernel is built and loaded in this process (building it if need be)."""
    return _library() is not None


def native_decode_supports(k_cache: Tensor, num_heads: int | None = None) -> bool:
    """Whether the kernel takes this cache (a CPU tensor of one of `DTYPES`, head and block
    sizes within its buffers) and, given `num_heads`, that many query heads on it."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    return (
        (num_heads is None or (num_heads % num_kv_heads == 0
                               and num_heads // num_kv_heads <= MAX_GROUP))
        and k_cache.device.type == "cpu" and k_cache.dtype in DTYPES
        and head_dim <= MAX_HEAD_DIM and block_size <= MAX_BLOCK
    )


def paged_decode(
    out: Tensor,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    rows: Tensor,
    seqs: Tensor,
    scale: float,
    *,
    validate: bool = True,
) -> None:
    """Write into `out [T, H, D]` the attention of q's rows `rows` (one query each, sequence
    `seqs[i]` of the batch) over their sequences' `seq_lens` keys in the paged cache, read in
    place through `block_tables`. The int tensors must be int32 and contiguous, `q`, `out` and
    the caches contiguous; other rows of `out` are left as they are. Raises `RuntimeError` when
    the kernel is not available (`native_decode_available`). `validate=False` skips the checks
    of layouts and sizes, for a caller that checked them once for every layer of a step."""
    call = bind_paged_decode(out, q, k_cache, v_cache, block_tables, seq_lens, rows, seqs, scale,
                             validate=validate)
    if call.run_as(PROFILER_NAME) != 0:
        raise ValueError("the native decode kernel refused these sizes")


def bind_paged_decode(
    out: Tensor,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    rows: Tensor,
    seqs: Tensor,
    scale: float,
    *,
    validate: bool = True,
) -> KernelCall:
    """`paged_decode(...)` as a call with every argument fixed, to run again and again over the
    same tensors (their contents changing: a step replayed); it returns the kernel's status, 0.
    All of `rows` are decoded; threads as many as torch's now."""
    library = require_native(_library(), "paged-decode kernel")
    if validate:
        _check_decode_args(out, q, k_cache, v_cache, block_tables, seq_lens, rows, seqs)
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    return KernelCall(library.paged_decode_call, PagedDecodeArgs(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(), rows.data_ptr(),
        seqs.data_ptr(), rows.numel(), num_heads, num_kv_heads, head_dim, block_size, scale,
        int(q.dtype == torch.bfloat16), torch.get_num_threads()))


def _check_decode_args(out: Tensor, q: Tensor, k_cache: Tensor, v_cache: Tensor,
                       block_tables: Tensor, seq_lens: Tensor, rows: Tensor,
                       seqs: Tensor) -> None:
    if not native_decode_supports(k_cache, q.shape[1]):
        raise ValueError(f"the native decode kernel takes {DTYPES} on CPU, at most {MAX_GROUP} "
                         f"query heads per KV head, head dim {MAX_HEAD_DIM}, block {MAX_BLOCK}")
    for name, t in (("out", out), ("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not t.is_contiguous() or t.dtype != q.dtype:
            raise ValueError(f"{name} must be contiguous and {q.dtype}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("rows", rows),
                    ("seqs", seqs)):
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int32 tensor, got {t.dtype}")


def write_kv_supports(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                      slot_mapping: Tensor) -> bool:
    """Whether `bind_write_kv` takes these: contiguous CPU caches of one of `DTYPES`, int64 slots,
    and keys and values of the caches' dtype whose rows each hold their heads side by side
    (`[T, H_kv, D]` with strides `(any, D, 1)`: contiguous, or the columns of a fused
    projection's output)."""
    _, _, num_kv_heads, head_dim = k_cache.shape
    return (
        k_cache.device.type == "cpu" and k_cache.dtype in DTYPES
        and k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.dtype == k_cache.dtype
        and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
        and all(t.dtype == k_cache.dtype and t.dim() == 3 and t.shape[1:] == k_cache.shape[2:]
                and t.stride(1) == head_dim and t.stride(2) == 1 for t in (key, value))
    )


def bind_write_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                  slot_mapping: Tensor) -> KernelCall:
    """The attention contract's `reshape_and_cache` as one call with every argument fixed, to
    run again and again over the same tensors (their contents changing: a step replayed): row
    t of `key` and `value` (`[T, H_kv, D]`, as `write_kv_supports` takes them) into slot
    `slot_mapping[t]` (int64, -1: skip) of the contiguous caches `[num_blocks, block_size, H_kv,
    D]`. The slots must lie in the cache (`minipaged.attention.contract.
    check_reshape_and_cache_args`): they are not checked here. Raises `RuntimeError` when the
    kernel is not available."""
    library = require_native(_library(), "paged-attention kernels")
    _, _, num_kv_heads, head_dim = k_cache.shape
    return KernelCall(library.write_kv_call, WriteKvArgs(
        key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), k_cache.data_ptr(),
        v_cache.data_ptr(), slot_mapping.data_ptr(), key.shape[0], num_kv_heads * head_dim,
        key.element_size()))
