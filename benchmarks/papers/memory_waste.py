"""How much KV cache memory holds token states: paged blocks vs contiguous reservation.

Reproduces, in miniature, the vLLM paper's memory-waste figures (Kwon et al. SOSP'23):

* Fig. 2 / §6.2: the time-averaged fraction of the KV cache holding token states, for paged
  blocks of 1..256 tokens and for the Orca variants (Max, Pow2, Oracle) on a buddy allocator,
  plus static batching. Paper: vLLM 96.3%, Orca Max 20.4%, Pow2 26.8%, Oracle 38.2%.
* Fig. 15 / §6.3: the memory saved by sharing blocks for parallel sampling (n = 2, 4, 6) and
  beam search (width 2, 4, 6) on Alpaca. Paper: 6.1-9.8% and 37.6-55.2%.

The KV capacity is the paper's OPT-13B on one A100: 15.7K token slots. A small iteration-level
simulator drives the real `KVCacheManager` and the baselines of `minipaged.kv.reservation`: each
iteration every running request writes one token; waiting requests are admitted FCFS while
they fit; a paged request that cannot grow preempts the newest running one (recomputation).
Fractions are averaged over the iterations in which requests are waiting, i.e. while the
system is memory-bound: free memory then counts as waste ("external fragmentation & others").

Run: .venv/bin/python benchmarks/papers/memory_waste.py            (~2-4 minutes on 2 CPU cores)
     .venv/bin/python benchmarks/papers/memory_waste.py --quick    (a smaller run, for notebooks)
"""

from __future__ import annotations

import argparse
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

import numpy as np
from tqdm import tqdm

from machine import report_header, save_report
from minipaged.kv.interface import MemoryUsage
from minipaged.kv.manager import KVCacheManager
from minipaged.kv.reservation import ReservationKVCacheManager
from minipaged.sim.traces import TraceRequest, alpaca_like, sharegpt_like

CAPACITY_SLOTS = 15_700  # OPT-13B on one A100-40GB (vLLM paper §3)
MAX_SEQ_LEN = 2048
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SHARING_WIDTHS = (2, 4, 6)

PAPER_TOKEN_PERCENT = {"paged@16": 96.3, "orca-max": 20.4, "orca-pow2": 26.8, "orca-oracle": 38.2}
PAPER_SAVINGS_PERCENT = {"parallel": (6.1, 9.8), "beam": (37.6, 55.2)}  # n / width 2 .. 6

RESULTS = Path(__file__).resolve().parents[1] / "results" / "memory_waste.json"


# --------------------------------------------------------------------------------------------
# Systems behind one small interface
# --------------------------------------------------------------------------------------------


@dataclass
class _Request:
    rid: int
    prompt_len: int
    output_len: int
    generated: int = 0


class PagedSystem:
    """The KV cache manager: blocks on demand, preemption by recomputation when short."""

    preempts = True

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.m = KVCacheManager(
            CAPACITY_SLOTS // block_size, block_size, enable_prefix_caching=False
        )

    def try_admit(self, r: _Request) -> bool:
        tokens = [0] * (r.prompt_len + r.generated)  # a preempted request recomputes its output
        if not self.m.can_allocate(r.rid, tokens):
            return False
        self.m.allocate(r.rid, tokens)
        return True

    def grow(self, r: _Request) -> bool:
        length = r.prompt_len + r.generated + 1
        if not self.m.can_append(r.rid, num_tokens=length):
            return False
        self.m.append_slots(r.rid, num_tokens=length)
        return True

    def release(self, r: _Request) -> None:
        self.m.free(r.rid)

    def usage(self) -> MemoryUsage:
        return self.m.memory_usage()


class ContiguousSystem:
    """An Orca reservation policy or static batching (`ReservationKVCacheManager`, one-token
    blocks): room for the whole output up front. A static batch is closed once it decodes and
    reopens when all its requests have finished."""

    preempts = False

    def __init__(self, policy: str, static_batch: bool = False) -> None:
        self.m = ReservationKVCacheManager(
            CAPACITY_SLOTS, 1, policy, MAX_SEQ_LEN, static_batch=static_batch
        )
        self.static_batch = static_batch
        self.decoding = False  # a static batch has started: nobody joins it

    def try_admit(self, r: _Request) -> bool:
        if self.static_batch and self.decoding:
            return False
        self.m.expect(r.rid, r.prompt_len, r.output_len)
        prompt = [0] * r.prompt_len
        if not self.m.can_allocate(r.rid, prompt):
            return False
        self.m.allocate(r.rid, prompt)
        return True

    def grow(self, r: _Request) -> bool:
        self.m.append_slots(r.rid, num_tokens=r.prompt_len + r.generated + 1)
        self.decoding = True
        return True

    def release(self, r: _Request) -> None:
        self.m.free(r.rid)
        self.decoding = self.decoding and bool(self.m.seq_ids())

    def usage(self) -> MemoryUsage:
        return self.m.memory_usage()


