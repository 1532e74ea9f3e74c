"""A short request's time to first token beside a long prompt: FCFS, FCFS with vLLM's
long-prefill threshold, and FastServe's skip-join MLFQ.

One long prompt (2,048 tokens by default) arrives first, a short one (24 tokens) a moment later,
on the bundled SmolLM2 in float32 on one thread, with a step budget of 512 tokens so that the
long prompt prefills in chunks. Under plain FCFS the long prompt takes each step's whole budget
until it is done, so the short request waits for nearly the whole prefill (head-of-line
blocking); `long_prefill_token_threshold` caps the tokens one prompt computes per step, so the
short one joins the next step; skip-join MLFQ puts the long job in a lower queue from the start
(FastServe §4.1), so the short one runs first.

It drives `LLMEngine` directly on the wall clock (the engine `minipaged serve` runs, without the
HTTP layer: the HTTP server's own overhead is `benchmarks/serving/online.py`'s), adding each
request at its arrival time and stepping until both finish; settings alternate over `--repeats`
rounds.

    .venv/bin/python benchmarks/serving/long_prompt_ttft.py            # ~2 min on 2 cores
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

import torch

from machine import report_header, save_report
from minipaged import LLMEngine, SamplingParams

RESULTS = Path(__file__).resolve().parents[1] / "results" / "long_prompt_ttft.json"
SETTINGS = {
    "fcfs": dict(scheduler="fcfs"),
    "fcfs + long_prefill_token_threshold=64": dict(
        scheduler="fcfs", long_prefill_token_threshold=64
    ),
    "skip-join mlfq": dict(scheduler="mlfq"),
}


def serve_pair(engine: LLMEngine, long_len: int, gap_s: float) -> dict[str, float]:
    """The long prompt now, the short one `gap_s` later; times from each one's arrival."""
    long_prompt = [(7 * j) % 40_000 + 100 for j in range(long_len)]
    short_prompt = [(11 * j) % 40_000 + 100 for j in range(24)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    start = time.monotonic()
    arrivals = {"long": start, "short": start + gap_s}
    engine.add_request("long", long_prompt, params, arrival_time=start)
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    short_added = False
    while len(done) < 2:
        if not short_added and time.monotonic() >= arrivals["short"]:
            engine.add_request("short", short_prompt, params, arrival_time=arrivals["short"])
            short_added = True
        if not engine.has_unfinished_requests():  # the long one done before the short came
            time.sleep(max(0.0, arrivals["short"] - time.monotonic()))
            continue
        for output in engine.step():
            now = time.monotonic()
            if output.outputs[0].token_ids and output.request_id not in first:
                first[output.request_id] = now
            if output.finished:
                done[output.request_id] = now
    return {
        "short_ttft_s": first["short"] - arrivals["short"],
        "long_ttft_s": first["long"] - arrivals["long"],
        "long_latency_s": done["long"] - arrivals["long"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--long-tokens", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    parser.add_argument("--gap", type=float, default=0.2, help="seconds between the arrivals")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cost_file = Path(tempfile.gettempdir()) / "minipaged_long_prompt_cost.json"
    engines = {
        name: LLMEngine.from_pretrained(
            None, max_num_batched_tokens=args.budget, max_num_seqs=8,
            enable_prefix_caching=False, cost_model_file=str(cost_file), **kwargs,
        )
        for name, kwargs in SETTINGS.items()
    }
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    for _ in range(args.repeats):
        for name, engine in engines.items():  # alternating: the same load for every setting
            runs[name].append(serve_pair(engine, args.long_tokens, args.gap))
    table = {
        name: {key: statistics.median(r[key] for r in results) for key in results[0]}
        for name, results in runs.items()
    }
    base = table["fcfs"]["short_ttft_s"]
    print(f"{'setting':42} {'short TTFT s':>12} {'vs fcfs':>8} {'long TTFT s':>11} "
          f"{'long done s':>11}")
    for name, row in table.items():
        print(f"{name:42} {row['short_ttft_s']:12.3f} {row['short_ttft_s'] / base:8.3f} "
              f"{row['long_ttft_s']:11.3f} {row['long_latency_s']:11.3f}")
    report = report_header(load_average=os.getloadavg())
    report.update(
        what="a short request's TTFT beside a long prompt, one thread, float32, bundled SmolLM2",
        long_tokens=args.long_tokens, short_tokens=24, max_num_batched_tokens=args.budget,
        gap_s=args.gap, repeats=args.repeats, median=table, runs=runs,
    )
    save_report(RESULTS, report)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
