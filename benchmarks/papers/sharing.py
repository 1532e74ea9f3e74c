"""The vLLM paper's sharing and ablation experiments, in the simulator at the OPT-13B setting.

Kwon et al. SOSP'23, simulated with `minipaged.sim.simulator` (the real `FCFSScheduler`, KV cache
managers and baselines, timed by the A100-like `OPT_13B_A100` cost model, 15.7K KV slots):

* `sampling` (§6.3, Fig. 14): parallel sampling n = 2, 4, 6 and beam search width 2, 4, 6 on the
  Alpaca-like trace, paged vs Orca-Oracle: the highest rate each sustains and the ratio. Paper:
  vLLM's gain over Orca-Oracle grows from 1.3x (basic sampling) to 2.3x (beam width 6). Beams are
  modelled as in benchmarks/papers/memory_waste.py: each step, each of the `width` new beams
  picks its parent uniformly among the current ones (a parent picked twice forks, one never
  picked is dropped); paged beams share blocks with copy-on-write, Orca beams own a chunk each.
* `prefix` (§6.4, Fig. 16): a shared few-shot prefix (1-shot: 80 tokens, 5-shot: 341 tokens, as
  the paper's WMT16 prompts) before each request's own sentence; paged with prefix caching vs
  Orca-Oracle. Paper: 1.67x and 3.58x the throughput of Orca-Oracle.
* `blocksize` (§7.2, Fig. 18b): paged attention with blocks of 1 to 256 tokens, normalized latency
  at fixed rates on both traces.
* `swap` (§7.3, Fig. 19): recomputation vs swapping by block size: (a) the cost per token of
  each recovery mechanism, (b) normalized latency on ShareGPT under memory pressure.

Run: .venv/bin/python benchmarks/papers/sharing.py            (~10-15 minutes on 2 CPU cores)
     .venv/bin/python benchmarks/papers/sharing.py --quick    (smoke run, *_quick.json)
     --only sampling|prefix|blocksize|swap   (one experiment; repeatable)
Writes benchmarks/results/paper_sharing_<experiment>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

import numpy as np

from machine import report_header, save_report
from minipaged.sampling.params import SamplingParams
from minipaged.sampling.sequence import Sequence, SequenceGroup
from minipaged.sched.base import PreemptionMode, Scheduler
from minipaged.sched.cost_model import OPT_13B_A100, CostModel
from minipaged.sched.registry import build_scheduler
from minipaged.sim.traces import TRACES, TraceRequest
from papers.normalized_latency import (
    CAPACITY_SLOTS,
    LATENCY_BOUND,
    MAX_SEQ_LEN,
    RESULTS,
    SIM_SCHEDULER,
    RunStats,
    make_groups,
    simulate_groups,
    sustained_rate,
    sweep,
)

PAPER = {
    "sampling": "gain over Orca-Oracle (OPT-13B, Alpaca): 1.3x basic sampling -> 2.3x beam width 6",
    "prefix": {"1-shot (80 tokens)": 1.67, "5-shot (341 tokens)": 3.58},
    "blocksize": "best 16-128 on ShareGPT, 16-32 on Alpaca; small blocks slow the GPU kernel",
    "swap": "swapping costs more than recomputation for small blocks; similar at 16-64",
}
SYSTEMS = ("orca-oracle", "paged")
PREFIX_LENGTHS = {"1-shot": 80, "5-shot": 341}
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# -- parallel sampling and beam search ------------------------------------------------------------


def beam_search_hook(rng: np.random.Generator):
    """The beams' forks and drops after each step (the sampler's part of beam search)."""

    def hook(scheduler: Scheduler, sampled: list, seq_ids: Iterator[int]) -> None:
        beams_of: dict[int, tuple[SequenceGroup, list[Sequence]]] = {}
        for group, seq in sampled:
            beams_of.setdefault(id(group), (group, []))[1].append(seq)
        for group, beams in beams_of.values():
            width = group.sampling_params.beam_width
            if len(beams) != len(group.get_unfinished_seqs()):
                continue  # beams recomputed apart after a preemption: wait until all are back
            if len(beams) == 1 and len(group.seqs) == 1:
                parents = [0] * width  # the prompt is done: every beam starts from it
            else:
                parents = rng.integers(0, len(beams), size=width).tolist()
            picks = [parents.count(i) for i in range(len(beams))]
            for beam, count in zip(beams, picks, strict=True):
                if count == 0:  # dropped first, so a reservation's chunk is free to reuse
                    scheduler.free_sequence(group, beam)
            for beam, count in zip(beams, picks, strict=True):
                for _ in range(count - 1):
                    scheduler.fork_sequence(group, beam, beam.fork(next(seq_ids)))

    return hook


def sampling_params(kind: str, width: int):
    def params(t: TraceRequest) -> SamplingParams:
        if kind == "beam":
            return SamplingParams(
                use_beam_search=True,
                beam_width=width,
                temperature=0.0,
                max_tokens=t.output_len,
                ignore_eos=True,
            )
        return SamplingParams(n=width, temperature=1.0, max_tokens=t.output_len, ignore_eos=True)

    return params


def scheduler_for(system: str, block_size: int = 16, prefix_caching: bool = False) -> Scheduler:
    """Paged ("fcfs" over `KVCacheManager`) or Orca-Oracle at the paper's 15.7K slots."""
    if system == "paged":
        return build_scheduler(
            "fcfs",
            SIM_SCHEDULER,
            num_gpu_blocks=CAPACITY_SLOTS // block_size,
            block_size=block_size,
            enable_prefix_caching=prefix_caching,
        )
    return build_scheduler(system, SIM_SCHEDULER, num_gpu_blocks=CAPACITY_SLOTS, block_size=1)


