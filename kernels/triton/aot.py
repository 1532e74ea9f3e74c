"""The kernels compiled ahead of time for real GPUs, on a machine without one.

Triton's compiler needs no GPU: `triton.compile(ASTSource(...), target=GPUTarget("cuda", 90,
32))` lowers a `@triton.jit` function to PTX, and the `ptxas` inside the Triton wheel assembles
it into a cubin for that architecture. This module asks each launcher for the launches it makes
on a GPU (its `*_launches` planner, run on meta tensors: shapes, strides and dtypes without
memory), specialises their arguments with Triton's own JIT binder, so that the compiled program
is the one a launch compiles, and compiles them for sm_80 (A100) and sm_90 (H100, H200). From
the result it reads what the interpreter cannot say: registers per thread, stack, local and
shared memory (`cuobjdump --dump-resource-usage`), and whether each `tl.dot` became
tensor-core instructions (`mma` / `wgmma`).

The compiler needs the real `@triton.jit` functions, so `TRITON_INTERPRET` must be unset when
this module is imported. `python -m minipaged.kernels.triton.aot --out FILE` writes the records as
JSON: that is how the tests, whose process runs the interpreter, reach it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from .copy_blocks import copy_blocks_launches
from .decode import decode_launches
from .fused import rms_norm_launches, silu_mul_launches
from .launch import KernelLaunch, interpreting
from .prefill import prefill_launches
from .reshape_and_cache import reshape_and_cache_launches

# Compute capabilities compiled for: the A100 (Ampere) and the H100 / H200 (Hopper).
ARCHS = {"sm_80": 80, "sm_90": 90}
# The runner's index dtypes (`minipaged.runner.model_runner`): what the kernels are launched with.
SLOT_DTYPE = torch.int64
TABLE_DTYPE = torch.int32
# Any split count above 1: the kernels do not specialise on it, so one program serves all.
EXAMPLE_SPLITS = 4
# Kernels whose every `tl.dot` must become tensor-core instructions.
ATTENTION_KERNELS = ("decode_partition", "prefill")


@dataclass(frozen=True)
class HeadShape:
    """Query heads, KV heads and head dim of one attention layer."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class Configuration:
    """A layer shape, a cache block size and a cache dtype: what selects the launchers'
    programs on a GPU (their tile and warp choices follow from these)."""

    heads: HeadShape
    block_size: int
    dtype: str  # "float32", "float16" or "bfloat16"

    @property
    def name(self) -> str:
        return f"{self.heads.name}-d{self.heads.head_dim}/bs{self.block_size}/{self.dtype}"


@dataclass
class Program:
    """One distinct compiled program: a kernel specialised for one architecture, with the
    configurations that launch it and, once compiled, what it uses."""

    key: str  # hash of kernel source, arch, argument types and specialisations, constants, warps
    kernel: str
    arch: str
    constexprs: dict[str, str]
    num_warps: int
    configurations: list[str] = field(default_factory=list)
    resources: dict[str, Any] = field(default_factory=dict)  # filled by compiling


# GQA groups of the bundled model and of common ones, each at head dims 64, 128 and 256
# (Gemma's).
GROUPS = {  # group -> (name, query heads, KV heads)
    1: ("mha", 32, 32),         # Llama-2-7B
    3: ("smollm2", 9, 3),       # SmolLM2-135M, the bundled model
    4: ("llama3-8b", 32, 8),
    8: ("llama3-70b", 64, 8),
}
HEAD_SHAPES = {(group, d): HeadShape(name, h, hkv, d)
               for group, (name, h, hkv) in GROUPS.items() for d in (64, 128, 256)}
CONFIGURATIONS = [Configuration(heads, bs, dtype)
                  for heads in HEAD_SHAPES.values() for bs in (16, 32)
                  for dtype in ("float32", "float16", "bfloat16")]
# A covering subset, small enough to compile in every test run: each cache dtype at each head
# dim (which set the tiles, warps and tensor-core instructions), every group and block size.
COVERING = [Configuration(HEAD_SHAPES[group, d], bs, dtype) for group, d, bs, dtype in [
    (1, 64, 16, "float32"), (3, 128, 32, "float32"),
    (4, 64, 16, "float16"), (8, 128, 32, "float16"),
    (3, 64, 16, "bfloat16"), (4, 128, 32, "bfloat16"),
    (1, 256, 32, "float32"), (3, 256, 16, "float16"), (8, 256, 32, "bfloat16"),
]]


# --- the launches of one configuration -------------------------------------------------------


