"""Tensor parallelism on this CPU: TP=1 against TP=2 (one thread per rank), and on paper on GPUs.

The model has SmolLM2-135M's shape (30 layers, hidden 576, MLP 1536, vocabulary 49152, tied
head) with 8 query heads and 2 KV heads of 72 dimensions instead of 9 and 3 of 64, so that it
splits over two ranks; its weights are random (only time is measured). It is written once as a
safetensors folder, from which every rank reads only its slices.

For each batch size, `B` sequences of `--context` tokens are prefilled, then `--steps` decode
steps are timed through the runner's `execute` (the engine's boundary: rank 0 sends each
step's plan to the worker, both compute, the logits come back to rank 0). Three set-ups:
TP=1 with one thread, TP=1 with two threads (the same two cores as TP=2), and TP=2 with one
thread per rank. For TP=2, `torch.profiler` on rank 0 sums the time spent inside the
collectives (the two all-reduces per layer, the embedding's all-reduce, the logits' gather):
that time includes waiting for the other rank, so it is the cost of synchronising, not only of
moving bytes.

How rank 0 sends each step's plan is measured on its own: a decode plan of `B` entries over a
pipe (how spawned workers get it) against `broadcast_object_list` over gloo (how `torchrun`
workers get it), each followed by a one-number all-reduce so that rank 0 waits for the worker;
the all-reduce's own time is measured alone and subtracted.

The "on paper" section counts the bytes the same sharding moves per layer and per token, and
what a ring all-reduce of those bytes costs at published link bandwidths (NVLink 4 on H100
SXM; PCIe 4.0 and 5.0 x16), for this model and for a Llama-3-8B-shaped one.

Run: .venv/bin/python benchmarks/cpu/tensor_parallel.py     (~2-4 minutes)
Writes benchmarks/results/tensor_parallel.json.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from machine import report_header, save_report
from minipaged.engine.config import EngineConfig
from minipaged.engine.engine import LLMEngine
from minipaged.runner.model_runner import ModelRunner
from minipaged.runner.parallel.worker import CheckpointShards, free_port
from minipaged.sched.output import ScheduledSequence, SchedulerOutput

RESULTS = Path(__file__).resolve().parents[1] / "results" / "tensor_parallel.json"
HF_CONFIG = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=576,
    intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=2,
    head_dim=72, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)
# Published per-direction link bandwidths, bytes/s.
LINKS = {
    "NVLink 4 (H100 SXM, 900 GB/s total = 450 GB/s each way)": 450e9,
    "PCIe 5.0 x16 (64 GB/s each way)": 64e9,
    "PCIe 4.0 x16 (32 GB/s each way)": 32e9,
}
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def write_model(folder: Path) -> None:
    """A random model of `HF_CONFIG`'s shape, as a Hugging Face safetensors folder."""
    from safetensors.torch import save_file

    from minipaged.models.checkpoint.model_config import ModelConfig
    from minipaged.models.checkpoint.weight_names import expected_shapes
    from minipaged.models.registry import FAMILIES

    config = ModelConfig.from_hf_dict(HF_CONFIG, FAMILIES)
    generator = torch.Generator().manual_seed(0)
    state = {
        name: torch.randn(shape, generator=generator) * (0.02 if len(shape) == 2 else 1.0)
        for name, shape in expected_shapes(config).items()
    }
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(HF_CONFIG))


def decode_times(runner: ModelRunner, batch: int, context: int, steps: int) -> list[float]:
    """Seconds of each of `steps` decode steps of `batch` sequences at `context` tokens."""
    bs = runner.block_size
    per_seq = -(-(context + 1) // bs)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    prompts = [[(7 * i + j) % 49000 + 3 for j in range(context)] for i in range(batch)]
    runner.execute(SchedulerOutput(scheduled=[
        ScheduledSequence(str(i), i, 0, tuple(p), is_prefill=True, block_table=tuple(t))
        for i, (p, t) in enumerate(zip(prompts, tables, strict=True))
    ]))
    decode = SchedulerOutput(scheduled=[
        ScheduledSequence(str(i), i, context, (5,), block_table=tuple(t))
        for i, t in enumerate(tables)
    ])
    for _ in range(3):  # warm-up
        runner.execute(decode)
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        runner.execute(decode)
        times.append(time.perf_counter() - began)
    return times


def collective_seconds(runner: ModelRunner, batch: int, context: int, steps: int) -> float:
    """Rank 0's seconds inside collectives over `steps` decode steps (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decode_times(runner, batch, context, steps)
    # gloo's own events span each collective from its start to its end (waiting included);
    # the `c10d::` ones only launch it.
    total_us = sum(e.cpu_time_total for e in prof.key_averages() if e.key.startswith("gloo:"))
    # The profiled run includes the prefill and warm-up steps: scale to the decode steps.
    return total_us / 1e6 * steps / (steps + 4)


def engine_runner(path: Path, tp: int, blocks: int) -> LLMEngine:
    config = EngineConfig(
        num_gpu_blocks=blocks, num_cpu_blocks=0, block_size=16, tensor_parallel_size=tp,
        tensor_parallel_timeout=120,
    )
    from minipaged.models.checkpoint.loader import checkpoint_config
    from minipaged.models.registry import FAMILIES

    model_config = checkpoint_config(path, FAMILIES)
    source = CheckpointShards(str(path))
    return LLMEngine(source, model_config, None, config)


def decode_plan(batch: int, context: int) -> SchedulerOutput:
    """What rank 0 sends for a decode step of `batch` sequences at `context` tokens."""
    n = -(-(context + 1) // 16)
    return SchedulerOutput(scheduled=[
        ScheduledSequence(str(i), i, context, (5 + i,), block_table=tuple(range(i * n, i * n + n)))
        for i in range(batch)
    ])


def channel_peer(init_method: str, conn, batches: list[int], rounds: int) -> None:
    """Rank 1 of `plan_channel_costs`: receive each plan, then meet rank 0 in an all-reduce."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=1, world_size=2,
                            timeout=timedelta(seconds=60))
    ack = torch.zeros(1)
    for _ in batches:
        for _ in range(rounds):
            dist.all_reduce(ack)
        for _ in range(rounds):
            conn.recv()
            dist.all_reduce(ack)
        for _ in range(rounds):
            dist.broadcast_object_list([None], src=0)
            dist.all_reduce(ack)
    dist.destroy_process_group()


