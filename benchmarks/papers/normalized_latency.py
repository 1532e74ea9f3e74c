"""The vLLM paper's central result in miniature: normalized latency against request rate.

Kwon et al. SOSP'23, §6.2, Fig. 12-13: five systems serve the same Poisson stream of requests
with the same KV cache capacity -- static batching (FasterTransformer-like), Orca with Max, Pow2
and Oracle reservations, and paged attention (vLLM; here minipaged's `FCFSScheduler` over its
`KVCacheManager`). A system "sustains" a request rate while the mean normalized latency (a
request's end-to-end latency divided by its output length, in s/token) stays low; past its
capacity the queue grows without bound and the latency explodes. The baselines are the very
scheduler code of the paged system with another KV cache manager (`minipaged.sched.baselines`),
built by name (`minipaged.sched.registry`; the paged system is "fcfs" there).

Two sub-commands, one figure each:

* `sim`: the paper's OPT-13B set-up in `minipaged.sim.simulator` -- 15.7K KV slots (paged:
  981 blocks of 16; Orca: 15,700 one-token blocks, so reservations are token-exact), an A100-like
  cost model (`minipaged.sched.cost_model.OPT_13B_A100`), max length 2048, ShareGPT-like and
  Alpaca-like traces (`minipaged.sim.traces`). Reports each system's highest rate under a latency
  bound and the ratios next to the paper's (ShareGPT: 1.7-2.7x over Orca-Oracle, 2.7-8x over
  Orca-Max, up to 22x over FasterTransformer; Fig. 13a: 2.2x / 4.3x more requests batched than
  Oracle / Max).
* `engine`: the real engine with the bundled SmolLM2-135M on this CPU, wall-clock Poisson
  arrivals replayed on the engine's busy clock, ShareGPT-like lengths scaled down 16x (max
  length 128), outputs fixed by `max_tokens` with `ignore_eos`, and a KV cache of 512 slots
  (four maximum-length rows, as 15.7K / 2048 is about eight) so memory limits the batch.

Run: .venv/bin/python benchmarks/papers/normalized_latency.py sim     (~5-8 minutes on 2 CPU cores)
     .venv/bin/python benchmarks/papers/normalized_latency.py engine  (< 10 minutes on 2 CPU cores)
     add --quick for a smoke run (results go to *_quick.json)
Writes benchmarks/results/paper_vllm_sim.json and paper_vllm_engine.json.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

import numpy as np
from tqdm import tqdm

import minipaged.sim.simulator
from machine import report_header, save_report
from minipaged.sampling.params import SamplingParams
from minipaged.sampling.sequence import Sequence, SequenceGroup
from minipaged.sched.base import Scheduler, SchedulerConfig
from minipaged.sched.cost_model import OPT_13B_A100, CostModel
from minipaged.sched.registry import build_scheduler
from minipaged.sim.simulator import SampleHook
from minipaged.sim.traces import TRACES, TraceRequest

RESULTS = Path(__file__).resolve().parents[1] / "results"

# The paper's OPT-13B on one A100-40GB (§6.1, Table 1): 15.7K KV slots, context 2048.
CAPACITY_SLOTS = 15_700
MAX_SEQ_LEN = 2048
PAGED_BLOCK_SIZE = 16
# vLLM's defaults at the time of the paper: 2560 tokens and 256 sequences per iteration.
SIM_SCHEDULER = SchedulerConfig(
    max_num_batched_tokens=2560, max_num_seqs=256, max_model_len=MAX_SEQ_LEN
)
LATENCY_BOUND = 0.1  # s/token: "sustains a rate" = mean normalized latency at most this
SIM_REQUESTS = {"sharegpt": 1000, "alpaca": 3000}
SIM_RATES = {
    "sharegpt": [0.25 * i for i in range(1, 25)],  # 0.25 .. 6 req/s
    "alpaca": [0.5, 1.0, 1.5] + [2.5 * i for i in range(1, 33)],  # 0.5 .. 80 req/s
}

# The five systems of the vLLM paper's Fig. 12, as this benchmark's results name them, and the
# scheduler each is built as.
SYSTEMS = ("static", "orca-max", "orca-pow2", "orca-oracle", "paged")


def scheduler_name(system: str) -> str:
    return "fcfs" if system == "paged" else system


PAPER = {
    "sharegpt_ratio_over": {
        "orca-oracle": [1.7, 2.7],
        "orca-max": [2.7, 8.0],
        "static": [None, 22.0],
    },
    "batched_requests_ratio_opt13b_sharegpt": {"orca-oracle": 2.2, "orca-max": 4.3},
    "note": "vLLM paper §6.2, Fig. 12-13: ratios across OPT-13B/66B/175B; FT: up to 22x",
}

# -- data types -----------------------------------------------------------------------------------


@dataclass
class RunStats:
    """What one served trace measured."""

    normalized_latency: float  # mean over requests of latency / output tokens, s/token
    mean_latency: float
    mean_batched_requests: float  # requests holding KV memory, averaged over steps
    num_steps: int
    num_preemptions: int
    duration: float  # from the first arrival to the last completion

    def as_dict(self) -> dict:
        return {k: (round(v, 5) if isinstance(v, float) else v) for k, v in vars(self).items()}


# -- the simulated server -------------------------------------------------------------------------


def make_groups(
    trace: list[TraceRequest], params: Callable[[TraceRequest], SamplingParams] | None = None
) -> list[SequenceGroup]:
    """One request per trace entry; prompt token ids are made up (lengths are what matter)."""
    groups = []
    for i, t in enumerate(trace):
        p = (
            params(t)
            if params
            else SamplingParams(temperature=0.0, max_tokens=t.output_len, ignore_eos=True)
        )
        prompt = [(7 * i + j) % 50_000 + 3 for j in range(t.prompt_len)]
        groups.append(SequenceGroup(str(i), [Sequence(i, prompt)], p, t.arrival_time))
    return groups


def simulate_groups(
    scheduler: Scheduler,
    groups: list[SequenceGroup],
    cost_model: CostModel,
    sample: SampleHook | None = None,
) -> RunStats:
    """Serve `groups` with a ready `scheduler` (and its KV cache manager, prefix caching on or
    off) in `minipaged.sim.simulator`, with `sample` as beam search's forks and drops (the
    engine forks parallel samples itself)."""
    result = minipaged.sim.simulator.simulate(
        None,
        cost_model,
        lambda _config, _kv: scheduler,
        config=scheduler.config,
        kv_manager=scheduler.kv_manager,
        groups=groups,
        on_sample=sample,
        record_steps=True,
    )
    batched = sum(step.num_running for step in result.steps)  # requests holding KV memory
    return _run_stats(result, batched / max(result.num_steps, 1))


def _stats(
    latencies: np.ndarray,
    outputs: np.ndarray,
    duration: float,
    steps: int,
    batched: int,
    preemptions: int,
) -> RunStats:
    """A served trace's numbers from each request's latency and output length."""
    return RunStats(
        normalized_latency=float(np.mean(latencies / outputs)),
        mean_latency=float(latencies.mean()),
        mean_batched_requests=batched / max(steps, 1),
        num_steps=steps,
        num_preemptions=preemptions,
        duration=duration,
    )


def sim_geometry(system: str, block_size: int = PAGED_BLOCK_SIZE) -> tuple[int, int]:
    """(blocks, block size) at the paper's capacity: paged in blocks, Orca and static batching
    in one-token blocks (token-exact reservations)."""
    if system == "paged":
        return CAPACITY_SLOTS // block_size, block_size
    return CAPACITY_SLOTS, 1


def simulate_system(system: str, trace: list[TraceRequest]) -> RunStats:
    """One of `SYSTEMS` serving `trace` in `minipaged.sim.simulator` at the paper's setting.

    `minipaged.sim.simulator` builds a `KVCacheManager` itself and hands it to a scheduler factory;
    the factory builds the system by name over a KV manager of the same geometry.
    """
    num_blocks, block_size = sim_geometry(system)

    def factory(config: SchedulerConfig, kv) -> Scheduler:
        return build_scheduler(
            scheduler_name(system),
            config,
            num_gpu_blocks=kv.num_gpu_blocks,
            block_size=kv.block_size,
            enable_prefix_caching=False,
        )

    result = minipaged.sim.simulator.simulate(
        trace,
        OPT_13B_A100,
        factory,
        num_gpu_blocks=num_blocks,
        block_size=block_size,
        config=SIM_SCHEDULER,
        record_steps=True,
    )
    batched = [len(step.request_ids) for step in result.steps]
    return _run_stats(result, float(np.mean(batched)))


def _run_stats(result: minipaged.sim.simulator.SimulationResult, mean_batched: float) -> RunStats:
    """A simulation's numbers, with the mean batch size as the caller counts it."""
    latencies = np.array([r.jct for r in result.requests])
    return RunStats(
        normalized_latency=result.mean_normalized_latency,
        mean_latency=float(latencies.mean()),
        mean_batched_requests=mean_batched,
        num_steps=result.num_steps,
        num_preemptions=result.num_preemptions,
        duration=result.makespan,
    )


