"""Registers, spills, shared memory, tensor-core use and occupancy of every Triton program the
launchers use on a GPU, read from Triton's compiler on a machine without one.

    python benchmarks/gpu/kernel_resources.py               # all configurations, sm_80 and sm_90
    python benchmarks/gpu/kernel_resources.py --workers 2   # compile in 2 processes

`minipaged.kernels.triton.aot` plans the launches of every configuration of `aot.CONFIGURATIONS`
(cache dtypes float32 / float16 / bfloat16, head dims 64, 128 and 256, GQA groups 1, 3, 4 and 8,
block sizes 16 and 32, each with the tiles and warps the launchers pick on a GPU), compiles each
distinct program for sm_80 and sm_90 and reads its cubin. Occupancy is computed as CUDA's
occupancy calculator does, from the published per-SM limits of an A100 (for sm_80) and an H100
(for sm_90): the fewest blocks per SM that registers, shared memory, warps and the block limit
allow. The decode roofline (`decode_roofline`) puts the bytes and FLOPs of a decode step next
to each card's HBM bandwidth and tensor-core rate. Writes
`benchmarks/results/kernel_resources.json`; prints the summary table of
docs/performance-gpu.md.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

import torch

from gpu.check import DECODE_CASES, DecodeCase
from machine import report_header, save_report
from minipaged.kernels.triton.decode import split_count
from minipaged.kernels.triton.launch import MIN_DOT_SIZE, default_key_tile, pow2_at_least

RESULTS = Path(__file__).resolve().parents[1] / "results" / "kernel_resources.json"
KiB = 1024


@dataclass(frozen=True)
class Gpu:
    """Per-SM limits and peak rates of one card.

    Limits: CUDA C++ Programming Guide, "Technical Specifications per Compute Capability"
    (compute capability 8.0 and 9.0: 64K 32-bit registers, at most 64 resident warps and 32
    resident blocks per SM, 255 registers per thread, 1 KB of shared memory reserved per block),
    and the NVIDIA A100 (2020) and H100 (2022) Tensor Core GPU Architecture whitepapers
    (SM counts, shared memory per SM and per block, HBM bandwidth, dense tensor-core rates).
    """

    name: str
    arch: str
    sms: int
    shared_per_sm: int  # bytes of shared memory an SM can give its blocks
    shared_per_block: int  # the most one block may ask for (opt-in)
    hbm_bytes_per_s: float
    fp16_flops: float  # dense float16 / bfloat16 tensor-core FLOP/s
    tf32_flops: float  # dense TF32 tensor-core FLOP/s
    registers_per_sm: int = 65536
    register_unit: int = 256  # registers are allocated to a warp in units of 256
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    reserved_shared_per_block: int = 1 * KiB


A100 = Gpu("A100 SXM4 80GB", "sm_80", sms=108, shared_per_sm=164 * KiB,
           shared_per_block=163 * KiB, hbm_bytes_per_s=2.039e12, fp16_flops=312e12,
           tf32_flops=156e12)
H100 = Gpu("H100 SXM5 80GB", "sm_90", sms=132, shared_per_sm=228 * KiB,
           shared_per_block=227 * KiB, hbm_bytes_per_s=3.35e12, fp16_flops=989.4e12,
           tf32_flops=494.7e12)
GPUS = {gpu.arch: gpu for gpu in (A100, H100)}


def occupancy(registers: int, shared_bytes: int, num_warps: int, gpu: Gpu) -> dict:
    """Resident blocks and warps per SM of a program, and which resource limits them."""
    regs_per_warp = math.ceil(registers * 32 / gpu.register_unit) * gpu.register_unit
    shared = shared_bytes + gpu.reserved_shared_per_block
    limits = {
        "registers": gpu.registers_per_sm // regs_per_warp // num_warps,
        "shared memory": gpu.shared_per_sm // shared if shared <= gpu.shared_per_block else 0,
        "warps": gpu.max_warps_per_sm // num_warps,
        "blocks": gpu.max_blocks_per_sm,
    }
    blocks = min(limits.values())
    return {"blocks_per_sm": blocks, "warps_per_sm": blocks * num_warps,
            "occupancy": round(blocks * num_warps / gpu.max_warps_per_sm, 3),
            "limited_by": min(limits, key=limits.get)}


ROWS_PER_GROUP = 16  # the decode kernel pads a KV head's query group to at least 16 rows
PV_PRODUCTS = {"float32": 3, "float16": 2, "bfloat16": 2}  # tf32x3; hi.V + lo.V (_tiles.py)
QK_PRODUCTS = {"float32": 3, "float16": 1, "bfloat16": 1}


def decode_roofline(case: DecodeCase, gpu: Gpu) -> dict:
    """Bytes and FLOPs of one decode step of one layer (a `gpu_check` case), against `gpu`'s
    HBM bandwidth and dense tensor-core rate.

    Bytes: K and V of every context token (the bulk), the queries and outputs, the block
    tables (read once per KV head), and the split-K partials (float32 out + lse, written by
    stage 1 and read by stage 2) at the split count the launcher picks on `gpu`. FLOPs: the
    useful 4 * H * L * D of Q.K^T and P.V, and what the tensor cores execute: each KV head's
    group padded to 16 rows, and each product repeated as `_tiles.py` does it.
    """
    b, ctx, h, hkv, d = case.batch, case.context, case.num_heads, case.num_kv_heads, case.head_dim
    dtype = getattr(torch, case.dtype)
    elem = dtype.itemsize
    key_tile = default_key_tile(dtype, pow2_at_least(d, MIN_DOT_SIZE))
    splits = split_count(b, hkv, ctx, key_tile, gpu.sms)
    kv = 2 * b * ctx * hkv * d * elem
    q_out = 2 * b * h * d * elem
    tables = b * hkv * math.ceil(ctx / case.block_size) * 4
    partials = 2 * b * h * splits * (d + 1) * 4 if splits > 1 else 0
    total = kv + q_out + tables + partials
    useful = 4 * b * h * ctx * d
    rows = b * hkv * max(ROWS_PER_GROUP, h // hkv)
    executed = 2 * rows * ctx * d * (QK_PRODUCTS[case.dtype] + PV_PRODUCTS[case.dtype])
    rate = gpu.tf32_flops if dtype == torch.float32 else gpu.fp16_flops
    memory_s, tensor_s = total / gpu.hbm_bytes_per_s, executed / rate
    return {
        "case": case.name, "gpu": gpu.name, "num_splits": splits, "kv_bytes": kv,
        "other_bytes": total - kv, "useful_flops": useful, "tensor_core_flops": executed,
        "flops_per_byte": round(useful / total, 2),
        "machine_flops_per_byte": round(rate / gpu.hbm_bytes_per_s, 1),
        "memory_time_us": round(memory_s * 1e6, 1), "tensor_time_us": round(tensor_s * 1e6, 1),
        "kv_fraction_of_bytes": round(kv / total, 4),
        "tensor_time_over_memory_time": round(tensor_s / memory_s, 3),
    }


# --- the table --------------------------------------------------------------------------------


def tile_text(kernel: str, constexprs: dict[str, str]) -> str:
    """A program's tile in words: query rows x keys for attention, elements otherwise."""
    c = {k: int(v) for k, v in constexprs.items() if v.isdigit()}
    if kernel == "decode_partition":
        return f"{c['GROUP_PAD']} rows x {c['KEY_TILE']} keys"
    if kernel == "prefill":
        return f"{c['QUERY_TILE'] * c['GROUP_PAD']} rows x {c['KEY_TILE']} keys"
    if kernel == "decode_merge":
        return f"{c['SPLITS_PAD']} splits"
    if kernel in ("reshape_and_cache", "rotary_and_cache"):
        return f"{c['TOKEN_TILE']} tokens"
    if kernel in ("rms_norm", "add_rms_norm"):
        return f"{c['ROW_TILE']} rows"
    if kernel == "silu_and_mul":
        return f"{c['ROW_TILE'] * c['COL_TILE']} elements"
    return f"{c['CHUNK']} elements"