def plan_channel_costs(batches: list[int], context: int, rounds: int = 200) -> dict:
    """Microseconds to get a decode plan to one worker: over a pipe, and broadcast over gloo."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    context_mp = mp.get_context("spawn")
    parent, child = context_mp.Pipe()
    peer = context_mp.Process(target=channel_peer, args=(init_method, child, batches, rounds))
    peer.start()
    dist.init_process_group("gloo", init_method=init_method, rank=0, world_size=2,
                            timeout=timedelta(seconds=60))
    ack = torch.zeros(1)

    def per_round(send) -> float:
        times = []
        for _ in range(rounds):
            began = time.perf_counter()
            send()
            dist.all_reduce(ack)
            times.append(time.perf_counter() - began)
        return statistics.median(times) * 1e6

    costs = {}
    for batch in batches:
        plan = decode_plan(batch, context)
        alone = per_round(lambda: None)
        pipe = per_round(lambda plan=plan: parent.send(plan))
        broadcast = per_round(lambda plan=plan: dist.broadcast_object_list([plan], src=0))
        costs[str(batch)] = {
            "pickled_bytes": len(pickle.dumps(plan)),
            "all_reduce_alone_us": round(alone, 1),
            "pipe_us": round(pipe - alone, 1),
            "broadcast_object_list_us": round(broadcast - alone, 1),
        }
        print("plan", batch, costs[str(batch)], flush=True)
    dist.destroy_process_group()
    peer.join()
    return costs


def on_paper(hidden: int, layers: int, vocab: int, dtype_bytes: int, world: int) -> dict:
    """Bytes a Megatron split over `world` ranks moves per decode token, and the time of a
    ring all-reduce of them (each rank sends and receives 2 (N-1)/N of the buffer) per link."""
    per_layer = 2 * hidden * dtype_bytes  # two all-reduces of one hidden vector each
    per_token = layers * per_layer + hidden * dtype_bytes  # + the embedding's all-reduce
    gather = vocab * dtype_bytes * (world - 1) / world  # logits of the other ranks to rank 0
    ring = 2 * (world - 1) / world
    return {
        "bytes_all_reduced_per_layer_per_token": per_layer,
        "bytes_all_reduced_per_token": per_token,
        "bytes_of_logits_gathered_per_token": gather,
        "all_reduces_per_step": 2 * layers + 1,
        "microseconds_per_token_at_bandwidth": {
            link: round((ring * per_token + gather) / bw * 1e6, 3) for link, bw in LINKS.items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    blocks = max(args.batches) * (-(-(args.context + 1) // 16))
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        write_model(path)
        for name, tp, threads in [("tp1_1thread", 1, 1), ("tp1_2threads", 1, 2),
                                  ("tp2_1thread_per_rank", 2, 1)]:
            torch.set_num_threads(threads)
            engine = engine_runner(path, tp, blocks)
            rows = {}
            for batch in args.batches:
                times = decode_times(engine.runner, batch, args.context, args.steps)
                step = statistics.median(times)
                row = {"decode_step_ms": round(step * 1e3, 2),
                       "tokens_per_s": round(batch / step, 1)}
                if tp > 1:
                    spent = collective_seconds(engine.runner, batch, args.context, args.steps)
                    row["collective_share"] = round(spent / sum(times), 3)
                rows[str(batch)] = row
                print(name, batch, row, flush=True)
            engine.close()
            results[name] = rows
    torch.set_num_threads(1)
    channels = plan_channel_costs(args.batches, args.context)
    flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[-1].split("\n", 1)[0].split()
    report = report_header(
        cpu_flags=[f for f in CPU_FLAGS if f in flags],
    ) | {
        "model": "SmolLM2-135M-shaped LLaMA, 8 query / 2 KV heads of 72, random weights",
        "context_tokens": args.context,
        "decode_steps_timed": args.steps,
        "cpu": results,
        "plan_channel_per_step": channels,
        "tp2_speedup_over_tp1_1thread": {
            b: round(results["tp1_1thread"][b]["decode_step_ms"]
                     / results["tp2_1thread_per_rank"][b]["decode_step_ms"], 2)
            for b in results["tp1_1thread"]
        },
        "on_paper_bf16_tp2": {
            "this model": on_paper(576, 30, 49152, 2, 2),
            "Llama-3-8B shape (hidden 4096, 32 layers, vocab 128256)": on_paper(
                4096, 32, 128256, 2, 2
            ),
        },
    }
    save_report(RESULTS, report)
    print(json.dumps(report["tp2_speedup_over_tp1_1thread"]))


if __name__ == "__main__":
    main()
