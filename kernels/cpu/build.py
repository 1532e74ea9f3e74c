"""Building this layer's C kernels and loading them: each C file of `csrc/` is compiled once
per machine by the system's C compiler and loaded with `ctypes`.

The kernels are plain C with no PyTorch headers, so a build takes about a second: the system's
C compiler (`$CC`, else `cc`), `-O3 -ffast-math -march=native -fopenmp` (fast-math for the
compile only: it must not change the process's floating-point state; without OpenMP or
`-march=native` where the compiler lacks them), into a cache directory (`$MINIPAGED_CACHE`, else
`~/.cache/minipaged`) under a name that hashes the source, the flags, the compiler, the tier and
this CPU's model and flags, so a cached build never runs on a CPU it was not built for. Without
a compiler `load_native` says None and each kernel's callers take their PyTorch paths.

`-march=native` is an optimisation, never a requirement: every file builds for each tier of its
architecture (`TIERS`), and a kernel with paths for wider instruction sets compiles each path
with its own `target` attribute and picks one when called. `$MINIPAGED_CPU_ISA` caps the tier:
the build then targets that tier's baseline (`TIER_MARCH`) and the kernels' dispatch picks no
wider path (`isa_tier`), so one machine can run the code of every narrower CPU.

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
# The instruction-set tiers of each architecture, narrowest first, and what each compiles for
# when `$MINIPAGED_CPU_ISA` caps the build at it (x86-64's psABI levels; NEON is part of every
# aarch64 CPU, so its two tiers differ only in the kernels' dispatch).
ISA_ENV = "MINIPAGED_CPU_ISA"
TIERS = {"x86_64": ("generic", "avx2", "avx512"), "aarch64": ("generic", "neon")}
TIER_MARCH = {"generic": "x86-64", "avx2": "x86-64-v3", "avx512": "x86-64-v4"}  # x86-64 only
# /proc/cpuinfo flags each x86 tier needs (x86-64-v3: AVX2, FMA, F16C, BMI; v4: AVX-512's core)
TIER_FLAGS = {"avx2": {"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"},
              "avx512": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}}
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


def architecture() -> str:
    """This machine's architecture as `TIERS` names it ("x86_64", "aarch64", ...)."""
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


@functools.cache
def cpu_tier() -> str:
    """The widest tier of `TIERS` this CPU has ("generic" for an architecture not listed, or
    where the CPU's flags cannot be read)."""
    tiers = TIERS.get(architecture(), ("generic",))
    if tiers[-1] == "neon":
        return "neon"
    flags = set(_cpu_identity().split())
    return next((tier for tier in reversed(tiers) if TIER_FLAGS.get(tier, set()) <= flags),
                "generic")


def isa_tier() -> str | None:
    """The tier `$MINIPAGED_CPU_ISA` caps the kernels at, lowered to what this CPU has; None
    when it is unset (every build and dispatch then takes the widest the CPU has). Raises
    ValueError naming the variable for a tier this architecture does not have."""
    cap = os.environ.get(ISA_ENV, "").strip().lower()
    if not cap:
        return None
    tiers = TIERS.get(architecture(), ("generic",))
    if cap not in tiers:
        raise ValueError(f"{ISA_ENV}={cap!r}: this {architecture()} CPU's tiers are "
                         f"{', '.join(tiers)}")
    return tiers[min(tiers.index(cap), tiers.index(cpu_tier()))]


def find_compiler(compiler: str | None = None) -> str | None:
    """The path of `compiler` (default `$CC`, else `cc`), or None where there is none: the one
    reason a kernel may be missing (a failed build is an error to report, not a missing kernel)."""
    return shutil.which(compiler or os.environ.get("CC", "cc"))


def tier_flags(tier: str | None) -> tuple[tuple[str, ...], ...]:
    """The optional flags a build of `tier` tries in turn: OPTIONAL_FLAGS, with the tier's
    baseline in place of -march=native when capped (an aarch64 compiler's default is its
    baseline)."""
    if tier is None:
        return OPTIONAL_FLAGS
    march = TIER_MARCH.get(tier) if architecture() == "x86_64" else None
    arch = () if march is None else (f"-march={march}",)
    return ((*arch, "-fopenmp"), arch, ())


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
    found = find_compiler(compiler)
    if found is None:
        logger.warning("no C compiler %r to build %s: its callers take their PyTorch paths",
                       compiler or os.environ.get("CC", "cc"), source.name)
        return None
    version = subprocess.run([found, "--version"], capture_output=True, text=True).stdout
    tier = isa_tier()
    optional = tier_flags(tier)
    flags = CFLAGS + LDFLAGS + tuple(f for extra in optional for f in extra)
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]
    parts = [source.read_bytes(), *headers, " ".join(flags).encode(), version.encode(),
             _cpu_identity().encode(), str(tier).encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    target = (cache_dir or _cache_dir()) / f"{source.stem}-{tier or 'native'}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built, errors = Path(scratch) / target.name, []
        for extra in optional:
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
