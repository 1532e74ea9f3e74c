"""Offline throughput: minipaged's engine vs `transformers`, and every step against its roofline.

Shaped like vLLM's `benchmarks/benchmark_throughput.py`: every request is handed to the engine at
once and the clock stops when the last one finishes; requests/s and tokens/s are reported.

* Workload: `--num-requests` requests with ShareGPT-like lengths (`minipaged.sim.traces`, the vLLM
  paper's Fig. 11 statistics) scaled to the bundled SmolLM2-135M on a CPU: prompts clipped to
  16-512 tokens, outputs halved and clipped to 16-256, generated with `ignore_eos` so each
  request produces exactly its output length. Prompts are random token ids (the model does not
  care what they say, only how long they are).
* minipaged, once per attention backend of `--attention-backends` ("torch": the readable
  reference; "cpu": its CPU arrangement, the engine's default on a CPU), in `--dtype`.
* Peers, `transformers` (the reference implementation, loading the same GGUF) in the same dtype:
  its *continuous batching* (`init_continuous_batching`, paged attention, at each
  `--cb-max-batch-tokens`; the best is the peer), and *static batching* with `generate`, the way
  one would batch by hand: requests in order, `B` at a time (`--hf-batch-sizes`), left-padded,
  each batch running until its longest output is done. Only requested tokens count.
* Correctness: all are greedy; the token ids of every request are compared with transformers'
  static batches. Where they differ, the engine's model's logits at the first differing position
  show whether it is a near-tie (sums taken in another order can flip a choice between two almost
  equal logits).
* The roofline, measured in the same run (`cpu/roofline.py`): `linear`'s GEMM rate in this dtype at
  the row counts steps use and the memory bandwidth of a large copy; for every decode and mixed
  step, its time next to its floor (matrix FLOPs at that rate + weight and K/V bytes at that
  bandwidth) and the ratio. The CPU model and its AMX / AVX-512 flags are in the JSON.
* Engine anatomy, from the same run (`LLMEngine.add_step_observer`): the share of step time spent
  in the scheduler and the KV bookkeeping (`schedule`, `mark_computed`, `finish_step`).

Run: .venv/bin/python benchmarks/cpu/throughput.py             (float32; ~20 minutes on a busy CPU)
     .venv/bin/python benchmarks/cpu/throughput.py --dtype bfloat16
     .venv/bin/python benchmarks/cpu/throughput.py --quick     (a small run, a few minutes)
Writes benchmarks/results/throughput.json (bfloat16: throughput_bfloat16.json; --quick:
throughput_quick.json).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

import numpy as np
import torch
from tqdm import tqdm

from cpu.roofline import Roofline, StepShape, cpu_features, measure, step_floor
from machine import report_header, save_report
from minipaged.engine.engine import LLMEngine
from minipaged.engine.record import StepRecord
from minipaged.models.checkpoint.loader import default_model_path
from minipaged.platforms import DTYPES
from minipaged.sampling.params import SamplingParams
from minipaged.sim.traces import sharegpt_like
from minipaged.testing.dense import DenseAttentionBackend, DenseKVCache

RESULTS = Path(__file__).resolve().parents[1] / "results"
FIRST_ORDINARY_TOKEN = 17  # SmolLM2's control tokens are 0-16

# -- the workload ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    output_len: int


def make_requests(
    num: int, seed: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
    output_scale: float, vocab_size: int,
) -> list[Request]:
    """ShareGPT-shaped lengths, clipped to the ranges; random ordinary tokens as prompts."""
    rng = np.random.default_rng(seed)
    requests = []
    for r in sharegpt_like(num, seed=seed):
        prompt_len = int(np.clip(r.prompt_len, *prompt_range))
        output_len = int(np.clip(round(r.output_len * output_scale), *output_range))
        prompt = rng.integers(FIRST_ORDINARY_TOKEN, vocab_size, prompt_len).tolist()
        requests.append(Request(prompt, output_len))
    return requests


# -- minipaged, instrumented ----------------------------------------------------------------------


@dataclass
class StepLog:
    """Per-step timings and shapes: a step observer of the engine (`StepRecord`s)."""

    step_s: list[float] = field(default_factory=list)
    bookkeeping_s: list[float] = field(default_factory=list)  # scheduler + KV manager
    execute_s: list[float] = field(default_factory=list)  # runner: swaps, batch, forward
    tokens: list[int] = field(default_factory=list)  # tokens computed in the step
    decode_only: list[bool] = field(default_factory=list)
    num_seqs: list[int] = field(default_factory=list)
    logits_rows: list[int] = field(default_factory=list)  # sequences that sampled
    context_tokens: list[int] = field(default_factory=list)  # sum of seq_lens: K/V read
    attended_pairs: list[int] = field(default_factory=list)  # (query, key) pairs scored

    def __call__(self, record: StepRecord) -> None:
        timings = record.timings
        assert timings is not None  # the engine's records are timed
        self.step_s.append(timings.total_s)
        self.bookkeeping_s.append(timings.schedule_s + timings.update_s)
        self.execute_s.append(timings.forward_s)
        work = record.scheduled
        self.tokens.append(record.num_batched_tokens)
        self.decode_only.append(bool(work) and all(w.num_new_tokens == 1 for w in work))
        self.num_seqs.append(len(work))
        self.logits_rows.append(sum(w.needs_logits for w in work))
        self.context_tokens.append(sum(w.start + w.num_new_tokens for w in work))
        self.attended_pairs.append(sum(  # query r of a chunk sees start + r + 1 keys
            w.num_new_tokens * w.start + w.num_new_tokens * (w.num_new_tokens + 1) // 2
            for w in work))

    def shape(self, i: int) -> StepShape:
        return StepShape(self.tokens[i], self.logits_rows[i], self.context_tokens[i],
                         self.attended_pairs[i])


def run_minipaged(
    engine: LLMEngine, requests: list[Request], log: StepLog
) -> tuple[float, list[list[int]]]:
    """All requests at once, stepped to completion (vLLM's offline throughput set-up), after one
    small untimed request (first calls: the GEMM choice of each weight shape, oneDNN's packing)."""
    engine.add_request(None, requests[0].prompt[:8], SamplingParams(temperature=0.0, max_tokens=2,
                                                                     ignore_eos=True))
    engine.run_until_done()
    engine.add_step_observer(log)
    start = time.perf_counter()
    ids = [
        engine.add_request(
            None, r.prompt, SamplingParams(temperature=0.0, max_tokens=r.output_len,
                                           ignore_eos=True)
        )
        for r in requests
    ]
    finals = engine.run_until_done(use_tqdm=True)
    elapsed = time.perf_counter() - start
    return elapsed, [finals[i].outputs[0].token_ids for i in ids]


# -- transformers, static batches -----------------------------------------------------------------


def run_transformers(hf_model, requests: list[Request], batch_size: int, pad: int):
    """Static batching with `generate`: `batch_size` requests at a time, left-padded, each batch
    decoding until its longest output is done; returns (seconds, each request's tokens)."""
    from transformers import GenerationConfig

    outputs: list[list[int]] = []
    start = time.perf_counter()
    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    for batch in tqdm(batches, desc=f"transformers B={batch_size}", leave=False):
        width = max(len(r.prompt) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r.prompt)) + r.prompt for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch])
        config = GenerationConfig(
            do_sample=False, max_new_tokens=max(r.output_len for r in batch),
            eos_token_id=None, pad_token_id=pad,  # like ignore_eos: never stop early
        )
        with torch.inference_mode():
            out = hf_model.generate(ids, attention_mask=mask, generation_config=config)
        for row, r in zip(out[:, width:].tolist(), batch, strict=True):
            outputs.append(row[: r.output_len])
    return time.perf_counter() - start, outputs


