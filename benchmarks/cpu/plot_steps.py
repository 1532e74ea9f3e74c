"""Draw every decode step of the throughput benchmark against its same-run floor.

Reads `benchmarks/results/throughput.json` (float32) and `throughput_bfloat16.json`, written by
`benchmarks/cpu/throughput.py`, and draws one panel per dtype: each decode step's time against the
number of sequences it decoded, for both attention backends, with the step's floor (matrix FLOPs
at the measured GEMM rate + weight and K/V bytes at the measured bandwidth) and twice the floor.
Measures nothing itself.

    .venv/bin/python benchmarks/cpu/plot_steps.py      # writes docs/images/cpu_decode_steps.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
OUT = Path(__file__).resolve().parents[2] / "docs" / "images" / "cpu_decode_steps.png"
RUNS = ("throughput.json", "throughput_bfloat16.json")
COLORS = {"torch": "tab:orange", "cpu": "tab:blue"}


def decode_steps(result: dict, backend: str) -> list[tuple[int, float, float]]:
    """(sequences, step ms, floor ms) of every decode step of `backend` in one run."""
    roofline = result["minipaged"][backend]["roofline"]
    columns = roofline["step_columns"]
    kind, seqs, step, floor = (columns.index(c) for c in ("kind", "seqs", "step_ms", "floor_ms"))
    return [(row[seqs], row[step], row[floor]) for row in roofline["steps"]
            if row[kind] == "decode"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    runs = [json.loads((RESULTS / name).read_text()) for name in RUNS]
    fig, axes = plt.subplots(1, len(runs), figsize=(10, 4), sharey=True)
    for ax, result in zip(axes, runs, strict=True):
        for backend in result["minipaged"]:
            steps = decode_steps(result, backend)
            ax.scatter([s for s, _, _ in steps], [t for _, t, _ in steps], s=9,
                       color=COLORS.get(backend), label=f"attention {backend}", alpha=0.7)
        floor = sorted({(s, f) for s, _, f in decode_steps(result, "cpu")})
        ax.plot([s for s, _ in floor], [f for _, f in floor], color="black", lw=1.5,
                label="floor (same run)")
        ax.plot([s for s, _ in floor], [2 * f for _, f in floor], color="black", lw=1,
                ls="--", label="2 x floor")
        machine = result["machine"]
        ax.set_title(f"{result['dtype']}: {machine['cpu_model']}, "
                     f"{machine['torch_threads']} thread", fontsize=10)
        ax.set_xlabel("sequences in the decode step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("step time (ms)")
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle("Decode steps of the throughput benchmark against the roofline", fontsize=11)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
