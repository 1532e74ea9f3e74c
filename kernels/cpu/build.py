"""Building this layer's C kernels and loading them: each C file of `csrc/` is compiled once
per machine by the system's C compiler and loaded with `ctypes`.

The kernels are plain C with no PyTorch headers, so a build takes about a second: the system's
C compiler (`$CC`, else `cc`), `-O3 -ffast-math -march=native -fopenmp` (fast-math for the
compile only: it must not change the process's floating-point state; without OpenMP or
`-march=native` where the compiler lacks them), into a cache directory (`$MINIPAGED_CACHE`, else
`~/.cache/minipaged`) under a name that hashes the source, the flags, the compiler and this CPU's
model and flags, so a cached build never runs on a CPU it was not built for. Without a compiler
`load_native` says None and each kernel's callers take their PyTorch paths.

Every kernel call of this layer shows in torch's profiler under its own name (`profiled`), at
no cost when no profiler runs.
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

logger = logging.getLogger(__name__)

# -ffast-math only to compile (vector reductions and glibc's vector expf): linked with it, gcc
# adds crtfastmath.o, whose constructor flushes subnormals to zero in the whole process.
CFLAGS = ("-O3", "-ffast-math", "-fPIC", "-std=c11", "-c")
LDFLAGS = ("-shared", "-lm")
# Tried in turn: a compiler that lacks OpenMP (Apple's clang) or -march=native still builds it.
OPTIONAL_FLAGS = (("-march=native", "-fopenmp"), ("-march=native",), ())
# The C types of the kernels' arguments, as ctypes names them.
POINTER, I64, I32, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


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


def native_loader(
    source: Path, signatures: Mapping[str, tuple[Sequence[type], type | None]]
) -> Callable[[], ctypes.CDLL | None]:
    """`load_native(source, signatures)` on the first call, the same library (or None) on every
    call after: each kernel module's `_library`, so that a kernel is built and loaded once per
    process, and only when something asks for it."""
    return functools.cache(functools.partial(load_native, source, signatures))