# -- transformers, continuous batching ------------------------------------------------------------


def run_transformers_cb(hf_model, requests: list[Request], max_batch_tokens: int,
                        num_blocks: int):
    """transformers' continuous batching (its paged attention and scheduler) over all requests at
    once, `max_batch_tokens` per step; returns (seconds, each request's tokens)."""
    from transformers.generation import ContinuousBatchingConfig, GenerationConfig

    manager = hf_model.init_continuous_batching(
        generation_config=GenerationConfig(
            do_sample=False, eos_token_id=-1,  # -1: never stop early, like ignore_eos
            max_new_tokens=max(r.output_len for r in requests)),
        continuous_batching_config=ContinuousBatchingConfig(
            num_blocks=num_blocks, max_batch_tokens=max_batch_tokens, use_cuda_graph=False,
            use_async_batching=False),
    )
    manager.start()
    try:
        start = time.perf_counter()
        ids = [manager.add_request(r.prompt, request_id=f"r{i}", max_new_tokens=r.output_len,
                                   eos_token_id=-1) for i, r in enumerate(requests)]
        done: dict[str, list[int]] = {}
        with tqdm(total=len(ids), desc=f"transformers CB {max_batch_tokens}", leave=False) as bar:
            while len(done) < len(ids):
                result = manager.get_result(timeout=60)
                if result is not None and result.is_finished():
                    done[result.request_id] = list(result.generated_tokens)
                    bar.update()
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    return seconds, [done[i] for i in ids]