def make_system(name: str) -> PagedSystem | ContiguousSystem:
    if name.startswith("paged@"):
        return PagedSystem(int(name.split("@")[1]))
    if name == "static":
        return ContiguousSystem("max", static_batch=True)
    return ContiguousSystem(name.split("-")[1])


# --------------------------------------------------------------------------------------------
# The iteration-level simulation
# --------------------------------------------------------------------------------------------


def simulate(system, trace: list[TraceRequest]) -> dict:
    """Serve the trace; return time-averaged memory categories and counts."""
    requests = [_Request(i, t.prompt_len, t.output_len) for i, t in enumerate(trace)]
    waiting: deque[_Request] = deque()
    running: list[_Request] = []
    sums = np.zeros(6)  # token, reserved, internal, external, free, total (saturated iterations)
    next_arrival = finished = iterations = saturated = preemptions = 0
    clock = 0.0
    while finished < len(requests):
        if not waiting and not running:
            clock = max(clock, trace[next_arrival].arrival_time)
        while next_arrival < len(trace) and trace[next_arrival].arrival_time <= clock:
            waiting.append(requests[next_arrival])
            next_arrival += 1
        # Running requests each write one token; a paged request short of blocks preempts the
        # newest running request (possibly itself), as vLLM's FCFS scheduler does.
        index = 0
        while index < len(running):
            r = running[index]
            if system.grow(r):
                r.generated += 1
                index += 1
                continue
            victim = running.pop()
            system.release(victim)
            waiting.appendleft(victim)
            preemptions += 1
        while waiting and system.try_admit(waiting[0]):
            running.append(waiting.popleft())
        u = system.usage()
        if waiting:
            sums += (
                u.token_slots,
                u.reserved_slots,
                u.internal_fragmentation_slots,
                u.external_fragmentation_slots,
                u.free_slots,
                u.total_slots,
            )
            saturated += 1
        done = [r for r in running if r.generated == r.output_len]
        for r in done:
            system.release(r)
            running.remove(r)
        finished += len(done)
        iterations += 1
        clock += 1.0
    percent = 100.0 * sums[:5] / sums[5] if saturated else np.full(5, float("nan"))
    return {
        "token_percent": round(float(percent[0]), 2),
        "reserved_percent": round(float(percent[1]), 2),
        "internal_fragmentation_percent": round(float(percent[2]), 2),
        "external_fragmentation_percent": round(float(percent[3]), 2),
        "free_percent": round(float(percent[4]), 2),
        "token_percent_of_allocated": round(float(100.0 * sums[0] / sums[:4].sum()), 2),
        "iterations": iterations,
        "saturated_iterations": saturated,
        "preemptions": preemptions,
    }


# --------------------------------------------------------------------------------------------
# Sharing: parallel sampling and beam search (§4.4, Fig. 15)
# --------------------------------------------------------------------------------------------


