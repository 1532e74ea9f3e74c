"""`benchmarks/cpu/versus.py`: both sides get the same requests, and a side's worker runs the
engine of the checkout it is pointed at."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[3] / "benchmarks"))

from cpu.versus import ROOT, side, workload  # noqa: E402


def test_the_workload_is_the_same_for_a_seed_and_within_its_ranges() -> None:
    first, again, other = workload(12, seed=3), workload(12, seed=3), workload(12, seed=4)
    assert first == again and first != other
    assert len(first["many"]) == 12
    for ids, output in first["many"]:
        assert 16 <= len(ids) <= 512 and 16 <= output <= 256
        assert all(100 <= i < 10000 for i in ids)
    assert len(first["one"][0]) == 128 and first["one"][1] == 128


def test_a_side_runs_its_own_checkout_and_is_deterministic(tmp_path: Path) -> None:
    requests = {"one": [[101, 102, 103, 104, 105, 106, 107, 108] * 2, 6],
                "many": [[[200, 201, 202, 203], 5], [[300, 301], 7]]}
    path = tmp_path / "requests.json"
    path.write_text(json.dumps(requests))
    results = [side(ROOT, 0, 1, path) for _ in range(2)]
    assert results[0]["package"] == str(ROOT / "minipaged")
    assert [len(t) for t in results[0]["tokens"]] == [6, 5, 7]
    assert results[0]["tokens"] == results[1]["tokens"]
    assert results[0]["one_request_tok_s"] > 0 and results[0]["many_requests_tok_s"] > 0