def sustained_rate(rates: list[float], latencies: list[float], bound: float) -> float | None:
    """The highest rate under `bound`, interpolated linearly where the curve crosses it
    (first crossing); None when even the lowest rate is over the bound."""
    if not latencies or latencies[0] > bound:
        return None
    for i in range(1, len(latencies)):
        if latencies[i] > bound:
            r0, r1, l0, l1 = rates[i - 1], rates[i], latencies[i - 1], latencies[i]
            return r0 + (r1 - r0) * (bound - l0) / (l1 - l0)
    return rates[len(latencies) - 1]  # never crossed within the sweep: a lower bound


def sweep(
    name: str,
    rates: list[float],
    systems: list[str],
    serve: Callable[[str, float], RunStats],
    give_up: float,
) -> dict:
    """Serve each system at increasing rates; stop a system once it is clearly overloaded
    (normalized latency above `give_up` twice in a row)."""
    curves: dict[str, list[dict]] = {}
    bar = tqdm(total=len(rates) * len(systems), desc=name, unit="run")
    for system in systems:
        curves[system] = []
        over = 0
        for rate in rates:
            stats = serve(system, rate)
            curves[system].append({"rate": rate, **stats.as_dict()})
            bar.update(1)
            over = over + 1 if stats.normalized_latency > give_up else 0
            if over == 2:
                bar.update(len(rates) - len(curves[system]))
                break
    bar.close()
    return curves


