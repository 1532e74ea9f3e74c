"""`benchmarks/gpu/check.py` set up on CPU: the script a GPU machine runs must not rot unseen.

GPU machines are lent rarely, so the script's `--smoke` path runs here: every decode and prefill
case at interpreter size, through the same set-up code as on the GPU (each case's paged result
must equal dense attention), then every part of the throughput benchmark (`gpu/throughput.py`)
on tiny random models: minipaged, its profiled decode step, transformers' static batch and
continuous batching, and the 8B path (built on "meta", filled, saved, served).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[3] / "benchmarks"))

from gpu import check  # noqa: E402


def test_smoke_runs_every_case_and_the_throughput_benchmark(capsys) -> None:
    assert check.smoke() == 0
    printed = capsys.readouterr().out
    for case in [*check.DECODE_CASES, *check.PREFILL_CASES]:
        assert f"ok: {case.name}" in printed
    assert "throughput ok" in printed
    for system in ("minipaged", "transformers generate (static)",
                   "transformers continuous batching", "minipaged, 8B-shaped (defaults)"):
        assert f"\n{system} " in printed, system
    assert "Decode step at 6 sequences (2 steps profiled)" in printed