def run_sampling(quick: bool) -> dict:
    num = 300 if quick else 600
    rates = [2.5, 5.0, 7.5, 10.0, 12.5, 15.0, 17.5, 20.0, 25.0, 30.0, 35.0, 40.0, 50.0, 60.0, 70.0]
    rates = rates[::2] if quick else rates
    out: dict = {}
    for kind, widths in (("basic", [1]), ("parallel", [2, 4, 6]), ("beam", [2, 4, 6])):
        for width in widths:

            def serve(system: str, rate: float, kind=kind, width=width) -> RunStats:
                trace = TRACES["alpaca"](num, rate=rate, seed=0, max_seq_len=MAX_SEQ_LEN)
                groups = make_groups(trace, sampling_params(kind, width))
                hook = beam_search_hook(np.random.default_rng(0)) if kind == "beam" else None
                return simulate_groups(scheduler_for(system), groups, OPT_13B_A100, hook)

            name = f"{kind}" + (f"-{width}" if kind != "basic" else "")
            curves = sweep(name, rates, list(SYSTEMS), serve, give_up=10 * LATENCY_BOUND)
            out[name] = _with_ratio(curves)
    return out


def _with_ratio(curves: dict) -> dict:
    rates = {
        s: sustained_rate(
            [p["rate"] for p in pts], [p["normalized_latency"] for p in pts], LATENCY_BOUND
        )
        for s, pts in curves.items()
    }
    paged, orca = rates["paged"], rates["orca-oracle"]
    return {
        "curves": curves,
        "sustained_rate": {s: (round(r, 3) if r else None) for s, r in rates.items()},
        "paged_over_orca_oracle": round(paged / orca, 2) if paged and orca else None,
    }


# -- shared prefix --------------------------------------------------------------------------------


def prefix_groups(trace: list[TraceRequest], prefix_len: int) -> list[SequenceGroup]:
    """Every prompt = the same few-shot prefix + the request's own sentence."""
    prefix = [(11 * j) % 40_000 + 3 for j in range(prefix_len)]
    groups = []
    for i, t in enumerate(trace):
        own = [(7 * i + j) % 40_000 + 3 for j in range(t.prompt_len)]
        params = SamplingParams(temperature=0.0, max_tokens=t.output_len, ignore_eos=True)
        groups.append(SequenceGroup(str(i), [Sequence(i, prefix + own)], params, t.arrival_time))
    return groups


def translation_like(num: int, rate: float, seed: int = 0) -> list[TraceRequest]:
    """WMT16-shaped requests: a sentence of ~25 tokens in, a translation of ~25 tokens out."""
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(np.log(24.0), 0.45, size=(num, 2)).round().clip(4, 120).astype(int)
    arrivals = TRACES["alpaca"](num, rate=rate, seed=seed)
    return [
        TraceRequest(a.arrival_time, int(p), int(o))
        for a, (p, o) in zip(arrivals, lengths, strict=True)
    ]


def run_prefix(quick: bool) -> dict:
    num = 300 if quick else 1500
    rates = [2.5, 5, 10, 15, 20, 25, 30, 40, 50, 60, 70, 80, 100, 120]
    rates = rates[::2] if quick else rates
    out: dict = {}
    for name, prefix_len in PREFIX_LENGTHS.items():

        def serve(system: str, rate: float, prefix_len=prefix_len) -> RunStats:
            groups = prefix_groups(translation_like(num, rate), prefix_len)
            return simulate_groups(
                scheduler_for(system, prefix_caching=True), groups, OPT_13B_A100
            )

        curves = sweep(name, rates, list(SYSTEMS), serve, give_up=10 * LATENCY_BOUND)
        out[name] = {"prefix_len": prefix_len, **_with_ratio(curves)}
    return out


# -- block size -----------------------------------------------------------------------------------

BLOCKSIZE_RATES = {"sharegpt": [2.0, 3.0, 3.5], "alpaca": [30.0, 45.0, 55.0]}


