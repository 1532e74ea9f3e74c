"""The engine's steps, watched: a light log of every step of a timed run (`StepLog`, an engine
step observer), and a decode step at the batch's full width under `torch.profiler`
(`profile_decode`), set against its memory floor (`DecodeProfile.report`).

Only the engine's public surface is used: `add_request`, `step`, `abort_request` and step
observers (`StepRecord`: which sequences computed which tokens from which position).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from minipaged import LLMEngine, SamplingParams, StepRecord

# Trace events of a kernel launch: the runtime's and the driver's calls, and a graph replay.
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaGraphLaunch", "cuGraphLaunch")
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # trace categories that keep the GPU busy


@dataclass
class StepLog:
    """Each step's width, kind, tokens and wall time (`StepRecord.timings`)."""

    rows: list[tuple[int, bool, int, float]] = field(default_factory=list)

    def __call__(self, record: StepRecord) -> None:
        work = record.scheduled
        decode = bool(work) and all(w.num_new_tokens == 1 for w in work)
        seconds = record.timings.total_s if record.timings else record.end - record.start
        self.rows.append((len(work), decode, record.num_batched_tokens, seconds))

    def summary(self) -> dict:
        """Step counts, the widest decode step, and the median decode step at that width."""
        decode = [r for r in self.rows if r[1]]
        widest = max((r[0] for r in decode), default=0)
        at_widest = [r[3] for r in decode if r[0] == widest]
        return {
            "steps": len(self.rows),
            "decode_steps": len(decode),
            "widest_decode": widest,
            "median_decode_ms_at_widest": median_ms(at_widest),
            "median_step_ms": median_ms([r[3] for r in self.rows]),
        }


def median_ms(seconds: list[float]) -> float | None:
    return 1e3 * statistics.median(seconds) if seconds else None


@dataclass
class DecodeProfile:
    """`steps` profiled decode steps of `num_seqs` sequences: their wall time, the trace's GPU
    events, and the K/V tokens each step read."""

    num_seqs: int
    steps: int
    wall_s: float
    context_tokens: list[int]
    all_decode: bool
    trace: dict

    def gpu_events(self) -> list[dict]:
        return [e for e in self.trace.get("traceEvents", [])
                if e.get("ph") == "X" and e.get("cat") in GPU_WORK]

    def report(self, weights_bytes: int, kv_bytes_per_token: int,
               copy_bw: float | None) -> dict:
        """Per-step wall and kernel time, busy fraction, launches, and the memory floor: the
        weights plus the K/V the step reads, at the copy bandwidth (None: no floor)."""
        events = self.gpu_events()
        kernels = [e for e in events if e["cat"] == "kernel"]
        busy_us = sum(float(e["dur"]) for e in events)
        launches = [e for e in self.trace.get("traceEvents", [])
                    if e.get("ph") == "X" and e.get("name") in LAUNCH_CALLS]
        step_s = self.wall_s / self.steps
        context = statistics.mean(self.context_tokens)
        floor_bytes = weights_bytes + kv_bytes_per_token * context
        result = {
            "num_seqs": self.num_seqs, "steps": self.steps, "all_decode": self.all_decode,
            "step_ms": 1e3 * step_s,
            "kernel_ms": busy_us / 1e3 / self.steps,
            "busy_fraction": busy_us * 1e-6 / self.wall_s,
            "busy_fraction_union": union_us(events) * 1e-6 / self.wall_s,
            "kernels_per_step": len(kernels) / self.steps,
            "launch_calls_per_step": len(launches) / self.steps,
            "context_tokens_per_step": context,
            "weights_bytes": weights_bytes,
            "kv_bytes_read_per_step": kv_bytes_per_token * context,
            "floor_bytes": floor_bytes,
        }
        if copy_bw:
            floor_s = floor_bytes / copy_bw
            result |= {"floor_ms": 1e3 * floor_s, "step_over_floor": step_s / floor_s,
                       "kernels_over_floor": busy_us * 1e-6 / self.steps / floor_s}
        return result


def union_us(events: list[dict]) -> float:
    """Microseconds during which at least one of `events` ran (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def profile_decode(engine: LLMEngine, prompts: list[list[int]], temperature: float,
                   steps: int, device: str, warmup: int = 2, max_steps: int = 400) -> DecodeProfile:
    """Fill the batch (`max_num_seqs` requests, or as many prompts as there are), step until
    every one of them decodes, then profile `steps` steps; the requests are aborted after."""
    width = min(engine.config.max_num_seqs, len(prompts))
    records: list[StepRecord] = []
    engine.add_step_observer(records.append)
    params = SamplingParams(temperature=temperature, ignore_eos=True,
                            max_tokens=max_steps + warmup + steps)
    ids = [engine.add_request(None, prompts[i], params) for i in range(width)]
    try:
        for _ in range(max_steps):
            engine.step(final_only=True)
            last = records[-1].scheduled
            if len(last) == width and all(w.num_new_tokens == 1 for w in last):
                break
        for _ in range(warmup):
            engine.step(final_only=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        first = len(records)
        with torch.profiler.profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                engine.step(final_only=True)
            if device == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
        profiled = [r.scheduled for r in records[first:]]
    finally:
        engine.remove_step_observer(records.append)
        for request_id in ids:
            engine.abort_request(request_id)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return DecodeProfile(
        num_seqs=max(len(s) for s in profiled), steps=steps, wall_s=wall,
        context_tokens=[sum(w.start + w.num_new_tokens for w in s) for s in profiled],
        all_decode=all(len(s) == width and all(w.num_new_tokens == 1 for w in s)
                       for s in profiled),
        trace=trace)