def sharing_savings(
    trace: list[TraceRequest], mode: str, width: int, block_size: int = 16, seed: int = 0
) -> float:
    """Percent of blocks saved by sharing, time-averaged: 1 - used / (blocks without sharing).

    Parallel sampling forks `width` samples from the prompt, each with its own output length
    (drawn from the trace). Beam search keeps `width` beams; each step every new beam picks its
    parent uniformly among the current beams (forking when a parent is picked twice, freeing
    beams picked by none), a simple model of how beams share history.
    """
    rng = np.random.default_rng(seed)
    max_groups = 32
    blocks_needed = max_groups * width * (MAX_SEQ_LEN // block_size + 1)
    m = KVCacheManager(blocks_needed, block_size, enable_prefix_caching=False, watermark=0.0)
    next_id = iter(range(10**9))
    pending = deque(range(len(trace)))
    active: list[dict] = []
    used_sum = unshared_sum = 0
    while pending or active:
        while pending and len(active) < max_groups:
            i = pending.popleft()
            root = next(next_id)
            m.allocate(root, [0] * trace[i].prompt_len)
            if mode == "parallel":
                lengths = [trace[(i + j * 7919) % len(trace)].output_len for j in range(width)]
                seqs = [root] + [next(next_id) for _ in range(width - 1)]
                for child in seqs[1:]:
                    m.fork(root, child)
                active.append({"seqs": dict(zip(seqs, lengths, strict=True)), "step": 0})
            else:
                active.append({"beams": [root], "steps_left": trace[i].output_len})
        for group in active:
            if mode == "parallel":
                group["step"] += 1
                for seq, length in list(group["seqs"].items()):
                    m.append_slots(seq, num_tokens=m.num_slots(seq) + 1)
                    if group["step"] == length:
                        m.free(seq)
                        del group["seqs"][seq]
            else:
                beams = group["beams"]
                parents = rng.integers(0, len(beams), size=width)
                new_beams, taken = [], set()
                for p in parents:
                    if p in taken:
                        child = next(next_id)
                        m.fork(beams[p], child)
                    else:
                        taken.add(p)
                        child = beams[p]
                    new_beams.append(child)
                for p, seq in enumerate(beams):
                    if p not in taken:
                        m.free(seq)
                for seq in new_beams:
                    m.append_slots(seq, num_tokens=m.num_slots(seq) + 1)
                group["beams"] = new_beams
                group["steps_left"] -= 1
        used_sum += m.num_used_blocks
        unshared_sum += sum(m.num_blocks_for(m.num_slots(s)) for s in m.seq_ids())
        for group in [g for g in active if not g.get("seqs", True) or g.get("steps_left") == 0]:
            for seq in group.get("beams", []):
                m.free(seq)
            active.remove(group)
    m.check_invariants()
    assert m.num_free_blocks == m.num_gpu_blocks
    return 100.0 * (1.0 - used_sum / unshared_sum)


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def trace_stats(trace: list[TraceRequest]) -> dict:
    p = np.array([t.prompt_len for t in trace])
    o = np.array([t.output_len for t in trace])
    return {
        "num_requests": len(trace),
        "prompt_mean": round(float(p.mean()), 1),
        "prompt_median": float(np.median(p)),
        "output_mean": round(float(o.mean()), 1),
        "output_median": float(np.median(o)),
        "max_total": int((p + o).max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests (about 20 s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    scale = 0.25 if args.quick else 1.0
    traces = {
        # Rates well above what the cache can serve: the system stays memory-bound.
        "sharegpt": sharegpt_like(int(1000 * scale), rate=1.0, seed=args.seed),
        "alpaca": alpaca_like(int(2000 * scale), rate=20.0, seed=args.seed),
    }
    systems = [f"paged@{b}" for b in BLOCK_SIZES] + [
        "orca-oracle",
        "orca-pow2",
        "orca-max",
        "static",
    ]
    results: dict = {"traces": {}, "sharing": {}}
    for trace_name, trace in traces.items():
        rows = {}
        for name in tqdm(systems, desc=f"memory waste ({trace_name})"):
            rows[name] = simulate(make_system(name), trace)
        results["traces"][trace_name] = {"stats": trace_stats(trace), "systems": rows}

    alpaca_sharing = alpaca_like(int(400 * scale), seed=args.seed + 1)
    for mode in ("parallel", "beam"):
        results["sharing"][mode] = {
            str(w): round(sharing_savings(alpaca_sharing, mode, w, seed=args.seed), 2)
            for w in tqdm(SHARING_WIDTHS, desc=f"sharing ({mode})")
        }

    report = {
        **report_header(),
        "capacity_slots": CAPACITY_SLOTS,
        "paper_token_percent": PAPER_TOKEN_PERCENT,
        "paper_sharing_savings_percent": PAPER_SAVINGS_PERCENT,
        **results,
    }
    save_report(args.out, report)
    print_tables(report)
    print(f"\nwrote {args.out}")


def print_tables(report: dict) -> None:
    paper = report["paper_token_percent"]
    for trace_name, entry in report["traces"].items():
        s = entry["stats"]
        print(
            f"\n{trace_name}: {s['num_requests']} requests, prompt mean {s['prompt_mean']} "
            f"(median {s['prompt_median']}), output mean {s['output_mean']} "
            f"(median {s['output_median']})"
        )
        print(
            f"{'system':<12} {'tokens %':>8} {'paper %':>8} {'reserved':>8} {'internal':>8} "
            f"{'external':>8} {'free':>6} {'tok/alloc':>9} {'preempt':>7} {'vs max':>7}"
        )
        rows = entry["systems"]
        base = rows["orca-max"]["token_percent"]
        for name, r in rows.items():
            paper_value = paper.get(name, "") if trace_name == "sharegpt" else ""
            print(
                f"{name:<12} {r['token_percent']:>8.1f} {paper_value!s:>8} "
                f"{r['reserved_percent']:>8.1f} {r['internal_fragmentation_percent']:>8.1f} "
                f"{r['external_fragmentation_percent']:>8.1f} {r['free_percent']:>6.1f} "
                f"{r['token_percent_of_allocated']:>9.1f} "
                f"{r['preemptions']:>7} {r['token_percent'] / base:>6.2f}x"
            )
    print("\nmemory saved by sharing (Alpaca-like, block 16), percent:")
    for mode, values in report["sharing"].items():
        low, high = report["paper_sharing_savings_percent"][mode]
        shown = ", ".join(f"{w}: {v:.1f}" for w, v in values.items())
        print(f"  {mode:<9} {shown}   (paper: {low}-{high})")


if __name__ == "__main__":
    main()
