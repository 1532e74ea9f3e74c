"""The machine's roofline for a model step: its GEMM rates, its memory bandwidth, a step's floor.

A step of the engine multiplies its `T` rows by every weight matrix (and the rows that sample by
the output head), attends each new token over its context, and reads every weight and every
cached K/V byte once from memory. Its *floor* on this machine is

    matrix FLOPs / (GEMM rate at T rows)  +  (weight bytes + K/V bytes) / (memory bandwidth),

with both rates measured here, in the same process as the steps they bound:

* `gemm_rates`: GFLOP/s of `minipaged.models.layers.linear` (the engine's projection path) per
  dtype at the row counts steps use, over the model's own projection shapes with weights hot in
  the cache (the arithmetic, not the memory traffic, which the second term counts);
* `copy_bandwidth`: GB/s of a large `copy_` (bytes read + bytes written over the time);
* `step_floor`: the floor of one step of a given shape (`StepShape`).

The sum is a conservative floor (it assumes no overlap of arithmetic and memory traffic); a kernel
that overlaps them perfectly could run at the larger of the two terms, which the JSON also gives.

`cpu_features` records what decides the fast path on a CPU: its AMX / AVX-512 flags.

Run on its own (the rates, and a profiled decode step of 48 sequences at 230 tokens of context
per dtype and attention backend, self CPU time by op kind next to the step's floor):
    .venv/bin/python benchmarks/roofline.py --threads 1   (~2 minutes)
Writes benchmarks/results/roofline.json; `benchmarks/throughput.py` measures it in its own run.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from machine import report_header, save_report

from minipaged.checkpoint.model_config import ModelConfig
from minipaged.engine.config import cpu_flags, native_bfloat16
from minipaged.models.layers import linear

RESULTS = Path(__file__).parent / "results" / "roofline.json"
ROWS = (1, 2, 4, 8, 16, 32, 48, 64, 128, 256, 512, 1024, 2048)
FLAGS = ("amx_bf16", "amx_tile", "amx_int8", "avx512_bf16", "avx512_fp16", "avx512f",
         "avx512_vnni", "avx2", "fma")


@dataclass(frozen=True)
class StepShape:
    """What a step computes: `tokens` rows through the layers, `logits_rows` through the head,
    `context_tokens` cached + new K/V read, `attended_pairs` (query, key) pairs scored."""

    tokens: int
    logits_rows: int
    context_tokens: int
    attended_pairs: int


@dataclass(frozen=True)
class Roofline:
    """One machine's rates in one dtype: GEMM GFLOP/s at `rows`, memory GB/s."""

    dtype: str
    rows: tuple[int, ...]
    gemm_gflops: tuple[float, ...]
    bandwidth_gbs: float

    def rate_at(self, rows: int) -> float:
        """GEMM GFLOP/s at `rows` rows, interpolated between the measured row counts."""
        return float(np.interp(np.log(rows), np.log(self.rows), self.gemm_gflops))


def cpu_features() -> dict[str, object]:
    """Which of the matrix / vector extensions in `FLAGS` the CPU has (its model name is in
    `machine_info`), and the vector level PyTorch's CPU kernels were dispatched to."""
    flags = cpu_flags()
    return {"cpu_flags": {flag: flag in flags for flag in FLAGS},
            "native_bfloat16": native_bfloat16(torch.device("cpu")),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}


def _best_s(fn, repeats: int) -> float:
    """Seconds of `fn`, the best of `repeats` after a warm-up: a rate the machine reaches (other
    load on a shared machine only ever slows a call down)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def projection_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of one layer's projections: q, k, v, o, gate, up, down."""
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, \
        config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    return [(q, h), (kv, h), (kv, h), (h, q), (inter, h), (inter, h), (h, inter)]


def gemm_rates(config: ModelConfig, dtype: torch.dtype, rows=ROWS, repeats: int = 5
               ) -> tuple[float, ...]:
    """GFLOP/s of `linear` at each row count over one layer's projections, weights hot, the best
    of `repeats`."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen).to(dtype) for o, i in projection_shapes(config)]
    flops_per_row = 2 * sum(w.numel() for w in weights)
    rates = []
    with torch.inference_mode():
        for n in rows:
            inputs = {w.shape[1]: torch.randn(n, w.shape[1], generator=gen).to(dtype)
                      for w in weights}
            seconds = _best_s(lambda inputs=inputs: [linear(inputs[w.shape[1]], w)
                                                       for w in weights], repeats)
            rates.append(n * flops_per_row / seconds / 1e9)
    return tuple(round(r, 2) for r in rates)


def copy_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """GB/s of a large `copy_`: (bytes read + bytes written) / time, best of `repeats`."""
    src = torch.ones(megabytes << 18)  # float32: megabytes MiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = _best_s(lambda: dst.copy_(src), repeats)
    return round(2 * src.numel() * src.element_size() / best / 1e9, 2)


def measure(config: ModelConfig, dtype: torch.dtype, rows=ROWS) -> Roofline:
    """This machine's roofline in `dtype` (bandwidth is the same for every dtype)."""
    return Roofline(str(dtype).removeprefix("torch."), tuple(rows),
                    gemm_rates(config, dtype, rows), copy_bandwidth())


