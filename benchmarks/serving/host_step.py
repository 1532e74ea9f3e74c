"""The engine's own host time per decode step: everything but the model's forward pass.

The engine runs on the CPU with a stand-in model whose forward costs next to nothing (its
logits are a one-hot of a hash of each row's token and position, over a small vocabulary, so
that the sampler's arithmetic is negligible too) and a stand-in platform that replays decode
steps from static buffers as a GPU's captured graphs do, so that the host does what it does
beside a GPU (the PyTorch sampler included), over nano-vllm's benchmark workload: prompts
of uniform random length in [100, 1024] tokens, greedy, `ignore_eos`. Once every sequence is
decoding, `--steps` steps are timed, each with every sequence computing one token, and split by
phase from the engine's `StepRecord` timings (wall time) and a processor that times its
sampling; the engine's clock is this thread's CPU time, so that a record's span is the step's
CPU time, which other work on a shared machine inflates less than its wall time:

* schedule: `Scheduler.schedule`;
* prepare: the runner's flat batch, written into the static buffers (the stand-in's forward
  included);
* sample: the sampler, the tokens appended, the stop rules;
* postprocess: the rest of the update (computed tokens, forks, freeing what finished);
* outputs: what `run_until_done` builds of the step's outputs.

What a GPU's host would spend in the same Python, the card then idle; the step's time on a
GPU is this plus the forward pass. Reported at 64, 256 and 1,024 sequences, so that the cost
per sequence shows; each size runs `--repeats` times and the table keeps the run with the lowest
median, the one other work on a shared machine disturbed least (every run's median is in the
JSON).

Run: .venv/bin/python benchmarks/serving/host_step.py      (~1 minute on 2 CPU cores)
Writes benchmarks/results/host_step.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

import numpy as np
import torch
from torch import nn

from machine import report_header, save_report
from minipaged.engine.config import EngineConfig
from minipaged.engine.engine import LLMEngine
from minipaged.engine.postprocess import OutputProcessor
from minipaged.engine.record import StepRecord
from minipaged.models.checkpoint.model_config import ModelConfig
from minipaged.models.registry import FAMILIES
from minipaged.platforms import Platform
from minipaged.runner.model_runner import ModelRunner
from minipaged.sampling.params import SamplingParams

RESULTS = Path(__file__).resolve().parents[1] / "results" / "host_step.json"
VOCAB = 64  # the sampler's arithmetic over it (a device's work on a GPU) costs ~40 us at 256 rows
PHASES = ("schedule", "prepare", "sample", "postprocess", "outputs")


class StandInPlatform(Platform):
    """A GPU platform's host side, on the CPU: decode steps of the ladder's sizes replayed from
    a capture over static buffers (the "graph" runs the stand-in's forward again)."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.graph_sizes = (1, 2, 4, 8, *range(16, 1025, 16))
        self.replays = 0

    def capture(self, forward):
        out = forward()

        def replay() -> None:
            self.replays += 1
            out.copy_(forward())

        return replay, out


class StandInModel(nn.Module):
    """A model in shape only: its hidden state is a hash of each token and position, its
    logits the one-hot of that hash (greedy decoding then follows a fixed walk)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: object):
        return (input_ids * 31 + positions) % VOCAB

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return nn.functional.one_hot(hidden, VOCAB).float()


class TimedProcessor(OutputProcessor):
    """The engine's processor, timing its sampling (`sample`) per step."""

    sample_s: list[float] = []

    def sample(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return super().sample(*args, **kwargs)
        finally:
            TimedProcessor.sample_s.append(time.perf_counter() - start)


def model_config(max_len: int) -> ModelConfig:
    return ModelConfig(
        family=FAMILIES["llama"], vocab_size=VOCAB, hidden_size=1, num_layers=1, num_heads=1,
        num_kv_heads=1, head_dim=1, intermediate_size=1, max_position_embeddings=max_len,
    )


def stand_in_engine(num_seqs: int, max_len: int, **engine: object) -> LLMEngine:
    """The engine over the stand-in model and platform, with room for `num_seqs` sequences of
    up to `max_len` tokens; `engine` goes to `LLMEngine` (its processor, its clock)."""
    block_size = 16
    config = EngineConfig(
        device="cpu", dtype="float32", block_size=block_size,
        num_gpu_blocks=num_seqs * -(-max_len // block_size) + 16, num_cpu_blocks=0,
        max_num_seqs=num_seqs, max_num_batched_tokens=16384, max_model_len=max_len,
        enable_prefix_caching=True,
    )
    runner = ModelRunner(StandInModel(), model_config(max_len), config,
                         platform=StandInPlatform())
    return LLMEngine(None, model_config(max_len), config=config, runner=runner, **engine)


def run(num_seqs: int, steps: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    engine = stand_in_engine(num_seqs, 1024 + steps + 256, processor=TimedProcessor,
                             clock=time.thread_time)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 240, ignore_eos=True)
    for _ in range(num_seqs):
        prompt = rng.integers(0, VOCAB, int(rng.integers(100, 1025))).tolist()
        engine.add_request(None, prompt, params)
    records: list[StepRecord] = []
    engine.add_step_observer(records.append)
    finals = {}  # none: no sequence reaches max_tokens while the steps are timed
    while not records or not all(not s.is_prefill for s in records[-1].scheduled):
        engine.step(final_only=True)  # the prompts' prefills
    records.clear()
    TimedProcessor.sample_s.clear()
    for _ in range(steps):
        for output in engine.step(final_only=True):  # as `run_until_done` steps
            if output.finished:
                finals[output.request_id] = output
    assert not finals and all(len(r.scheduled) == num_seqs for r in records), "not all decoding"
    phases = {name: [] for name in PHASES}
    for record, sample in zip(records, TimedProcessor.sample_s, strict=True):
        t = record.timings
        phases["schedule"].append(t.schedule_s)
        phases["prepare"].append(t.forward_s)
        phases["sample"].append(sample)
        phases["postprocess"].append(t.update_s - sample)
        phases["outputs"].append(t.outputs_s)
    totals = [r.timings.total_s for r in records]
    cpu = [r.end - r.start for r in records]  # the engine's clock: this thread's CPU time
    ms = {name: round(statistics.median(v) * 1e3, 3) for name, v in phases.items()}
    return {
        "num_seqs": num_seqs,
        "steps": steps,
        "step_ms_median": round(statistics.median(totals) * 1e3, 3),
        "step_ms_min": round(min(totals) * 1e3, 3),
        "step_cpu_ms_median": round(statistics.median(cpu) * 1e3, 3),
        "us_per_sequence": round(statistics.median(totals) * 1e6 / num_seqs, 2),
        "phase_ms_median": ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for n in args.seqs:  # the quietest of the repeats: the least disturbed by other work
        runs = [run(n, args.steps, args.seed) for _ in range(args.repeats)]
        best = min(runs, key=lambda r: r["step_ms_median"])
        rows.append(best | {"step_ms_median_of_repeats": [r["step_ms_median"] for r in runs]})
    header = (f"{'seqs':>6} {'ms/step':>8} {'min':>7} {'cpu ms':>7} {'us/seq':>7} "
              + " ".join(f"{p:>11}" for p in PHASES))
    print(header)
    for row in rows:
        phases = " ".join(f"{row['phase_ms_median'][p]:>11.3f}" for p in PHASES)
        print(f"{row['num_seqs']:>6} {row['step_ms_median']:>8.3f} {row['step_ms_min']:>7.3f} "
              f"{row['step_cpu_ms_median']:>7.3f} {row['us_per_sequence']:>7.2f} {phases}")
    report = report_header() | {
        "workload": "nano-vllm's: prompts uniform in [100, 1024], greedy, ignore_eos; stand-in "
                    f"model (vocabulary {VOCAB}); every sequence decoding; medians over the steps",
        "results": rows,
    }
    save_report(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
