"""llama.cpp as a peer: minipaged float32 / bfloat16 / int8 against llama.cpp F32 and Q4_1.

The engine a CPU user would run instead of minipaged is llama.cpp. This benchmark serves the same
requests to each, one thread each, greedy, in one run:

* Workloads: one request of 128 random prompt tokens + 128 new tokens, and the 48 ShareGPT-like
  requests of `cpu/throughput.py` (its `make_requests` with its default lengths and seed), each
  generating exactly its own output length (`ignore_eos`). Every system gets the same token ids.
* minipaged: an `LLMEngine` per variant, `float32`, `bfloat16` and (where the engine has the
  option) `quantization="int8"`, all requests at once and stepped to completion, as in
  `cpu/throughput.py`.
* llama.cpp, through llama-cpp-python's C API (`worker.py`, a child process run by
  `--llama-python`, so minipaged's environment does not need llama-cpp-python): the bundled Q4_1
  GGUF as shipped, and requantised to F32 (`llama_model_quantize`, `allow_requantize`);
  continuous batching of every request in one context, as llama-server does.
* Fair on a shared machine: the systems run interleaved, one after another, `--repeats` rounds
  per workload, each round in a rotated order, so load from other processes hits all alike; the
  best round of each counts (other load only ever slows a run down) and the load average at
  every run is recorded. Ratios are of tokens/s measured in the same run.
* Token agreement: each system's greedy tokens against minipaged float32's, per request
  (identical requests) and in tokens (the share of tokens before each request's first
  difference).
* The bandwidth ceiling of one request: weight bytes / the one-thread DRAM read rate
  (`roofline.read_bandwidth`), in tokens/s, for each system's weight format.

Install the peer (an optional benchmark dependency, not one of minipaged's: it builds llama.cpp
from source, ~15-20 minutes on 2 cores) into its own environment:
    python3 -m venv /work/llama-venv && /work/llama-venv/bin/pip install llama-cpp-python==0.3.36
(or into minipaged's .venv, then `--llama-python` may be left out).
Run: .venv/bin/python benchmarks/peers/llamacpp.py --llama-python /work/llama-venv/bin/python
     (~25 minutes on a busy 2-core CPU; `--quick`: 12 small requests, a few minutes)
Writes benchmarks/results/llama_cpp_peer.json (--quick: llama_cpp_peer_quick.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

import numpy as np
import torch

from cpu.roofline import (
    EngineVariant,
    cpu_features,
    dram_bytes,
    quantization_available,
    read_bandwidth,
    weight_bytes,
)
from cpu.throughput import FIRST_ORDINARY_TOKEN, Request, first_difference, make_requests
from machine import report_header, save_report
from minipaged.engine.engine import LLMEngine
from minipaged.models.checkpoint.loader import default_model_path
from minipaged.sampling.params import SamplingParams

RESULTS = Path(__file__).resolve().parents[1] / "results"
WORKER = Path(__file__).parent / "worker.py"
REFERENCE = "minipaged float32"


# -- the systems ----------------------------------------------------------------------------------


class MinipagedSystem:
    """One engine variant, kept for the whole run; `run` serves requests to completion."""

    def __init__(self, variant: EngineVariant, threads: int):
        self.name = f"minipaged {variant.name}"
        self.engine = LLMEngine.from_pretrained(**variant.engine_kwargs(), num_cpu_blocks=0)
        self.weight_bytes = weight_bytes(self.engine.runner.model)
        self.threads = threads

    def run(self, requests: list[Request]) -> dict[str, object]:
        """Seconds and tokens of every request at once, after one small untimed request."""
        engine = self.engine
        warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        engine.add_request(None, requests[0].prompt[:8], warm)
        engine.run_until_done()
        steps: list[float] = []

        def observe(record) -> None:
            if record.scheduled and all(w.num_new_tokens == 1 for w in record.scheduled):
                steps.append(record.timings.total_s)

        engine.add_step_observer(observe)
        try:
            start = time.perf_counter()
            ids = [engine.add_request(None, r.prompt, SamplingParams(
                temperature=0.0, max_tokens=r.output_len, ignore_eos=True)) for r in requests]
            finals = engine.run_until_done()
            seconds = time.perf_counter() - start
        finally:
            engine.remove_step_observer(observe)
        return {"seconds": seconds, "tokens": [finals[i].outputs[0].token_ids for i in ids],
                "decode_step_s": steps}


class LlamaCppSystem:
    """A `worker.py` child process serving one format of the GGUF."""

    def __init__(self, python: str, model: Path, fmt: str, threads: int):
        self.name = f"llama.cpp {'F32' if fmt == 'f32' else model.stem.rsplit('.', 1)[-1]}"
        self.process = subprocess.Popen(
            [python, str(WORKER), str(model), "--format", fmt, "--threads", str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env=os.environ | {"OMP_NUM_THREADS": str(threads)})
        self.info = self._reply()
        self.weight_bytes = int(self.info["model_bytes"])

    def _reply(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}: the worker ended (exit {self.process.wait()}); "
                               "see its standard error above")
        return json.loads(line)

    def run(self, requests: list[Request]) -> dict[str, object]:
        job = {"requests": [[r.prompt, r.output_len] for r in requests]}
        self.process.stdin.write(json.dumps(job) + "\n")
        self.process.stdin.flush()
        return self._reply()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


# -- running them side by side --------------------------------------------------------------------


def interleaved(systems: list, requests: list[Request], repeats: int) -> dict[str, dict]:
    """Every system on `requests`, `repeats` rounds, each round in an order rotated by one;
    per system: all runs' seconds and load averages, the best run's tokens/s, its tokens."""
    output_tokens = sum(r.output_len for r in requests)
    runs: dict[str, dict] = {s.name: {"seconds": [], "load_1min": []} for s in systems}
    for round_ in range(repeats):
        order = systems[round_ % len(systems):] + systems[:round_ % len(systems)]
        for system in order:
            load = os.getloadavg()[0]
            result = system.run(requests)
            assert [len(t) for t in result["tokens"]] == [r.output_len for r in requests]
            entry = runs[system.name]
            entry["seconds"].append(round(result["seconds"], 3))
            entry["load_1min"].append(round(load, 2))
            entry["tokens"] = result["tokens"]
            if result["decode_step_s"]:
                entry.setdefault("median_decode_step_ms", []).append(
                    round(1e3 * float(np.median(result["decode_step_s"])), 2))
            print(f"  {system.name}: {output_tokens / result['seconds']:.1f} tok/s "
                  f"(load {load:.2f})", flush=True)
    for entry in runs.values():
        entry["output_tokens_per_s"] = round(output_tokens / min(entry["seconds"]), 2)
    return runs


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict[str, object]:
    """Requests whose tokens equal the reference's, and the share of tokens before each
    request's first difference."""
    same = [first_difference(a, b) for a, b in zip(tokens, reference, strict=True)]
    agreed = sum(len(a) if d is None else d for a, d in zip(reference, same, strict=True))
    return {"identical_requests": f"{sum(d is None for d in same)}/{len(same)}",
            "tokens_before_first_difference": round(agreed / sum(map(len, reference)), 4)}


