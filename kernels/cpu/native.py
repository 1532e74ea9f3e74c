"""Building this layer's C kernels (`build_native`), and the native paged-attention kernels
(`csrc/paged_decode.c`: decode, and the KV write): built once per machine, loaded with `ctypes`.

PyTorch has no operator that attends over K/V scattered in blocks, so the PyTorch backends copy
every sequence's blocks out of the cache before attending (`attention.gather_context`): on a
CPU that copy costs as much as the attention itself (`benchmarks/roofline.py`). The kernel reads
the blocks in place instead. It is plain C with no PyTorch headers, so building it takes about a
second: the system's C compiler (`$CC`, else `cc`), `-O3 -ffast-math -march=native -fopenmp`
(fast-math for the compile only: it must not change the process's floating-point state; without
OpenMP or `-march=native` where the compiler lacks them), into a cache directory
(`$MINIPAGED_CACHE`, else `~/.cache/minipaged`) under a name that hashes the source, the flags,
the compiler and this CPU's model and flags, so a cached build never runs on a CPU it was not
built for.

`native_decode_available()` says whether the kernel could be built here (it is built then, once
per process); without a compiler the CPU backend attends the PyTorch way and says so in the log.
`paged_decode` runs it on `torch.get_num_threads()` OpenMP threads. `write_kv` stores a step's
new keys and values in their slots in one call: PyTorch's way (a mask of the written slots, an
index, two `index_copy_`) is six operators a layer, each costing more than the copy at a decode.

Every kernel call of this layer shows in torch's profiler under its own name (`profiled`),
at no cost when no profiler runs.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
# -ffast-math only to compile (vector reductions and glibc's vector expf): linked with it, gcc
# adds crtfastmath.o, whose constructor flushes subnormals to zero in the whole process.
CFLAGS = ("-O3", "-ffast-math", "-fPIC", "-std=c11", "-c")
LDFLAGS = ("-shared", "-lm")
# Tried in turn: a compiler that lacks OpenMP (Apple's clang) or -march=native still builds it.
OPTIONAL_FLAGS = (("-march=native", "-fopenmp"), ("-march=native",), ())
DTYPES = (torch.float32, torch.bfloat16)  # what the kernel reads and writes
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 64, 256, 256  # the kernel's fixed buffers
PROFILER_NAME = "minipaged::paged_decode"  # its calls, as torch's profiler lists them
WRITE_PROFILER_NAME = "minipaged::write_kv"


def profiled(name: str) -> AbstractContextManager:
    """`torch.profiler.record_function(name)` while a profiler runs, else nothing: entering a
    record_function costs ~7 us even with no profiler, and a decode step calls ~150 kernels."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return nullcontext()


def _cpu_identity() -> str:
    """The CPU's model name and feature flags (Linux), else what `platform` knows."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _cache_dir() -> Path:
    return Path(os.environ.get("MINIPAGED_CACHE", Path.home() / ".cache" / "minipaged"))


def build_native(
    source: Path, compiler: str | None = None, cache_dir: Path | None = None
) -> Path | None:
    """The shared library of the C file `source` for this CPU, built by `compiler` (default
    `$CC`, else `cc`) into `cache_dir` (default `$MINIPAGED_CACHE`, else `~/.cache/minipaged`)
    unless a build with the same key is already there; None, with the reason in the log, when
    there is no such compiler or the build fails (the caller then takes its PyTorch path).
    Every kernel of this layer is built this one way."""
    found = shutil.which(compiler or os.environ.get("CC", "cc"))
    if found is None:
        logger.warning("no C compiler %r to build %s: its callers take their PyTorch paths",
                       compiler or os.environ.get("CC", "cc"), source.name)
        return None
    version = subprocess.run([found, "--version"], capture_output=True, text=True).stdout
    flags = CFLAGS + LDFLAGS + tuple(f for extra in OPTIONAL_FLAGS for f in extra)
    parts = [source.read_bytes(), " ".join(flags).encode(), version.encode(),
             _cpu_identity().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    target = (cache_dir or _cache_dir()) / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built, errors = Path(scratch) / target.name, []
        for extra in OPTIONAL_FLAGS:
            error = _compile(found, source, extra, Path(scratch), built)
            if error is None:
                os.replace(built, target)  # atomic: a concurrent build of this key is the same
                return target
            errors.append(f"with {' '.join(extra) or 'no optional flags'}:\n{error}")
    logger.warning("building %s failed, its callers take their PyTorch paths:\n%s",
                   source.name, "\n".join(errors))
    return None


def build_native_decode(compiler: str | None = None, cache_dir: Path | None = None) -> Path | None:
    """`build_native` of `csrc/paged_decode.c`: without it, CPU paged decode gathers blocks the
    PyTorch way."""
    return build_native(SOURCE, compiler, cache_dir)


def _compile(
    compiler: str, source: Path, extra: tuple[str, ...], scratch: Path, built: Path
) -> str | None:
    """Compile, then link (fast-math only in the first), into `built`; the error, or None."""
    obj = scratch / f"{source.stem}.o"
    result = subprocess.run([compiler, *CFLAGS, *extra, str(source), "-o", str(obj)],
                            capture_output=True, text=True)
    if result.returncode == 0:
        link_extra = [f for f in extra if f == "-fopenmp"]
        result = subprocess.run([compiler, str(obj), *LDFLAGS, *link_extra, "-o", str(built)],
                                capture_output=True, text=True)
    return None if result.returncode == 0 else result.stderr


def load_native(source: Path,
                signatures: Mapping[str, tuple[Sequence[type], type | None]]) -> ctypes.CDLL | None:
    """The shared library of the C file `source` (`build_native`), loaded with `ctypes`, each
    function named in `signatures` given its argument and result types (name -> (argtypes,
    restype)); None where it cannot be built. Every kernel module of this layer loads its C
    file this way, once per process."""
    path = build_native(source)
    if path is None:
        return None
    library = ctypes.CDLL(str(path))
    for name, (argtypes, restype) in signatures.items():
        function = getattr(library, name)
        function.argtypes, function.restype = list(argtypes), restype
    return library


POINTER, I64, I32, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The kernels, built and loaded once per process (`load_native`); None without."""
    return load_native(SOURCE, {
        "paged_decode": ([POINTER] * 5 + [I64] + [POINTER] * 3 + [I64] + [I32] * 4
                         + [F32, I32, I32], ctypes.c_int),
        "write_kv": ([POINTER, I64, POINTER, I64, POINTER, POINTER, POINTER, I64, I64, I32],
                     None),
    })


