"""Greedy generation speed: minipaged's `generate_dense` vs `transformers`' `generate`.

Both run the bundled SmolLM2-135M-Instruct (float32, CPU) on the same chat prompts, at batch 1 and
batch 8, greedy. The new tokens of both are checked to be identical before any number is kept.
`transformers` pads the batch on the left and keeps computing finished rows; `generate_dense`
runs a flat batch with no padding and drops a sequence once it emits end-of-sequence. Throughput
counts the useful new tokens (up to and including end-of-sequence), the same for both.

Each measurement is the best of `--repeats` runs, alternating the two systems (and which goes
first) so that load from other processes on the machine hits both alike. Wall-clock time gives
the ratio; process CPU time is recorded too: with one thread it leaves out the time spent waiting
for a core that another process holds, but not the memory bandwidth others take.

Run: .venv/bin/python benchmarks/peers/dense_generation.py --threads 1    (~1 minute on 2 CPU cores)
Writes benchmarks/results/dense_generation.json. On a machine shared with other work, use
`--threads 1`: with torch's default of one OpenMP thread per core, every parallel operator waits
for a core another process holds, and both systems slow down several-fold, erratically.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

import torch
from tqdm import tqdm

from machine import report_header, save_report
from minipaged.models.checkpoint.loader import default_model_path
from minipaged.models.registry import load_model
from minipaged.testing.dense import generate_dense

RESULTS = Path(__file__).resolve().parents[1] / "results" / "dense_generation.json"

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle works.",
    "What are the benefits of drinking water?",
    "Describe the water cycle.",
    "Give me three tips for learning a new language.",
    "Why is the sky blue?",
    "Write a poem about autumn leaves.",
    "How do airplanes stay in the air?",
]


def timed(fn: Callable[[], list[list[int]]]) -> tuple[float, float, list[list[int]]]:
    """(wall-clock seconds, process CPU seconds, output) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads for both systems (default: torch's choice); "
                             "1 avoids OpenMP stalls on a machine shared with other work")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()

    import transformers  # a reference only, not a dependency of minipaged

    path = default_model_path()
    model, config = load_model(path, progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    eos = list(config.eos_token_ids)
    pad = 0

    def chat_ids(text: str) -> list[int]:
        enc = tok.apply_chat_template([{"role": "user", "content": text}],
                                      add_generation_prompt=True, tokenize=True)
        return list(enc["input_ids"])

    rows = []
    for batch in tqdm(args.batch_sizes, desc="batch sizes"):
        prompts = [chat_ids(PROMPTS[i % len(PROMPTS)]) for i in range(batch)]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

        def ours(n: int = args.max_new_tokens, prompts=prompts) -> list[list[int]]:
            return generate_dense(model, prompts, n, eos_token_ids=eos)

        def theirs(n: int = args.max_new_tokens, ids=ids, mask=mask) -> list[list[int]]:
            with torch.inference_mode():
                out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                  eos_token_id=eos, pad_token_id=pad)
            return out[:, ids.shape[1]:].tolist()

        ours(4), theirs(4)  # warm-up
        best = {"ours": (float("inf"), float("inf")), "theirs": (float("inf"), float("inf"))}
        outputs = {}
        for repeat in range(args.repeats):
            order = [("ours", ours), ("theirs", theirs)]
            for name, fn in order if repeat % 2 == 0 else order[::-1]:
                wall, cpu, outputs[name] = timed(fn)
                best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
        (t_ours, cpu_ours), (t_hf, cpu_hf) = best["ours"], best["theirs"]
        out_ours, out_hf = outputs["ours"], outputs["theirs"]
        for i, (a, b) in enumerate(zip(out_ours, out_hf, strict=True)):
            if a != b[:len(a)] or any(x not in (pad, *eos) for x in b[len(a):]):
                sys.exit(f"batch {batch}, prompt {i}: tokens differ\nminipaged {a}\nhf        {b}")
        new_tokens = sum(map(len, out_ours))
        rows.append({
            "batch_size": batch,
            "new_tokens": new_tokens,
            "prompt_tokens": sum(map(len, prompts)),
            "minipaged_s": round(t_ours, 3),
            "transformers_s": round(t_hf, 3),
            "minipaged_tok_s": round(new_tokens / t_ours, 2),
            "transformers_tok_s": round(new_tokens / t_hf, 2),
            "ratio": round(t_hf / t_ours, 3),
            "minipaged_cpu_s": round(cpu_ours, 3),
            "transformers_cpu_s": round(cpu_hf, 3),
            "ratio_cpu": round(cpu_hf / cpu_ours, 3),
            "tokens_identical": True,
        })

    print(f"\n{'batch':>5} {'tokens':>6} {'minipaged tok/s':>16} {'transformers tok/s':>19} "
          f"{'ratio':>6} {'ratio (CPU time)':>17}")
    for r in rows:
        print(f"{r['batch_size']:>5} {r['new_tokens']:>6} {r['minipaged_tok_s']:>16} "
              f"{r['transformers_tok_s']:>19} {r['ratio']:>6} {r['ratio_cpu']:>17}")
    report = {
        "benchmark": "dense_generation",
        "what": "greedy new tokens/s, generate_dense vs transformers generate, bundled "
                "SmolLM2-135M-Instruct float32 CPU; ratio = transformers time / minipaged time "
                "(wall clock; ratio_cpu: process CPU time), each the best of `repeats` runs",
        **report_header(transformers=transformers.__version__,
                        load_average_1min_before=round(load_before[0], 2)),
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "results": rows,
    }
    save_report(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
