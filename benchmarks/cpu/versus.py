"""This checkout's engine against another checkout's, side by side in one run: one request's
decode and a batch of requests, on the bundled SmolLM2, greedy.

A change to the engine's insides should not make it slower; on a machine shared with other work
only a comparison in one run, the two taking turns, says so. Each round runs both sides in turn,
each in its own process (`--worker`, with the side's checkout first on `PYTHONPATH`), on the
same requests:

* one request: a 128-token prompt, 128 new tokens; tokens/s of the whole request;
* `--requests` requests (default 48) with ShareGPT-like lengths (`minipaged.sim.traces`, as
  `cpu/throughput.py` draws them), all at once: output tokens/s;

for float32 and int8 weights. Each side's greedy tokens are compared with the other's.

Run: .venv/bin/python benchmarks/cpu/versus.py --other /path/to/other/checkout --threads 1
     (a checkout of an older commit: `git worktree add /tmp/base <commit>`; where its kernels
     folder is not importable as `minipaged.kernels` from the checkout alone, link it:
     `ln -s ../kernels /tmp/base/minipaged/kernels`)
Writes benchmarks/results/versus.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
CONFIGS = (("float32", None), ("float32", "int8"))


def workload(num_requests: int, seed: int = 0) -> dict:
    """The requests both sides run: token ids and output lengths."""
    import numpy as np

    from minipaged.sim.traces import sharegpt_like

    rng = np.random.default_rng(seed)
    many = []
    for request in sharegpt_like(num_requests, seed=seed):
        prompt = int(min(max(request.prompt_len, 16), 512))
        output = int(min(max(request.output_len // 2, 16), 256))
        many.append((rng.integers(100, 10000, prompt).tolist(), output))
    one = (rng.integers(100, 10000, 128).tolist(), 128)
    return {"one": one, "many": many}


def worker(config_index: int, threads: int, requests_file: Path) -> dict:
    """One side's measurement, in this process (the side's checkout on `sys.path`)."""
    import torch

    import minipaged
    from minipaged import LLM, SamplingParams

    torch.set_num_threads(threads)
    dtype, quantization = CONFIGS[config_index]
    load = json.loads(requests_file.read_text())
    start = time.perf_counter()
    llm = LLM(dtype=dtype, quantization=quantization, enable_prefix_caching=False)
    startup_s = time.perf_counter() - start

    def run(requests: list) -> tuple[float, list[list[int]], int]:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                  for _, n in requests]
        begin = time.perf_counter()
        outputs = llm.generate([ids for ids, _ in requests], params, use_tqdm=False)
        seconds = time.perf_counter() - begin
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        return seconds, tokens, sum(len(t) for t in tokens)

    run([(load["one"][0][:16], 4)])  # warm-up
    one_s, one_tokens, one_count = run([load["one"]])
    many_s, many_tokens, many_count = run(load["many"])
    return {"package": str(Path(minipaged.__file__).parent), "startup_s": startup_s,
            "one_request_tok_s": one_count / one_s, "many_requests_tok_s": many_count / many_s,
            "tokens": [one_tokens[0], *many_tokens]}


def side(checkout: Path, config_index: int, threads: int, requests_file: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout), OMP_NUM_THREADS=str(threads))
    done = subprocess.run([sys.executable, str(HERE), "--worker", str(config_index),
                           "--threads", str(threads), "--requests-file", str(requests_file)],
                          env=env, cwd=checkout, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", type=Path, help="the other checkout's root")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--requests-file", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/versus.json")
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.threads, args.requests_file)))
        return
    from tqdm import tqdm

    from machine import report_header, save_report

    requests_file = args.out.with_suffix(".requests.json")
    requests_file.write_text(json.dumps(workload(args.requests)))
    sides = {"this": ROOT, "other": args.other.resolve()}
    rows = []
    try:
        for index, (dtype, quantization) in enumerate(CONFIGS):
            runs: dict[str, list[dict]] = {name: [] for name in sides}
            for round_ in tqdm(range(args.rounds), desc=f"{dtype} {quantization or ''}"):
                order = list(sides) if round_ % 2 == 0 else list(sides)[::-1]
                for name in order:
                    runs[name].append(side(sides[name], index, args.threads, requests_file))
            row = {"dtype": dtype, "quantization": quantization}
            for name, results in runs.items():
                row[name] = {key: statistics.median(r[key] for r in results) for key in
                             ("startup_s", "one_request_tok_s", "many_requests_tok_s")}
                row[name]["package"] = results[0]["package"]
                row[name]["rounds"] = [{k: r[k] for k in ("one_request_tok_s",
                                                          "many_requests_tok_s")}
                                       for r in results]
            row["this_over_other"] = {key: row["this"][key] / row["other"][key] for key in
                                      ("one_request_tok_s", "many_requests_tok_s")}
            this_tokens, other_tokens = runs["this"][0]["tokens"], runs["other"][0]["tokens"]
            row["requests_with_equal_tokens"] = sum(
                a == b for a, b in zip(this_tokens, other_tokens, strict=True))
            row["requests"] = len(this_tokens)
            rows.append(row)
    finally:
        requests_file.unlink(missing_ok=True)
    print(f"{'weights':16s} {'side':6s} {'1 request tok/s':>16s} {'many tok/s':>11s} "
          f"{'start-up s':>11s}")
    for row in rows:
        name = row["dtype"] + (" int8" if row["quantization"] else "")
        for side_name in sides:
            r = row[side_name]
            print(f"{name:16s} {side_name:6s} {r['one_request_tok_s']:16.1f} "
                  f"{r['many_requests_tok_s']:11.1f} {r['startup_s']:11.1f}")
        ratio = row["this_over_other"]
        print(f"{'':16s} {'ratio':6s} {ratio['one_request_tok_s']:16.3f} "
              f"{ratio['many_requests_tok_s']:11.3f}   equal tokens "
              f"{row['requests_with_equal_tokens']}/{row['requests']}")
    save_report(args.out, report_header() | {
        "other": str(sides["other"]), "threads": args.threads, "rows": rows})


if __name__ == "__main__":
    main()