# -- checks and machine numbers -------------------------------------------------------------------


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def logit_gap(model, context: list[int], a: int, b: int) -> float:
    """|logit(a) - logit(b)| after `context`, from one dense forward pass."""
    attn = DenseAttentionBackend(DenseKVCache(model.config.num_layers), [0], [len(context)])
    with torch.inference_mode():
        hidden = model(torch.tensor(context), torch.arange(len(context)), attn)
        logits = model.compute_logits(hidden[-1:])[0]
    return abs(float(logits[a] - logits[b]))


def token_differences(model, requests: list[Request], ours: list[list[int]],
                      theirs: list[list[int]]) -> list[dict]:
    """Where `ours` and `theirs` first differ, per request, and the logit gap there."""
    differences = []
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        at = first_difference(a, b)
        if at is not None:
            gap = logit_gap(model, requests[i].prompt + a[:at], a[at], b[at])
            differences.append({"request": i, "position": at, "logit_gap": round(gap, 6)})
    return differences


def roofline_summary(config, roof: Roofline, log: StepLog, element_size: int) -> dict:
    """Every decode and mixed step's time next to its floor, and the medians by kind."""
    steps, by_kind = [], {"decode_32_plus": [], "decode": [], "mixed": []}
    for i in range(len(log.step_s)):
        floor = step_floor(config, roof, log.shape(i), element_size)
        kind = "decode" if log.decode_only[i] else "mixed"
        ratio = log.step_s[i] / floor["floor_s"]
        steps.append([kind, log.num_seqs[i], log.tokens[i], log.context_tokens[i],
                      round(log.step_s[i] * 1e3, 2), round(floor["floor_s"] * 1e3, 2),
                      round(ratio, 3)])
        by_kind[kind].append((log.step_s[i], floor, log.execute_s[i]))
        if kind == "decode" and log.num_seqs[i] >= 32:
            by_kind["decode_32_plus"].append((log.step_s[i], floor, log.execute_s[i]))

    def summary(rows: list) -> dict:
        if not rows:
            return {"steps": 0}
        return {
            "steps": len(rows),
            "median_step_ms": round(1e3 * float(np.median([r[0] for r in rows])), 2),
            "median_floor_ms": round(1e3 * float(np.median([r[1]["floor_s"] for r in rows])), 2),
            "median_ratio": round(float(np.median([r[0] / r[1]["floor_s"] for r in rows])), 3),
            "median_ratio_runner_execute": round(
                float(np.median([r[2] / r[1]["floor_s"] for r in rows])), 3),
            "median_ratio_to_overlapped_floor": round(
                float(np.median([r[0] / r[1]["overlapped_floor_s"] for r in rows])), 3),
            "compute_share_of_floor": round(
                sum(r[1]["compute_s"] for r in rows) / sum(r[1]["floor_s"] for r in rows), 3),
        }

    return {**{kind: summary(rows) for kind, rows in by_kind.items()},
            "step_columns": ["kind", "seqs", "tokens", "context_tokens", "step_ms", "floor_ms",
                             "ratio"],
            "steps": steps}


