"""How long the KV cache manager's bookkeeping takes per engine step.

256 concurrent sequences (ShareGPT-like lengths); every step each one gets a slot for its next
token (`can_append` + `append_slots`) and is marked computed (`mark_computed` with its token
ids, kept here as the engine's `Sequence`s keep them; it hashes the blocks it fills when prefix
caching is on). A finished sequence is freed and replaced by a new one (`allocate` of its prompt
+ `mark_computed`; the pool is sized so that it always fits), as continuous batching does.
Reported: wall time per step, with prefix caching on and off. The engine issue checks that this
stays a small fraction (< 5%) of a model step.

Run: .venv/bin/python benchmarks/serving/allocator_speed.py      (~30 s on 2 CPU cores)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

import numpy as np
from tqdm import tqdm

from machine import report_header, save_report
from minipaged.kv.manager import KVCacheManager
from minipaged.sim.traces import sharegpt_like

RESULTS = Path(__file__).resolve().parents[1] / "results" / "allocator_speed.json"


def run(num_seqs: int, steps: int, block_size: int, prefix_caching: bool, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    trace = iter(sharegpt_like(100_000, seed=seed))
    num_blocks = num_seqs * (2048 // block_size + 1)
    m = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    remaining: dict[int, int] = {}
    tokens: dict[int, list[int]] = {}  # each sequence's token ids: its owner's, not the manager's
    next_id = 0

    def admit() -> None:
        nonlocal next_id
        request = next(trace)
        prompt = rng.integers(0, 49152, request.prompt_len).tolist()
        m.allocate(next_id, prompt)
        m.mark_computed(next_id, prompt)
        remaining[next_id] = request.output_len
        tokens[next_id] = prompt
        next_id += 1

    for _ in range(num_seqs):
        admit()
    times = []
    for _ in tqdm(range(steps), desc=f"block {block_size}, prefix caching {prefix_caching}"):
        new_tokens = rng.integers(0, 49152, len(remaining)).tolist()
        start = time.perf_counter()
        for seq_id, token in zip(list(remaining), new_tokens, strict=True):
            assert m.can_append(seq_id, num_tokens=len(tokens[seq_id]) + 1)
            m.append_slots(seq_id, num_tokens=len(tokens[seq_id]) + 1)
            tokens[seq_id].append(token)
            m.mark_computed(seq_id, tokens[seq_id])
            remaining[seq_id] -= 1
            if remaining[seq_id] == 0:
                m.free(seq_id)
                del remaining[seq_id], tokens[seq_id]
                admit()
        times.append(time.perf_counter() - start)
    t = np.array(times) * 1e6
    return {
        "block_size": block_size,
        "prefix_caching": prefix_caching,
        "num_seqs": num_seqs,
        "steps": steps,
        "step_us_mean": round(float(t.mean()), 1),
        "step_us_p50": round(float(np.median(t)), 1),
        "step_us_p99": round(float(np.percentile(t, 99)), 1),
        "us_per_sequence_step": round(float(t.mean()) / num_seqs, 2),
        "sequences_admitted": next_id,
        "prefix_cache_hit_rate": round(m.prefix_cache_hit_rate, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    rows = [
        run(args.num_seqs, args.steps, block_size, caching, args.seed)
        for block_size in (16, 128)
        for caching in (False, True)
    ]
    save_report(args.out, {**report_header(), "results": rows})
    print(f"\n{'block':>5} {'prefix cache':>12} {'step mean ms':>12} {'p99 ms':>8} {'us/seq':>7}")
    for r in rows:
        print(
            f"{r['block_size']:>5} {r['prefix_caching']!s:>12} {r['step_us_mean'] / 1e3:>12.2f} "
            f"{r['step_us_p99'] / 1e3:>8.2f} {r['us_per_sequence_step']:>7.2f}"
        )
    base = rows[0]["step_us_mean"]
    print(f"prefix caching costs {rows[1]['step_us_mean'] / base:.2f}x at block 16")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