def run_blocksize(quick: bool) -> dict:
    out: dict = {}
    for trace_name, rates in BLOCKSIZE_RATES.items():
        num = (100 if quick else 500) * (3 if trace_name == "alpaca" else 1)
        points = []
        for bs in BLOCK_SIZES[:: 2 if quick else 1]:
            for rate in rates:
                trace = TRACES[trace_name](num, rate=rate, seed=0, max_seq_len=MAX_SEQ_LEN)
                stats = simulate_groups(
                    scheduler_for("paged", block_size=bs), make_groups(trace), OPT_13B_A100
                )
                points.append({"block_size": bs, "rate": rate, **stats.as_dict()})
                print(f"blocksize {trace_name} {bs:>3} @ {rate}: {stats.normalized_latency:.4f}")
        out[trace_name] = points
    return out


# -- recomputation vs swapping --------------------------------------------------------------------

# Swapping one block moves its K and V of every layer; vLLM (at the paper's time) issued one
# copy per layer and per K/V (OPT-13B: 40 x 2), each with a fixed launch cost, plus the bytes
# over PCIe 4.0 (a token's KV is 800 kB; ~25 GB/s: 32 us). Assumed numbers, see docs.
COPIES_PER_BLOCK = 80
COPY_LAUNCH_S = 5e-6
SWAP_S_PER_TOKEN = 800e3 / 25e9


def swap_cost_per_block(block_size: int) -> float:
    return COPIES_PER_BLOCK * COPY_LAUNCH_S + block_size * SWAP_S_PER_TOKEN


def run_swap(quick: bool) -> dict:
    per_token = [
        {
            "block_size": bs,
            "swap_out_and_in_s_per_token": 2 * swap_cost_per_block(bs) / bs,
            "recompute_s_per_token": OPT_13B_A100.per_prefill_token,
        }
        for bs in BLOCK_SIZES
    ]
    num = 100 if quick else 500
    rate = 4.0  # past paged's capacity on ShareGPT: preemptions happen
    points = []
    for bs in BLOCK_SIZES[:: 2 if quick else 1]:
        cost: CostModel = dataclasses.replace(OPT_13B_A100, per_swap_block=swap_cost_per_block(bs))
        for mode in (PreemptionMode.RECOMPUTE, PreemptionMode.SWAP):
            config = dataclasses.replace(SIM_SCHEDULER, preemption_mode=mode)
            scheduler = build_scheduler(
                "fcfs",
                config,
                num_gpu_blocks=CAPACITY_SLOTS // bs,
                block_size=bs,
                num_cpu_blocks=CAPACITY_SLOTS // bs,
                enable_prefix_caching=False,
            )
            trace = TRACES["sharegpt"](num, rate=rate, seed=0, max_seq_len=MAX_SEQ_LEN)
            stats = simulate_groups(scheduler, make_groups(trace), cost)
            points.append({"block_size": bs, "mode": mode.value, "rate": rate, **stats.as_dict()})
            print(
                f"swap {bs:>3} {mode.value:<9}: {stats.normalized_latency:.4f} "
                f"({stats.num_preemptions} preemptions)"
            )
    return {
        "assumptions": {
            "copies_per_block": COPIES_PER_BLOCK,
            "copy_launch_s": COPY_LAUNCH_S,
            "swap_s_per_token": SWAP_S_PER_TOKEN,
            "host_slots": CAPACITY_SLOTS,
        },
        "overhead_per_token": per_token,
        "end_to_end": points,
    }


# -- main -----------------------------------------------------------------------------------------

EXPERIMENTS = {
    "swap": run_swap,
    "blocksize": run_blocksize,
    "prefix": run_prefix,
    "sampling": run_sampling,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller smoke run")
    parser.add_argument("--only", choices=sorted(EXPERIMENTS), action="append")
    args = parser.parse_args(argv)
    suffix = "_quick" if args.quick else ""
    for name in args.only or EXPERIMENTS:
        started = time.monotonic()
        load_before = os.getloadavg()[0]
        result = {
            "benchmark": f"paper_sharing_{name}",
            "what": f"vLLM paper {name} experiment, simulated OPT-13B on one A100",
            **EXPERIMENTS[name](args.quick),
            **report_header(load_average_1min_before=round(load_before, 2)),
            "setup": {
                "capacity_slots": CAPACITY_SLOTS,
                "max_seq_len": MAX_SEQ_LEN,
                "scheduler": vars(SIM_SCHEDULER) | {"preemption_mode": "recompute (single seqs)"},
                "cost_model": {k: getattr(OPT_13B_A100, k) for k in vars(OPT_13B_A100)},
                "latency_bound_s_per_token": LATENCY_BOUND,
            },
            "paper": PAPER[name],
            "wall_seconds": round(time.monotonic() - started, 1),
        }
        for case, block in result.items():
            if isinstance(block, dict) and "paged_over_orca_oracle" in block:
                print(
                    f"{name:<9} {case:<11} sustained {block['sustained_rate']}  "
                    f"paged/Orca-Oracle {block['paged_over_orca_oracle']}"
                )
        path = RESULTS / f"paper_sharing_{name}{suffix}.json"
        save_report(path, result)
        print(f"wrote {path} in {result['wall_seconds']} s")


if __name__ == "__main__":
    main()
