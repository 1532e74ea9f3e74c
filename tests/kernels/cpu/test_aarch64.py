"""The C kernels of `kernels/cpu/csrc` compute on aarch64 what they compute on x86-64.

Nothing in CI runs on an ARM CPU, yet the kernels are meant to: `gemv.c` has a NEON path there
and the other files lean on the compiler to vectorize portable C. So this test cross-compiles
`aarch64_harness.c` (every exported kernel over a fixed set of cases, each output value printed
in hex-float) with the kernels, each file its own object with `build.py`'s flags, once for
x86-64 at its baseline (`-march=x86-64`: the plain-C reference) and once for aarch64, runs the
aarch64 build under qemu-user, and compares every value: the same labels, integers (status
codes, token ids, copied bits) exactly, float32 within a relative 1e-4 plus 1e-5 of the
magnitude of the terms that make the value (fast-math reorders sums differently on each
machine), bfloat16 within one ulp (two where the kernel rounds twice) plus that floor. On
aarch64 gemv runs on both its paths, plain C and NEON, and each is compared with the reference
and with the other. The tolerance is tight enough that a NEON bfloat16 widening with a lane
wrong, or a tail loop dropped, fails.

Without the cross compiler or qemu the test is skipped, saying how to get them; with
`MINIPAGED_REQUIRE_AARCH64=1` (CI, after installing them) their absence fails it.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from minipaged.kernels.cpu.build import architecture

HERE = Path(__file__).parent
HARNESS = HERE / "aarch64_harness.c"
CSRC = HERE.parents[2] / "kernels" / "cpu" / "csrc"
KERNELS = ("gemv", "paged_decode", "greedy", "norm_rotary", "calls")
# kernels/cpu/build.py's compile and link flags (OpenMP included); -march per target below.
CFLAGS = ("-O3", "-ffast-math", "-fPIC", "-std=c11", "-fopenmp")
LDFLAGS = ("-lm", "-fopenmp")
HOST_CC, CROSS_CC, QEMU = "cc", "aarch64-linux-gnu-gcc", "qemu-aarch64"
INSTALL = "apt-get install crossbuild-essential-arm64 qemu-user"
REQUIRE_ENV = "MINIPAGED_REQUIRE_AARCH64"

RTOL = 1e-4  # float32, relative to the reference value
FLOOR = 1e-5  # every kind, relative to the magnitude of the value's terms
BF16_ULPS = {"bf16": 1, "bf16r": 2}  # one rounding of a float32 result; more than one
ISA = re.compile(r" isa=(\d+)")  # a case label's gemv path
MAX_ISA = "gemv_isa[max]"  # the widest path each build ran


@dataclass(frozen=True)
class Value:
    kind: str  # "int", "f32", "bf16" or "bf16r"
    value: float | int
    scale: float


Printout = dict[str, Value]


def tools() -> dict[str, str]:
    """The compilers and qemu by name; skips (or fails, under `MINIPAGED_REQUIRE_AARCH64=1`)
    naming what is missing."""
    if architecture() != "x86_64":
        pytest.skip(f"the reference is an x86-64 host's plain-C build; this {architecture()} "
                    "machine runs its own kernels in the other tests")
    found = {name: shutil.which(name) for name in (HOST_CC, CROSS_CC, QEMU)}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        reason = f"{', '.join(missing)} not found: `{INSTALL}` provides them"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but {reason}")
        pytest.skip(reason)
    return {name: path for name, path in found.items() if path is not None}


def run(command: Sequence[str], what: str, env: dict[str, str] | None = None) -> str:
    """`command`'s stdout, under `nice` where there is one (the machine may be shared); fails
    the test with its stderr if it fails."""
    nice = ["nice"] if shutil.which("nice") else []
    result = subprocess.run([*nice, *command], capture_output=True, text=True, env=env)
    assert result.returncode == 0, (
        f"{what} failed ({result.returncode}): {' '.join(command)}\n{result.stderr[-8000:]}")
    return result.stdout


def compile_all(compiler: str, arch_flags: Sequence[str], out: Path) -> list[list[str]]:
    """The commands that compile every kernel file and the harness into `out`: each kernel file
    to its own object (their static helpers share names), with build.py's flags."""
    out.mkdir()
    commands = [[compiler, *CFLAGS, *arch_flags, "-c", str(CSRC / f"{name}.c"), "-o",
                 str(out / f"{name}.o")] for name in KERNELS]
    commands.append([compiler, "-O1", "-std=c11", "-Wall", "-Wextra", f"-I{CSRC}", "-c",
                     str(HARNESS), "-o", str(out / "harness.o")])
    return commands


def link(compiler: str, link_flags: Sequence[str], out: Path) -> Path:
    """The harness linked with the kernels' objects in `out`."""
    binary = out / "harness"
    objects = [str(out / f"{name}.o") for name in (*KERNELS, "harness")]
    run([compiler, *objects, *LDFLAGS, *link_flags, "-o", str(binary)], "linking the harness")
    return binary


