"""The Triton kernels compile for real GPUs (sm_80, sm_90), without spilling, on tensor cores.

The interpreter proves the kernels equal to dense attention, but accepts programs a GPU compiler
rejects and says nothing about registers. Here Triton's own compiler, which runs without a GPU,
compiles the programs the launchers choose on a GPU (`minipaged.kernels.triton.aot`, which asks the
launchers' `*_launches` planners for them) down to cubins, and the checks read the artefacts:
registers, stack and local memory (`cuobjdump`) and the tensor-core instructions.

This process runs the interpreter (conftest.py), and the compiler needs the real `@triton.jit`
functions, so one subprocess with `TRITON_INTERPRET` unset compiles everything once per test
run, into a Triton cache in the run's temporary folder. It compiles the covering subset
`aot.COVERING` (every cache dtype at each head dim, every GQA group and block size, for both
architectures); the whole matrix, `aot.CONFIGURATIONS`, is compiled by
`benchmarks/gpu/kernel_resources.py` into `benchmarks/results/kernel_resources.json`, and the last
test checks that file still describes the programs the launchers choose now.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minipaged.kernels.triton import aot

ROOT = Path(__file__).resolve().parents[3]
COMMITTED = ROOT / "benchmarks" / "results" / "kernel_resources.json"
KERNELS = {"decode_partition", "decode_merge", "prefill", "reshape_and_cache", "copy_blocks",
           "rms_norm", "add_rms_norm", "silu_and_mul"}

# One xdist worker runs every test here, so the programs are compiled once per run.
pytestmark = pytest.mark.xdist_group("aot")


@pytest.fixture(scope="session")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every program of `aot.CONFIGURATIONS` planned, those of `aot.COVERING` compiled."""
    folder = tmp_path_factory.mktemp("aot")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(folder / "triton-cache")
    out = folder / "programs.json"
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "minipaged.kernels.triton.aot",
         "--compile", "covering", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text(encoding="utf-8"))


def compiled_programs(report: dict) -> list[dict]:
    return [p for p in report["programs"] if p["resources"]]


def describe(program: dict) -> str:
    return f"{program['kernel']} {program['arch']} for {program['configurations'][0]}"


def test_every_kernel_compiles_for_sm80_and_sm90(compiled: dict) -> None:
    programs = compiled_programs(compiled)
    errors = [f"{describe(p)}: {p['resources']['error']}" for p in programs
              if "error" in p["resources"]]
    assert not errors, "\n".join(errors)
    built = {(p["kernel"], p["arch"]) for p in programs}
    assert built == {(k, arch) for k in KERNELS for arch in aot.ARCHS}
    covered = {name for p in programs for name in p["configurations"]}
    assert {c.name for c in aot.COVERING} <= covered


def test_no_compiled_program_spills(compiled: dict) -> None:
    """Stack and local memory 0: every value stays in registers (at most 255 per thread)."""
    spills = [f"{describe(p)}: REG {r['registers']} STACK {r['stack_bytes']} "
              f"LOCAL {r['local_bytes']}" for p in compiled_programs(compiled)
              if (r := p["resources"])["stack_bytes"] or r["local_bytes"]]
    assert not spills, "\n".join(spills)


def test_every_attention_dot_runs_on_tensor_cores(compiled: dict) -> None:
    """Both products of both attention kernels become `mma` (sm_80) or `mma`/`wgmma` (sm_90)
    tensor-core instructions: no dot falls back to FMA."""
    for p in compiled_programs(compiled):
        if p["kernel"] not in aot.ATTENTION_KERNELS:
            continue
        r = p["resources"]
        float32 = p["configurations"][0].endswith("/float32")
        if p["kernel"] == "prefill":
            # Q.K^T and P.V in each of its two loops (whole tiles below the diagonal, then the
            # diagonal), or in one (MASK_EVERY_TILE).
            loops = 1 if p["constexprs"]["MASK_EVERY_TILE"] == "True" else 2
            assert r["dots"] == 2 * loops, describe(p)
        else:
            # Q.K^T and P.V; P.V is two products (hi.V + lo.V) for 16-bit caches (_tiles.py).
            assert r["dots"] == (2 if float32 else 3), describe(p)
        assert r["gpu_dots"] >= r["dots"], describe(p)  # tf32x3 splits a dot in three
        assert r["tensor_core_dots"] == r["gpu_dots"], describe(p)
        assert r["mma_instructions"] + r["wgmma_instructions"] > 0, describe(p)


def test_committed_resource_table_describes_the_current_programs(compiled: dict) -> None:
    """`benchmarks/results/kernel_resources.json` lists exactly the programs the launchers
    choose now (same specialisations, same kernel sources), and none of them spills or misses
    the tensor cores; where this run compiled one with the same Triton, the numbers agree."""
    committed = json.loads(COMMITTED.read_text(encoding="utf-8"))
    rows = {row["key"]: row for row in committed["programs"]}
    planned = {p["key"]: p for p in compiled["programs"]}
    stale = sorted(describe(p) for key, p in planned.items() if key not in rows)
    gone = sorted(f"{r['kernel']} {r['arch']}" for key, r in rows.items() if key not in planned)
    assert not stale and not gone, (
        "benchmarks/results/kernel_resources.json is out of date; rerun "
        f"`python benchmarks/gpu/kernel_resources.py`.\nnew: {stale[:5]}\nremoved: {gone[:5]}")
    for row in rows.values():
        assert row["stack_bytes"] == row["local_bytes"] == 0, row
        if row["kernel"] in aot.ATTENTION_KERNELS:
            assert row["tensor_core_dots"] == row["gpu_dots"] > 0, row
    if committed["triton"] == compiled["triton"]:
        for p in compiled_programs(compiled):
            assert p["resources"]["registers"] == rows[p["key"]]["registers"], describe(p)