def summarise(runs: dict[str, dict], systems: list, dram_gbs: float) -> dict[str, dict]:
    """Per system: tokens/s, ratios to each llama.cpp format, agreement with minipaged float32,
    the one-request bandwidth ceiling of its weights."""
    peers = {name: r["output_tokens_per_s"] for name, r in runs.items()
             if name.startswith("llama.cpp")}
    reference = runs[REFERENCE]["tokens"]
    table = {}
    for system in systems:
        r = runs[system.name]
        table[system.name] = {
            **{k: v for k, v in r.items() if k != "tokens"},
            **{f"ratio_to_{peer}": round(r["output_tokens_per_s"] / tps, 3)
               for peer, tps in peers.items()},
            "agreement_with_minipaged_float32": agreement(r["tokens"], reference),
            "weight_bytes": system.weight_bytes,
            "weights_read_floor_ms": round(1e3 * system.weight_bytes / (dram_gbs * 1e9), 2),
            "bandwidth_ceiling_tokens_per_s_1_request": round(
                dram_gbs * 1e9 / system.weight_bytes, 1),
        }
    return table


def print_table(title: str, table: dict[str, dict]) -> None:
    peers = [k.removeprefix("ratio_to_") for k in next(iter(table.values()))
             if k.startswith("ratio_to_")]
    print(f"\n{title}\n{'system':<20} {'tok/s':>8} " + " ".join(f"{'/ ' + p:>16}" for p in peers)
          + f" {'identical':>10} {'agreed tokens':>14}")
    for name, r in table.items():
        a = r["agreement_with_minipaged_float32"]
        print(f"{name:<20} {r['output_tokens_per_s']:>8.1f} "
              + " ".join(f"{r['ratio_to_' + p]:>16.2f}" for p in peers)
              + f" {a['identical_requests']:>10} {a['tokens_before_first_difference']:>14.3f}")


