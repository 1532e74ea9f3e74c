"""Offline throughput on a CUDA GPU in nano-vllm's shape: minipaged's engine against transformers.

The workload is nano-vllm's `bench.py`, so that the numbers compare with its own: `random` seeded
with 0; 256 requests, each a prompt of `randint(100, 1024)` token ids drawn by `randint(0, 10000)`
and `max_tokens = randint(100, 1024)` with `ignore_eos` (prompts drawn first, then the output
lengths, in its order). The model is Qwen3-0.6B-shaped with random bfloat16 weights, built in code
(no download), saved as safetensors with a stand-in tokenizer, and served by
`minipaged.LLM(folder, max_num_seqs=256, max_num_batched_tokens=8192)`. After one warm-up request
(nano-vllm's "Benchmark: "), `llm.generate` over every request is timed. Sampling is greedy by
default (temperature 0, as issue #41 measured); nano-vllm samples at 0.6 (`--temperature 0.6`).

In the same run:

* a decode step at the batch's full width (every sequence decoding; 256 here), under
  `torch.profiler`: the step's wall time, the GPU's kernel time (summed, and as the union of the
  kernels' intervals) over that wall time, kernels and launch calls per step, and the step
  against its memory floor: the weights' bytes plus the K/V bytes the step reads, at the
  device-to-device copy bandwidth measured as `gpu/check.py` measures it (read + write bytes);
* transformers on the same model: `generate` with one static batch of the first requests
  (left-padded, greedy, every row to the batch's longest output; only each request's own
  `max_tokens` count), and its continuous batching (`init_continuous_batching`) over all of them,
  each stopped at a time box (the rate is then over the tokens done in the box);
* an 8B-shaped model (Llama-3-8B's config, built on "meta" and filled on the device) at default
  engine settings over a few hundred requests of the same kind, shorter outputs.

    python benchmarks/gpu/throughput.py             # ~3 minutes on one H200
    python benchmarks/gpu/throughput.py --smoke     # CPU, tiny models: checks this script only

Writes `benchmarks/results/gpu_throughput_<gpu name>.json` (command, machine, GPU, date; `--out`)
and prints a table. `gpu/check.py` runs it after its kernel checks (`run`).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

import torch

from gpu.decode_profile import StepLog, profile_decode
from gpu.random_models import (
    LLAMA3_8B,
    QWEN3_0_6B,
    TINY_LLAMA,
    TINY_QWEN3,
    build_hf,
    model_bytes,
    save_folder,
)
from gpu.transformers_peers import continuous_batching, static_batch
from machine import report_header, save_report
from minipaged import LLM, SamplingParams

RESULTS = Path(__file__).resolve().parents[1] / "results"


@dataclass(frozen=True)
class Workload:
    """nano-vllm's request generator, with its sizes as parameters."""

    num_seqs: int = 256
    max_input_len: int = 1024
    max_output_len: int = 1024
    min_len: int = 100
    max_token_id: int = 10000
    seed: int = 0

    def requests(self) -> list[tuple[list[int], int]]:
        """(prompt token ids, max_tokens) per request, drawn in nano-vllm's order."""
        rng = random.Random(self.seed)
        prompts = [[rng.randint(0, self.max_token_id)
                    for _ in range(rng.randint(self.min_len, self.max_input_len))]
                   for _ in range(self.num_seqs)]
        outputs = [rng.randint(self.min_len, self.max_output_len) for _ in range(self.num_seqs)]
        return list(zip(prompts, outputs, strict=True))


NANO_VLLM = Workload()
BIG = Workload(num_seqs=200, max_output_len=200)  # the 8B model: fewer, shorter outputs


