"""FastServe in miniature: FCFS vs skip-join MLFQ and its ablations, simulated and on the engine.

Reproduces the shape of FastServe's evaluation (Wu et al., §6): average and p95 job completion
time (JCT) and normalized latency (JCT / output tokens) against the request rate, for

* scheduling: FCFS (vLLM's run-to-completion order) vs skip-join MLFQ vs naive MLFQ (every
  job enters Q1) vs fixed priority (skip-join levels, no demotion);
* KV cache management: proactive swapping vs reactive swapping vs recomputation (all MLFQ);

and the highest rate each meets a latency target (mean and p95 normalized latency).

1. **Simulator, FastServe's setting** (the main table; `minipaged.sim.simulator` drives the engine's
   own scheduler and KV manager code): OPT-13B on one A100 (`cost_model.OPT_13B_A100`: public
   figures, 930 KV blocks of 16 tokens, host swap space for 4000), *no chunked prefill* (a
   job's whole prompt is one iteration, as in FastServe), quanta sized to the cost model (Q1's
   quantum = the shortest iteration, ratio 2: `MLFQConfig.sized_to`), ShareGPT-like prompts
   (9% of them 256-2048 tokens long) with heavy-tailed outputs, bursty gamma arrivals (CV 2).
   Rates are fractions of FCFS's saturated throughput.
2. **Simulator with chunked prefill** (second table): the same with vLLM's chunked prefill, for
   the scheduling systems only.
3. **Real engine on CPU**: a tiny random LLaMA on a small heavy-tailed trace at three request
   rates, measured in thread CPU time (`LLMEngine(clock=time.thread_time)`, torch on one
   thread: a shared machine's neighbours stay out; MLFQ charges its quanta on that clock too),
   beside the simulator's prediction from a cost model profiled
   once just before (and handed to every engine: `EngineConfig(cost_model=...)`).

Paper ratios (FastServe §6): skip-join MLFQ up to 8.9x lower average JCT than FCFS (vLLM) and
1.87x lower than naive MLFQ; proactive swapping 2.7x vs recomputation and 1.7x vs reactive.

4. **`--study skip-join`** (own JSON, `fastserve_skip_join.json`): skip-join vs naive MLFQ (and
   FCFS) over three workloads from short to long first iterations, 4/16/64 sequences per step
   and loads 0.5-1.1, two seeds each; and MLFQ vs FCFS at 64 sequences per step over five
   seeds, with FCFS's queueing delay (is a tie noise, or is nobody waiting?).

Run: .venv/bin/python benchmarks/papers/fastserve.py            (~4-5 minutes on 2 busy CPU cores)
     .venv/bin/python benchmarks/papers/fastserve.py --quick    (fewer requests and rates)
     .venv/bin/python benchmarks/papers/fastserve.py --study skip-join   (~6 minutes; --quick: 30 s)
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

import numpy as np
from tqdm import tqdm

from machine import report_header, save_report
from minipaged.sched.base import SchedulerConfig
from minipaged.sched.cost_model import OPT_13B_A100, OPT_13B_A100_KV_BLOCKS, CostModel, StepShape
from minipaged.sched.fcfs import FCFSScheduler
from minipaged.sched.mlfq import MLFQ_VARIANTS, MLFQConfig, mlfq_factory
from minipaged.sim.simulator import SimulationResult, simulate
from minipaged.sim.traces import gamma_arrival_times, heavy_tailed, with_arrivals

RESULTS = Path(__file__).resolve().parents[1] / "results" / "fastserve.json"
SWEEP_RESULTS = RESULTS.with_name("fastserve_skip_join.json")
PAPER = {
    "skip-join vs FCFS (mean JCT)": 8.9,
    "skip-join vs naive MLFQ": 1.87,
    "proactive vs recompute": 2.7,
    "proactive vs reactive": 1.7,
}
SCHEDULING = ["fcfs", "mlfq", "mlfq-naive", "mlfq-fixed"]
SWAPPING = ["mlfq", "mlfq-reactive", "mlfq-recompute"]
HOST_BLOCKS = 4000
REAL_ENGINE_REPEATS = 3  # replays per scheduler and load on the real engine
ARRIVAL_CV = 2.0


def mlfq_config(name: str, cost: CostModel, overrides: dict | None = None) -> MLFQConfig:
    """A named MLFQ variant with quanta sized to `cost` (Q1 = its shortest iteration, FastServe
    §4.1); overrides apply on top (fixed priority keeps no starvation promotion)."""
    variant = {k: v for k, v in MLFQ_VARIANTS[name].mlfq.__dict__.items() if k != "base_quantum"}
    settings = {**variant, **(overrides or {})}
    if MLFQ_VARIANTS[name].mlfq.starvation_bound is None:
        settings["starvation_bound"] = None
    return MLFQConfig.sized_to(cost, **settings)


def factory(name: str, cost: CostModel, overrides: dict | None = None):
    """The scheduler constructor of a named system."""
    if name == "fcfs":
        return FCFSScheduler
    return mlfq_factory(
        mlfq_config(name, cost, overrides), cost, MLFQ_VARIANTS[name].preemption_mode
    )


def metrics(result: SimulationResult) -> dict:
    return {k: round(v, 4) for k, v in result.summary().items()}


# -- 1. the simulator ----------------------------------------------------------------------------


def simulation_settings(max_num_seqs: int, chunked_prefill: bool) -> dict:
    """`simulate` keyword arguments for the FastServe setting: OPT-13B's KV blocks on one A100,
    a host pool for swapping, a 2048-token budget and context."""
    config = SchedulerConfig(
        max_num_batched_tokens=2048,
        max_num_seqs=max_num_seqs,
        max_model_len=2048,
        enable_chunked_prefill=chunked_prefill,
    )
    return dict(
        num_gpu_blocks=OPT_13B_A100_KV_BLOCKS, block_size=16, num_cpu_blocks=HOST_BLOCKS,
        config=config
    )


def saturated_rate(base: list, kwargs: dict) -> float:
    """FCFS's saturated throughput on `base` (req/s): every request at t=0, the rate over the
    first 90% of completions (the tail of the last long jobs would understate it)."""
    n = len(base)
    finish = sorted(
        r.finished_time for r in simulate(base, OPT_13B_A100, FCFSScheduler, **kwargs).requests
    )
    return 0.9 * n / finish[int(0.9 * n) - 1]


def at_rate(base: list, rate: float, seed: int) -> list:
    """`base` with gamma arrivals (CV `ARRIVAL_CV`) at `rate` requests per second."""
    arrivals = gamma_arrival_times(len(base), rate, ARRIVAL_CV, np.random.default_rng(seed))
    return with_arrivals(base, arrivals)


def simulated(
    num_requests: int,
    loads: list[float],
    max_num_seqs: int,
    seed: int,
    chunked_prefill: bool,
    names: list[str],
    prompt_median: float | None = None,
) -> dict:
    base = heavy_tailed(num_requests, seed=seed, prompt_median=prompt_median)
    kwargs = simulation_settings(max_num_seqs, chunked_prefill)
    capacity = saturated_rate(base, kwargs)
    rows: dict[str, dict[str, dict]] = {}
    label = "chunked prefill" if chunked_prefill else "no chunked prefill"
    for load in tqdm(loads, desc=f"simulated loads, {label}"):
        rate = load * capacity
        trace = at_rate(base, rate, seed)
        rows[f"{load:.2f}"] = {
            name: {
                "rate": round(rate, 4),
                **metrics(simulate(trace, OPT_13B_A100, factory(name, OPT_13B_A100), **kwargs)),
            }
            for name in names
        }
    outputs = np.array([r.output_len for r in base])
    prompts = np.array([r.prompt_len for r in base])
    return {
        "trace": {
            "num_requests": num_requests,
            "prompt_mean": round(float(prompts.mean()), 1),
            "prompt_p99": float(np.percentile(prompts, 99)),
            "output_mean": round(float(outputs.mean()), 1),
            "output_median": float(np.median(outputs)),
            "output_p99": float(np.percentile(outputs, 99)),
            "arrival_cv": ARRIVAL_CV,
        },
        "cost_model": OPT_13B_A100.__dict__,
        "kv_blocks": OPT_13B_A100_KV_BLOCKS,
        "host_blocks": HOST_BLOCKS,
        "max_num_seqs": max_num_seqs,
        "enable_chunked_prefill": chunked_prefill,
        "mlfq": {
            "base_quantum_s": round(OPT_13B_A100.min_iteration_time, 6),
            "quantum_ratio": MLFQConfig().quantum_ratio,
            "num_levels": MLFQConfig().num_levels,
            "starvation_bound_s": MLFQConfig().starvation_bound,
        },
        "capacity_req_per_s": round(capacity, 4),
        "by_load": rows,
    }


def _ratio_by_load(by_load: dict, metric: str, ours: str, other: str) -> dict:
    """Per load, `other`'s `metric` over `ours`'s: above 1, ours is lower (better)."""
    return {
        load: round(rows[other][metric] / rows[ours][metric], 3) for load, rows in by_load.items()
    }


def ratios(by_load: dict) -> dict:
    """Per load, how many times lower the first system's mean JCT is than the second's, and the
    same for the p95 normalized latency (the tail a latency target bounds)."""
    pairs = {
        "skip-join vs FCFS (mean JCT)": ("mlfq", "fcfs"),
        "skip-join vs naive MLFQ": ("mlfq", "mlfq-naive"),
        "proactive vs recompute": ("mlfq", "mlfq-recompute"),
        "proactive vs reactive": ("mlfq", "mlfq-reactive"),
    }
    out = {}
    names = next(iter(by_load.values()))
    for label, (ours, other) in pairs.items():
        if other not in names:
            continue
        per_load = _ratio_by_load(by_load, "mean_jct", ours, other)
        tail = _ratio_by_load(by_load, "p95_normalized_latency", ours, other)
        out[label] = {
            "by_load": per_load,
            "max": max(per_load.values()),
            "p95_normalized_latency": {"by_load": tail, "max": max(tail.values())},
        }
    return out


def max_rate_meeting(by_load: dict, mean_target: float, p95_target: float) -> dict:
    """The highest simulated rate at which a system's normalized latency meets both targets."""
    best: dict[str, float | None] = {}
    for rows in by_load.values():
        for name, row in rows.items():
            ok = (
                row["mean_normalized_latency"] <= mean_target
                and row["p95_normalized_latency"] <= p95_target
            )
            if ok and (best.get(name) is None or row["rate"] > best[name]):
                best[name] = row["rate"]
            best.setdefault(name, None)
    return best


