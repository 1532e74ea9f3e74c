"""A short request's time to first token beside a long prompt: FCFS, FCFS with vLLM's
`long_prefill_token_threshold`, and skip-join MLFQ (`benchmarks/serving.py`'s companion).

One long prompt (`LONG_PROMPT` random token ids) is added first, a short one (`SHORT_PROMPT`
tokens, `SHORT_OUTPUT` outputs) `SHORT_DELAY` seconds of wall time later, on the bundled model
with a step budget of `max_num_batched_tokens=512`, so the long prompt takes several chunks.
The engine is driven in this process through its public API (`LLMEngine.add_request` and
`step`, one torch thread): a request is added at the first step boundary after its arrival
time, with that arrival time, so its TTFT counts the step it waited behind -- what a server's
loop does, without HTTP's own cost (measured in `serving.py`). Settings:

* `fcfs`: chunked prefill, no threshold: the long prompt takes each step's whole budget and
  the short request waits for its last chunk.
* `fcfs-threshold`: `long_prefill_token_threshold=THRESHOLD`: the long prompt takes at most
  that many tokens a step, so the short one prefills in the next step beside it.
* `mlfq`: skip-join MLFQ (FastServe): the short request joins a higher queue than the long
  prompt's and goes first. Its cost model is profiled once and saved (`cost_model_file`).

Settings alternate (A B C C B A ...) over the repeats, since a shared machine's load drifts.

Run: .venv/bin/python benchmarks/serving_long_prompt.py           (3 repeats, a few minutes)
     .venv/bin/python benchmarks/serving_long_prompt.py --quick   (1 repeat)
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path

import numpy as np
from machine import report_header, save_report

from minipaged.engine.engine import LLMEngine
from minipaged.sampling.params import SamplingParams

RESULTS = Path(__file__).parent / "results" / "serving_long_prompt.json"
LONG_PROMPT = 2000
LONG_OUTPUT = 8
SHORT_PROMPT = 20
SHORT_OUTPUT = 8
SHORT_DELAY = 0.2  # seconds after the long prompt
THRESHOLD = 64
FIRST_TOKEN_ID = 17  # random prompts avoid SmolLM2's control tokens (0-16)
ENGINE = dict(
    max_num_seqs=4,
    max_num_batched_tokens=512,
    max_model_len=2048,
    enable_chunked_prefill=True,
    enable_prefix_caching=False,  # the same prompts every run: no cache hits between them
    kv_cache_memory=0.5,
)
SETTINGS = {
    "fcfs": dict(scheduler="fcfs"),
    "fcfs-threshold": dict(scheduler="fcfs", long_prefill_token_threshold=THRESHOLD),
    "mlfq": dict(scheduler="mlfq"),
}


def run_once(engine: LLMEngine, prompts: dict[str, list[int]]) -> dict:
    """Add the long prompt now and the short one `SHORT_DELAY` s later; step until both end.
    Returns each request's TTFT and end-to-end time from its arrival (seconds), and steps."""
    arrivals = {"long": 0.0, "short": SHORT_DELAY}
    outputs = {"long": LONG_OUTPUT, "short": SHORT_OUTPUT}
    pending = sorted(arrivals, key=arrivals.get)
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    steps = 0
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while pending and arrivals[pending[0]] <= now:
            name = pending.pop(0)
            params = SamplingParams(temperature=0, max_tokens=outputs[name], ignore_eos=True)
            engine.add_request(name, prompts[name], params)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[pending[0]] - now))
            continue
        for out in engine.step():
            t = time.perf_counter() - t0
            if out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = t
            if out.finished:
                done[out.request_id] = t
        steps += 1
    return {
        **{f"{n}_ttft_s": round(first[n] - arrivals[n], 4) for n in arrivals},
        **{f"{n}_e2e_s": round(done[n] - arrivals[n], 4) for n in arrivals},
        "steps": steps,
        "load_average_1min": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cost-model-file", default=None,
                        help="MLFQ's cost model (profiled and written when missing)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    repeats = 1 if args.quick else args.repeats
    rng = random.Random(args.seed)
    prompts = {
        name: [rng.randrange(FIRST_TOKEN_ID, 49152) for _ in range(n)]
        for name, n in (("long", LONG_PROMPT), ("short", SHORT_PROMPT))
    }
    cost_file = args.cost_model_file or str(Path(tempfile.gettempdir()) / "minipaged-cost.json")
    report = report_header(torch_threads=1, uptime_before=_uptime())
    report |= {
        "engine": ENGINE,
        "long_prompt": LONG_PROMPT, "long_output": LONG_OUTPUT,
        "short_prompt": SHORT_PROMPT, "short_output": SHORT_OUTPUT,
        "short_delay_s": SHORT_DELAY, "threshold": THRESHOLD,
    }
    engines = {}
    for name, extra in SETTINGS.items():
        kwargs = ENGINE | extra
        if extra["scheduler"] == "mlfq":
            kwargs["cost_model_file"] = cost_file
        engines[name] = LLMEngine.from_pretrained(**kwargs)
        run_once(engines[name], prompts)  # warm-up, not recorded
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    order = list(SETTINGS)
    for repeat in range(repeats):
        for name in order if repeat % 2 == 0 else order[::-1]:
            row = run_once(engines[name], prompts)
            runs[name].append(row)
            print(name, row, flush=True)
    summary = {
        name: {key: round(float(np.median([r[key] for r in rows])), 4)
               for key in ("short_ttft_s", "long_ttft_s", "long_e2e_s", "short_e2e_s")}
        for name, rows in runs.items()
    }
    base = summary["fcfs"]["short_ttft_s"]
    for row in summary.values():
        row["short_ttft_over_fcfs"] = round(row["short_ttft_s"] / base, 3)
    report |= {"runs": runs, "median": summary, "uptime_after": _uptime()}
    print(f"{'setting':16} {'short TTFT':>11} {'/ fcfs':>7} {'long TTFT':>10} {'long E2E':>9}")
    for name, row in summary.items():
        print(f"{name:16} {row['short_ttft_s']:11.3f} {row['short_ttft_over_fcfs']:7.3f} "
              f"{row['long_ttft_s']:10.3f} {row['long_e2e_s']:9.3f}")
    save_report(RESULTS, report)
    print(f"wrote {RESULTS}")


def _uptime() -> str:
    return Path("/proc/loadavg").read_text().strip()


if __name__ == "__main__":
    main()