def native_decode_available() -> bool:
    """Whether the native kernel is built and loaded in this process (building it if need be)."""
    return _library() is not None


def native_decode_supports(k_cache: Tensor, num_heads: int | None = None) -> bool:
    """Whether the kernel takes this cache (a CPU tensor of one of `DTYPES`, head and block
    sizes within its buffers) and, given `num_heads`, that many query heads on it."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group_fits = num_heads is None or (
        num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_GROUP
    )
    return (
        k_cache.device.type == "cpu" and k_cache.dtype in DTYPES and group_fits
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
    with profiled(PROFILER_NAME):
        status = call()
    if status != 0:
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
) -> Callable[[], int]:
    """`paged_decode(...)` as a call with every argument fixed, to run again and again over the
    same tensors (their contents changing: a step replayed); it returns the kernel's status, 0.
    All of `rows` are decoded; threads as many as torch's now."""
    library = _library()
    if library is None:
        raise RuntimeError("the native CPU paged-decode kernel could not be built here")
    if validate:
        _check_decode_args(out, q, k_cache, v_cache, block_tables, seq_lens, rows, seqs)
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    return functools.partial(
        library.paged_decode, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        out.data_ptr(), block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(),
        rows.data_ptr(), seqs.data_ptr(), rows.numel(), num_heads, num_kv_heads, head_dim,
        block_size, scale, int(q.dtype == torch.bfloat16), torch.get_num_threads(),
    )


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
    """Whether `write_kv` takes these: contiguous CPU caches of one of `DTYPES`, int64 slots,
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


def write_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
             slot_mapping: Tensor) -> None:
    """The attention contract's `reshape_and_cache` in one call: row t of `key` and `value`
    (`[T, H_kv, D]`, as `write_kv_supports` takes them) into slot `slot_mapping[t]` (int64, -1:
    skip) of the contiguous caches `[num_blocks, block_size, H_kv, D]`. The slots must lie in
    the cache (`minipaged.attention.contract.check_reshape_and_cache_args`): they are not
    checked here. Raises `RuntimeError` when the kernel is not available."""
    call = bind_write_kv(key, value, k_cache, v_cache, slot_mapping)
    with profiled(WRITE_PROFILER_NAME):
        call()


def bind_write_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                  slot_mapping: Tensor) -> Callable[[], None]:
    """`write_kv(...)` as a call with every argument fixed, to run again and again over the
    same tensors (their contents changing: a step replayed)."""
    library = _library()
    if library is None:
        raise RuntimeError("the native CPU paged-attention kernels could not be built here")
    _, _, num_kv_heads, head_dim = k_cache.shape
    return functools.partial(
        library.write_kv, key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
        k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(), key.shape[0],
        num_kv_heads * head_dim, key.element_size())