def run_engine(folder: Path, requests: list[tuple[list[int], int]], temperature: float,
               device: str, profile_steps: int, copy_bw: float | None, floor: tuple[int, int],
               trace: Path | None = None, **engine_kwargs) -> dict:
    """minipaged over every request at once after one warm-up request; then (`profile_steps`) a
    profiled decode step at the batch's full width, its Chrome trace written to `trace`, set
    against `floor`: (the weights' bytes, the K/V bytes of one token)."""
    llm = LLM(model=str(folder), dtype="bfloat16" if device == "cuda" else "float32",
              device=device, **engine_kwargs)
    try:
        llm.generate(["Benchmark: "], SamplingParams(temperature=temperature, max_tokens=16),
                     use_tqdm=False)
        params = [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=n)
                  for _, n in requests]
        log = StepLog()
        llm.engine.add_step_observer(log)
        sync(device)
        start = time.perf_counter()
        outputs = llm.generate([p for p, _ in requests], params, use_tqdm=False)
        sync(device)
        seconds = time.perf_counter() - start
        llm.engine.remove_step_observer(log)
        got = [len(o.outputs[0].token_ids) for o in outputs]
        if got != [n for _, n in requests]:
            raise RuntimeError("a request got other than its max_tokens (ignore_eos)")
        prompt_tokens = sum(len(p) for p, _ in requests)
        config = llm.engine.config  # the EngineConfig, defaults included
        result = {
            "engine": {k: v for k, v in vars(config).items()
                       if isinstance(v, (bool, int, float, str, type(None)))},
            "requests": len(requests), "prompt_tokens": prompt_tokens,
            "output_tokens": sum(got), "seconds": seconds,
            "output_tokens_per_s": sum(got) / seconds,
            "total_tokens_per_s": (prompt_tokens + sum(got)) / seconds,
            "steps": log.summary(),
        }
        if profile_steps:
            profile = profile_decode(llm.engine, [p for p, _ in requests], temperature,
                                     profile_steps, device)
            result["decode_profile"] = profile.report(*floor, copy_bw)
            if trace is not None:
                trace.parent.mkdir(parents=True, exist_ok=True)
                trace.write_text(json.dumps(profile.trace))
        return result
    finally:
        llm.close()
        del llm
        free_memory(device)


def kv_bytes_per_token(config: dict, dtype: torch.dtype) -> int:
    """K and V of one token in every layer of a model of `config` (transformers' names)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * element


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def guarded(name: str, fn, *args, **kwargs) -> dict:
    """`fn`'s result, or what failed: one failing part must not lose the others' numbers. Either
    way with the part's wall time, set-up included (`part_s`: what the run's budget pays)."""
    start = time.perf_counter()
    try:
        result = fn(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - reported in the JSON and on stderr
        print(f"{name} failed: {type(error).__name__}: {error}", file=sys.stderr)
        result = {"error": f"{type(error).__name__}: {error}"}
    return result | {"part_s": time.perf_counter() - start}


def run(*, device: str = "cuda", small: dict | None = None, big: dict | None = None,
        workload: Workload = NANO_VLLM, big_workload: Workload = BIG, temperature: float = 0.0,
        hf_batch: int = 256, hf_seconds: float = 20.0, cb_seconds: float = 30.0,
        profile_steps: int = 5, copy_bw: float | None = None, skip_big: bool = False,
        trace: Path | None = None) -> dict:
    """Every part of the benchmark; the report's body (no header)."""
    small = small or QWEN3_0_6B
    big = big or {}
    if device == "cuda" and copy_bw is None:
        from gpu.check import copy_bandwidth

        copy_bw = copy_bandwidth()
    requests = workload.requests()
    report: dict = {
        "workload": vars(workload) | {"sampling": "greedy" if temperature == 0 else
                                      f"temperature {temperature}", "ignore_eos": True},
        "copy_bandwidth_bytes_per_s": copy_bw,
    }
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with tempfile.TemporaryDirectory(prefix="minipaged-bench-") as tmp:
        hf = build_hf(small, device, dtype)
        floor = model_bytes(hf), kv_bytes_per_token(small, dtype)
        folder = save_folder(hf, Path(tmp) / "small")
        report["model"] = {"config": small, "weights_bytes": floor[0],
                           "kv_bytes_per_token": floor[1]}
        engine_settings = {"max_num_seqs": 256, "max_num_batched_tokens": 8192}
        report["minipaged"] = guarded(
            "minipaged", run_engine, folder, requests, temperature, device, profile_steps,
            copy_bw, floor, trace, **engine_settings)
        report["transformers_static"] = guarded(
            "transformers generate", static_batch, hf, requests[:hf_batch], hf_seconds)
        free_memory(device)
        report["transformers_cb"] = guarded(
            "transformers continuous batching", continuous_batching, hf, requests, cb_seconds,
            max_batch_tokens=engine_settings["max_num_batched_tokens"], device=device)
        del hf
        free_memory(device)
        if not skip_big and big:
            report["big"] = guarded("8B-shaped model", run_big, big, big_workload, device,
                                    dtype, Path(tmp) / "big", temperature)
    return report


def run_big(config: dict, workload: Workload, device: str, dtype: torch.dtype, folder: Path,
            temperature: float) -> dict:
    """The 8B-shaped model at the engine's default settings."""
    hf = build_hf(config, device, dtype, on_meta=True)
    weights = model_bytes(hf)
    save_folder(hf, folder)
    del hf
    free_memory(device)
    result = run_engine(folder, workload.requests(), temperature, device, 0, None, (weights, 0))
    return {"config": config, "weights_bytes": weights, "workload": vars(workload), **result}


