"""`minipaged serve` measured online, shaped like vLLM's `benchmark_serving.py`.

An asyncio HTTP client (httpx) replays a trace against a server in a child process: every
request is sent at its arrival time, streamed (`stream=true`), and timed on the client side --
time to first token (TTFT), time per output token after the first (TPOT) and end-to-end latency
(E2E), as mean, p50 and p99 -- with the throughput. Prompts are random token ids, outputs run
to their length (`ignore_eos`), greedy. Engine: four sequences per step, no chunked prefill,
one torch thread. Models: a small random LLaMA over the bundled tokenizer's vocabulary (4
layers, hidden 256: steps of milliseconds, so the server's own cost shows), and for the
saturation check also the bundled SmolLM2 (steps of a real model).

1. **Saturation**: every request at once, over HTTP and on the offline engine in this process
   (the same requests and settings): what HTTP, JSON and the engine loop cost, as the server's
   throughput over the engine's (wall time; the offline run is made before and after, since a
   shared machine's load drifts) and as CPU time per token (the server process's, every thread,
   against the offline engine's: the steadier measure on a shared machine).
2. **FCFS vs skip-join MLFQ** (FastServe's setting in miniature, Wu et al. §6): heavy-tailed
   output lengths, so that jobs queue behind long ones; Poisson and bursty gamma (CV 2)
   arrivals at fractions of FCFS's saturated rate. Beside each measurement, the simulator's
   prediction for the same trace (`minipaged.sim.simulator`, with a cost model profiled here in wall
   time just before, which the MLFQ server is given too).
3. **Soak**: 64 clients sending short requests back to back for `--soak` seconds: errors, KV
   blocks still in use once the server is idle (leaks), and the server's resident memory.

Run: .venv/bin/python benchmarks/serving/online.py            (~10 minutes on 2 busy CPU cores)
     .venv/bin/python benchmarks/serving/online.py --quick    (fewer requests, one load, 20 s soak)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

import httpx
import numpy as np

from machine import report_header, save_report
from minipaged.engine.engine import EngineConfig, LLMEngine
from minipaged.models.checkpoint.loader import default_model_path
from minipaged.models.checkpoint.model_config import ModelConfig
from minipaged.models.registry import FAMILIES, build_model
from minipaged.sampling.params import SamplingParams
from minipaged.sched.base import SchedulerConfig
from minipaged.sched.cost_model import CostModel
from minipaged.sched.fcfs import FCFSScheduler
from minipaged.sched.mlfq import MLFQConfig, mlfq_factory
from minipaged.server.launch import free_port, wait_until_healthy
from minipaged.server.metrics import parse_metrics
from minipaged.sim.simulator import simulate
from minipaged.sim.traces import (
    TraceRequest,
    gamma_arrival_times,
    heavy_tailed,
    poisson_arrival_times,
    with_arrivals,
)
from minipaged.tokenizer.tokenizer import Tokenizer

RESULTS = Path(__file__).resolve().parents[1] / "results" / "serving.json"
ENGINE = dict(
    num_gpu_blocks=256,
    num_cpu_blocks=256,
    block_size=16,
    max_num_seqs=4,
    max_num_batched_tokens=512,
    max_model_len=512,
    enable_chunked_prefill=False,  # FastServe's iteration: a job's whole prompt at once
    enable_prefix_caching=False,  # random prompts share nothing; every block must come back
)
SMALL_LLAMA = dict(
    vocab_size=49152,  # the bundled tokenizer's, so that outputs are text
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)
FIRST_TOKEN_ID = 17  # random prompts avoid SmolLM2's control tokens (0-16)
ARRIVAL_CV = 2.0
SOAK_CLIENTS = 64

# -- data types -----------------------------------------------------------------------------------


@dataclass
class Timing:
    """One request as the client saw it (seconds from the replay's start)."""

    sent: float
    first_token: float | None = None
    done: float | None = None
    output_tokens: int = 0
    error: str | None = None


# -- the server in a child process ----------------------------------------------------------------


def make_small_llama(path: Path) -> None:
    """The small random LLaMA, saved for the server's child process."""
    import torch
    import transformers

    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL_LLAMA)).eval()
    config = ModelConfig.from_hf_dict(hf_model.config.to_dict(), FAMILIES)
    torch.save((config, build_model(config, hf_model.state_dict()).state_dict()), path)


def load_engine(model: str, **engine_kwargs) -> LLMEngine:
    """ "bundled", or the path of a model `make_small_llama` saved (with the bundled tokenizer)."""
    import torch

    if model == "bundled":
        return LLMEngine.from_pretrained(**engine_kwargs)
    config, weights = torch.load(model, weights_only=False)
    tokenizer = Tokenizer.from_pretrained(default_model_path())
    return LLMEngine(build_model(config, weights), config, tokenizer, EngineConfig(**engine_kwargs))


