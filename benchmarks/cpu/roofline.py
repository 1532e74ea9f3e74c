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
    .venv/bin/python benchmarks/cpu/roofline.py --threads 1   (~2 minutes)
Writes benchmarks/results/roofline.json; `benchmarks/cpu/throughput.py` measures it in its own run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

import numpy as np
import torch

from machine import last_level_cache_bytes, report_header, save_report
from minipaged.kernels.cpu.pages import huge_page_buffer
from minipaged.models.checkpoint.model_config import ModelConfig
from minipaged.platforms import DTYPES
from minipaged.platforms.cpu import CPUPlatform, cpu_flags
from minipaged.platforms.cpu.linear import linear

RESULTS = Path(__file__).resolve().parents[1] / "results" / "roofline.json"
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
            "native_bfloat16": CPUPlatform.native_bfloat16(),
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


def read_bandwidth(nbytes: int, threads: int = 1, repeats: int = 5,
                   huge_pages: bool = True) -> float:
    """GB/s of `buffer.sum()` over a float32 buffer of `nbytes` on `threads` torch threads, the
    best of `repeats` after a warm-up: how fast this machine streams that many bytes, over and
    over, into the cores.

    A sum is a pure read: torch's reduction is vectorised (AVX2 / AVX-512) and does one add per
    4 bytes read, a few per cent of what a core can add, so its time is the memory's. A buffer
    larger than the last-level cache (`machine.last_level_cache_bytes`) measures DRAM; one the
    size of a model's weights measures what a decode step can get, cache included
    (`cache_resident_sum_rate` shows how far above the memory's speed the sum itself runs).
    The buffer is on huge pages where the OS grants them, as the engine's weights are
    (`minipaged.kernels.cpu.pages.huge_page_buffer`): the faster of the two page sizes, so
    the floor is the machine's best; `huge_pages=False` measures PyTorch's ordinary pages."""
    if huge_pages:
        buffer = huge_page_buffer(max(4, nbytes // 4 * 4)).view(torch.float32).fill_(1.0)
    else:
        buffer = torch.ones(max(1, nbytes // 4))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best = _best_s(buffer.sum, repeats)
    finally:
        torch.set_num_threads(before)
    return round(buffer.numel() * 4 / best / 1e9, 2)


def cache_resident_sum_rate(threads: int = 1) -> float:
    """GB/s of the same sum over 256 KiB, a buffer that stays in the L2 cache: the rate of the
    sum's arithmetic, which must be far above `read_bandwidth` for that to measure memory."""
    return read_bandwidth(256 << 10, threads, repeats=200)


def dram_bytes() -> int:
    """A read-bandwidth buffer that no cache holds: 4x the last-level cache, at least 1 GiB."""
    return max(1 << 30, 4 * (last_level_cache_bytes() or 0))


def stream_read_report(working_sets: dict[str, int], threads: int) -> dict[str, object]:
    """Read GB/s from DRAM on one thread and on `threads`, of the cache-resident sum, and of a
    buffer of each named working set's size (one thread)."""
    return {
        "method": "torch float32 buffer.sum(), best of 5 after a warm-up, on huge pages where "
                  "the OS grants them (see read_bandwidth)",
        "dram_buffer_bytes": dram_bytes(),
        "dram_gbs_1_thread": read_bandwidth(dram_bytes(), 1),
        "dram_gbs_1_thread_ordinary_pages": read_bandwidth(dram_bytes(), 1, huge_pages=False),
        f"dram_gbs_{threads}_threads": read_bandwidth(dram_bytes(), threads),
        "cache_resident_sum_gbs_1_thread": cache_resident_sum_rate(1),
        "working_set_gbs_1_thread": {name: read_bandwidth(n, 1)
                                     for name, n in working_sets.items()},
    }


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


# -- decode steps of the engine at few rows, against both floors -----------------------------

DECODE_ROWS = (1, 2, 4, 8)
DECODE_ROUNDS = 3  # of each row count, in turn (decode_floors)
DECODE_STEPS = 16  # timed steps a round (time_decode_steps)


@dataclass(frozen=True)
class EngineVariant:
    """An engine's weight format: the model `dtype` and its weight-only `quantization`."""

    dtype: str
    quantization: str | None = None

    @property
    def name(self) -> str:
        return self.quantization or self.dtype

    def engine_kwargs(self) -> dict[str, object]:
        return {"dtype": self.dtype} | ({"quantization": self.quantization}
                                        if self.quantization else {})


def quantization_available() -> bool:
    """Whether this minipaged's engine takes a weight-only `quantization` option."""
    from minipaged.engine.config import EngineConfig

    return any(f.name == "quantization" for f in dataclasses.fields(EngineConfig))


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights a decode step reads whole, in their stored format: every parameter,
    buffer and tensor field of a dataclass a module holds (the int8 values and scales of a
    quantised layer, `minipaged.kernels.cpu.gemv.Int8Weight`), each tensor once (a tied head
    and its embedding are one), except the rotary tables and an embedding table no other module
    holds, of which a step reads only its tokens' rows."""
    from minipaged.models.layers import RotaryEmbedding

    holders: dict[tuple[int, int], set[bool]] = {}  # (address, bytes) -> held by an embedding?
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            continue
        fields = [vars(v).values() for v in vars(module).values()
                  if dataclasses.is_dataclass(v) and not isinstance(v, type)]
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False),
                   *(t for f in fields for t in f if isinstance(t, torch.Tensor))]
        for tensor in tensors:
            key = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
            holders.setdefault(key, set()).add(isinstance(module, torch.nn.Embedding))
    return sum(nbytes for (_, nbytes), kinds in holders.items() if False in kinds)


def kv_bytes(config: ModelConfig, context_tokens: int, element_size: int) -> int:
    """Bytes of K and V, all layers, of `context_tokens` cached tokens."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * context_tokens \
        * element_size


@dataclass
class _DecodeSteps:
    """A step observer keeping (total s, runner s, context tokens) of decode-only steps."""

    steps: list[tuple[float, float, int]]

    def __call__(self, record) -> None:
        work = record.scheduled
        if work and all(w.num_new_tokens == 1 for w in work) and record.timings is not None:
            self.steps.append((record.timings.total_s, record.timings.forward_s,
                               sum(w.start + 1 for w in work)))


@dataclass(frozen=True)
class DecodeTimes:
    """Decode steps of `rows` requests, each with all rows decoding and warm: seconds of the
    whole step and of the runner's forward pass, context tokens, and the seconds of the read
    (`buffer.sum()`) right after each step."""

    step_s: list[float]
    forward_s: list[float]
    context_tokens: list[int]
    read_s: list[float]


def time_decode_steps(engine, rows: int, context: int, read: torch.Tensor,
                      steps: int = DECODE_STEPS) -> DecodeTimes:
    """Decode `rows` requests of `context` random prompt tokens for `steps` tokens together,
    reading `read` (`read.sum()`) after each decode step: the step and the read see the same
    moment of the machine, whose read rate drifts by a quarter within seconds on a shared host
    (a step's floor from a rate read even a few seconds away is another machine's)."""
    from minipaged.sampling.params import SamplingParams

    gen = np.random.default_rng(rows)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 3, ignore_eos=True)
    for _ in range(rows):
        engine.add_request(None, gen.integers(17, engine.model_config.vocab_size,
                                              context).tolist(), params)
    log, reads = _DecodeSteps([]), []
    engine.add_step_observer(log)
    try:
        while engine.has_unfinished_requests():
            seen = len(log.steps)
            engine.step(final_only=True)
            if len(log.steps) > seen:
                start = time.perf_counter()
                read.sum()
                reads.append(time.perf_counter() - start)
    finally:
        engine.remove_step_observer(log)
    warm = [i for i, s in enumerate(log.steps) if i > 0 and s[2] >= rows * (context + 1)]
    return DecodeTimes([log.steps[i][0] for i in warm], [log.steps[i][1] for i in warm],
                       [log.steps[i][2] for i in warm], [reads[i] for i in warm])


def decode_round(engine, config: ModelConfig, rows: int, context: int, read: torch.Tensor,
                 weights: int) -> dict:
    """One round of `rows` requests decoding together (`time_decode_steps`), against the
    bandwidth floor given twice. *Paired*: each step's bytes (weights + K/V of its context) over
    the rate of the read of the weights' size made right after it, the median of the steps'
    ratios: step and floor on the same machine. *Best rate*: the median step against the
    better of the DRAM read rates (`read_bandwidth`, best of 5) measured right before and right
    after the round: against the machine at its quickest."""
    kv_size = engine.runner.kv_caches[0].element_size()
    before = read_bandwidth(dram_bytes(), 1)
    timed = time_decode_steps(engine, rows, context, read)
    after = read_bandwidth(dram_bytes(), 1)
    step_bytes = [weights + kv_bytes(config, c, kv_size) for c in timed.context_tokens]
    read_gbs = [read.numel() * 4 / r / 1e9 for r in timed.read_s]
    paired = [b / (g * 1e9) for b, g in zip(step_bytes, read_gbs, strict=True)]
    step_s, middle_bytes = float(np.median(timed.step_s)), float(np.median(step_bytes))
    floor = middle_bytes / (max(before, after) * 1e9)
    return {"steps": len(timed.step_s), "context_tokens": int(np.median(timed.context_tokens)),
            "step_ms": round(step_s * 1e3, 2),
            "forward_ms": round(float(np.median(timed.forward_s)) * 1e3, 2),
            "bytes_read": int(middle_bytes),
            "paired_read_gbs": round(float(np.median(read_gbs)), 2),
            "paired_floor_ms": round(float(np.median(paired)) * 1e3, 2),
            "ratio_to_paired_floor": round(float(np.median(
                [s / f for s, f in zip(timed.step_s, paired, strict=True)])), 3),
            "dram_gbs_before_after": [before, after],
            "bandwidth_floor_ms": round(floor * 1e3, 2),
            "ratio_to_bandwidth_floor": round(step_s / floor, 3)}


def decode_floors(variant: EngineVariant, config: ModelConfig, roof: Roofline | None,
                  context: int, rows=DECODE_ROWS, rounds: int = DECODE_ROUNDS) -> dict:
    """Decode steps of one engine variant at each row count against the bandwidth floor
    (`decode_round`) and, for an unquantised dtype, the GEMM-rate floor (`step_floor`).

    Each row count runs `rounds` times, the row counts in turn, so that its rounds fall tens of
    seconds apart: on a shared host a stretch of seconds to a minute can slow a step by half
    while a read beside it keeps its rate. A row count's figures are those of its median round
    (by the paired ratio), which one such stretch cannot move; every round is in `rounds`."""
    from minipaged.engine.engine import LLMEngine

    engine = LLMEngine.from_pretrained(**variant.engine_kwargs(), kv_cache_memory=0.25,
                                       num_cpu_blocks=0)
    weights = weight_bytes(engine.runner.model)
    kv_size = engine.runner.kv_caches[0].element_size()
    read = huge_page_buffer(weights // 4 * 4).view(torch.float32).fill_(1.0)
    measured: dict[int, list[dict]] = {n: [] for n in rows}
    for _ in range(rounds):
        for n in rows:
            measured[n].append(decode_round(engine, config, n, context, read, weights))
    table = []
    for n, results in measured.items():
        middle = sorted(results, key=lambda r: r["ratio_to_paired_floor"])[len(results) // 2]
        row = {"rows": n, **middle,
               "rounds": [{k: r[k] for k in ("step_ms", "paired_floor_ms",
                                             "ratio_to_paired_floor", "ratio_to_bandwidth_floor")}
                          for r in results]}
        if roof is not None:
            element = torch.tensor([], dtype=DTYPES[variant.dtype]).element_size()
            shape = StepShape(n, n, row["context_tokens"], row["context_tokens"])
            gemm = step_floor(config, roof, shape, element)["floor_s"]
            row |= {"gemm_rate_floor_ms": round(gemm * 1e3, 2),
                    "ratio_to_gemm_rate_floor": round(row["step_ms"] / 1e3 / gemm, 3)}
        table.append(row)
    engine.close()
    return {"variant": variant.name, "dtype": variant.dtype,
            "quantization": variant.quantization, "weight_bytes": weights,
            "kv_element_size": kv_size, "steps": table}


def print_decode_floors(result: dict) -> None:
    print(f"{result['variant']}: weights {result['weight_bytes'] / 1e6:.1f} MB")
    for r in result["steps"]:
        gemm = (f", GEMM-rate floor {r['gemm_rate_floor_ms']} ms ({r['ratio_to_gemm_rate_floor']}x)"
                if "gemm_rate_floor_ms" in r else "")
        rounds = ", ".join(str(x["ratio_to_paired_floor"]) for x in r["rounds"])
        print(f"  {r['rows']} rows: step {r['step_ms']} ms (forward {r['forward_ms']}; "
              f"median of {r['steps']}; the median round of {rounds}); paired floor "
              f"{r['paired_floor_ms']} ms "
              f"({r['ratio_to_paired_floor']}x; read {r['paired_read_gbs']} GB/s beside the "
              f"steps), best-rate floor {r['bandwidth_floor_ms']} ms "
              f"({r['ratio_to_bandwidth_floor']}x; DRAM "
              f"{'/'.join(map(str, r['dram_gbs_before_after']))} GB/s before/after)" + gemm)


# -- where a decode step's time goes ----------------------------------------------------------

# torch profiler op names -> the part of the roofline they are.
OP_KINDS = {
    "GEMM (projections, head)": ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise",
                                 "minipaged::gemv"),
    "attention kernel": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                         "aten::_scaled_dot_product_attention_math", "aten::bmm",
                         "minipaged::paged_decode"),
    "K/V gather (block copies)": ("aten::index_select",),
    "dtype conversions": ("aten::copy_",),
    "KV write, tail zeroing": ("aten::index_copy_", "aten::_index_put_impl_",
                               "minipaged::write_kv"),
}


def profile_decode_step(dtype: str, batch: int, context: int, backend: str,
                        steps: int = 3) -> dict[str, object]:
    """Self CPU time per op kind of an engine step of the bundled model while `batch` requests
    of `context` prompt tokens decode together with `backend` attention, under torch's
    profiler."""
    from torch.profiler import ProfilerActivity, profile

    from minipaged.engine.engine import LLMEngine
    from minipaged.sampling.params import SamplingParams

    engine = LLMEngine.from_pretrained(dtype=dtype, attention_backend=backend, num_cpu_blocks=0)
    gen = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(None, gen.integers(17, engine.model_config.vocab_size,
                                              context).tolist(), params)
    log = _DecodeSteps([])
    engine.add_step_observer(log)
    while len(log.steps) < 2:  # prompts done, one decode step warm
        engine.step(final_only=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step(final_only=True)
    engine.close()
    self_ms = {e.key: e.self_cpu_time_total / 1e3 / steps for e in prof.key_averages()}
    total = sum(self_ms.values())
    kinds = {kind: sum(self_ms.get(op, 0.0) for op in ops) for kind, ops in OP_KINDS.items()}
    kinds["everything else"] = total - sum(kinds.values())
    return {"dtype": dtype, "batch": batch, "context": context,
            "attention_backend": backend, "step_ms": round(total, 1),
            "ms_by_kind": {k: round(v, 1) for k, v in kinds.items()},
            "share_by_kind": {k: round(v / total, 3) for k, v in kinds.items()}}


def profiles(config: ModelConfig, roofs: dict[str, Roofline], batch: int, context: int
             ) -> list[dict]:
    """`profile_decode_step` per dtype and attention backend, each next to its floor."""
    out = []
    for dtype, roof in roofs.items():
        for backend in ("torch", "cpu"):
            prof = profile_decode_step(dtype, batch, context, backend)
            shape = StepShape(batch, batch, batch * (context + 1), batch * (context + 1))
            element = torch.tensor([], dtype=DTYPES[dtype]).element_size()
            prof["floor_ms"] = round(step_floor(config, roof, shape, element)["floor_s"] * 1e3, 1)
            prof["ratio"] = round(prof["step_ms"] / prof["floor_ms"], 2)
            out.append(prof)
            print(f"{dtype} {backend}: {prof['step_ms']} ms (floor {prof['floor_ms']}): "
                  + ", ".join(f"{k} {v}" for k, v in prof["ms_by_kind"].items()))
    return out


def main() -> None:
    from minipaged.models.checkpoint.gguf_weights import gguf_checkpoint
    from minipaged.models.checkpoint.loader import default_model_path
    from minipaged.models.registry import FAMILIES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--decode-context", type=int, default=192,
                        help="prompt tokens of each request in the few-row decode steps")
    parser.add_argument("--profile", type=int, nargs=2, default=[48, 230],
                        metavar=("BATCH", "CONTEXT"),
                        help="profile a decode step of this shape per dtype and backend")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    config, _ = gguf_checkpoint(default_model_path(), FAMILIES)
    roofs = {name: measure(config, DTYPES[name]) for name in ("float32", "bfloat16")}
    for roof in roofs.values():
        print(f"{roof.dtype}: copy {roof.bandwidth_gbs} GB/s; GEMM GFLOP/s at rows "
              + ", ".join(f"{n}: {r}" for n, r in zip(roof.rows, roof.gemm_gflops, strict=True)))
    layers, head = weight_elements(config)
    sets = {"float32_weights": 4 * (layers + head), "bfloat16_weights": 2 * (layers + head)}
    bandwidth = stream_read_report(sets, os.cpu_count() or 1)
    print("streaming read GB/s: " + ", ".join(f"{k} {v}" for k, v in bandwidth.items()
                                              if k.endswith("thread") or k.endswith("threads")))
    variants = [EngineVariant("float32"), EngineVariant("bfloat16")]
    if quantization_available():
        variants.append(EngineVariant("float32", "int8"))
    decode = []
    for variant in variants:
        decode.append(decode_floors(variant, config, roofs.get(variant.name),
                                    args.decode_context))
        print_decode_floors(decode[-1])
    profiled = [] if args.no_profile else profiles(config, roofs, *args.profile)
    save_report(args.out, {
        "benchmark": "roofline",
        "what": "GFLOP/s of models.layers.linear over SmolLM2-135M's projection shapes (weights "
                "hot) at each row count, GB/s of a 256 MiB copy (read + write), streaming read "
                "GB/s (buffer.sum) from DRAM and of buffers the weights' size, engine decode "
                "steps at 1-8 rows in 3 rounds each against the bandwidth floor (bytes read / "
                "read GB/s: paired, a read of the weights' size right after every step; best "
                "rate, the better of the DRAM rates read right before and after the round; a "
                "row count's figures from its median round) and the GEMM-rate floor, and a "
                "profiled decode step (self CPU time by op kind)",
        **report_header(load_average_1min_before=round(load_before[0], 2), **cpu_features()),
        "rooflines": [roof.__dict__ for roof in roofs.values()],
        "stream_read": bandwidth,
        "decode_steps": decode,
        "decode_step_profiles": profiled,
    })
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