# -- the table ------------------------------------------------------------------------------------


def print_table(report: dict) -> None:
    """One row per system; then the profiled decode step."""
    print(f"\nOffline throughput, nano-vllm's workload ({report['workload']['num_seqs']} requests, "
          f"{report['workload']['sampling']}, ignore_eos)")
    print(f"{'system':<34}{'requests':>9}{'seconds':>9}{'output tok/s':>14}{'total tok/s':>13}")
    rows = [("minipaged", report["minipaged"]),
            ("transformers generate (static)", report["transformers_static"]),
            ("transformers continuous batching", report["transformers_cb"])]
    if "big" in report:
        rows.append(("minipaged, 8B-shaped (defaults)", report["big"]))
    for name, r in rows:
        if "error" in r:
            print(f"{name:<34}  failed: {r['error'][:60]}")
            continue
        note = "" if r.get("finished", True) else "  (time box)"
        if r.get("second_half_output_tokens_per_s"):
            note += f"  (2nd half: {r['second_half_output_tokens_per_s']:,.0f} output tok/s)"
        print(f"{name:<34}{r['requests']:>9}{r['seconds']:>9.1f}{r['output_tokens_per_s']:>14,.0f}"
              f"{r['total_tokens_per_s']:>13,.0f}{note}")
    print("wall time per part, set-up included: " + ", ".join(
        f"{name} {r['part_s']:.0f} s" for name, r in rows if "part_s" in r))
    profile = report["minipaged"].get("decode_profile")
    if profile:
        print(f"\nDecode step at {profile['num_seqs']} sequences ({profile['steps']} steps "
              f"profiled): {profile['step_ms']:.2f} ms wall, {profile['kernel_ms']:.2f} ms of "
              f"kernels (busy {profile['busy_fraction']:.0%}, union "
              f"{profile['busy_fraction_union']:.0%}), {profile['kernels_per_step']:.0f} kernels "
              f"and {profile['launch_calls_per_step']:.0f} launch calls per step")
        if profile.get("floor_ms"):
            print(f"memory floor {profile['floor_ms']:.2f} ms ({profile['floor_bytes'] / 1e9:.2f} "
                  f"GB at the copy bandwidth): step {profile['step_over_floor']:.2f}x, kernels "
                  f"{profile['kernels_over_floor']:.2f}x")


def smoke() -> dict:
    """Every part on CPU with tiny models and few requests: checks this script, not a GPU."""
    tiny = Workload(num_seqs=6, max_input_len=24, max_output_len=12, min_len=4,
                    max_token_id=TINY_QWEN3["vocab_size"] - 1)
    report = run(device="cpu", small=TINY_QWEN3, big=TINY_LLAMA, workload=tiny,
                 big_workload=tiny, hf_batch=4, hf_seconds=30, cb_seconds=30, profile_steps=2)
    print_table(report)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy (default); nano-vllm's bench.py samples at 0.6")
    parser.add_argument("--hf-batch", type=int, default=256,
                        help="requests in transformers' one static batch (the first ones)")
    parser.add_argument("--hf-seconds", type=float, default=20.0, help="its time box")
    parser.add_argument("--cb-seconds", type=float, default=30.0,
                        help="the time box of transformers' continuous batching")
    parser.add_argument("--skip-big", action="store_true", help="no 8B-shaped run")
    parser.add_argument("--trace", type=Path, default=None,
                        help="write the profiled decode steps' Chrome trace here")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny models, nothing written")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        smoke()
        return 0
    if not torch.cuda.is_available():
        print("throughput: no CUDA GPU (use --smoke on CPU)", file=sys.stderr)
        return 2
    from gpu.check import gpu_slug

    name = torch.cuda.get_device_name(0)
    report = {**report_header(cuda=torch.version.cuda), "gpu": name,
              **run(big=LLAMA3_8B, temperature=args.temperature, hf_batch=args.hf_batch,
                    hf_seconds=args.hf_seconds, cb_seconds=args.cb_seconds,
                    skip_big=args.skip_big, trace=args.trace)}
    print_table(report)
    path = args.out or RESULTS / f"gpu_throughput_{gpu_slug(name)}.json"
    save_report(path, report)
    print(f"\nwrote {path}")
    return 1 if failed_parts(report) else 0


def failed_parts(report: dict) -> list[str]:
    """The parts of a report that failed (each holds an "error")."""
    return [name for name, part in report.items() if isinstance(part, dict) and "error" in part]


if __name__ == "__main__":
    sys.exit(main())