# -- main -----------------------------------------------------------------------------------------


def save(args: argparse.Namespace, systems: list, results: dict, load_before: float,
         dram_gbs: float, dram_after: float | None) -> None:
    """The report so far (written after each workload, so a cut-short run keeps its numbers)."""
    peer = next(s for s in systems if isinstance(s, LlamaCppSystem))
    save_report(args.out, {
        "benchmark": "llama_cpp_peer",
        "what": "greedy output tokens/s, one thread each, ignore_eos, same token-id requests: "
                "minipaged LLMEngine variants vs llama.cpp (llama-cpp-python C API, continuous "
                "batching in one context) on the bundled SmolLM2-135M-Instruct GGUF as F32 "
                "(requantised) and as shipped (Q4_1); interleaved rounds, best round each; "
                "agreement with minipaged float32",
        **report_header(load_average_1min_before=round(load_before, 2),
                        llama_cpp_python=peer.info["llama_cpp_python"],
                        llama_cpp_system_info=peer.info["system_info"], **cpu_features()),
        "threads": args.threads,
        "llama_cpp_extra_buffers": peer.info["extra_buffers"],
        "dram_read_gbs_1_thread": {"before": dram_gbs, "after": dram_after},
        "workloads": results,
    })


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-python", default=sys.executable,
                        help="a Python with llama-cpp-python installed (default: this one)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats-one", type=int, default=3,
                        help="rounds of the one-request workload")
    parser.add_argument("--repeats-many", type=int, default=1,
                        help="rounds of the many-request workload")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--one-request", type=int, nargs=2, default=[128, 128],
                        metavar=("PROMPT", "NEW"))
    parser.add_argument("--quick", action="store_true",
                        help="12 requests, prompts 16-128, outputs 16-64; one request 32 + 32")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.out is None:
        args.out = RESULTS / ("llama_cpp_peer" + ("_quick" if args.quick else "") + ".json")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    path = default_model_path()
    variants = [EngineVariant("float32"), EngineVariant("bfloat16")]
    if quantization_available():
        variants.append(EngineVariant("float32", "int8"))
    systems: list = [MinipagedSystem(v, args.threads) for v in variants]
    systems += [LlamaCppSystem(args.llama_python, path, fmt, args.threads)
                for fmt in ("f32", "native")]
    vocab = systems[0].engine.model_config.vocab_size
    # cpu/throughput.py's workload: its defaults (prompts 16-512, outputs 16-256, ShareGPT output
    # lengths halved); --quick as its --quick.
    prompts, outputs = ((16, 128), (16, 64)) if args.quick else ((16, 512), (16, 256))
    many = make_requests(12 if args.quick else args.num_requests, args.seed, prompts, outputs,
                         0.5, vocab)
    prompt_len, new = (32, 32) if args.quick else args.one_request
    rng = np.random.default_rng(args.seed)
    one = [Request(rng.integers(FIRST_ORDINARY_TOKEN, vocab, prompt_len).tolist(), new)]
    dram_gbs = read_bandwidth(dram_bytes(), 1)
    results = {}
    try:
        workloads = [("one_request", one, args.repeats_one)]
        if many:  # --num-requests 0: the one request only
            workloads.append((f"{len(many)}_requests", many, args.repeats_many))
        for name, requests, repeats in workloads:
            print(f"{name}: {sum(len(r.prompt) for r in requests)} prompt tokens, "
                  f"{sum(r.output_len for r in requests)} output tokens", flush=True)
            runs = interleaved(systems, requests, repeats)
            results[name] = {
                "prompt_tokens": sum(len(r.prompt) for r in requests),
                "output_tokens": sum(r.output_len for r in requests),
                "rounds": repeats, "systems": summarise(runs, systems, dram_gbs)}
            print_table(f"{name} (output tokens/s, best of {repeats} interleaved rounds)",
                        results[name]["systems"])
            save(args, systems, results, load_before[0], dram_gbs, None)
    finally:
        for system in systems:
            if isinstance(system, LlamaCppSystem):
                system.close()
    dram_after = read_bandwidth(dram_bytes(), 1)
    save(args, systems, results, load_before[0], dram_gbs, dram_after)
    print(f"\nDRAM read {dram_gbs} GB/s before, {dram_after} after (one thread); "
          f"load {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