def weight_elements(config: ModelConfig) -> tuple[int, int]:
    """Elements of every layer's projections, and of the output head."""
    per_layer = sum(o * i for o, i in projection_shapes(config))
    return config.num_layers * per_layer, config.vocab_size * config.hidden_size


def step_floor(config: ModelConfig, roof: Roofline, shape: StepShape,
               element_size: int) -> dict[str, float]:
    """Seconds of compute and of memory traffic a step needs at least, and their sum."""
    layers, head = weight_elements(config)
    attention = 4 * shape.attended_pairs * config.num_heads * config.head_dim * config.num_layers
    compute = (2 * layers * shape.tokens + attention) / (roof.rate_at(shape.tokens) * 1e9)
    compute += 2 * head * shape.logits_rows / (roof.rate_at(max(1, shape.logits_rows)) * 1e9)
    kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * shape.context_tokens
    memory = (layers + head + kv) * element_size / (roof.bandwidth_gbs * 1e9)
    return {"compute_s": compute, "memory_s": memory, "floor_s": compute + memory,
            "overlapped_floor_s": max(compute, memory)}


# -- where a decode step's time goes ----------------------------------------------------------

# torch profiler op names -> the part of the roofline they are.
OP_KINDS = {
    "GEMM (projections, head)": ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise"),
    "attention kernel": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                         "aten::_scaled_dot_product_attention_math", "aten::bmm",
                         "minipaged::paged_decode"),
    "K/V gather (block copies)": ("aten::index_select",),
    "dtype conversions": ("aten::copy_",),
    "KV write, tail zeroing": ("aten::index_copy_", "aten::_index_put_impl_"),
}


def profile_decode_step(dtype: torch.dtype, batch: int, context: int, backend: str,
                        steps: int = 3) -> dict[str, object]:
    """Self CPU time per op kind of a decode step of the bundled model: `batch` sequences of
    `context` tokens in shuffled 16-token blocks, `backend` attention, under torch's profiler."""
    import random

    from torch.profiler import ProfilerActivity, profile

    from minipaged.models.registry import load_model
    from minipaged.runner.model_runner import BatchEntry, ModelRunner

    model, config = load_model(dtype=dtype, progress=False)
    block_size, blocks_each = 16, -(-(context + 1) // 16)
    runner = ModelRunner(model, config, block_size=block_size, attention_backend=backend,
                         num_gpu_blocks=batch * blocks_each, dtype=dtype)
    blocks = list(range(batch * blocks_each))
    random.Random(0).shuffle(blocks)
    entries = [BatchEntry([100 + i], context, blocks[i * blocks_each:(i + 1) * blocks_each])
               for i in range(batch)]
    for _ in range(2):
        runner.execute(entries)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            runner.execute(entries)
    self_ms = {e.key: e.self_cpu_time_total / 1e3 / steps for e in prof.key_averages()}
    total = sum(self_ms.values())
    kinds = {kind: sum(self_ms.get(op, 0.0) for op in ops) for kind, ops in OP_KINDS.items()}
    kinds["everything else"] = total - sum(kinds.values())
    return {"dtype": str(dtype).removeprefix("torch."), "batch": batch, "context": context,
            "attention_backend": backend, "step_ms": round(total, 1),
            "ms_by_kind": {k: round(v, 1) for k, v in kinds.items()},
            "share_by_kind": {k: round(v / total, 3) for k, v in kinds.items()}}


def main() -> None:
    from minipaged.checkpoint.gguf_weights import gguf_checkpoint
    from minipaged.checkpoint.loader import default_model_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", type=int, nargs=2, default=[48, 230],
                        metavar=("BATCH", "CONTEXT"),
                        help="profile a decode step of this shape per dtype and backend")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config, _ = gguf_checkpoint(default_model_path())
    roofs = [measure(config, dtype) for dtype in (torch.float32, torch.bfloat16)]
    for roof in roofs:
        print(f"{roof.dtype}: copy {roof.bandwidth_gbs} GB/s; GEMM GFLOP/s at rows "
              + ", ".join(f"{n}: {r}" for n, r in zip(roof.rows, roof.gemm_gflops, strict=True)))
    profiles = []
    for dtype in (torch.float32, torch.bfloat16):
        roof = roofs[0] if dtype == torch.float32 else roofs[1]
        for backend in ("torch", "cpu"):
            prof = profile_decode_step(dtype, *args.profile, backend)
            batch, context = args.profile
            shape = StepShape(batch, batch, batch * (context + 1), batch * (context + 1))
            floor = step_floor(config, roof, shape, torch.tensor([], dtype=dtype).element_size())
            prof["floor_ms"] = round(floor["floor_s"] * 1e3, 1)
            prof["ratio"] = round(prof["step_ms"] / prof["floor_ms"], 2)
            profiles.append(prof)
            print(f"{prof['dtype']} {backend}: {prof['step_ms']} ms (floor {prof['floor_ms']}): "
                  + ", ".join(f"{k} {v}" for k, v in prof["ms_by_kind"].items()))
    save_report(args.out, {
        "benchmark": "roofline",
        "what": "GFLOP/s of model_layers.linear over SmolLM2-135M's projection shapes (weights "
                "hot) at each row count, GB/s of a 256 MiB copy (read + write), and a profiled "
                "decode step (self CPU time by op kind) next to its floor",
        **report_header(**cpu_features()),
        "rooflines": [roof.__dict__ for roof in roofs],
        "decode_step_profiles": profiles,
    })
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
