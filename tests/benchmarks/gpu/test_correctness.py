"""`benchmarks/gpu/correctness.py --smoke`: on a CPU, the same checks on a tiny model (greedy
float32 tokens against transformers', replayed steps against eager ones) pass, and a
disagreement would fail them."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[3] / "benchmarks"))

from gpu import correctness  # noqa: E402
from gpu.random_models import TINY_LLAMA  # noqa: E402


def test_the_smoke_run_agrees_with_transformers_and_with_eager_steps() -> None:
    result = correctness.run("cpu", TINY_LLAMA, count=3, max_tokens=6)
    assert result["greedy_equal"] == result["greedy_total"] == 3
    assert result["replay_equals_eager"] == 3
    assert result["float32_platform"] == "cpu" and result["float32_graph_sizes"] > 0
    assert result["ok"]
