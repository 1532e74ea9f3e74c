"""`benchmarks/gpu_check.py` set up on CPU: the script a GPU machine runs must not rot unseen.

GPU machines are lent rarely, so the script's `--smoke` path (every decode and prefill case at
interpreter size, through the same set-up code as on the GPU) runs here: each case's paged
result must equal dense attention.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

import gpu_check  # noqa: E402


def test_smoke_runs_every_case_and_agrees_with_dense_attention(capsys) -> None:
    assert gpu_check.smoke() == 0
    printed = capsys.readouterr().out
    for case in [*gpu_check.DECODE_CASES, *gpu_check.PREFILL_CASES]:
        assert f"ok: {case.name}" in printed