def configuration_launches(config: Configuration, device: str = "meta") -> list[KernelLaunch]:
    """Every launch the public launchers make for `config`: a decode step (partitions and
    merge), a prefill, the K/V write of a decode step, a copy-on-write block copy and the fused
    small operators of a layer (`layer_launches`).

    The inputs are zeros and one-token contexts (block 0, slot 0), so on a real device the
    launches can run as they are; on "meta" they only carry shapes, strides and dtypes.
    """
    if interpreting():
        raise RuntimeError("GPU launches are planned with TRITON_INTERPRET unset")
    heads, bs = config.heads, config.block_size
    dtype = getattr(torch, config.dtype)
    num_seqs, num_blocks, max_blocks = 4, 64, 64
    zeros = partial(torch.zeros, device=device)

    q = zeros(num_seqs, heads.num_heads, heads.head_dim, dtype=dtype)
    k_cache = zeros(num_blocks, bs, heads.num_kv_heads, heads.head_dim, dtype=dtype)
    v_cache = zeros(num_blocks, bs, heads.num_kv_heads, heads.head_dim, dtype=dtype)
    block_tables = zeros(num_seqs, max_blocks, dtype=TABLE_DTYPE)
    seq_lens = torch.ones(num_seqs, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32, device=device)
    scale = heads.head_dim**-0.5
    _, decode = decode_launches(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                scale, num_splits=EXAMPLE_SPLITS)
    _, prefill = prefill_launches(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                  scale, max_query_len=1)
    key = zeros(num_seqs, heads.num_kv_heads, heads.head_dim, dtype=dtype)
    write = reshape_and_cache_launches(key, key, k_cache, v_cache,
                                       zeros(num_seqs, dtype=SLOT_DTYPE))
    layer = zeros(2, num_blocks, bs, heads.num_kv_heads, heads.head_dim, dtype=dtype)
    copy = copy_blocks_launches([layer], zeros(1, 2, dtype=SLOT_DTYPE))
    return [*decode, *prefill, *write, *copy, *layer_launches(config, device)]


def layer_launches(config: Configuration, device: str = "meta") -> list[KernelLaunch]:
    """The fused small operators of a layer of `config`'s shape: the two RMSNorms and SwiGLU's
    activation. The hidden size is the query heads' width
    and the MLP's 8/3 of it (rounded up to 256, Llama's rule: SmolLM2's 1536, Llama-2-7B's
    11008)."""
    heads, dtype = config.heads, getattr(torch, config.dtype)
    num_tokens = 4
    hidden = heads.num_heads * heads.head_dim
    intermediate = -(-hidden * 8 // 3 // 256) * 256
    zeros = partial(torch.zeros, device=device)
    x = zeros(num_tokens, hidden, dtype=dtype)
    weight = zeros(hidden, dtype=dtype)
    norm = rms_norm_launches(x, None, weight, 1e-6, x, None)
    add_norm = rms_norm_launches(x, x, weight, 1e-6, x, x)
    gate_up = zeros(num_tokens, 2 * intermediate, dtype=dtype)
    silu = silu_mul_launches(gate_up[:, :intermediate], gate_up[:, intermediate:],
                             zeros(num_tokens, intermediate, dtype=dtype))
    return [*norm, *add_norm, *silu]


# --- compiling a launch ----------------------------------------------------------------------


def specialise(launch: KernelLaunch, capability: int) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of `launch` as Triton's JIT derives them at launch time.

    The JIT's binder types each argument (`*fp16`, `i32`, ...), turns integers equal to 1 into
    constants and marks pointers and integers divisible by 16, unless the kernel opts out
    (`do_not_specialize`); each distinct result is one compiled program.
    """
    kernel = launch.kernel
    backend = make_backend(GPUTarget("cuda", capability, 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, _ = binder(*launch.args, **launch.constexprs)
    signature, constexprs, attrs = {}, {}, {}
    for index, (param, (kind, attr)) in enumerate(zip(kernel.params, specialization,
                                                       strict=True)):
        signature[param.name] = kind
        if kind == "constexpr":
            constexprs[(index,)] = bound[param.name]
        elif isinstance(attr, str):
            attrs[(index,)] = backend.parse_attr(attr)
    return signature, constexprs, attrs


def compile_launch(launch: KernelLaunch, capability: int) -> Any:
    """`launch`'s program compiled for compute capability `capability`, down to a cubin."""
    signature, constexprs, attrs = specialise(launch, capability)
    stages = {} if launch.num_stages is None else {"num_stages": launch.num_stages}
    return triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs),
                          target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": launch.num_warps, **stages})


def program_key(launch: KernelLaunch, arch: str) -> str:
    """What makes a compiled program distinct, hashed: the kernel's source, the architecture,
    the argument types and specialisations, the constants, the warps and the pipeline stages."""
    signature, constexprs, attrs = specialise(launch, ARCHS[arch])
    # Launches that leave the stages to Triton keep the keys they had before stages were set.
    stages = () if launch.num_stages is None else (launch.num_stages,)
    spec = repr((source_hash(launch.kernel), launch.name, arch, sorted(signature.items()),
                 sorted(constexprs.items()), sorted(attrs.items()), launch.num_warps, *stages))
    return hashlib.sha256(spec.encode()).hexdigest()[:16]


def source_hash(kernel: JITFunction) -> str:
    """Hash of `kernel`'s source and of every @triton.jit function it reaches by name."""
    seen: dict[str, str] = {}
    pending = [kernel]
    while pending:
        fn = pending.pop()
        if fn.__name__ in seen:
            continue
        seen[fn.__name__] = fn.src
        names = set(re.findall(r"\b\w+\b", fn.src))
        pending += [v for k, v in fn.fn.__globals__.items()
                    if k in names and isinstance(v, JITFunction)]
    text = "\n".join(seen[name] for name in sorted(seen))
    return hashlib.sha256(text.encode()).hexdigest()