# -- 2. the real engine ---------------------------------------------------------------------------


def real_engine(num_requests: int, loads: list[float], seed: int) -> dict:
    """FCFS, skip-join and naive MLFQ on a tiny LLaMA (no chunked prefill), at a few rates,
    each measured against the simulator's prediction with a cost model profiled here."""
    import torch
    import transformers

    from minipaged.engine.config import EngineConfig
    from minipaged.engine.engine import LLMEngine
    from minipaged.models.checkpoint.model_config import ModelConfig
    from minipaged.models.registry import FAMILIES, build_model
    from minipaged.sim.profiling import profile_engine, replay_on_engine

    # The simulations before this leave millions of objects behind, and every full collection
    # walks them: milliseconds landing on random ~1 ms steps, in the profile and the replays
    # alike. Frozen, the collector sees what a fresh process would.
    gc.collect()
    gc.freeze()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    hf_config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(hf_config).eval()
    model_config = ModelConfig.from_hf_dict(hf_config.to_dict(), FAMILIES)
    model = build_model(model_config, hf_model.state_dict())
    engine_config = dict(
        num_gpu_blocks=48,
        num_cpu_blocks=96,
        block_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=200,
        max_model_len=200,
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
    )
    base = heavy_tailed(num_requests, seed=seed, output_median=12, max_seq_len=200)
    base = [r.__class__(0.0, min(r.prompt_len, 64), min(r.output_len, 120)) for r in base]
    # Profiled once, in CPU time (a step is ~1-2 ms here); every engine gets it ready-made.
    probe = LLMEngine(model, model_config, None, EngineConfig(**engine_config),
                      clock=time.thread_time)
    cost = profile_engine(probe, max_prefill=64, max_batch=4)
    sim_kwargs = dict(
        num_gpu_blocks=48, block_size=8, num_cpu_blocks=96, config=probe.scheduler.config
    )
    saturated = simulate(base, cost, FCFSScheduler, **sim_kwargs).throughput
    overrides = {"starvation_bound": 0.5}
    names = ["fcfs", "mlfq", "mlfq-naive"]
    by_load: dict[str, dict] = {}
    for load in tqdm(loads, desc="real engine loads"):
        rate = load * saturated
        arrivals = gamma_arrival_times(num_requests, rate, ARRIVAL_CV, np.random.default_rng(seed))
        trace = with_arrivals(base, arrivals)
        rows = {}
        for name in names:
            extra = {}
            if name != "fcfs":
                extra = {"mlfq": mlfq_config(name, cost, overrides), "cost_model": cost}
            config = EngineConfig(**engine_config, scheduler=name, **extra)
            # Each replay times its own steps, and MLFQ demotes by those times: a few
            # jittery steps change its decisions. The run with the median mean JCT is kept.
            runs = sorted(
                (
                    replay_on_engine(
                        LLMEngine(model, model_config, None, config, clock=time.thread_time), trace
                    )
                    for _ in range(REAL_ENGINE_REPEATS)
                ),
                key=lambda run: run.mean_jct,
            )
            measured = runs[len(runs) // 2]
            predicted = simulate(trace, cost, factory(name, cost, overrides), **sim_kwargs)
            rows[name] = {
                "measured": {
                    k: round(v, 5)
                    for k, v in measured.summary().items()
                    if not k.startswith("swap")
                },
                "measured_mean_jct_runs": [round(run.mean_jct, 5) for run in runs],
                "simulated": metrics(predicted),
                "sim_over_measured_mean_jct": round(predicted.mean_jct / measured.mean_jct, 3),
            }
        by_load[f"{load:.2f}"] = {"rate_req_per_cpu_s": round(rate, 2), "rows": rows}
    torch.set_num_threads(threads)
    gc.unfreeze()
    return {
        "num_requests": num_requests,
        "engine": engine_config,
        "cost_model": cost.__dict__,
        "mlfq": {"base_quantum_s": round(cost.min_iteration_time, 6), **overrides},
        "by_load": by_load,
    }


# -- 3. skip-join vs naive MLFQ: where the first iteration matters --------------------------------

# Workloads from short to long first iterations: (label, prompt median or None for ShareGPT-like,
# output median). Outputs stay log-normal with sigma 1.5 (heavy-tailed).
SWEEP_WORKLOADS = [
    ("ShareGPT-like prompts, outputs median 40", None, 40.0),
    ("prompts median 300, outputs median 40", 300.0, 40.0),
    ("prompts median 1000, outputs median 10", 1000.0, 10.0),
]


def prefill_share(trace: list, cost: CostModel, batch: int) -> float:
    """The first iterations' share of the work when batches are full: the prompts' tokens
    (`per_prefill_token` each) against the decode steps, one `batch`-th of a full step each."""
    prefill = cost.per_prefill_token * sum(r.prompt_len for r in trace)
    context = int(np.mean([r.prompt_len + r.output_len / 2 for r in trace]))
    step = cost.step_time(StepShape(decode_seqs=batch, context_tokens=batch * context))
    decode = sum(r.output_len - 1 for r in trace) * step / batch
    return prefill / (prefill + decode)


def _trace_at(base: list, load: float, seed: int, kwargs: dict) -> tuple[list, float]:
    """`base` at `load` times FCFS's saturated throughput (as in `simulated`)."""
    capacity = saturated_rate(base, kwargs)
    return at_rate(base, load * capacity, seed), capacity


def _spread(values: list[float]) -> dict:
    return {
        "mean": round(float(np.mean(values)), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "per_seed": [round(v, 3) for v in values],
    }


def skip_join_sweep(
    num_requests: int, loads: list[float], batch_limits: list[int], seeds: list[int]
) -> dict:
    """Skip-join vs naive MLFQ (and both vs FCFS) over workloads, batch limits and loads,
    several seeds each (FastServe's setting: no chunked prefill, quanta sized to the cost)."""
    rows = []
    cells = [(w, b, x) for w in SWEEP_WORKLOADS for b in batch_limits for x in loads]
    for (label, prompt_median, output_median), batch, load in tqdm(cells, desc="skip-join sweep"):
        kwargs = simulation_settings(batch, chunked_prefill=False)
        jct: dict[str, list[float]] = {"fcfs": [], "mlfq": [], "mlfq-naive": []}
        tail: dict[str, list[float]] = {name: [] for name in jct}  # p95 normalized latency
        shares = []
        for seed in seeds:
            base = heavy_tailed(
                num_requests, seed=seed, prompt_median=prompt_median, output_median=output_median
            )
            shares.append(prefill_share(base, OPT_13B_A100, batch))
            trace, _ = _trace_at(base, load, seed, kwargs)
            for name in jct:
                result = simulate(trace, OPT_13B_A100, factory(name, OPT_13B_A100), **kwargs)
                jct[name].append(result.mean_jct)
                tail[name].append(result.p95_normalized_latency)
        rows.append(
            {
                "workload": label,
                "max_num_seqs": batch,
                "load": load,
                "prefill_share": round(float(np.mean(shares)), 3),
                "mean_jct": {name: round(float(np.mean(v)), 3) for name, v in jct.items()},
                "skip_join_vs_naive": _spread(
                    [n / s for n, s in zip(jct["mlfq-naive"], jct["mlfq"], strict=True)]
                ),
                "skip_join_vs_fcfs": _spread(
                    [f / s for f, s in zip(jct["fcfs"], jct["mlfq"], strict=True)]
                ),
                "skip_join_vs_naive_p95_normalized_latency": _spread(
                    [n / s for n, s in zip(tail["mlfq-naive"], tail["mlfq"], strict=True)]
                ),
            }
        )
    return {
        "num_requests": num_requests,
        "seeds": seeds,
        "chunked_prefill": False,
        "arrival_cv": ARRIVAL_CV,
        "rows": rows,
    }


def fcfs_seed_spread(
    num_requests: int, loads: list[float], max_num_seqs: int, seeds: list[int]
) -> dict:
    """Skip-join MLFQ vs FCFS on the main table's trace at several seeds: is a tie noise?
    With it, FCFS's mean queueing delay (time to first token minus the prefill alone): where
    nobody waits, every work-conserving order gives the same JCT."""
    kwargs = simulation_settings(max_num_seqs, chunked_prefill=False)
    bases = {seed: heavy_tailed(num_requests, seed=seed) for seed in seeds}
    rows = {}
    for load in tqdm(loads, desc=f"seeds, {max_num_seqs} seqs/step"):
        ratios_, waits = [], []
        for seed in seeds:
            trace, _ = _trace_at(bases[seed], load, seed, kwargs)
            fcfs = simulate(trace, OPT_13B_A100, FCFSScheduler, **kwargs)
            mlfq = simulate(trace, OPT_13B_A100, factory("mlfq", OPT_13B_A100), **kwargs)
            ratios_.append(fcfs.mean_jct / mlfq.mean_jct)
            prefill = [OPT_13B_A100.prefill_time(r.prompt_len) for r in fcfs.requests]
            waits.append(fcfs.mean_ttft - float(np.mean(prefill)))
        rows[f"{load:.2f}"] = {
            "skip_join_vs_fcfs": _spread(ratios_),
            "fcfs_mean_queueing_s": [round(w, 3) for w in waits],
        }
    return {
        "num_requests": num_requests,
        "max_num_seqs": max_num_seqs,
        "seeds": seeds,
        "by_load": rows,
    }


def print_sweep(sweep: dict, spread: dict) -> None:
    print(
        f"\nskip-join vs naive MLFQ (ratios, >1: skip-join better; mean [min, max] over seeds "
        f"{sweep['seeds']}, {sweep['num_requests']} requests, no chunked prefill)"
    )
    columns = {
        "skip_join_vs_naive": "vs naive, mean JCT",
        "skip_join_vs_naive_p95_normalized_latency": "vs naive, p95 NL",
        "skip_join_vs_fcfs": "vs FCFS, mean JCT",
    }
    header = " ".join(f"{title:>22}" for title in columns.values())
    print(f"{'workload':<42} {'seqs':>4} {'prefill':>7} {'load':>5} {header}")
    for row in sweep["rows"]:
        cells = []
        for key in columns:
            s = row[key]
            cells.append(f"{s['mean']:.3f} [{s['min']:.2f}, {s['max']:.2f}]")
        print(
            f"{row['workload']:<42} {row['max_num_seqs']:>4} {row['prefill_share']:>7.3f}"
            f" {row['load']:>5} " + " ".join(f"{cell:>22}" for cell in cells)
        )
    print(
        f"\nskip-join MLFQ vs FCFS over seeds {spread['seeds']} "
        f"({spread['max_num_seqs']} seqs/step, {spread['num_requests']} requests): "
        "mean [min, max]; FCFS mean queueing per seed (s)"
    )
    for load, row in spread["by_load"].items():
        s = row["skip_join_vs_fcfs"]
        print(
            f"  load {load}: {s['mean']:.3f} [{s['min']:.3f}, {s['max']:.3f}]  "
            f"per seed {s['per_seed']}  queueing {row['fcfs_mean_queueing_s']}"
        )


def study_main(args: argparse.Namespace) -> None:
    """`--study skip-join`: the sweep and the seed spread, written to their own JSON."""
    if args.quick:
        sweep = skip_join_sweep(150, [0.7, 1.1], [4, 16], [0])
        spread = fcfs_seed_spread(200, [0.6], 64, [0, 1])
    else:
        sweep = skip_join_sweep(300, [0.5, 0.7, 0.9, 1.1], [4, 16, 64], [0, 1])
        spread = fcfs_seed_spread(400, [0.5, 0.6, 0.7, 0.9, 1.1], 64, [0, 1, 2, 3, 4])
    out = args.out if args.out != RESULTS else SWEEP_RESULTS
    report = {
        **report_header(),
        "paper_ratios": PAPER,
        "cost_model": OPT_13B_A100.__dict__,
        "skip_join_sweep": sweep,
        "fcfs_seed_spread": spread,
    }
    save_report(out, report)
    print_sweep(sweep, spread)
    print(f"\nwrote {out}")


# -- report ---------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests and loads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--prompt-median",
        type=float,
        default=None,
        help="log-normal prompts of this median (sigma 1) instead of ShareGPT-like ones",
    )
    parser.add_argument(
        "--study",
        choices=["main", "skip-join"],
        default="main",
        help="main: the tables below; skip-join: skip-join vs naive MLFQ over workloads, batch "
        "limits and loads, and MLFQ vs FCFS over seeds (writes fastserve_skip_join.json)",
    )
    args = parser.parse_args()
    if args.study == "skip-join":
        study_main(args)
        return

    loads = [0.5, 0.9] if args.quick else [0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1]
    num_requests = 200 if args.quick else 600
    every = list(dict.fromkeys(SCHEDULING + SWAPPING))
    common = dict(max_num_seqs=args.max_num_seqs, seed=args.seed, prompt_median=args.prompt_median)
    sim = simulated(num_requests, loads, chunked_prefill=False, names=every, **common)
    chunked = simulated(num_requests, loads, chunked_prefill=True, names=SCHEDULING[:3], **common)
    lowest = sim["by_load"][f"{loads[0]:.2f}"]["fcfs"]
    targets = {
        "mean": round(2 * lowest["mean_normalized_latency"], 4),
        "p95": round(2 * lowest["p95_normalized_latency"], 4),
    }
    report = {
        **report_header(),
        "paper_ratios": PAPER,
        "simulated": sim,
        "ratios": ratios(sim["by_load"]),
        "latency_targets_s_per_token": targets,
        "max_rate_meeting_targets": max_rate_meeting(
            sim["by_load"], targets["mean"], targets["p95"]
        ),
        "simulated_chunked_prefill": chunked,
        "ratios_chunked_prefill": ratios(chunked["by_load"]),
        "real_engine": real_engine(
            16 if args.quick else 40, [0.5, 1.0] if args.quick else [0.5, 0.8, 1.1], args.seed
        ),
    }
    save_report(args.out, report)
    print_tables(report)
    print(f"\nwrote {args.out}")


def print_sim_table(sim: dict, title: str) -> None:
    t = sim["trace"]
    print(
        f"\n{title}: simulated OPT-13B/A100, {sim['max_num_seqs']} seqs/step, "
        f"{t['num_requests']} requests (prompt mean {t['prompt_mean']}; output mean "
        f"{t['output_mean']}, median {t['output_median']}, p99 {t['output_p99']}), gamma "
        f"arrivals CV {t['arrival_cv']}, capacity {sim['capacity_req_per_s']} req/s"
    )
    names = list(next(iter(sim["by_load"].values())))
    print(f"{'load':>5} {'metric':>10} " + " ".join(f"{n:>14}" for n in names))
    for load, rows in sim["by_load"].items():
        for metric, key in (
            ("mean JCT", "mean_jct"),
            ("p95 JCT", "p95_jct"),
            ("mean NL", "mean_normalized_latency"),
            ("p95 NL", "p95_normalized_latency"),
        ):
            print(f"{load:>5} {metric:>10} " + " ".join(f"{rows[n][key]:>14.3f}" for n in names))


def print_ratios(ratios_: dict, paper: dict) -> None:
    print("ratios (higher is better for the first), ours vs the paper's:")
    for label, entry in ratios_.items():
        for metric, values in (("mean JCT", entry), ("p95 NL", entry["p95_normalized_latency"])):
            per_load = ", ".join(f"{k}: {v}" for k, v in values["by_load"].items())
            print(
                f"  {label:<30} {metric:<9} max {values['max']:>6}  paper {paper[label]:>5}"
                f"   ({per_load})"
            )


def print_tables(report: dict) -> None:
    print_sim_table(report["simulated"], "1. FastServe's setting (no chunked prefill)")
    print_ratios(report["ratios"], report["paper_ratios"])
    targets = report["latency_targets_s_per_token"]
    print(
        f"highest rate meeting mean NL <= {targets['mean']} and p95 NL <= {targets['p95']} s/token:"
    )
    for name, rate in report["max_rate_meeting_targets"].items():
        print(f"  {name:<16} {rate}")
    print_sim_table(report["simulated_chunked_prefill"], "2. With chunked prefill")
    print_ratios(report["ratios_chunked_prefill"], report["paper_ratios"])
    real = report["real_engine"]
    print(
        f"\n3. Real engine (tiny LLaMA, CPU, thread time, no chunked prefill), "
        f"{real['num_requests']} requests:"
    )
    print(
        f"{'load':>5} {'req/s':>7} {'scheduler':>12} {'mean JCT':>10} {'p95 JCT':>10}"
        f" {'mean NL':>10} {'sim JCT':>10} {'sim/real':>9} {'FCFS/this':>10}"
    )
    for load, entry in real["by_load"].items():
        fcfs = entry["rows"]["fcfs"]["measured"]["mean_jct"]
        for name, row in entry["rows"].items():
            m, s = row["measured"], row["simulated"]
            print(
                f"{load:>5} {entry['rate_req_per_cpu_s']:>7} {name:>12} {m['mean_jct']:>10.4f} "
                f"{m['p95_jct']:>10.4f} {m['mean_normalized_latency']:>10.5f} "
                f"{s['mean_jct']:>10.4f} {row['sim_over_measured_mean_jct']:>9} "
                f"{fcfs / m['mean_jct']:>10.3f}"
            )


if __name__ == "__main__":
    main()