def summarize(curves: dict[str, list[dict]], bound: float) -> dict:
    """Sustained rates under the bound, and paged's ratio over each baseline."""
    sustained = {}
    for system, points in curves.items():
        rate = sustained_rate(
            [p["rate"] for p in points], [p["normalized_latency"] for p in points], bound
        )
        sustained[system] = None if rate is None else round(rate, 3)
    paged = sustained["paged"]
    ratios = {
        s: (round(paged / r, 2) if (paged and r) else None)
        for s, r in sustained.items()
        if s != "paged"
    }
    return {"latency_bound_s_per_token": bound, "sustained_rate": sustained, "paged_over": ratios}


def batched_at_saturation(curves: dict[str, list[dict]]) -> dict:
    """Mean requests in the batch at the highest rate each system was run at (Fig. 13): how
    many requests its memory lets it batch once requests queue up."""
    return {
        system: {
            "rate": points[-1]["rate"],
            "mean_batched_requests": points[-1]["mean_batched_requests"],
        }
        for system, points in curves.items()
    }


def run_sim(quick: bool) -> dict:
    results: dict = {}
    for trace_name in ("sharegpt", "alpaca"):
        num = SIM_REQUESTS[trace_name] // (5 if quick else 1)
        rates = SIM_RATES[trace_name][:: 3 if quick else 1]

        def serve(system: str, rate: float, trace_name=trace_name, num=num) -> RunStats:
            trace = TRACES[trace_name](num, rate=rate, seed=0, max_seq_len=MAX_SEQ_LEN)
            return simulate_system(system, trace)

        curves = sweep(trace_name, rates, list(SYSTEMS), serve, give_up=10 * LATENCY_BOUND)
        summary = summarize(curves, LATENCY_BOUND)
        summary_loose = summarize(curves, 3 * LATENCY_BOUND)
        results[trace_name] = {
            "num_requests": num,
            "curves": curves,
            "summary": summary,
            "summary_bound_x3": summary_loose,
            "batched_requests_at_saturation": batched_at_saturation(curves),
        }
    return {
        "benchmark": "paper_vllm_sim",
        "what": "normalized latency vs Poisson request rate, simulated OPT-13B on one A100",
        "setup": {
            "capacity_slots": CAPACITY_SLOTS,
            "paged_block_size": PAGED_BLOCK_SIZE,
            "orca_block_size": 1,
            "max_seq_len": MAX_SEQ_LEN,
            "scheduler": vars(SIM_SCHEDULER) | {"preemption_mode": "recompute (single seqs)"},
            "cost_model": _cost_dict(OPT_13B_A100),
            "latency_bound_s_per_token": LATENCY_BOUND,
            "seed": 0,
        },
        "paper": PAPER,
        **results,
    }


