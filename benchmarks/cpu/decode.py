"""One request's decode on a CPU against the memory's floor: float32, bfloat16 and int8 weights.

A decode step of one request reads every weight once (and the K/V of its context), so its floor
is those bytes over the memory's streaming-read bandwidth, measured here in the same run
(`roofline.read_bandwidth`: a `sum` over 1 GiB or more, best of five). For each weight format
this times, on the bundled SmolLM2-135M, greedy and ignoring end-of-sequence:

* 1 request of 128 prompt + 128 new tokens: tokens/s over the whole request, and the median
  decode step (ms) next to its floor;
* `--requests` requests (default 48) of their own prompt and output lengths, all at once:
  output tokens/s.

Float weights run twice in one process, with the few-row GEMV kernel (`minipaged.kernels.cpu.gemv`,
the engine's default, a decode step replayed from bound kernel calls) and without it: a second
engine that runs its model's modules (`enforce_eager`) with PyTorch's GEMMs only
(`MINIPAGED_GEMV_ROWS=0`, the CPU platform's override of its few-row choice), the two taking
turns; int8 weights (`quantization="int8"`)
always take the kernel at few rows.
Prefix caching is off, so that every run computes its prompts. Ratios within one run are what
to read on a machine shared with other work.

Run: .venv/bin/python benchmarks/cpu/decode.py --threads 1    (~4 minutes)
Writes benchmarks/results/decode_cpu.json.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

import torch

from cpu.roofline import dram_bytes, read_bandwidth, weight_bytes
from machine import report_header, save_report
from minipaged.engine.llm import LLM
from minipaged.platforms.cpu import GEMV_ROWS_VARIABLE, cpu_flags
from minipaged.sampling.params import SamplingParams

RESULTS = Path(__file__).resolve().parents[1] / "results" / "decode_cpu.json"
FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx_bf16",
         "amx_int8", "amx_tile")
CONFIGS = (("float32", None), ("bfloat16", None), ("float32", "int8"))


def one_request(llm: LLM, prompt: list[int], new: int) -> tuple[float, float]:
    """(tokens/s over the request, median decode step in ms)."""
    steps: list[float] = []
    observer = lambda record: steps.append(record.end - record.start)  # noqa: E731
    llm.engine.add_step_observer(observer)
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=new, ignore_eos=True, temperature=0.0),
                 use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.engine.remove_step_observer(observer)
    return new / elapsed, statistics.median(steps[1:]) * 1e3


def many_requests(llm: LLM, prompts: list[list[int]], outs: list[int]) -> float:
    """Output tokens/s of all the requests at once."""
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in outs]
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return sum(outs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    prompt = [rng.randrange(20, 49000) for _ in range(128)]
    prompts = [[rng.randrange(20, 49000) for _ in range(rng.randint(16, 256))]
               for _ in range(args.requests)]
    outs = [rng.randint(16, 160) for _ in range(args.requests)]
    bandwidth = read_bandwidth(dram_bytes(), 1)
    context = 128 + args.new_tokens // 2  # the mean context of the request's decode steps
    results = []
    for dtype, quantization in CONFIGS:
        llm = LLM(dtype=dtype, quantization=quantization, enable_prefix_caching=False)
        model, config = llm.engine.runner.model, llm.engine.model_config
        engines = {"gemv": llm}
        if quantization is None:  # the modules with PyTorch's GEMMs: a replay runs the kernel
            os.environ[GEMV_ROWS_VARIABLE] = "0"
            try:
                engines["torch"] = LLM(dtype=dtype, enable_prefix_caching=False,
                                       enforce_eager=True)
            finally:
                del os.environ[GEMV_ROWS_VARIABLE]
        element = 2 if dtype == "bfloat16" else 4
        kv = 2 * config.num_layers * context * config.num_kv_heads * config.head_dim * element
        floor_ms = (weight_bytes(model) + kv) / (bandwidth * 1e9) * 1e3
        for engine in engines.values():
            one_request(engine, prompt[:32], 8)  # warm-up
        row: dict = {"dtype": dtype, "quantization": quantization,
                     "weight_MB": round(weight_bytes(model) / 1e6, 1),
                     "floor_ms": round(floor_ms, 2)}
        for turn in range(2):  # the paths take turns; the best of two is kept
            for name, engine in engines.items():
                tok_s, step_ms = one_request(engine, prompt, args.new_tokens)
                best = row.setdefault(name, {"tok_s_1": 0.0, "step_ms": float("inf")})
                best["tok_s_1"] = round(max(best["tok_s_1"], tok_s), 2)
                best["step_ms"] = round(min(best["step_ms"], step_ms), 2)
                best["step_over_floor"] = round(best["step_ms"] / floor_ms, 2)
                if turn == 0:
                    best[f"tok_s_{args.requests}"] = round(many_requests(engine, prompts, outs),
                                                           1)
        print(row, flush=True)
        results.append(row)
        for engine in engines.values():
            engine.close()
        del llm, model, engines, engine
    flags = cpu_flags()
    report = report_header(cpu_flags={f: f in flags for f in FLAGS}) | {
        "stream_read_GB_s": round(bandwidth, 2),
        "workload": {"one_request": f"128 prompt + {args.new_tokens} new tokens, greedy",
                     "many": f"{args.requests} requests, prompts 16-256, outputs 16-160"},
        "results": results,
    }
    save_report(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