def parse(text: str) -> dict[int | None, Printout]:
    """The harness's printout by gemv path (None: cases that do not depend on it), each as its
    values by label: "<case label without isa=N>[<index>]"."""
    groups: dict[int | None, Printout] = {}
    case: str | None = None
    printout: Printout = {}
    for line in text.splitlines():
        if line.startswith("case "):
            label = line[5:]
            isa = ISA.search(label)
            printout = groups.setdefault(int(isa.group(1)) if isa else None, {})
            case = ISA.sub("", label)
            continue
        index, kind, value, scale = line.split()
        assert case is not None, f"a value before any case: {line!r}"
        label = f"{case}[{index}]"
        assert label not in printout, f"{label} printed twice"
        number = int(value) if kind == "int" else float.fromhex(value)
        printout[label] = Value(kind, number, float.fromhex(scale))
    return groups


def bf16_ulp(x: float) -> float:
    """The spacing of bfloat16 values at |x| (8 significant bits)."""
    _, exponent = math.frexp(x)  # |x| = m * 2**exponent, 0.5 <= m < 1
    return math.ldexp(1.0, exponent - 8)


def tolerance(reference: Value) -> float:
    value = float(reference.value)
    floor = FLOOR * reference.scale
    if reference.kind == "f32":
        return RTOL * abs(value) + floor
    return BF16_ULPS[reference.kind] * bf16_ulp(value) + floor


def mismatches(reference: Printout, other: Printout) -> list[str]:
    """Each label whose value in `other` is not `reference`'s (within tolerance), or that only
    one of them has."""
    found = [f"{label}: only in the reference" for label in reference.keys() - other.keys()]
    found += [f"{label}: not in the reference" for label in other.keys() - reference.keys()]
    for label in sorted(reference.keys() & other.keys()):
        want, got = reference[label], other[label]
        if want.kind != got.kind:
            found.append(f"{label}: kind {got.kind}, the reference's {want.kind}")
        elif want.kind == "int":
            if want.value != got.value:
                found.append(f"{label}: {got.value}, the reference's {want.value}")
        elif not same_float(float(want.value), float(got.value), tolerance(want)):
            found.append(f"{label} ({want.kind}): {float(got.value)!r}, the reference's "
                         f"{float(want.value)!r} (tolerance {tolerance(want):.3g})")
    return found


def same_float(want: float, got: float, tol: float) -> bool:
    if math.isnan(want) or math.isnan(got):
        return math.isnan(want) and math.isnan(got)
    return want == got or abs(want - got) <= tol


def check(reference: Printout, other: Printout, what: str) -> None:
    found = mismatches(reference, other)
    shown = "\n".join(found[:25])
    assert not found, f"{what}: {len(found)} of {len(reference)} values differ:\n{shown}"


def test_kernels_on_aarch64_match_plain_c_on_x86(tmp_path: Path) -> None:
    found = tools()
    x86_dir, arm_dir = tmp_path / "x86-64", tmp_path / "aarch64"
    commands = [*compile_all(found[HOST_CC], ["-march=x86-64"], x86_dir),
                *compile_all(found[CROSS_CC], [], arm_dir)]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        jobs = [pool.submit(run, command, "compiling") for command in commands]
        for job in jobs:
            job.result()
    x86_binary = link(found[HOST_CC], [], x86_dir)
    arm_binary = link(found[CROSS_CC], ["-static"], arm_dir)  # qemu needs no aarch64 libraries
    env = {**os.environ, "OMP_WAIT_POLICY": "passive"}  # idle OpenMP threads sleep, not spin
    with ThreadPoolExecutor(max_workers=2) as pool:
        x86_run = pool.submit(run, [str(x86_binary)], "the x86-64 harness", env)
        arm_run = pool.submit(run, [found[QEMU], str(arm_binary)], "the aarch64 harness", env)
        reference, aarch64 = parse(x86_run.result()), parse(arm_run.result())
    assert set(reference) == {0, None}, f"gemv paths on x86-64: {sorted(reference, key=str)}"
    assert set(aarch64) == {0, 1, None}, f"gemv paths on aarch64: {sorted(aarch64, key=str)}"
    assert reference[None].pop(MAX_ISA).value == 0  # the reference is plain C alone
    assert aarch64[None].pop(MAX_ISA).value == 1, "gemv_isa() on aarch64 is not NEON's 1"
    check(reference[None], aarch64[None], "aarch64 against x86-64 (cases without gemv)")
    check(reference[0], aarch64[0], "aarch64 plain-C gemv against x86-64's")
    check(reference[0], aarch64[1], "aarch64 NEON gemv against x86-64 plain C")
    check(aarch64[0], aarch64[1], "aarch64 NEON gemv against aarch64 plain C")