# -- the real engine on this CPU ------------------------------------------------------------------

ENGINE_SCALE = 16  # lengths divided by this: max length 2048 -> 128
ENGINE_MAX_LEN = MAX_SEQ_LEN // ENGINE_SCALE
ENGINE_BLOCK_SIZE = 8
ENGINE_NUM_BLOCKS = 64  # 512 slots: 4 rows of the maximum length (the paper: 15.7K / 2048 = 7.7)
ENGINE_REQUESTS = 48
ENGINE_RATES = [2.0, 4.0, 8.0, 16.0]
ENGINE_LATENCY_BOUND = 0.2  # s/token, about twice the unloaded engine's on this CPU


def engine_trace(num: int, rate: float, seed: int = 0) -> list[TraceRequest]:
    """ShareGPT-like lengths divided by `ENGINE_SCALE` (at least one token each)."""
    out = []
    for t in TRACES["sharegpt"](num, rate=rate, seed=seed, max_seq_len=MAX_SEQ_LEN):
        prompt = max(1, round(t.prompt_len / ENGINE_SCALE))
        output = max(1, min(round(t.output_len / ENGINE_SCALE), ENGINE_MAX_LEN - prompt))
        out.append(TraceRequest(t.arrival_time, prompt, output))
    return out


def serve_engine(engine, trace: list[TraceRequest], vocab: int) -> RunStats:
    """Replay the trace on the engine's own busy clock: each `engine.step()` advances it by
    the step's measured wall time, and an idle engine jumps to the next arrival instead of
    sleeping (the same latencies as real time, without waiting through idle gaps)."""
    rng = np.random.default_rng(0)
    arrival: dict[str, float] = {}
    output_len: dict[str, int] = {}
    finished: dict[str, float] = {}
    clock = 0.0
    pending = list(trace)
    steps = batched = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].arrival_time <= clock:
            t = pending.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=t.output_len, ignore_eos=True)
            prompt = rng.integers(3, vocab, t.prompt_len).tolist()
            rid = engine.add_request(None, prompt, params)
            arrival[rid], output_len[rid] = t.arrival_time, t.output_len
        if not engine.has_unfinished_requests():
            clock = pending[0].arrival_time
            continue
        start = time.perf_counter()
        for output in engine.step(final_only=True):
            if output.finished:
                finished[output.request_id] = clock + time.perf_counter() - start
        clock += time.perf_counter() - start
        batched += len(engine.scheduler.running)
        steps += 1
    rids = sorted(arrival, key=arrival.get)
    latencies = np.array([finished[r] - arrival[r] for r in rids])
    outputs = np.array([output_len[r] for r in rids])
    duration = max(finished.values()) - arrival[rids[0]]
    return _stats(latencies, outputs, duration, steps, batched, engine.scheduler.num_preemptions)


