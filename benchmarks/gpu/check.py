"""GPU check of the Triton kernels: their tests on CUDA, decode and prefill timings, and the
compiled-resource table read back from the loaded kernels.

    python benchmarks/gpu/check.py               # everything, < 8 minutes on one H100/H200
    python benchmarks/gpu/check.py --skip-tests  # timings, resources and throughput only
    TRITON_INTERPRET=1 python benchmarks/gpu/check.py --smoke  # CPU: tiny shapes, no timings
    benchmarks/gpu/run_on_device.sh              # beside the machine's own torch, results to $OUT

1. Runs `tests/test_kernels_*.py` with Triton compiling for the GPU (`TRITON_INTERPRET=0`), so
   every kernel is checked against dense attention on the device it is meant for.
2. Measures the card's copy bandwidth in the same run: a large device-to-device tensor copy,
   counting the bytes read plus the bytes written.
3. Paged decode (the split-K kernel) against dense `scaled_dot_product_attention` decode on the
   same contexts (the dense side holds each sequence's K/V contiguously, as a reserve-max cache
   would). Achieved bandwidth = bytes of K/V read / time. Targets (issue #5), for batch 64,
   context 4096, 32 heads, head dim 128, float16: at least 70% of the measured copy bandwidth,
   and at most 1.3x the dense time (the vLLM paper's kernel was 20-26% slower than its dense
   baseline, Kwon et al. SOSP'23, section 7.1).
4. Prefill TFLOP/s of the varlen paged prefill kernel, next to causal dense SDPA on the same
   prompts, and for a prefix-cache hit (few new queries over a long cached context).
5. The resource table of `benchmarks/gpu/kernel_resources.py` on the device: every program of
   `minipaged.kernels.triton.aot.CONFIGURATIONS` is compiled ahead of time for this card's
   architecture (in parallel, which also fills Triton's cache), then launched by the launchers
   themselves; the registers and spills the driver reports for each loaded kernel must equal the
   ahead-of-time numbers, and the loaded cubin must be the ahead-of-time one (same bytes).
6. The engine's offline throughput (`benchmarks/gpu/throughput.py`: nano-vllm's workload on a
   Qwen3-0.6B-shaped model against transformers, a profiled decode step against its memory
   floor at the copy bandwidth of step 2, an 8B-shaped model), unless `--skip-throughput`.

Writes `benchmarks/results/gpu_<gpu name>.json` with the command, machine and date, and exits
non-zero when a test fails or a target is missed. Without CUDA it says so and exits with 2.
`--smoke` runs the same set-up and agreement checks on tiny shapes through Triton's interpreter
on CPU, and the throughput benchmark on tiny models (wall-clock times meaningless, nothing
written): it checks these scripts, not the GPU.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

import torch
from tqdm import tqdm

from machine import report_header, save_report
from minipaged import kernels
from minipaged.kernels.triton.decode import decode_launches

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
# The Triton kernels' tests, and the CUDA platform's (CUDA graphs against eager steps, the KV
# budget after a profile), which a CPU-only test run skips.
KERNEL_TESTS = ["tests/kernels/triton/test_attention.py", "tests/kernels/triton/test_cache.py",
                "tests/kernels/triton/test_fused.py", "tests/platforms/cuda/test_cuda.py"]

# Targets of issue #5 for the headline decode case.
MIN_FRACTION_OF_COPY_BANDWIDTH = 0.70
MAX_RATIO_TO_DENSE = 1.3


@dataclass
class DecodeCase:
    """One decode step: `batch` sequences of `context` tokens, one new query each."""

    name: str
    batch: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 128
    block_size: int = 16
    dtype: str = "float16"
    headline: bool = False  # the case the targets apply to


@dataclass
class PrefillCase:
    """A varlen prefill: `batch` sequences, the last `new_tokens` of `context` are queries."""

    name: str
    batch: int
    context: int
    new_tokens: int
    num_heads: int = 32
    num_kv_heads: int = 32
    head_dim: int = 128
    block_size: int = 16
    dtype: str = "float16"


DECODE_CASES = [
    DecodeCase("MHA, the target", 64, 4096, 32, 32, headline=True),
    DecodeCase("GQA 4 (8 KV heads)", 64, 4096, 32, 8),
    DecodeCase("few long sequences (split-K)", 4, 16384, 32, 8),
    DecodeCase("bf16, block 32", 64, 2048, 32, 32, block_size=32, dtype="bfloat16"),
]
PREFILL_CASES = [
    PrefillCase("8 prompts of 2048", 8, 2048, 2048),
    PrefillCase("GQA 4, 4 prompts of 4096", 4, 4096, 4096, num_kv_heads=8),
    PrefillCase("prefix hit: 512 new over 4096", 8, 4096, 512),
]


# --- the checks ------------------------------------------------------------------------------


def require_cuda() -> None:
    """Exit with a clear message unless a CUDA GPU is usable."""
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU is available (torch.cuda.is_available() is False).\n"
              "It times the Triton kernels on a GPU; on CPU, run the kernel tests instead:\n"
              "    pytest tests/kernels/triton/test_attention.py "
              "tests/kernels/triton/test_cache.py",
              file=sys.stderr)
        sys.exit(2)


def run_kernel_tests(workers: int) -> dict:
    """pytest on the kernel test files, with Triton compiling for the GPU."""
    env = dict(os.environ, TRITON_INTERPRET="0")  # conftest only sets it when unset
    cmd = [sys.executable, "-m", "pytest", "-q", *KERNEL_TESTS]
    if workers > 1:
        cmd += ["-n", str(workers)]  # compilation is CPU-bound: spread it over processes
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, text=True, capture_output=True)
    print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n", flush=True)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-200:]
    return {"command": " ".join(cmd), "returncode": proc.returncode, "summary": summary}


def bench_ms(fn) -> float:
    """Median milliseconds of `fn` (CUDA events, L2 flushed between runs)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def copy_bandwidth(gib: float = 2.0) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write bytes / time)."""
    numel = int(gib * 2**30) // 2
    src = torch.empty(numel, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * numel * 2 / (ms * 1e-3)


def paged_from_dense(k: torch.Tensor, v: torch.Tensor, block_size: int, gen: torch.Generator):
    """The same K/V ([B, H_kv, L, D]) scattered into shuffled blocks of a paged cache."""
    batch, num_kv_heads, context, head_dim = k.shape
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq + 16
    order = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per_seq].to(k.device)
    block_tables = order.view(batch, blocks_per_seq).to(torch.int32)
    padded = blocks_per_seq * block_size

    def scatter(x: torch.Tensor) -> torch.Tensor:
        cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim,
                            dtype=x.dtype, device=x.device)
        x = torch.nn.functional.pad(x.transpose(1, 2), (0, 0, 0, 0, 0, padded - context))
        cache[block_tables.long()] = x.reshape(batch, blocks_per_seq, block_size,
                                               num_kv_heads, head_dim)
        return cache

    return scatter(k), scatter(v), block_tables


def time_decode(case: DecodeCase, copy_bw: float, device: str, timer: Callable) -> dict:
    """Paged decode vs dense SDPA decode on the same contexts; checks they agree."""
    dtype = getattr(torch, case.dtype)
    gen = torch.Generator().manual_seed(0)
    b, h, hkv, d, n = case.batch, case.num_heads, case.num_kv_heads, case.head_dim, case.context
    q = torch.randn(b, h, d, generator=gen).to(device, dtype)
    k = torch.randn(b, hkv, n, d, generator=gen).to(device, dtype)
    v = torch.randn(b, hkv, n, d, generator=gen).to(device, dtype)
    k_cache, v_cache, block_tables = paged_from_dense(k, v, case.block_size, gen)
    seq_lens = torch.full((b,), n, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)
    scale = d**-0.5

    def paged():
        return kernels.paged_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                       query_start_loc, scale, max_query_len=1,
                                       max_seq_len=n, validate=False)

    def dense():
        return torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None], k, v, scale=scale, enable_gqa=hkv != h)[:, :, 0]

    torch.testing.assert_close(paged().float(), dense().float(), rtol=2e-2, atol=2e-2)
    paged_ms, dense_ms = timer(paged), timer(dense)
    kv_bytes = 2 * k.numel() * k.element_size()
    achieved = kv_bytes / (paged_ms * 1e-3)
    _, (partitions, _) = decode_launches(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_seq_len=n)
    result = {
        **asdict(case),
        "num_splits": partitions.grid[2],  # the grid is (sequences, KV heads, splits)
        "paged_ms": paged_ms,
        "dense_sdpa_ms": dense_ms,
        "paged_over_dense": paged_ms / dense_ms,
        "kv_bytes": kv_bytes,
        "paged_bytes_per_s": achieved,
        "fraction_of_copy_bandwidth": achieved / copy_bw,
    }
    if case.headline:
        result["meets_bandwidth_target"] = achieved / copy_bw >= MIN_FRACTION_OF_COPY_BANDWIDTH
        result["meets_dense_ratio_target"] = paged_ms / dense_ms <= MAX_RATIO_TO_DENSE
    return result


def causal_flops(query_len: int, context: int, num_heads: int, head_dim: int) -> float:
    """FLOPs of causal attention for the last `query_len` positions of a `context`: 2 matmuls of
    2 * head_dim FLOPs per visible (query, key) pair."""
    first = context - query_len + 1  # keys visible to the first query
    pairs = query_len * (first + context) / 2
    return 4.0 * head_dim * num_heads * pairs


def time_prefill(case: PrefillCase, device: str, timer: Callable) -> dict:
    """Paged varlen prefill TFLOP/s; dense causal SDPA beside it on the same prompts."""
    dtype = getattr(torch, case.dtype)
    gen = torch.Generator().manual_seed(0)
    b, h, hkv, d = case.batch, case.num_heads, case.num_kv_heads, case.head_dim
    n, m = case.context, case.new_tokens
    k = torch.randn(b, hkv, n, d, generator=gen).to(device, dtype)
    v = torch.randn(b, hkv, n, d, generator=gen).to(device, dtype)
    q = torch.randn(b, h, m, d, generator=gen).to(device, dtype)
    k_cache, v_cache, block_tables = paged_from_dense(k, v, case.block_size, gen)
    seq_lens = torch.full((b,), n, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(0, (b + 1) * m, m, dtype=torch.int32, device=device)
    flat_q = q.transpose(1, 2).reshape(b * m, h, d).contiguous()
    scale = d**-0.5

    def paged():
        return kernels.paged_attention(flat_q, k_cache, v_cache, block_tables, seq_lens,
                                       query_start_loc, scale, max_query_len=m,
                                       max_seq_len=n, validate=False)

    # Dense SDPA's causal mask is aligned to the top-left corner; the queries here are the last
    # m positions, so pass an explicit bottom-right-aligned mask when m < n.
    mask = None
    if m < n:
        mask = torch.ones(m, n, dtype=torch.bool, device=device).tril(diagonal=n - m)

    def dense():
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
            enable_gqa=hkv != h)

    want = dense().transpose(1, 2).reshape(b * m, h, d)
    torch.testing.assert_close(paged().float(), want.float(), rtol=2e-2, atol=2e-2)
    paged_ms, dense_ms = timer(paged), timer(dense)
    flops = b * causal_flops(m, n, h, d)
    return {
        **asdict(case),
        "paged_ms": paged_ms,
        "dense_sdpa_ms": dense_ms,
        "flops": flops,
        "paged_tflops": flops / (paged_ms * 1e-3) / 1e12,
        "dense_sdpa_tflops": flops / (dense_ms * 1e-3) / 1e12,
    }


def device_resources(workers: int) -> dict:
    """Registers and spills of every program, ahead of time and as loaded on this GPU."""
    from minipaged.kernels.triton import aot

    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    if arch not in aot.ARCHS:
        return {"arch": arch, "skipped": f"no ahead-of-time table for {arch}"}
    programs = aot.compile_programs(aot.plan_programs(aot.CONFIGURATIONS, [arch]), workers)
    ahead = {p.key: p.resources for p in programs}
    by_key: dict[str, dict] = {}
    for config in aot.CONFIGURATIONS:
        for launch in aot.configuration_launches(config, device="cuda"):
            key = aot.program_key(launch, arch)
            if key in by_key:
                continue
            loaded = launch()  # Triton's JIT: compiles (or finds in its cache) and launches
            by_key[key] = {
                "key": key, "kernel": launch.name, "configuration": config.name,
                "aot_registers": ahead[key].get("registers"), "device_registers": loaded.n_regs,
                "device_spills": loaded.n_spills,
                "same_binary": aot.cubin_hash(loaded.kernel) == ahead[key].get("cubin_sha256"),
            }
    torch.cuda.synchronize()
    rows = list(by_key.values())
    mismatches = [r for r in rows if r["device_spills"] or not r["same_binary"]
                  or r["device_registers"] != r["aot_registers"]]
    return {"arch": arch, "programs": rows, "mismatches": mismatches}


# --- report ----------------------------------------------------------------------------------


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia_h200' (the results file name)."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "gpu"


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """Rows as a fixed-width table; columns are (key, header, format)."""
    widths = [max(len(header), 12) for _, header, _ in columns]
    print("  ".join(h.rjust(w) for (_, h, _), w in zip(columns, widths, strict=True)))
    for row in rows:
        cells = [format(row[key], fmt) if key in row else "-" for key, _, fmt in columns]
        print("  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)))


def wall_ms(fn) -> float:
    """Milliseconds of one call by the wall clock: for --smoke, where times mean nothing."""
    import time

    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def shrink(case, **sizes):
    """A tiny copy of a case for --smoke (same code path, interpreter-sized)."""
    return replace(case, **sizes)


def smoke() -> int:
    """Set-up and agreement checks of every case on tiny shapes, on CPU through the interpreter;
    then every part of the throughput benchmark on tiny models."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        print("gpu_check --smoke runs on CPU: set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    for case in DECODE_CASES:
        small = shrink(case, batch=2, context=37, num_heads=case.num_heads // 8,
                       num_kv_heads=max(case.num_kv_heads // 8, 1), head_dim=32)
        row = time_decode(small, copy_bw=1.0, device="cpu", timer=wall_ms)
        print("decode ok:", case.name, f"(splits {row['num_splits']})")
    for case in PREFILL_CASES:
        full_prompt = case.new_tokens == case.context
        small = shrink(case, batch=2, context=40, new_tokens=40 if full_prompt else 9,
                       num_heads=4, num_kv_heads=4 * case.num_kv_heads // case.num_heads,
                       head_dim=32)
        row = time_prefill(small, device="cpu", timer=wall_ms)
        print("prefill ok:", case.name, f"({row['flops']:.3g} FLOPs)")
    from gpu import throughput

    failed = throughput.failed_parts(throughput.smoke())
    print("throughput failed:" if failed else "throughput ok", *failed)
    return 1 if failed else 0


def engine_throughput(copy_bw: float, trace: Path | None, failures: list[str]) -> dict:
    """gpu/throughput.py's run at the copy bandwidth measured here; a part of the engine that
    failed is a failure of the check (the transformers baselines' failures are only reported)."""
    from gpu import throughput
    from gpu.random_models import LLAMA3_8B

    report = throughput.run(big=LLAMA3_8B, copy_bw=copy_bw, trace=trace)
    throughput.print_table(report)
    failures += [f"throughput: {part} failed: {report[part]['error']}"
                 for part in throughput.failed_parts(report) if part in ("minipaged", "big")]
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-tests", action="store_true", help="timings and resources only")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                        help="pytest-xdist workers for the kernel tests (1: no xdist)")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU + TRITON_INTERPRET=1: tiny shapes, checks this script only")
    parser.add_argument("--skip-throughput", action="store_true",
                        help="no offline throughput benchmark (gpu/throughput.py)")
    parser.add_argument("--trace", type=Path, default=None,
                        help="write the throughput run's profiled decode steps here (Chrome trace)")
    args = parser.parse_args(argv)
    if args.smoke:
        return smoke()
    require_cuda()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("gpu_check: unset TRITON_INTERPRET: the interpreter would time Python, not the GPU",
              file=sys.stderr)
        return 2

    device_name = torch.cuda.get_device_name(0)
    report: dict = {
        **report_header(cuda=torch.version.cuda, triton=__import__("triton").__version__),
        "gpu": device_name,
    }
    failures: list[str] = []

    if not args.skip_tests:
        workers = args.workers
        try:
            import xdist  # noqa: F401
        except ImportError:
            workers = 1
        report["tests"] = run_kernel_tests(workers)
        if report["tests"]["returncode"] != 0:
            failures.append(f"kernel tests failed: {report['tests']['summary']}")

    copy_bw = copy_bandwidth()
    report["copy_bandwidth_bytes_per_s"] = copy_bw
    print(f"\n{device_name}: device-to-device copy {copy_bw / 1e9:.0f} GB/s")

    decode = [time_decode(c, copy_bw, "cuda", bench_ms) for c in tqdm(DECODE_CASES, desc="decode")]
    report["decode"] = decode
    print("\nDecode (one query per sequence): paged split-K kernel vs dense SDPA")
    print_table(decode, [("name", "case", ""), ("batch", "batch", "d"), ("context", "context", "d"),
                         ("num_splits", "splits", "d"), ("paged_ms", "paged ms", ".3f"),
                         ("dense_sdpa_ms", "dense ms", ".3f"),
                         ("paged_over_dense", "paged/dense", ".2f"),
                         ("fraction_of_copy_bandwidth", "of copy bw", ".0%")])

    prefill = [time_prefill(c, "cuda", bench_ms) for c in tqdm(PREFILL_CASES, desc="prefill")]
    report["prefill"] = prefill
    print("\nPrefill (causal, varlen, one launch): paged kernel vs dense SDPA")
    print_table(prefill, [("name", "case", ""), ("paged_ms", "paged ms", ".3f"),
                          ("dense_sdpa_ms", "dense ms", ".3f"),
                          ("paged_tflops", "paged TFLOP/s", ".1f"),
                          ("dense_sdpa_tflops", "dense TFLOP/s", ".1f")])

    resources = device_resources(os.cpu_count() or 1)
    report["resources"] = resources
    if "skipped" in resources:
        print(f"\nresources: {resources['skipped']}")
    else:
        rows = resources["programs"]
        print(f"\nResources on {resources['arch']}: {len(rows)} programs, "
              f"{sum(r['same_binary'] for r in rows)} the ahead-of-time binary, "
              f"{len(resources['mismatches'])} differing or spilling")
        for r in resources["mismatches"]:
            failures.append(f"resources differ on the device: {r}")

    headline = next(r for r in decode if r["headline"])
    targets = {
        "decode_fraction_of_copy_bandwidth": {
            "value": headline["fraction_of_copy_bandwidth"],
            "target": f">= {MIN_FRACTION_OF_COPY_BANDWIDTH}",
            "met": headline["meets_bandwidth_target"]},
        "decode_paged_over_dense": {
            "value": headline["paged_over_dense"], "target": f"<= {MAX_RATIO_TO_DENSE}",
            "met": headline["meets_dense_ratio_target"]},
    }
    report["targets"] = targets
    print()
    for name, t in targets.items():
        print(f"{name}: {t['value']:.3f} (target {t['target']}): {'MET' if t['met'] else 'MISSED'}")
        if not t["met"]:
            failures.append(f"target missed: {name}")

    if not args.skip_throughput:
        report["throughput"] = engine_throughput(copy_bw, args.trace, failures)

    path = RESULTS / f"gpu_{gpu_slug(device_name)}.json"
    report["failures"] = failures
    save_report(path, report)
    print(f"\nwrote {path.relative_to(ROOT)}")
    for f in failures:
        print("FAILED:", f, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
