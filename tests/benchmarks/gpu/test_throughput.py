"""The parts of `benchmarks/gpu/throughput.py` that decide its numbers, without a GPU.

* The workload is nano-vllm's `bench.py`: its seeded draws in its order (every prompt, its
  length first, then every output length), so both projects time the same requests.
* A profiled decode step: GPU busy time counts overlapping kernels once (`union_us`), and the
  report turns a trace into per-step kernel time, launches and the memory floor.
* The K/V bytes a token holds, from a transformers config (Qwen3's `head_dim` is its own).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[3] / "benchmarks"))

from gpu.decode_profile import DecodeProfile, union_us  # noqa: E402
from gpu.random_models import LLAMA3_8B, QWEN3_0_6B  # noqa: E402
from gpu.throughput import NANO_VLLM, Workload, kv_bytes_per_token  # noqa: E402


def test_the_workload_is_nano_vllms() -> None:
    random.seed(0)  # nano-vllm's bench.py, written out as it draws
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))]
               for _ in range(256)]
    max_tokens = [random.randint(100, 1024) for _ in range(256)]
    assert NANO_VLLM.requests() == list(zip(prompts, max_tokens, strict=True))


def test_a_smaller_workload_keeps_its_ranges() -> None:
    requests = Workload(num_seqs=50, max_input_len=30, max_output_len=9, min_len=3,
                        max_token_id=99).requests()
    assert len(requests) == 50
    assert all(3 <= len(p) <= 30 and 3 <= n <= 9 for p, n in requests)
    assert all(0 <= t <= 99 for p, _ in requests for t in p)


def test_overlapping_kernels_count_once() -> None:
    def span(ts: float, dur: float) -> dict:
        return {"ts": ts, "dur": dur}

    assert union_us([]) == 0
    assert union_us([span(0, 10), span(20, 5)]) == 15  # apart
    assert union_us([span(0, 10), span(5, 10)]) == 15  # overlapping
    assert union_us([span(0, 10), span(2, 3), span(9, 1)]) == 10  # nested, touching the end
    assert union_us([span(5, 10), span(0, 10)]) == 15  # in any order


def test_a_profiled_decode_step_against_its_floor() -> None:
    def event(cat: str, name: str, ts: float, dur: float) -> dict:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    trace = {"traceEvents": [
        event("kernel", "gemm", 0, 400), event("kernel", "attention", 300, 300),  # 100 us overlap
        event("gpu_memcpy", "Memcpy HtoD", 1000, 100), event("kernel", "gemm", 2000, 600),
        event("cuda_runtime", "cudaLaunchKernel", 0, 5),
        event("cuda_runtime", "cudaLaunchKernel", 1, 5),
        event("cuda_runtime", "cudaGraphLaunch", 1500, 5), event("cpu_op", "aten::mm", 0, 50),
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 0},  # not a span: ignored
    ]}
    profile = DecodeProfile(num_seqs=4, steps=2, wall_s=4e-3, context_tokens=[100, 104],
                            all_decode=True, trace=trace)
    report = profile.report(weights_bytes=1_000_000, kv_bytes_per_token=1_000, copy_bw=1e9)
    assert report["kernel_ms"] == pytest.approx(1.4 / 2)  # 400 + 300 + 100 + 600 us, 2 steps
    assert report["busy_fraction"] == pytest.approx(1.4e-3 / 4e-3)
    assert report["busy_fraction_union"] == pytest.approx(1.3e-3 / 4e-3)
    assert report["kernels_per_step"] == 1.5 and report["launch_calls_per_step"] == 1.5
    assert report["step_ms"] == pytest.approx(2.0)
    assert report["floor_bytes"] == 1_000_000 + 1_000 * 102
    assert report["floor_ms"] == pytest.approx(1.102)
    assert report["step_over_floor"] == pytest.approx(2.0 / 1.102)
    assert report["kernels_over_floor"] == pytest.approx(0.7 / 1.102)
    assert "floor_ms" not in profile.report(1_000_000, 1_000, copy_bw=None)


def test_kv_bytes_per_token() -> None:
    # Qwen3-0.6B: 28 layers x (K and V) x 8 KV heads x head_dim 128 (not 1024 / 16) x 2 bytes.
    assert kv_bytes_per_token(QWEN3_0_6B, torch.bfloat16) == 28 * 2 * 8 * 128 * 2
    assert kv_bytes_per_token(LLAMA3_8B, torch.bfloat16) == 32 * 2 * 8 * 128 * 2