def run_engine(quick: bool, threads: int) -> dict:
    import torch

    from minipaged.engine.engine import EngineConfig, LLMEngine
    from minipaged.models.checkpoint.loader import default_model_path
    from minipaged.models.registry import load_model

    torch.set_num_threads(threads)
    model, model_config = load_model(default_model_path(), dtype=torch.float32, device="cpu")
    vocab = model_config.vocab_size
    num = ENGINE_REQUESTS // (4 if quick else 1)
    rates = ENGINE_RATES[:2] if quick else ENGINE_RATES
    warm = engine_trace(4, rate=math.inf)

    def serve(system: str, rate: float) -> RunStats:
        config = EngineConfig(
            scheduler=scheduler_name(system),
            block_size=ENGINE_BLOCK_SIZE,
            num_gpu_blocks=ENGINE_NUM_BLOCKS,
            num_cpu_blocks=0,
            max_model_len=ENGINE_MAX_LEN,
            max_num_seqs=64,
            max_num_batched_tokens=512,
            enable_prefix_caching=False,
        )
        engine = LLMEngine(model, model_config, None, config)
        serve_engine(engine, warm, vocab)  # first steps allocate and warm up
        return serve_engine(engine, engine_trace(num, rate=rate, seed=1), vocab)

    started = time.monotonic()
    curves = sweep("engine", rates, list(SYSTEMS), serve, give_up=3 * ENGINE_LATENCY_BOUND)
    elapsed = time.monotonic() - started
    trace = engine_trace(num, rate=1.0, seed=1)  # the lengths (the same at every rate)
    return {
        "benchmark": "paper_vllm_engine",
        "what": "normalized latency vs Poisson request rate on the real engine (bundled "
        "SmolLM2-135M, float32, CPU), ShareGPT-like lengths / 8, ignore_eos",
        "setup": {
            "kv_slots": ENGINE_NUM_BLOCKS * ENGINE_BLOCK_SIZE,
            "block_size": ENGINE_BLOCK_SIZE,
            "max_seq_len": ENGINE_MAX_LEN,
            "num_requests": num,
            "mean_prompt_len": float(np.mean([t.prompt_len for t in trace])),
            "mean_output_len": float(np.mean([t.output_len for t in trace])),
            "max_num_seqs": 64,
            "max_num_batched_tokens": 512,
            "torch_threads": threads,
            "sweep_seconds": round(elapsed, 1),
        },
        "curves": curves,
        "summary": summarize(curves, ENGINE_LATENCY_BOUND),
        "summary_bound_x3": summarize(curves, 3 * ENGINE_LATENCY_BOUND),
    }


# -- output ---------------------------------------------------------------------------------------


def _cost_dict(cost: CostModel) -> dict:
    return {k: getattr(cost, k) for k in vars(cost)}


def print_summary(name: str, block: dict) -> None:
    summary = block["summary"]
    print(
        f"\n{name}: highest rate with mean normalized latency <= "
        f"{summary['latency_bound_s_per_token']} s/token"
    )
    print(f"{'system':<12} {'rate':>8} {'paged x':>8}")
    for system, rate in summary["sustained_rate"].items():
        ratio = summary["paged_over"].get(system)
        print(f"{system:<12} {str(rate):>8} {str(ratio or ''):>8}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["sim", "engine"])
    parser.add_argument("--quick", action="store_true", help="a smaller smoke run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (engine)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    if args.what == "sim":
        result = run_sim(args.quick)
        for trace_name in ("sharegpt", "alpaca"):
            print_summary(trace_name, result[trace_name])
    else:
        result = run_engine(args.quick, args.threads)
        print_summary("engine", result)
    result |= report_header(load_average_1min_before=round(load_before, 2))
    result["wall_seconds"] = round(time.monotonic() - started, 1)
    suffix = "_quick" if args.quick else ""
    path = RESULTS / f"paper_vllm_{args.what}{suffix}.json"
    save_report(path, result)
    print(f"\nwrote {path} in {result['wall_seconds']} s")


if __name__ == "__main__":
    main()
