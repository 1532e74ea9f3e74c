"""Paged decode (the PyTorch reference and its CPU arrangement) vs dense SDPA decode on CPU.

    .venv/bin/python benchmarks/cpu/attention.py            # batch 32, contexts 128/512/1024
    .venv/bin/python benchmarks/cpu/attention.py --dtype bfloat16 --layers 30 \
        --out benchmarks/results/attention_cpu_bf16_30_layers.json
    .venv/bin/python benchmarks/cpu/attention.py --contexts 512 --repeats 200
    .venv/bin/python benchmarks/cpu/attention.py --layers 30 \
        --out benchmarks/results/attention_cpu_30_layers.json

One decode step: each of `batch` sequences has one new query and a `context`-token context, with
the bundled model's head shapes (SmolLM2-135M: 9 query heads, 3 KV heads, head dim 64). The dense
baseline keeps each sequence's K/V contiguous (`[B, H_kv, L, D]`, what a reserve-max cache
holds) and calls `torch.nn.functional.scaled_dot_product_attention` with GQA. The paged side
stores the same K/V in shuffled blocks of a paged cache and calls
`minipaged.attention.reference.paged_attention` (the reference, in float32) and
`minipaged.platforms.cpu.attention.cpu_paged_attention`: `cpu`, the CPU backend as the engine
runs it (decodes in the native kernel of `minipaged.kernels.cpu.native`, reading blocks in
place), and `cpu_gathered`, the same backend where that kernel cannot be built (the reference's
plan and gather in the cache's dtype, query heads packed onto their KV head). The ratio paged /
dense is the price of reading K/V through block tables in plain PyTorch (the paper's CUDA kernel
paid 20-26%, Kwon et al. section 7.1).
`--dtype` sets the dtype of the cache, the queries and the dense side. `--compiled` adds an
attention that reads the blocks in place, never copying them out: the decode written as indexed
loads, a softmax and two reductions, compiled by `torch.compile` (Inductor's C++ backend) with
dynamic shapes -- the candidate the CPU path was measured against.

With `--layers N` each timed step attends N layers, each with its own K/V, as a decode step of
the model does: then no layer's K/V is still in the CPU's cache when it is read again, on either
side (with one layer, the dense side's K/V of 25 MB at context 512 can stay in a 32 MB L3).

Timings alternate dense and paged call by call, in an order shuffled every repeat, and count this
thread's CPU time, so that load from other processes hits both alike; the table reports medians
and the median of per-pair ratios. Writes `benchmarks/results/attention_cpu.json` (or `--out`).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

import torch
import torch.nn.functional as F
from tqdm import tqdm

from cpu.roofline import cpu_features
from machine import report_header, save_report
from minipaged.attention.reference import gather_context, paged_attention, plan_attention
from minipaged.platforms import DTYPES
from minipaged.platforms.cpu.attention import cpu_paged_attention, plan_cpu_attention
from minipaged.testing.paged_examples import tolerance

# SmolLM2-135M-Instruct's attention shape.
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64
RESULTS = Path(__file__).resolve().parents[1] / "results" / "attention_cpu.json"


def make_inputs(batch: int, context: int, block_size: int, seed: int = 0,
                dtype: torch.dtype = torch.float32) -> dict:
    """Contiguous K/V for the dense side and the same K/V scattered into shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, generator=gen).to(dtype)

    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq + 8  # a few spare blocks, as in a real pool
    block_tables = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per_seq]
    block_tables = block_tables.view(batch, blocks_per_seq).int()
    padded = blocks_per_seq * block_size

    def to_cache(x: torch.Tensor) -> torch.Tensor:
        cache = torch.zeros(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
        x = F.pad(x.transpose(1, 2), (0, 0, 0, 0, 0, padded - context))  # [B, L_pad, H_kv, D]
        cache[block_tables.long()] = x.reshape(batch, blocks_per_seq, block_size, NUM_KV_HEADS,
                                               HEAD_DIM)
        return cache

    return {
        "q": q, "k": k, "v": v,
        "k_cache": to_cache(k), "v_cache": to_cache(v), "block_tables": block_tables,
        "seq_lens": torch.full((batch,), context, dtype=torch.int32),
        "query_start_loc": torch.arange(batch + 1, dtype=torch.int32),
        "scale": HEAD_DIM**-0.5,
    }


def dense_decode(x: dict) -> torch.Tensor:
    out = F.scaled_dot_product_attention(x["q"][:, :, None], x["k"], x["v"], scale=x["scale"],
                                         enable_gqa=True)
    return out[:, :, 0]


def paged_decode(x: dict, validate: bool, fn=paged_attention, **plan) -> torch.Tensor:
    return fn(
        x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"],
        x["query_start_loc"], x["scale"],
        max_query_len=1, max_seq_len=int(x["seq_lens"].max()), validate=validate, **plan,
    )


def cpu_plans(x: dict) -> dict:
    """The CPU backend's plans of `x`, made once per step as the engine does: native decodes,
    and gathered ones."""
    args = (x["block_tables"], x["seq_lens"], x["query_start_loc"], x["k_cache"])
    return {"cpu": plan_cpu_attention(*args),
            "cpu_gathered": plan_cpu_attention(*args, native=False)}


def in_place_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Decode attention reading K/V through the block table in place (for `torch.compile`,
    which fuses the indexed loads into the reductions instead of materialising a gather)."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    pos = torch.arange(block_tables.shape[1] * block_size, device=q.device)
    blocks, offsets = block_tables[:, pos // block_size].long(), pos % block_size
    keys = k_cache[blocks, offsets].permute(0, 2, 1, 3)  # [B, H_kv, L, D]: fused, not copied
    values = v_cache[blocks, offsets].permute(0, 2, 1, 3)
    grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim).float()
    scores = (grouped[:, :, :, None, :] * keys[:, :, None].float()).sum(-1) * scale
    scores = scores.masked_fill((pos[None] >= seq_lens[:, None])[:, None, None, :], float("-inf"))
    out = (scores.softmax(-1)[..., None] * values[:, :, None].float()).sum(-2)
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)