def program_rows(programs: list, configurations: dict) -> list[dict]:
    """One row per compiled program: its configuration's axes, resources and occupancy."""
    rows = []
    for p in programs:
        r = p.resources
        config = configurations[p.configurations[0]]
        row = {"key": p.key, "kernel": p.kernel, "arch": p.arch, "dtype": config.dtype,
               "head_dim": config.heads.head_dim, "group": config.heads.group,
               "block_size": config.block_size, "configurations": len(p.configurations),
               "tile": tile_text(p.kernel, p.constexprs), "num_warps": p.num_warps}
        if "error" in r:
            rows.append(row | {"error": r["error"]})
            continue
        shared = r["static_shared_bytes"] + r["dynamic_shared_bytes"]
        rows.append(row | {k: r[k] for k in (
            "registers", "stack_bytes", "local_bytes", "dots", "gpu_dots", "tensor_core_dots",
            "mma_instructions", "wgmma_instructions")} | {"shared_bytes": shared}
            | occupancy(r["registers"], shared, p.num_warps, GPUS[p.arch]))
    return rows


def column(rows: list[dict], key: str) -> list:
    """`key` of every row."""
    return [r[key] for r in rows]


def span(values: list) -> str:
    """'lo-hi' of `values`, or the one value they all have."""
    lo, hi = min(values), max(values)
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