# -- main -----------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-range", type=int, nargs=2, default=[16, 512])
    parser.add_argument("--output-range", type=int, nargs=2, default=[16, 256])
    parser.add_argument("--output-scale", type=float, default=0.5,
                        help="ShareGPT output lengths are multiplied by this before clipping")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--attention-backends", nargs="+", default=["torch", "cpu"])
    parser.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[16])
    parser.add_argument("--cb-max-batch-tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--cb-num-blocks", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=float, default=1.0, help="GiB")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads for every system; 1 (default) avoids OpenMP "
                             "stalls on a CPU shared with other work")
    parser.add_argument("--quick", action="store_true",
                        help="12 requests, prompts 16-128, outputs 16-64, batch size 4")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.num_requests = 12
        args.prompt_range, args.output_range = [16, 128], [16, 64]
        args.hf_batch_sizes = [4]
    if args.out is None:
        name = "throughput" + ("" if args.dtype == "float32" else f"_{args.dtype}")
        args.out = RESULTS / (name + ("_quick" if args.quick else "") + ".json")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    import transformers  # the reference only; not a dependency of minipaged

    dtype = DTYPES[args.dtype]
    path = default_model_path()

    def engine_with(backend: str) -> LLMEngine:
        return LLMEngine.from_pretrained(
            path, dtype=args.dtype, attention_backend=backend, block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, num_cpu_blocks=0,
        )

    engine = engine_with(args.attention_backends[0])
    config = engine.model_config
    requests = make_requests(args.num_requests, args.seed, tuple(args.prompt_range),
                             tuple(args.output_range), args.output_scale, config.vocab_size)
    prompt_tokens = sum(len(r.prompt) for r in requests)
    output_tokens = sum(r.output_len for r in requests)
    print(f"{len(requests)} requests: {prompt_tokens} prompt tokens, {output_tokens} output "
          f"tokens (prompts {min(len(r.prompt) for r in requests)}-"
          f"{max(len(r.prompt) for r in requests)}, outputs "
          f"{min(r.output_len for r in requests)}-{max(r.output_len for r in requests)})")

    roofs = [measure(config, dtype)]
    minipaged_runs: dict[str, dict] = {}
    for backend in tqdm(args.attention_backends, desc="minipaged attention backends"):
        if engine is None:
            engine = engine_with(backend)
        log = StepLog()
        seconds, tokens = run_minipaged(engine, requests, log)
        assert [len(t) for t in tokens] == [r.output_len for r in requests]
        minipaged_runs[backend] = {"seconds": seconds, "tokens": tokens, "log": log,
                                   "model": engine.runner.model, "engine": engine}
        engine = None

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=dtype
    ).eval()
    # `generate` fills an unset eos_token_id from the model's own generation config, and would
    # then pad a row after its EOS: clear it there too, so every row runs to its length.
    hf_model.generation_config.eos_token_id = None
    static_runs: dict[int, tuple[float, list[list[int]]]] = {}
    for batch_size in tqdm(args.hf_batch_sizes, desc="transformers static batch sizes"):
        static_runs[batch_size] = run_transformers(hf_model, requests, batch_size, pad=0)
    cb_runs: dict[int, tuple[float, list[list[int]]]] = {}
    for max_batch_tokens in tqdm(args.cb_max_batch_tokens, desc="transformers CB settings"):
        cb_runs[max_batch_tokens] = run_transformers_cb(hf_model, requests, max_batch_tokens,
                                                        args.cb_num_blocks)
    for _, tokens in [*static_runs.values(), *cb_runs.values()]:
        assert [len(t) for t in tokens] == [r.output_len for r in requests]
    roofs.append(measure(config, dtype))  # before and after: the better of the two
    roof = Roofline(roofs[0].dtype, roofs[0].rows,
                    tuple(max(a, b) for a, b in zip(roofs[0].gemm_gflops, roofs[1].gemm_gflops,
                                                    strict=True)),
                    max(roofs[0].bandwidth_gbs, roofs[1].bandwidth_gbs))

    best_static = min(static_runs, key=lambda b: static_runs[b][0])
    best_cb = min(cb_runs, key=lambda b: cb_runs[b][0])
    static_tokens, cb_tokens = static_runs[best_static][1], cb_runs[best_cb][1]
    cb_tps = output_tokens / cb_runs[best_cb][0]
    static_tps = output_tokens / static_runs[best_static][0]
    element_size = torch.tensor([], dtype=dtype).element_size()

    results = {}
    for backend, run in minipaged_runs.items():
        log = run["log"]
        step_total = sum(log.step_s)
        differences = token_differences(run["model"], requests, run["tokens"], static_tokens)
        tps = output_tokens / run["seconds"]
        results[backend] = {
            "seconds": round(run["seconds"], 2),
            "output_tokens_per_s": round(tps, 2),
            "requests_per_s": round(len(requests) / run["seconds"], 4),
            "ratio_to_transformers_cb": round(tps / cb_tps, 3),
            "ratio_to_transformers_static": round(tps / static_tps, 3),
            "greedy_tokens_identical_to_static": f"{len(requests) - len(differences)}/"
                                                 f"{len(requests)}",
            "token_differences_to_static": differences,
            "preemptions": run["engine"].scheduler.num_preemptions,
            "step_anatomy": {
                "steps": len(log.step_s),
                "bookkeeping_share": round(sum(log.bookkeeping_s) / step_total, 5),
                "runner_execute_share": round(sum(log.execute_s) / step_total, 4),
                "decode_steps": sum(log.decode_only),
            },
            "roofline": roofline_summary(config, roof, log, element_size),
        }
    cb_differences = token_differences(minipaged_runs[args.attention_backends[-1]]["model"],
                                       requests, cb_tokens, static_tokens)

    print(f"\n{'system':<34} {'seconds':>8} {'req/s':>7} {'output tok/s':>13}")
    rows = [(f"minipaged, attention {b}", r["seconds"], r["output_tokens_per_s"])
            for b, r in results.items()]
    rows += [(f"transformers CB max_batch_tokens={m}", s, output_tokens / s)
             for m, (s, _) in cb_runs.items()]
    rows += [(f"transformers static B={b}", s, output_tokens / s)
             for b, (s, _) in static_runs.items()]
    for name, seconds, tps in rows:
        print(f"{name:<34} {seconds:>8.1f} {len(requests) / seconds:>7.3f} {tps:>13.1f}")
    for backend, r in results.items():
        d32 = r["roofline"]["decode_32_plus"]
        print(f"{backend}: {r['ratio_to_transformers_cb']:.2f}x transformers CB, "
              f"{r['ratio_to_transformers_static']:.2f}x static; tokens identical to static "
              f"{r['greedy_tokens_identical_to_static']}"
              + (f" (gaps {[d['logit_gap'] for d in r['token_differences_to_static']]})"
                 if r["token_differences_to_static"] else "")
              + f"; decode steps of >= 32 seqs: {d32.get('steps', 0)}, median "
              f"{d32.get('median_step_ms')} ms vs floor {d32.get('median_floor_ms')} ms, "
              f"ratio {d32.get('median_ratio')}")
    print(f"transformers CB vs static tokens: {len(requests) - len(cb_differences)}/"
          f"{len(requests)} identical")
    print(f"roofline ({roof.dtype}): copy {roof.bandwidth_gbs} GB/s, GEMM GFLOP/s "
          + ", ".join(f"{n}: {g}" for n, g in zip(roof.rows, roof.gemm_gflops, strict=True)))

    report = {
        "benchmark": "throughput",
        "what": "offline throughput (all requests at once), greedy, ignore_eos; minipaged's "
                "engine (per attention backend) vs transformers' continuous batching (best "
                "max_batch_tokens) and static generate batches, same dtype; bundled "
                f"SmolLM2-135M-Instruct {args.dtype} CPU; every step against the same-run "
                "roofline",
        **report_header(transformers=transformers.__version__,
                        load_average_1min_before=round(load_before[0], 2), **cpu_features()),
        "dtype": args.dtype,
        "workload": {
            "num_requests": len(requests),
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "prompt_range": args.prompt_range,
            "output_range": args.output_range,
            "output_scale": args.output_scale,
            "seed": args.seed,
        },
        "engine": {
            "block_size": args.block_size,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
        },
        "roofline": {**roof.__dict__, "runs": [r.__dict__ for r in roofs],
                     "floor": "matrix FLOPs / GEMM rate at the step's rows + (weight + K/V "
                              "bytes) / copy bandwidth; rates: the better of before and after"},
        "minipaged": results,
        "transformers_cb": {
            str(m): {"seconds": round(s, 2), "output_tokens_per_s": round(output_tokens / s, 2)}
            for m, (s, _) in cb_runs.items()
        },
        "transformers_cb_settings": {"num_blocks": args.cb_num_blocks, "use_cuda_graph": False,
                                     "use_async_batching": False},
        "best_transformers_cb_max_batch_tokens": best_cb,
        "transformers_cb_tokens_identical_to_static": f"{len(requests) - len(cb_differences)}/"
                                                      f"{len(requests)}",
        "transformers_static": {
            str(b): {"seconds": round(s, 2), "output_tokens_per_s": round(output_tokens / s, 2)}
            for b, (s, _) in static_runs.items()
        },
        "best_transformers_static_batch_size": best_static,
    }
    save_report(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
