"""The model's projections on CPU: `F.linear` vs `model_layers.linear` (its choice).

A step of the bundled SmolLM2-135M multiplies the step's rows by every weight matrix once: 30
layers of q/k/v/o and gate/up/down projections, then the 49152-token output head. Weights (540 MB
in float32) stream from memory every step, so this benchmark does the same: it holds 30 layers'
worth of distinct random matrices of SmolLM2's shapes and times one pass over all of them, and
the head on its own, for the row counts of decode steps (1-16) and of prefills (64, 256), in
`--dtype`. Both paths run in one process on the same tensors, interleaved, in thread CPU time;
each number is the median of `--repeats` passes. The outputs of the two paths are checked equal
up to float rounding.

A second table times one weight shape at a time, from a tiny test model's 128 x 64 to SmolLM2's
1536 x 576 (30 MB of copies of each, so that every call reads from memory): `F.linear`, oneDNN's
op over the plain weight (which it rearranges on every call, as `F.linear` does) and over the
weight packed once (`packed_weight`, what `linear` multiplies). It shows what the packing buys
and where oneDNN's fixed cost per call stops paying, next to the choice `linear` makes for that
shape on this machine (`onednn_is_faster`, timed at start-up).

Run: .venv/bin/python benchmarks/cpu/linear.py --threads 1 [--dtype bfloat16]   (~1-2 minutes)
Writes benchmarks/results/linear_cpu.json (linear_cpu_bfloat16.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

import torch
import torch.nn.functional as F

from machine import report_header, save_report
from minipaged.platforms.cpu.linear import linear
from minipaged.platforms.cpu.onednn import (
    ONEDNN_AVAILABLE,
    onednn_is_faster,
    onednn_linear,
    packed_weight,
)

RESULTS = Path(__file__).resolve().parents[1] / "results" / "linear_cpu.json"
HIDDEN, KV, INTERMEDIATE, VOCAB, LAYERS = 576, 192, 1536, 49152, 30
# (in, out) of each projection of a SmolLM2-135M layer: q, k, v, o, gate, up, down.
LAYER_SHAPES = [
    (HIDDEN, HIDDEN), (HIDDEN, KV), (HIDDEN, KV), (HIDDEN, HIDDEN),
    (HIDDEN, INTERMEDIATE), (HIDDEN, INTERMEDIATE), (INTERMEDIATE, HIDDEN),
]
# (out, in) of single weights for the per-shape table: tiny test models up to SmolLM2's largest.
SINGLE_SHAPES = [(128, 64), (128, 128), (256, 256), (192, 576), (576, 576), (1536, 576)]
SINGLE_ROWS = [1, 8, 64]
COPIES_BYTES = 30 * 2**20


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        samples.append(time.thread_time() - start)
    return statistics.median(samples) * 1e3


def per_shape(repeats: int, dtype: torch.dtype) -> list[dict]:
    """Microseconds per call of F.linear and of oneDNN over plain and packed weights, one weight
    shape at a time, cold."""
    rows = []
    size = torch.tensor([], dtype=dtype).element_size()
    for out, inp in SINGLE_SHAPES:
        copies = [torch.randn(out, inp).to(dtype)
                  for _ in range(max(1, COPIES_BYTES // (size * out * inp)))]
        packed = [packed_weight(w) for w in copies]
        row: dict = {"weight": [out, inp], "elements": out * inp,
                     "linear_uses_onednn": onednn_is_faster(out, inp, dtype)}
        for n in SINGLE_ROWS:
            x = torch.randn(n, inp).to(dtype)
            with torch.inference_mode():
                us = {
                    name: median_ms(lambda fn=fn, x=x, ws=ws: [fn(x, w) for w in ws], repeats)
                    * 1e3 / len(copies)
                    for name, fn, ws in (("F.linear", F.linear, copies),
                                         ("oneDNN", onednn_linear, copies),
                                         ("oneDNN packed", onednn_linear, packed))
                }
            row[f"rows_{n}_us"] = {k: round(v, 1) for k, v in us.items()}
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 7, 8, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    out = args.out or (RESULTS if args.dtype == "float32"
                       else RESULTS.with_name(f"linear_cpu_{args.dtype}.json"))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if not ONEDNN_AVAILABLE:
        raise SystemExit("this torch build has no oneDNN linear: `linear` is `F.linear` here")

    torch.manual_seed(0)
    weights = [(torch.randn(out, inp) * inp**-0.5).to(dtype)
               for _ in range(LAYERS) for inp, out in LAYER_SHAPES]
    head = (torch.randn(VOCAB, HIDDEN) * HIDDEN**-0.5).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    paths = {"F.linear": F.linear, "linear": linear}

    rows = []
    with torch.inference_mode():
        for n in args.rows:
            inputs = {size: torch.randn(n, size).to(dtype) for size in (HIDDEN, INTERMEDIATE)}
            for w in (weights[0], weights[-1], head):
                x = inputs[w.shape[1]]
                torch.testing.assert_close(linear(x, w).float(), F.linear(x, w).float(),
                                           rtol=tol, atol=tol)

            def all_layers(fn, inputs=inputs):
                for w in weights:
                    fn(inputs[w.shape[1]], w)

            times: dict[str, dict[str, list[float]]] = {"layers": {}, "head": {}}
            for repeat in range(2):  # alternate which path runs first
                order = list(paths.items()) if repeat == 0 else list(paths.items())[::-1]
                for name, fn in order:
                    times["layers"].setdefault(name, []).append(
                        median_ms(lambda fn=fn: all_layers(fn), args.repeats))
                    times["head"].setdefault(name, []).append(
                        median_ms(lambda fn=fn, x=inputs[HIDDEN]: fn(x, head), args.repeats))
            best = {part: {name: min(v) for name, v in by_path.items()}
                    for part, by_path in times.items()}
            rows.append({
                "rows": n,
                "layers_ms": {k: round(v, 2) for k, v in best["layers"].items()},
                "head_ms": {k: round(v, 2) for k, v in best["head"].items()},
                "layers_speedup": round(best["layers"]["F.linear"] / best["layers"]["linear"], 2),
                "head_speedup": round(best["head"]["F.linear"] / best["head"]["linear"], 2),
            })

    shapes = per_shape(args.repeats, dtype)

    print(f"\n{'rows':>5} {'30 layers: F.linear':>20} {'linear':>8} {'speedup':>8}"
          f" {'head: F.linear':>15} {'linear':>8} {'speedup':>8}")
    for r in rows:
        layers, head = r["layers_ms"], r["head_ms"]
        print(f"{r['rows']:>5} {layers['F.linear']:>17.1f} ms {layers['linear']:>5.1f} ms"
              f" {r['layers_speedup']:>7.2f}x {head['F.linear']:>12.1f} ms"
              f" {head['linear']:>5.1f} ms {r['head_speedup']:>7.2f}x")
    print("\nper call, one weight shape at a time (us, F.linear / oneDNN / oneDNN packed):")
    for r in shapes:
        cells = "  ".join(
            f"{n:>2} rows " + " / ".join(f"{us[k]:>7.1f}" for k in us)
            for n, us in ((n, r[f"rows_{n}_us"]) for n in SINGLE_ROWS)
        )
        where = "oneDNN" if r["linear_uses_onednn"] else "F.linear"
        print(f"{r['weight'][0]:>5} x {r['weight'][1]:<5} {cells}   linear takes {where}")
    report = {
        "benchmark": "linear_cpu",
        "what": "milliseconds for one pass over 30 SmolLM2-135M layers' projections (distinct "
                "random weights, streamed from memory as in a real step) and for the output "
                "head, F.linear vs model_layers.linear (oneDNN over packed weights where it "
                "measured faster), thread CPU time",
        **report_header(),
        "dtype": args.dtype,
        "repeats": args.repeats,
        "results": rows,
        "per_shape": shapes,
    }
    save_report(out, report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
