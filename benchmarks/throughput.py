"""Offline throughput: minipaged's engine vs `transformers` `generate` with static batches.

Shaped like vLLM's `benchmarks/benchmark_throughput.py`: every request is handed to the engine at
once and the clock stops when the last one finishes; requests/s and tokens/s are reported.

* Workload: `--num-requests` requests with ShareGPT-like lengths (`minipaged.traces`, the vLLM
  paper's Fig. 11 statistics) scaled to the bundled SmolLM2-135M on a CPU: prompts clipped to
  16-512 tokens, outputs halved and clipped to 16-256, generated with `ignore_eos` so each
  request produces exactly its output length. Prompts are random token ids (the model does not
  care what they say, only how long they are).
* Baseline: `transformers` (the reference implementation, loading the same GGUF) with static
  batching, the way one would batch `generate` by hand: requests in order, `B` at a time,
  left-padded, each batch running until its longest output is done. It is run at every batch
  size of `--hf-batch-sizes`; the best is the baseline. Only requested tokens count.
* Correctness: both are greedy; the token ids of every request are compared. Where they differ,
  the dense model's logits at the first differing position show whether it is a near-tie
  (float32 sums taken in another order can flip a choice between two almost equal logits).
* Engine anatomy, from the same run (the engine's step records, `LLMEngine.add_step_observer`):
  the share of step time spent in the scheduler and the KV bookkeeping (`schedule`,
  `mark_computed`, `finish_step`), and the model FLOP rate of decode steps next to this
  machine's `torch.matmul` rate (2048 x 2048, float32) measured alongside.

Run: .venv/bin/python benchmarks/throughput.py           (full: several minutes on 2 CPU cores)
     .venv/bin/python benchmarks/throughput.py --quick   (a small run, about a minute)
Writes benchmarks/results/throughput.json (or throughput_quick.json).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from machine import report_header, save_report
from tqdm import tqdm

from minipaged.checkpoint import default_model_path
from minipaged.config import ModelConfig
from minipaged.dense import DenseAttentionBackend, DenseKVCache
from minipaged.engine import LLMEngine
from minipaged.sampling import SamplingParams
from minipaged.step import StepRecord
from minipaged.traces import sharegpt_like

RESULTS = Path(__file__).parent / "results"
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
    context_tokens: list[int] = field(default_factory=list)  # sum of seq_lens (attention FLOPs)

    def __call__(self, record: StepRecord) -> None:
        timings = record.timings
        assert timings is not None  # the engine's records are timed
        self.step_s.append(timings.total_s)
        self.bookkeeping_s.append(timings.schedule_s + timings.update_s)
        self.execute_s.append(timings.forward_s)
        work = record.scheduled
        self.tokens.append(record.num_batched_tokens)
        self.decode_only.append(bool(work) and all(w.num_new_tokens == 1 for w in work))
        self.context_tokens.append(sum(w.start + w.num_new_tokens for w in work))


def run_minipaged(
    engine: LLMEngine, requests: list[Request], log: StepLog
) -> tuple[float, list[list[int]]]:
    """All requests at once, stepped to completion (vLLM's offline throughput set-up)."""
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


def matmul_gflops(n: int = 2048, repeats: int = 5) -> float:
    """This machine's float32 `torch.matmul` rate (best of `repeats`)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def linear_flops_per_token(config: ModelConfig) -> int:
    """Multiply-adds x 2 of every weight matrix a token goes through (the layers and the head)."""
    h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
    q = config.num_heads * config.head_dim
    attention = h * q + 2 * h * kv + q * h
    mlp = 3 * h * config.intermediate_size  # gate, up, down (SwiGLU)
    return 2 * (config.num_layers * (attention + mlp) + h * config.vocab_size)


def attention_flops(config: ModelConfig, context_tokens: int) -> int:
    """QK^T and PV of one query over `context_tokens` keys, every head and layer."""
    return 4 * context_tokens * config.num_heads * config.head_dim * config.num_layers


# -- main -----------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-range", type=int, nargs=2, default=[16, 512])
    parser.add_argument("--output-range", type=int, nargs=2, default=[16, 256])
    parser.add_argument("--output-scale", type=float, default=0.5,
                        help="ShareGPT output lengths are multiplied by this before clipping")
    parser.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=float, default=1.0, help="GiB")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads for both systems; 1 (default) avoids OpenMP "
                             "stalls on a CPU shared with other work")
    parser.add_argument("--quick", action="store_true",
                        help="16 requests, prompts 16-128, outputs 16-64, batch sizes 4 and 8")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.num_requests = 16
        args.prompt_range, args.output_range = [16, 128], [16, 64]
        args.hf_batch_sizes = [4, 8]
    if args.out is None:
        args.out = RESULTS / ("throughput_quick.json" if args.quick else "throughput.json")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    import transformers  # the reference only; not a dependency of minipaged

    path = default_model_path()
    engine = LLMEngine.from_pretrained(
        path, block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        num_cpu_blocks=0,
    )
    config = engine.model_config
    requests = make_requests(args.num_requests, args.seed, tuple(args.prompt_range),
                             tuple(args.output_range), args.output_scale, config.vocab_size)
    prompt_tokens = sum(len(r.prompt) for r in requests)
    output_tokens = sum(r.output_len for r in requests)
    print(f"{len(requests)} requests: {prompt_tokens} prompt tokens, {output_tokens} output "
          f"tokens (prompts {min(len(r.prompt) for r in requests)}-"
          f"{max(len(r.prompt) for r in requests)}, outputs "
          f"{min(r.output_len for r in requests)}-{max(r.output_len for r in requests)})")

    peak = matmul_gflops()
    log = StepLog()
    mp_seconds, mp_tokens = run_minipaged(engine, requests, log)
    assert [len(t) for t in mp_tokens] == [r.output_len for r in requests]

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    # `generate` fills an unset eos_token_id from the model's own generation config, and would
    # then pad a row after its EOS: clear it there too, so every row runs to its length.
    hf_model.generation_config.eos_token_id = None
    hf_runs = {}
    hf_tokens_at: dict[int, list[list[int]]] = {}
    for batch_size in tqdm(args.hf_batch_sizes, desc="transformers batch sizes"):
        seconds, tokens = run_transformers(hf_model, requests, batch_size, pad=0)
        assert [len(t) for t in tokens] == [r.output_len for r in requests]
        hf_runs[batch_size], hf_tokens_at[batch_size] = seconds, tokens
    peak = max(peak, matmul_gflops())  # measured before and after: the better of the two
    best_batch = min(hf_runs, key=hf_runs.get)
    hf_seconds = hf_runs[best_batch]

    # Same greedy tokens? Where not, how close were the two candidates?
    differences = []
    for i, (ours, theirs) in enumerate(zip(mp_tokens, hf_tokens_at[best_batch], strict=True)):
        at = first_difference(ours, theirs)
        if at is not None:
            context = requests[i].prompt + ours[:at]
            gap = logit_gap(engine.runner.model, context, ours[at], theirs[at])
            differences.append({"request": i, "position": at, "logit_gap": round(gap, 6)})
    identical = len(requests) - len(differences)

    # Anatomy of the engine's steps.
    step_total = sum(log.step_s)
    bookkeeping_share = sum(log.bookkeeping_s) / step_total
    execute_share = sum(log.execute_s) / step_total
    per_token = linear_flops_per_token(config)
    decode = [i for i, d in enumerate(log.decode_only) if d]
    decode_flops = sum(per_token * log.tokens[i] + attention_flops(config, log.context_tokens[i])
                       for i in decode)
    decode_step_s = sum(log.step_s[i] for i in decode)
    decode_execute_s = sum(log.execute_s[i] for i in decode)
    decode_gflops_step = decode_flops / decode_step_s / 1e9
    decode_gflops_model = decode_flops / decode_execute_s / 1e9

    mp_tps, hf_tps = output_tokens / mp_seconds, output_tokens / hf_seconds
    rows = [("minipaged", mp_seconds, mp_tps)] + [
        (f"transformers static B={b}", s, output_tokens / s) for b, s in hf_runs.items()
    ]
    print(f"\n{'system':<28} {'seconds':>8} {'req/s':>7} {'output tok/s':>13} "
          f"{'total tok/s':>12}")
    for name, seconds, tps in rows:
        print(f"{name:<28} {seconds:>8.1f} {len(requests) / seconds:>7.3f} {tps:>13.1f} "
              f"{(prompt_tokens + output_tokens) / seconds:>12.1f}")
    print(f"\nratio (output tok/s, minipaged / best transformers B={best_batch}): "
          f"{mp_tps / hf_tps:.2f}x")
    print(f"greedy tokens identical for {identical}/{len(requests)} requests"
          + (f"; first differences at logit gaps {[d['logit_gap'] for d in differences]}"
             if differences else ""))
    print(f"scheduler + KV bookkeeping: {100 * bookkeeping_share:.2f}% of step time "
          f"(runner.execute {100 * execute_share:.1f}%, sampling and the rest "
          f"{100 * (1 - bookkeeping_share - execute_share):.1f}%) over {len(log.step_s)} steps")
    print(f"decode steps ({len(decode)}, mean batch {np.mean([log.tokens[i] for i in decode]):.1f}"
          f"): {decode_gflops_step:.1f} GFLOP/s per step, {decode_gflops_model:.1f} GFLOP/s in "
          f"the runner; torch.matmul 2048^2: {peak:.1f} GFLOP/s "
          f"({100 * decode_gflops_step / peak:.0f}% / {100 * decode_gflops_model / peak:.0f}%)")

    report = {
        "benchmark": "throughput",
        "what": "offline throughput (all requests at once), greedy, ignore_eos; minipaged's "
                "engine vs transformers generate with static batches at its best batch size; "
                "bundled SmolLM2-135M-Instruct float32 CPU",
        **report_header(transformers=transformers.__version__,
                        load_average_1min_before=round(load_before[0], 2)),
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
            "num_gpu_blocks": engine.kv_cache.num_blocks,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "preemptions": engine.scheduler.num_preemptions,
        },
        "minipaged": {"seconds": round(mp_seconds, 2), "output_tokens_per_s": round(mp_tps, 2),
                      "requests_per_s": round(len(requests) / mp_seconds, 4)},
        "transformers_static": {
            str(b): {"seconds": round(s, 2), "output_tokens_per_s": round(output_tokens / s, 2)}
            for b, s in hf_runs.items()
        },
        "best_transformers_batch_size": best_batch,
        "ratio_output_tokens_per_s": round(mp_tps / hf_tps, 3),
        "greedy_tokens_identical": f"{identical}/{len(requests)}",
        "token_differences": differences,
        "step_anatomy": {
            "steps": len(log.step_s),
            "bookkeeping_share": round(bookkeeping_share, 5),
            "runner_execute_share": round(execute_share, 4),
            "decode_steps": len(decode),
        },
        "decode_flops": {
            "gflop_per_token_linear": round(per_token / 1e9, 4),
            "gflops_per_decode_step": round(decode_gflops_step, 2),
            "gflops_in_runner_execute": round(decode_gflops_model, 2),
            "matmul_2048_gflops": round(peak, 2),
            "fraction_of_matmul": round(decode_gflops_step / peak, 3),
        },
    }
    save_report(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