def gather_only(x: dict) -> None:
    """The part of `paged_decode` that dense attention does not do: planning the chunks of
    sequences and copying K and V out of their blocks, chunk by chunk, as the reference does."""
    plan = plan_attention(x["block_tables"], x["seq_lens"], x["query_start_loc"], x["k_cache"])
    for chunk in plan:
        gather_context(x["k_cache"], x["v_cache"], chunk)


def bench(batch: int, context: int, block_size: int, repeats: int, layers: int,
          dtype: torch.dtype = torch.float32, compiled=None) -> dict:
    """Times of one decode step's attention over `layers` layers, each with its own K/V."""
    xs = [make_inputs(batch, context, block_size, layer, dtype) for layer in range(layers)]
    for x in xs:
        expected = dense_decode({**x, **{n: x[n].float() for n in ("q", "k", "v")}})
        x["plans"] = cpu_plans(x)
        assert x["plans"]["cpu"].decodes is not None  # the kernel is built here
        torch.testing.assert_close(paged_decode(x, True).float(), expected, **tolerance(dtype))
        for plan in x["plans"].values():
            torch.testing.assert_close(
                paged_decode(x, True, cpu_paged_attention, plan=plan).float(), expected,
                **tolerance(dtype),
            )

    def every_layer(fn: Callable[[dict], object]) -> Callable[[], None]:
        def step() -> None:
            for x in xs:
                fn(x)

        return step

    fns = {
        "dense": every_layer(dense_decode),
        "paged": every_layer(lambda x: paged_decode(x, False)),
        "paged_validated": every_layer(lambda x: paged_decode(x, True)),
        "gather": every_layer(gather_only),
        "cpu": every_layer(
            lambda x: paged_decode(x, False, cpu_paged_attention, plan=x["plans"]["cpu"])
        ),
        "cpu_gathered": every_layer(
            lambda x: paged_decode(x, False, cpu_paged_attention, plan=x["plans"]["cpu_gathered"])
        ),
    }
    if compiled is not None:
        def run_compiled(x: dict) -> torch.Tensor:
            return compiled(x["q"], x["k_cache"], x["v_cache"], x["block_tables"],
                            x["seq_lens"], x["scale"])

        torch.testing.assert_close(run_compiled(xs[0]).float(), dense_decode(
            {**xs[0], **{n: xs[0][n].float() for n in ("q", "k", "v")}}), **tolerance(dtype))
        fns["compiled_in_place"] = every_layer(run_compiled)
    for fn in fns.values():  # warm up
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    names, shuffler = list(fns), random.Random(0)
    for _ in tqdm(range(repeats), desc=f"B={batch} L={context}", leave=False):
        # A fresh order each repeat, so that each function runs about as often right after each
        # other one: what the previous call left in the CPU's cache moved a fixed order's ratios
        # by ~5%.
        shuffler.shuffle(names)
        for name in names:
            start = time.thread_time()
            fns[name]()
            times[name].append((time.thread_time() - start) / layers)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    ratio = statistics.median(p / d for p, d in zip(times["paged"], times["dense"], strict=True))
    ratio_validated = statistics.median(
        p / d for p, d in zip(times["paged_validated"], times["dense"], strict=True)
    )
    ratio_cpu = statistics.median(c / p for c, p in zip(times["cpu"], times["paged"],
                                                         strict=True))
    ratio_gathered = statistics.median(
        c / p for c, p in zip(times["cpu_gathered"], times["paged"], strict=True)
    )
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize
    return {
        "batch": batch, "context": context, "block_size": block_size, "layers": layers,
        "dense_ms": ms["dense"], "paged_ms": ms["paged"],
        "paged_validated_ms": ms["paged_validated"], "gather_ms": ms["gather"],
        "cpu_ms": ms["cpu"], "ratio_cpu_over_paged": ratio_cpu,
        "cpu_gathered_ms": ms["cpu_gathered"], "ratio_cpu_gathered_over_paged": ratio_gathered,
        "cpu_kv_gbs": kv_bytes / (ms["cpu"] / 1e3) / 1e9,
        **({"compiled_in_place_ms": ms["compiled_in_place"]} if compiled is not None else {}),
        "ratio_paged_over_dense": ratio, "ratio_validated_over_dense": ratio_validated,
        "dense_min_ms": min(times["dense"]) * 1e3, "paged_min_ms": min(times["paged"]) * 1e3,
        "kv_megabytes": kv_bytes / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--layers", type=int, default=1,
                        help="layers per timed step, each with its own K/V (SmolLM2 has 30): "
                             "with 1, the same K/V is read again and again and may stay in the "
                             "CPU's cache; with 30, as in a real decode step, it cannot")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice); 1 is steadier on a "
                             "machine shared with other jobs")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--compiled", action="store_true",
                        help="also time the in-place attention compiled by torch.compile")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    dtype = DTYPES[args.dtype]
    compiled = torch.compile(in_place_decode, dynamic=True) if args.compiled else None
    with torch.inference_mode():
        rows = [bench(args.batch, c, args.block_size, args.repeats, args.layers, dtype, compiled)
                for c in args.contexts]
    print(f"\npaged decode (torch reference) vs dense SDPA decode, batch {args.batch}, "
          f"{NUM_HEADS} heads / {NUM_KV_HEADS} KV heads / dim {HEAD_DIM}, "
          f"block size {args.block_size}, {torch.get_num_threads()} threads, {args.dtype}, "
          f"{args.layers} layer(s) per step, ms per layer")
    header = (f"{'context':>8} {'KV MB':>7} {'dense ms':>9} {'paged ms':>9} {'paged/dense':>12} "
              f"{'of which gather':>16} {'validated ms':>13} {'validated/dense':>16} "
              f"{'cpu ms':>7} {'cpu/paged':>10} {'cpu GB/s':>9} {'gathered ms':>12} "
              f"{'gathered/paged':>15}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['context']:>8} {r['kv_megabytes']:>7.1f} {r['dense_ms']:>9.3f} "
              f"{r['paged_ms']:>9.3f} {r['ratio_paged_over_dense']:>11.2f}x "
              f"{r['gather_ms']:>13.3f} ms "
              f"{r['paged_validated_ms']:>13.3f} {r['ratio_validated_over_dense']:>15.2f}x "
              f"{r['cpu_ms']:>7.3f} {r['ratio_cpu_over_paged']:>9.2f}x {r['cpu_kv_gbs']:>9.1f} "
              f"{r['cpu_gathered_ms']:>12.3f} {r['ratio_cpu_gathered_over_paged']:>14.2f}x"
              + (f"  compiled in place {r['compiled_in_place_ms']:.3f} ms"
                 if "compiled_in_place_ms" in r else ""))

    result = {
        **report_header(**cpu_features()),
        "shapes": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                   "dtype": args.dtype},
        "method": "this thread's CPU time per layer, medians over alternating calls; "
                  "ratio = median of per-pair ratios",
        "results": rows,
    }
    save_report(args.out, result)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