def child_main(config_path: str, port: int) -> None:
    """`--child`: serve a model with the settings in `config_path`."""
    import torch

    from minipaged.server.app import build_app
    from minipaged.server.launch import serve

    torch.set_num_threads(1)
    settings = json.loads(Path(config_path).read_text())
    kwargs = dict(ENGINE, scheduler=settings["scheduler"])
    if settings["scheduler"] != "fcfs":
        cost = CostModel(**settings["cost_model"])
        kwargs |= dict(mlfq=MLFQConfig.sized_to(cost), cost_model=cost)
    engine = load_engine(settings["model"], **kwargs)
    serve(build_app(engine, "bench"), "127.0.0.1", port, 2.0)


@contextmanager
def server(model: str, scheduler: str, cost: CostModel | None, workdir: Path):
    """A `serve` child with `scheduler`; yields (url, pid); stops it with SIGTERM."""
    config = workdir / f"{Path(model).stem}-{scheduler}.json"
    settings = {"model": model, "scheduler": scheduler, "cost_model": cost and asdict(cost)}
    config.write_text(json.dumps(settings))
    port = free_port()
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = open(config.with_suffix(".log"), "w")  # noqa: SIM115 -- closed below
    child = subprocess.Popen(
        [sys.executable, __file__, "--child", str(config), str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_until_healthy(url, 300, child)
        except RuntimeError as exc:
            log.flush()
            raise RuntimeError(f"{exc}:\n{Path(log.name).read_text()[-2000:]}") from None
        yield url, child.pid
    finally:
        child.terminate()
        child.wait(60)
        log.close()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# -- the client -----------------------------------------------------------------------------------


async def send(client: httpx.AsyncClient, prompt: list[int], output_len: int, t0: float) -> Timing:
    """Stream one completion; time its first and last token."""
    body = {
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    timing = Timing(sent=time.perf_counter() - t0)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                timing.error = f"HTTP {response.status_code}: {(await response.aread())[:200]}"
                return timing
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    timing.error = chunk["error"]["message"]
                elif chunk["choices"] and timing.first_token is None:
                    timing.first_token = time.perf_counter() - t0
                elif chunk.get("usage"):
                    timing.output_tokens = chunk["usage"]["completion_tokens"]
        timing.done = time.perf_counter() - t0
    except httpx.HTTPError as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
    return timing


async def replay(url: str, trace: list[TraceRequest], prompts: list[list[int]]) -> list[Timing]:
    """Send every request of `trace` at its arrival time (seconds from now); wait for all."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        t0 = time.perf_counter()

        async def at_arrival(request: TraceRequest, prompt: list[int]) -> Timing:
            await asyncio.sleep(max(0.0, request.arrival_time - (time.perf_counter() - t0)))
            return await send(client, prompt, request.output_len, t0)

        return list(await asyncio.gather(*map(at_arrival, trace, prompts)))


def summarize(timings: list[Timing], trace: list[TraceRequest]) -> dict:
    """TTFT, TPOT and E2E from each request's arrival (mean, p50, p99), and the throughput."""
    ok = [(t, r) for t, r in zip(timings, trace, strict=True) if t.error is None]
    ttft = [t.first_token - r.arrival_time for t, r in ok]
    e2e = [t.done - r.arrival_time for t, r in ok]
    tpot = [(t.done - t.first_token) / (t.output_tokens - 1) for t, _ in ok if t.output_tokens > 1]
    span = max(t.done for t, _ in ok) - min(r.arrival_time for r in trace)
    tokens = sum(t.output_tokens for t, _ in ok)
    return {
        "errors": len(timings) - len(ok),
        **_stats("ttft_s", ttft),
        **_stats("tpot_s", tpot),
        **_stats("e2e_s", e2e),
        "throughput_req_per_s": round(len(ok) / span, 4),
        "throughput_tok_per_s": round(tokens / span, 2),
        "output_tokens": tokens,
    }


def _stats(name: str, values: list[float]) -> dict:
    values_array = np.array(values) if values else np.array([np.nan])
    return {
        f"mean_{name}": round(float(values_array.mean()), 4),
        f"p50_{name}": round(float(np.percentile(values_array, 50)), 4),
        f"p99_{name}": round(float(np.percentile(values_array, 99)), 4),
    }


# -- the offline engine and the simulator ---------------------------------------------------------


def offline_throughput(model: str, trace: list[TraceRequest], prompts: list[list[int]]) -> dict:
    """The same requests, all at once, on the engine in this process (one thread): tokens per
    second of wall time and CPU seconds per token (this process does nothing else)."""
    engine = load_engine(model, **ENGINE)
    for prompt, request in zip(prompts, trace, strict=True):
        params = SamplingParams(temperature=0, max_tokens=request.output_len, ignore_eos=True)
        engine.add_request(None, prompt, params)
    start, cpu = time.perf_counter(), time.process_time()
    finals = engine.run_until_done()
    span, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(o.outputs[0].token_ids) for o in finals.values())
    return {
        "throughput_tok_per_s": round(tokens / span, 2),
        "cpu_ms_per_token": round(1000 * cpu / tokens, 3),
        "output_tokens": tokens,
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def simulated(trace: list[TraceRequest], scheduler: str, cost: CostModel) -> dict:
    """The simulator's prediction of TTFT, TPOT and E2E for `trace` (same engine settings)."""
    factory = (
        FCFSScheduler if scheduler == "fcfs" else mlfq_factory(MLFQConfig.sized_to(cost), cost)
    )
    config = SchedulerConfig(
        max_num_batched_tokens=ENGINE["max_num_batched_tokens"],
        max_num_seqs=ENGINE["max_num_seqs"],
        max_model_len=ENGINE["max_model_len"],
        enable_chunked_prefill=ENGINE["enable_chunked_prefill"],
    )
    result = simulate(
        trace,
        cost,
        factory,
        num_blocks=ENGINE["num_gpu_blocks"],
        block_size=ENGINE["block_size"],
        num_cpu_blocks=ENGINE["num_cpu_blocks"],
        config=config,
    )
    ttft = [r.ttft for r in result.requests]
    e2e = [r.jct for r in result.requests]
    tpot = [
        (r.finished_time - r.first_token_time) / (r.output_len - 1)
        for r in result.requests
        if r.output_len > 1
    ]
    return {**_stats("ttft_s", ttft), **_stats("tpot_s", tpot), **_stats("e2e_s", e2e)}


# -- the soak -------------------------------------------------------------------------------------


async def soak(url: str, pid: int, seconds: float, seed: int) -> dict:
    """`SOAK_CLIENTS` clients, each sending short requests back to back until time is up."""
    rng = random.Random(seed)
    deadline = time.perf_counter() + seconds
    memory: list[tuple[float, float]] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        t0 = time.perf_counter()

        async def one_client() -> list[Timing]:
            done = []
            while time.perf_counter() < deadline:
                prompt = [rng.randrange(FIRST_TOKEN_ID, 49152) for _ in range(rng.randint(4, 32))]
                done.append(await send(client, prompt, rng.randint(2, 12), t0))
            return done

        async def sample_memory() -> None:
            while time.perf_counter() < deadline:
                memory.append((round(time.perf_counter() - t0, 1), round(rss_mib(pid), 1)))
                await asyncio.sleep(seconds / 12)

        *per_client, _ = await asyncio.gather(
            *(one_client() for _ in range(SOAK_CLIENTS)), sample_memory()
        )
    timings = [t for client_timings in per_client for t in client_timings]
    await asyncio.sleep(0.5)
    values = parse_metrics(httpx.get(url + "/metrics").text)
    steady = [m for t, m in memory if t >= seconds / 4]  # after the warm-up
    return {
        "clients": SOAK_CLIENTS,
        "seconds": seconds,
        "requests": len(timings),
        "errors": sum(t.error is not None for t in timings),
        "leaked_blocks": values["minipaged:num_blocks"] - values["minipaged:num_free_blocks"],
        "requests_left": sum(
            values[f"minipaged:num_requests_{q}"] for q in ("running", "waiting", "swapped")
        ),
        "rss_mib_over_time": memory,
        "rss_growth_after_warmup_mib": round(steady[-1] - steady[0], 1) if steady else None,
    }


# -- the whole benchmark --------------------------------------------------------------------------


def saturation(model: str, trace: list[TraceRequest], prompts: list[list[int]], server) -> dict:
    """HTTP against offline throughput with every request at once, in wall time (offline runs
    before and after the HTTP run, so a change in the machine's load shows) and in CPU time
    (the server process's, all threads, against the offline engine's). `server` is the running
    FCFS server's (url, pid)."""
    url, pid = server
    before = offline_throughput(model, trace, prompts)
    cpu = cpu_seconds(pid)
    http = summarize(asyncio.run(replay(url, trace, prompts)), trace)
    http["cpu_ms_per_token"] = round(1000 * (cpu_seconds(pid) - cpu) / http["output_tokens"], 3)
    after = offline_throughput(model, trace, prompts)
    offline = (before["throughput_tok_per_s"] + after["throughput_tok_per_s"]) / 2
    offline_cpu = (before["cpu_ms_per_token"] + after["cpu_ms_per_token"]) / 2
    print(f"saturation, {Path(model).stem}: {http} vs offline {before}, {after}", flush=True)
    return {
        "trace": _trace_stats(trace),
        "http": http,
        "offline_before": before,
        "offline_after": after,
        "http_over_offline_throughput": round(http["throughput_tok_per_s"] / offline, 3),
        "offline_over_http_cpu_per_token": round(offline_cpu / http["cpu_ms_per_token"], 3),
    }


def make_trace(num_requests: int, max_len: int, seed: int):
    """Heavy-tailed output lengths (`simulate.heavy_tailed`), capped; random prompt ids."""
    base = heavy_tailed(num_requests, seed=seed, output_median=16, max_seq_len=512)
    trace = [
        TraceRequest(0.0, min(r.prompt_len, max_len // 2), min(r.output_len, max_len)) for r in base
    ]
    rng = random.Random(seed)
    prompts = [[rng.randrange(FIRST_TOKEN_ID, 49152) for _ in range(r.prompt_len)] for r in trace]
    return trace, prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", nargs=2, metavar=("CONFIG", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_main(args.child[0], int(args.child[1]))
    import tempfile

    import torch

    torch.set_num_threads(1)
    num_requests = 16 if args.quick else 48
    loads = [0.8] if args.quick else [0.5, 0.9]
    soak_seconds = 20.0 if args.quick else 60.0
    report = report_header(torch_threads_server=1)
    report |= {"engine": ENGINE, "small_llama": SMALL_LLAMA}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        small = str(workdir / "small_llama.pt")
        make_small_llama(Path(small))
        base, prompts = make_trace(num_requests, 128, args.seed)
        engine = load_engine(small, **ENGINE)
        cost = CostModel.profile(engine, max_prefill=64, max_batch=ENGINE["max_num_seqs"])
        del engine
        report |= {"cost_model": asdict(cost), "trace": _trace_stats(base)}
        rows: dict = {}
        with (
            server(small, "fcfs", cost, workdir) as fcfs,
            server(small, "mlfq", cost, workdir) as mlfq,
        ):
            # FCFS's saturated rate, measured just before the replays that are fractions of it.
            report["saturation"] = {"small_llama": saturation(small, base, prompts, fcfs)}
            capacity = report["saturation"]["small_llama"]["http"]["throughput_req_per_s"]
            traces = {}
            for arrival in ("poisson", "gamma"):
                for load in loads:
                    arrivals = _arrivals(arrival, num_requests, load * capacity, args.seed)
                    traces[(arrival, load)] = with_arrivals(base, arrivals)
            # Both servers are up (an idle one sleeps); they take turns, in the order
            # A B B A ..., so that a drift in the machine's load favours neither.
            for turn, ((arrival, load), trace) in enumerate(traces.items()):
                order = [("fcfs", fcfs), ("mlfq", mlfq)]
                for scheduler, (url, _) in order if turn % 2 == 0 else order[::-1]:
                    measured = summarize(asyncio.run(replay(url, trace, prompts)), trace)
                    row = {
                        "rate_req_per_s": round(load * capacity, 4),
                        "load_average_1min": round(os.getloadavg()[0], 2),
                        "measured": measured,
                        "simulated": simulated(trace, scheduler, cost),
                    }
                    rows.setdefault(arrival, {}).setdefault(f"{load:.2f}", {})[scheduler] = row
                    print(scheduler, arrival, load, measured, flush=True)
            report["soak"] = asyncio.run(soak(*fcfs, soak_seconds, args.seed))
            print("soak:", report["soak"], flush=True)
        small_trace = make_trace(4 if args.quick else 8, 32, args.seed)
        with server("bundled", "fcfs", None, workdir) as bundled:
            report["saturation"]["bundled"] = saturation("bundled", *small_trace, bundled)
        report["fcfs_vs_mlfq"] = rows
    save_report(RESULTS, report)
    print(f"wrote {RESULTS}")


def _arrivals(kind: str, n: int, rate: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed + 1)
    if kind == "poisson":
        return poisson_arrival_times(n, rate, rng)
    return gamma_arrival_times(n, rate, ARRIVAL_CV, rng)


def _trace_stats(trace: list[TraceRequest]) -> dict:
    prompts = np.array([r.prompt_len for r in trace])
    outputs = np.array([r.output_len for r in trace])
    return {
        "num_requests": len(trace),
        "prompt_mean": round(float(prompts.mean()), 1),
        "output_mean": round(float(outputs.mean()), 1),
        "output_median": float(np.median(outputs)),
        "output_max": int(outputs.max()),
        "arrival_cv_gamma": ARRIVAL_CV,
    }


if __name__ == "__main__":
    main()