# --- what a compiled program uses ------------------------------------------------------------

RESOURCE_LINE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def resource_usage(compiled: Any) -> dict[str, int]:
    """Registers per thread, stack, static shared and local memory (bytes) of the cubin, from
    `cuobjdump --dump-resource-usage`, and the dynamic shared memory Triton asks at launch."""
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        dump = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage",
                               str(cubin)], capture_output=True, text=True, check=True).stdout
    found = RESOURCE_LINE.search(dump)
    if found is None:
        raise RuntimeError(f"no resource line in cuobjdump's output:\n{dump}")
    regs, stack, shared, local = map(int, found.groups())
    return {"registers": regs, "stack_bytes": stack, "local_bytes": local,
            "static_shared_bytes": shared, "dynamic_shared_bytes": compiled.metadata.shared,
            "num_warps": compiled.metadata.num_warps}


def tensor_core_use(compiled: Any) -> dict[str, int]:
    """How the program's products were lowered: `tl.dot`s in the Triton IR, dots in the GPU IR
    (a tf32x3 dot is three by then) and how many of those have a tensor-core (`#mma`) result,
    and the `mma` / `wgmma` instructions in the PTX."""
    gpu_dots = re.findall(r"= (?:tt\.dot|ttng\.warp_group_dot) .*", compiled.asm["ttgir"])
    ptx = compiled.asm["ptx"]
    return {
        "dots": len(re.findall(r"= tt\.dot ", compiled.asm["ttir"])),
        "gpu_dots": len(gpu_dots),
        "tensor_core_dots": sum(1 for d in gpu_dots if re.search(r"-> tensor<[^>]*#mma", d)),
        "mma_instructions": len(re.findall(r"\bmma\.sync\.", ptx)),
        "wgmma_instructions": len(re.findall(r"\bwgmma\.mma_async\.", ptx)),
    }


def cubin_hash(cubin: bytes) -> str:
    """Short hash of a compiled binary, to tell whether two compiles made the same one."""
    return hashlib.sha256(cubin).hexdigest()[:16]


def program_resources(launch: KernelLaunch, capability: int) -> dict[str, Any]:
    """Compile `launch` and read its resources; a compiler error is a result too."""
    start = time.perf_counter()
    try:
        compiled = compile_launch(launch, capability)
        result = (resource_usage(compiled) | tensor_core_use(compiled)
                  | {"cubin_sha256": cubin_hash(compiled.kernel)})
    except Exception as error:  # a program the compiler rejects: reported, the callers fail
        result = {"error": f"{type(error).__name__}: {error}"}
    return result | {"compile_s": round(time.perf_counter() - start, 3)}


# --- every configuration ---------------------------------------------------------------------


def plan_programs(configs: Sequence[Configuration], archs: Iterable[str]) -> list[Program]:
    """The distinct programs that `configs` launch on `archs`, without compiling them."""
    programs: dict[str, Program] = {}
    for arch in archs:
        for config in configs:
            for launch in configuration_launches(config):
                key = program_key(launch, arch)
                constexprs = {k: str(v) for k, v in launch.constexprs.items()}
                program = programs.setdefault(
                    key, Program(key, launch.name, arch, constexprs, launch.num_warps))
                program.configurations.append(config.name)
    return list(programs.values())


def _compile_first_launch(program: Program) -> dict[str, Any]:
    """Resources of `program`, compiled from its first configuration's launch (worker side)."""
    config = next(c for c in CONFIGURATIONS if c.name == program.configurations[0])
    launch = next(launch for launch in configuration_launches(config)
                  if launch.name == program.kernel)
    return program_resources(launch, ARCHS[program.arch])


def compile_programs(programs: list[Program], workers: int = 1) -> list[Program]:
    """Compile every program (in `workers` processes) and fill in its resources."""
    if workers > 1:
        # Spawned, not forked: the caller may have initialised CUDA (benchmarks/gpu/check.py).
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(_compile_first_launch, programs))
    else:
        results = [_compile_first_launch(p) for p in programs]
    for program, result in zip(programs, results, strict=True):
        program.resources = result
    return programs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile", choices=["all", "covering", "none"], default="all",
                        help="compile the programs of every configuration, of the covering "
                             "subset the tests use, or none (every program is listed anyway)")
    parser.add_argument("--arch", action="append", choices=sorted(ARCHS),
                        help="this architecture only (repeatable; default: all)")
    parser.add_argument("--workers", type=int, default=1, help="compiling processes")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    programs = plan_programs(CONFIGURATIONS, args.arch or ARCHS)
    chosen = {"all": CONFIGURATIONS, "covering": COVERING, "none": []}[args.compile]
    names = {c.name for c in chosen}
    compile_programs([p for p in programs if names & set(p.configurations)], args.workers)
    args.out.write_text(json.dumps({
        "triton": triton.__version__,
        "configurations": [c.name for c in CONFIGURATIONS],
        "programs": [asdict(p) for p in programs],
    }, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
