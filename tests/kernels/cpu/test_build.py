"""Building the C kernels (`kernels/cpu/build.py`) for every tier of the CPU's architecture.

`-march=native` is an optimisation, never a requirement: each C file compiles for each tier's
baseline, whatever this machine's CPU; `$MINIPAGED_CPU_ISA` caps the tier a build targets and a
kernel's dispatch picks (never above what the CPU has), and the tier is part of a build's key.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

import pytest
from native_kernels import NEEDS_COMPILER

from minipaged.kernels.cpu.build import (
    CFLAGS,
    ISA_ENV,
    TIERS,
    architecture,
    build_native,
    cpu_tier,
    find_compiler,
    isa_tier,
    tier_flags,
)
from minipaged.kernels.cpu.gemv import ISAS, TIER_PATHS, gemv_isa

CSRC = Path(__file__).parents[3] / "kernels" / "cpu" / "csrc"
OWN_TIERS = TIERS.get(architecture(), ("generic",))


def test_the_cap_names_a_tier_of_this_architecture_and_never_exceeds_the_cpu(monkeypatch):
    monkeypatch.delenv(ISA_ENV, raising=False)
    assert isa_tier() is None
    assert cpu_tier() in OWN_TIERS
    for tier in OWN_TIERS:
        monkeypatch.setenv(ISA_ENV, tier.upper())
        expected = min(tier, cpu_tier(), key=OWN_TIERS.index)
        assert isa_tier() == expected
    for wrong in ("sse9", "neon" if architecture() == "x86_64" else "avx2"):
        monkeypatch.setenv(ISA_ENV, wrong)
        with pytest.raises(ValueError, match=ISA_ENV):
            isa_tier()


@NEEDS_COMPILER
@pytest.mark.parametrize("source", sorted(CSRC.glob("*.c")), ids=lambda path: path.name)
def test_every_file_compiles_for_every_tier_whatever_this_cpu(source: Path, tmp_path: Path):
    """Compiled only (an object per tier, not run): a tier above this CPU's still builds."""
    for tier in OWN_TIERS:
        flags = tier_flags(tier)[0]  # the tier's -march, with OpenMP
        done = subprocess.run([find_compiler(), *CFLAGS, *flags, "-Wall", "-Werror",
                               str(source), "-o", str(tmp_path / f"{tier}.o")],
                              capture_output=True, text=True)
        assert done.returncode == 0, f"{source.name} at {tier} ({flags}):\n{done.stderr}"


@NEEDS_COMPILER
def test_each_tier_builds_and_loads_under_its_own_key(monkeypatch, tmp_path: Path):
    built = {}
    for tier in OWN_TIERS:
        monkeypatch.setenv(ISA_ENV, tier)
        path = build_native(CSRC / "gemv.c", cache_dir=tmp_path)
        assert path is not None and isa_tier() in path.name
        assert ctypes.CDLL(os.fspath(path)).gemv_isa() >= 0
        built[isa_tier()] = path
    assert len(set(built.values())) == len(built)  # one build per tier this CPU reaches
    monkeypatch.delenv(ISA_ENV)
    assert build_native(CSRC / "gemv.c", cache_dir=tmp_path) not in built.values()


@NEEDS_COMPILER
def test_the_cap_moves_the_gemv_dispatch(monkeypatch):
    monkeypatch.delenv(ISA_ENV, raising=False)
    widest = gemv_isa()
    for tier in OWN_TIERS:
        monkeypatch.setenv(ISA_ENV, tier)
        assert ISAS[gemv_isa()] == min(ISAS[widest], TIER_PATHS[tier])