KERNELS = ["decode_partition", "decode_merge", "prefill", "reshape_and_cache", "copy_blocks",
           "rms_norm", "add_rms_norm", "rotary_and_cache", "silu_and_mul"]


def summary_order(item: tuple) -> tuple:
    """Kernels in the order a step runs them, then arch, cache dtype, head dim."""
    (kernel, arch, cache, head_dim), _ = item
    return KERNELS.index(kernel), arch, cache != "16-bit", len(head_dim), head_dim


def tiles_text(tiles: list[str]) -> str:
    """Distinct tiles of a group: '16 rows x 64 keys', or '1/2/4 tokens' when they vary."""
    distinct = sorted(set(tiles), key=lambda t: int(t.split()[0]))
    if len(distinct) == 1:
        return distinct[0]
    unit = distinct[0].split(" ", 1)[1]
    return "/".join(t.split()[0] for t in distinct) + " " + unit


def summary(rows: list[dict]) -> list[dict]:
    """The attention kernels by arch, cache (float32 or 16-bit) and head dim; the data-movement
    kernels by arch. Ranges run over GQA groups, block sizes and the grouped dtypes."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        if row["kernel"] in ("decode_partition", "prefill"):
            cache = "float32" if row["dtype"] == "float32" else "16-bit"
            groups[row["kernel"], row["arch"], cache, str(row["head_dim"])].append(row)
        else:
            groups[row["kernel"], row["arch"], "all", "64, 128, 256"].append(row)
    out = []
    for (kernel, arch, cache, head_dim), members in sorted(groups.items(), key=summary_order):
        tensor = (f"{span(column(members, 'tensor_core_dots'))} of "
                  f"{span(column(members, 'gpu_dots'))}" if members[0]["dots"] else "-")
        out.append({
            "kernel": kernel, "arch": arch, "cache": cache, "head_dim": head_dim,
            "programs": len(members), "tiles": tiles_text(column(members, "tile")),
            "warps": span(column(members, "num_warps")),
            "registers": span(column(members, "registers")),
            "stack_bytes": span(column(members, "stack_bytes")),
            "shared_kib": span([round(v / KiB) for v in column(members, "shared_bytes")]),
            "tensor_core_dots": tensor, "occupancy": span(column(members, "occupancy")),
            "limited_by": ", ".join(sorted(set(column(members, "limited_by")))),
        })
    return out


COLUMNS = [("kernel", "kernel"), ("arch", "arch"), ("cache", "cache"), ("head_dim", "D"),
           ("tiles", "tiles"), ("warps", "warps"), ("registers", "REG"),
           ("stack_bytes", "STACK"), ("shared_kib", "shared KiB"),
           ("tensor_core_dots", "tensor-core dots"), ("occupancy", "occupancy"),
           ("limited_by", "limited by")]


def markdown(table: list[dict]) -> str:
    """The summary as the docs' markdown table."""
    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(t[k]) for k, _ in COLUMNS) + " |" for t in table]
    return "\n".join(lines)


def roofline_markdown(roofline: list[dict]) -> str:
    """The decode roofline as the docs' markdown table."""
    lines = ["| decode step (one layer) | GPU | splits | K/V MB | FLOP/byte (machine) | "
             "HBM time us | tensor-core time us |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['gpu']} | {r['num_splits']} | {r['kv_bytes'] / 1e6:.0f} | "
              f"{r['flops_per_byte']} ({r['machine_flops_per_byte']}) | {r['memory_time_us']} | "
              f"{r['tensor_time_us']} |" for r in roofline]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="compiling processes")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("kernel_resources: unset TRITON_INTERPRET (the compiler needs real kernels)",
              file=sys.stderr)
        return 2
    import triton

    from minipaged.kernels.triton import aot

    programs = aot.compile_programs(aot.plan_programs(aot.CONFIGURATIONS, aot.ARCHS),
                                    args.workers)
    rows = program_rows(programs, {c.name: c for c in aot.CONFIGURATIONS})
    table = summary(rows)
    roofline = [decode_roofline(c, g) for c in DECODE_CASES for g in GPUS.values()]
    print(markdown(table), roofline_markdown(roofline), sep="\n\n")
    failures = [r for r in rows if "error" in r or r["stack_bytes"] or r["local_bytes"]]
    for r in failures:
        print("FAILED:", r, file=sys.stderr)
    save_report(args.out, {
        **report_header(triton=triton.__version__),
        "triton": triton.__version__,
        "gpus": {arch: asdict(gpu) for arch, gpu in GPUS.items()},
        "configurations": [c.name for c in aot.CONFIGURATIONS],
        "summary": table,
        "decode_roofline": roofline,
        "programs": rows,
    })
    print(f"wrote {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
