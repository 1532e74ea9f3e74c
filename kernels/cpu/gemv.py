"""The CPU's few-row linear kernel (`csrc/gemv.c`) and weight-only int8 weights.

A decode step of one request multiplies one row by every weight matrix: a matrix-vector
product (GEMV) that reads each weight byte once and does one multiply-add with it, so it runs
at the memory's speed or not at all. PyTorch's GEMMs rearrange or block the weight for many
rows and read it at well under that speed at one row (`benchmarks/cpu/linear.py`). The kernel
here reads the weight in its checkpoint layout (row-major `[out, in]`, one sequential stream)
for up to 8 rows at a time, and reads several weights that share an input in one call (a
layer's q, k and v projections: `GemvPlan`), writing their outputs side by side.

Weights are float32, bfloat16 or `Int8Weight`: int8 values with a float32 scale per group of
input features of each output row (`quantize_int8`), dequantised in registers, so no float copy
of a quantised weight exists. AVX-512 (with its bfloat16 dot products for bfloat16 weights and
inputs, where the CPU has them) or AVX2 on x86-64, NEON on aarch64, is chosen at run time from
what the CPU reports, within the tier `$MINIPAGED_CPU_ISA` caps (`gemv_isa`); plain C
otherwise. Without a C compiler `gemv_available()` is False and the
models multiply with PyTorch (int8 weights dequantised first).

`gemv_row_limit` measures, once per weight shape, up to how many rows the kernel beats a given
GEMM on this CPU: the few-row choice the models' `linear` makes (`minipaged.models.layers`).
"""

from __future__ import annotations

import copy
import ctypes
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from minipaged.kernels.cpu.build import I32, I64, POINTER, architecture, isa_tier, native_loader
from minipaged.kernels.cpu.calls import ENTRY, KernelCall, c_array, require_native
from minipaged.kernels.cpu.pages import huge_page_buffer

SOURCE = Path(__file__).with_name("csrc") / "gemv.c"
MAX_ROWS = 8  # the few-row range: rows the kernel takes in one pass over the weights
PROBE_ROWS = (1, 2, 4, 8)  # row counts `gemv_row_limit` times
# Bytes of weight copies each probe reads, on huge pages as a model's weights lie (`probe_copies`)
PROBE_BYTES = 256 << 20
# and at most this many copies: each is a kernel call, and the tiny weights of tests' models
# would otherwise take hundreds of thousands
PROBE_MAX_COPIES = 512
# How much faster the rival GEMM must measure at a row count to take it from the kernel: where
# the two read a layer's weights about as fast, the kernel keeps the rows, since a step whose
# every projection the kernel takes is replayed without Python (`platforms.cpu.replay`)
ROW_LIMIT_MARGIN = 0.1
FETCH_PROBE_SHAPE = (1536, 576)  # the weight `fetch_ahead` reads: a small model's MLP's
FETCH_PROBE_GROUP = 64  # and its int8 group, as quantised models have them (GROUP_SIZE)
FETCH_PROBE_ROUNDS = 9  # pairs `fetch_ahead` times
IO_DTYPES = (torch.float32, torch.bfloat16)  # x and out
WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}  # csrc/gemv.c's enum
# The kernel's paths on this architecture, by what they need (csrc/gemv.c's `isa`), and the
# widest path each tier of `build.TIERS` allows
ISAS = ({"c": 0, "neon": 1} if architecture() == "aarch64"
        else {"c": 0, "avx2": 1, "avx512": 2, "avx512_bf16": 3})
TIER_PATHS = {"generic": 0, "avx2": 1, "neon": 1, "avx512": 3}
PROFILER_NAME = "minipaged::gemv"


# ---------------------------------------------------------------------------------------------
# Weight-only int8
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Int8Weight:
    """An `[out, in]` weight as int8 `data` and float32 `scales [out, in / group_size]`:
    weight[o, i] ~= data[o, i] * scales[o, i // group_size]. A quarter of float32's bytes
    (plus a scale per group)."""

    data: Tensor
    scales: Tensor
    group_size: int

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The float weight these values stand for (a new tensor of `dtype`)."""
        out, inp = self.data.shape
        groups = self.data.view(out, inp // self.group_size, self.group_size).float()
        return (groups * self.scales[:, :, None]).view(out, inp).to(dtype)


def quantize_int8(weight: Tensor, group_size: int | None = None) -> Int8Weight:
    """Symmetric int8 of a float `[out, in]` weight: per output row (`group_size` None) or per
    `group_size` consecutive input features of each row, scale = the group's largest |value| /
    127, values rounded to the nearest step. Raises ValueError when `group_size` does not
    divide the input features."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_int8 takes a float [out, in] weight, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    out, inp = weight.shape
    group = inp if group_size is None else group_size
    if group < 1 or inp % group != 0:
        raise ValueError(f"group_size {group_size} must divide the weight's {inp} input features")
    with torch.no_grad():
        groups = weight.detach().float().reshape(out, inp // group, group)
        scales = groups.abs().amax(dim=-1) / 127.0
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # all-zero groups
        data = torch.round(groups / scales[:, :, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(data.reshape(out, inp).contiguous(), scales.contiguous(), group)


# ---------------------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------------------


class GemvArgs(ctypes.Structure):
    """`gemv_args` of `csrc/gemv.c`, field for field."""

    _fields_ = [("x", POINTER), ("m", I64), ("k", I64), ("io_bf16", I32), ("nw", I32),
                ("ws", POINTER), ("types", POINTER), ("ns", POINTER), ("scales", POINTER),
                ("groups", POINTER), ("biases", POINTER), ("out", POINTER), ("isa", I32),
                ("fetch_ahead", I32), ("threads", I32)]


# The kernel, built and loaded once per process (`native_loader`); None without.
_library = native_loader(SOURCE, {"gemv_call": ENTRY, "gemv_isa": ([], ctypes.c_int)})


def gemv_available() -> bool:
    """Whether the kernel is built and loaded in this process (building it if need be)."""
    return _library() is not None


def gemv_isa() -> str:
    """The path this CPU takes: "avx512_bf16", "avx512", "avx2", "neon" or "c" (or "none"
    without the kernel): the widest it has, within the tier `$MINIPAGED_CPU_ISA` caps."""
    library = _library()
    if library is None:
        return "none"
    return {v: k for k, v in ISAS.items()}[_widest_path(library)]


def _widest_path(library: ctypes.CDLL) -> int:
    """csrc/gemv.c's widest path on this CPU, within the tier `$MINIPAGED_CPU_ISA` caps."""
    tier = isa_tier()
    return library.gemv_isa() if tier is None else min(library.gemv_isa(), TIER_PATHS[tier])


class GemvPlan:
    """One kernel call's fixed half for weights that read the same input: their pointers,
    types, sizes, scales and biases, laid out for C once, so that a step's call passes only
    its input and output. `plan(x)` is `[F.linear(x, w_i, b_i) for each i]` side by side:
    `[rows, sum(out_i)]` in x's dtype.

    The plan holds its tensors: a weight given new storage (`module.weight = ...`) is not seen
    by it (`reads` tells whether it still reads a given list); one written in place is.
    """

    def __init__(
        self,
        weights: Sequence[Tensor | Int8Weight],
        biases: Sequence[Tensor | None] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if not weights:
            raise ValueError("a GemvPlan needs at least one weight")
        biases = list(biases) if biases is not None else [None] * len(weights)
        if len(biases) != len(weights):
            raise ValueError(f"{len(weights)} weights but {len(biases)} biases")
        if dtype not in IO_DTYPES:
            raise ValueError(f"the kernel's inputs are {IO_DTYPES}, got {dtype}")
        self.weights, self.biases, self.dtype = list(weights), biases, dtype
        self.in_features = weights[0].shape[1]
        data = [w.data if isinstance(w, Int8Weight) else w for w in self.weights]
        for i, (w, tensor, bias) in enumerate(zip(self.weights, data, biases, strict=True)):
            if (tensor.device.type != "cpu" or tensor.dtype not in WEIGHT_TYPES
                    or tensor.dim() != 2 or not tensor.is_contiguous()):
                raise ValueError(f"weight {i}: the kernel takes contiguous 2-D CPU weights of "
                                 f"{list(WEIGHT_TYPES)}, got {tensor.dtype} {tuple(tensor.shape)}")
            if tensor.shape[1] != self.in_features:
                raise ValueError(f"weight {i} has {tensor.shape[1]} input features, weight 0 "
                                 f"{self.in_features}")
            if tensor.dtype == torch.int8 and not isinstance(w, Int8Weight):
                raise ValueError(f"weight {i}: an int8 weight comes as an Int8Weight (scales)")
            if bias is not None and (bias.dtype != dtype or bias.shape != (tensor.shape[0],)
                                     or not bias.is_contiguous()):
                raise ValueError(f"bias {i} must be a contiguous [{tensor.shape[0]}] {dtype}")
        scales = [w.scales if isinstance(w, Int8Weight) else None for w in self.weights]
        groups = [w.group_size if isinstance(w, Int8Weight) else self.in_features
                  for w in self.weights]
        self.weight_dtype = data[0].dtype  # its reads are measured by this one (`fetch_ahead`)
        self.weight_dtypes = tuple(t.dtype for t in data)
        self.out_features = [t.shape[0] for t in data]
        self.width = sum(self.out_features)
        # gemv_args' per-weight arrays (ws, types, ns, scales, groups, biases), made once
        self._arrays = (
            c_array(ctypes.c_void_p, [t.data_ptr() for t in data]),
            c_array(ctypes.c_int, [WEIGHT_TYPES[t.dtype] for t in data]),
            c_array(ctypes.c_int64, self.out_features),
            c_array(ctypes.c_void_p, [0 if s is None else s.data_ptr() for s in scales]),
            c_array(ctypes.c_int64, groups),
            c_array(ctypes.c_void_p, [0 if b is None else b.data_ptr() for b in biases]),
        )
        self._keep = (data, scales)  # the pointers above stay valid while the plan lives

    def __deepcopy__(self, memo: dict) -> GemvPlan:
        """A plan over the copies of its weights (`copy.deepcopy` of a model copies its
        plans with it; ctypes' pointer arrays cannot be copied, only made again)."""
        weights = [copy.deepcopy(w, memo) for w in self.weights]
        biases = [copy.deepcopy(b, memo) for b in self.biases]
        return GemvPlan(weights, biases, self.dtype)

    def reads(self, weights: Sequence[Tensor | Int8Weight]) -> bool:
        """Whether this plan multiplies exactly these weight objects."""
        return len(weights) == len(self.weights) and all(
            a is b for a, b in zip(weights, self.weights, strict=True))

    def __call__(self, x: Tensor, isa: str | None = None, out: Tensor | None = None,
                 ahead: bool | None = None) -> Tensor:
        """`[rows, width]` outputs for `x [rows, in]` (contiguous, the plan's dtype); `isa`
        forces a slower path ("c", "avx2") and `ahead` whether weights are fetched ahead, for
        tests and measurements; `out` is written if given."""
        x = x.contiguous()
        if out is None and x.dim() == 2:
            out = torch.empty(x.shape[0], self.width, dtype=self.dtype)
        call = self.bind(x, out, isa, ahead)
        if x.shape[0] > 0 and call.run_as(PROFILER_NAME) != 0:
            raise ValueError("the GEMV kernel refused these sizes")
        return out

    def fetch_ahead_matters(self, level: int | None = None) -> bool:
        """Whether fetching ahead changes how a call reads these weights on the kernel's path
        `level` (`ISAS`; default this CPU's widest): on every path but AVX-512 BF16's dot
        products, which bfloat16 weights times bfloat16 inputs take and which never fetch
        ahead (`csrc/gemv.c`)."""
        if level is None:
            level = ISAS.get(gemv_isa(), 0)
        return not (level >= ISAS["avx512_bf16"] and self.dtype == torch.bfloat16
                    and all(dtype == torch.bfloat16 for dtype in self.weight_dtypes))

    def bind(self, x: Tensor, out: Tensor | None, isa: str | None = None,
             ahead: bool | None = None) -> KernelCall:
        """The kernel's call `out = self(x)` with every argument fixed, to run again and again
        over the same tensors (their contents changing: a step replayed,
        `platforms.cpu.replay`); it returns the kernel's status, 0. `x [rows, in]` and
        `out [rows, width]` contiguous, the plan's dtype, alive while the call is; threads as
        many as torch's now; weights fetched ahead as `fetch_ahead` measured, unless `ahead`
        says."""
        library = require_native(_library(), "GEMV kernel")
        if (x.dim() != 2 or x.shape[1] != self.in_features or x.dtype != self.dtype
                or not x.is_contiguous()):
            raise ValueError(f"x must be a contiguous [rows, {self.in_features}] {self.dtype}, "
                             f"got {x.dtype} {tuple(x.shape)}")
        rows = x.shape[0]
        if (out is None or out.shape != (rows, self.width) or out.dtype != self.dtype
                or not out.is_contiguous()):
            raise ValueError(f"out must be a contiguous [{rows}, {self.width}] {self.dtype}")
        level = min(_widest_path(library), ISAS[isa] if isa else len(ISAS))
        if ahead is None:
            ahead = (rows > 0 and self.fetch_ahead_matters(level)
                     and fetch_ahead(self.weight_dtype, rows))
        # keep=self: the plan holds the arrays the struct points into
        return KernelCall(library.gemv_call, GemvArgs(
            x.data_ptr(), rows, self.in_features, int(self.dtype == torch.bfloat16),
            len(self.weights), *(ctypes.addressof(array) for array in self._arrays),
            out.data_ptr(), level, int(ahead), torch.get_num_threads()), keep=self)


def gemv(x: Tensor, weights: Sequence[Tensor | Int8Weight],
         biases: Sequence[Tensor | None] | None = None) -> Tensor:
    """`GemvPlan(weights, biases, x.dtype)(x)`: for a one-off product; a step keeps its plans."""
    return GemvPlan(weights, biases, x.dtype)(x)


# ---------------------------------------------------------------------------------------------
# Choosing it by measurement
# ---------------------------------------------------------------------------------------------


def best_times(candidates: dict[str, Callable[[Tensor], object]], inputs: Sequence[Tensor],
               repeats: int = 5) -> dict[str, float]:
    """Each candidate's best time (seconds of this thread's CPU time, which leaves out waits
    for a core other work holds) over `repeats` turns of calling it on every input, the
    candidates taking turns so that other load on a shared machine hits them alike; one
    warm-up call each first (first-call costs are not a step's)."""
    best = dict.fromkeys(candidates, float("inf"))
    for fn in candidates.values():
        fn(inputs[0])
    for _ in range(repeats):
        for name, fn in candidates.items():
            start = time.thread_time()
            for x in inputs:
                fn(x)
            best[name] = min(best[name], time.thread_time() - start)
    return best


def probe_copies(shapes: Sequence[tuple[int, int]], dtype: torch.dtype,
                 values: Sequence[Tensor] | None = None) -> list[list[Tensor]]:
    """Copies of weights of `shapes` and `dtype` (`values`, one per shape, or zeros), back to
    back on huge pages as a model's weights are laid out (`platforms.cpu.weight_layout`),
    `PROBE_BYTES` of them (at most `PROBE_MAX_COPIES`): what the start-up probes read. A step
    reads its weights from memory on huge pages, so a probe must too. Fewer copies, partly held
    by the last-level cache, measure another machine: on an AMD EPYC (32 MiB of cache) 48 MiB
    of them on ordinary pages put fetching ahead within 0-20% of not, where over a model's
    weights it makes a float32 step 1.4x slower; on an Intel Xeon (with AMX) they put the
    kernel 15-20% behind `F.linear` at one row, where over 256 MiB on huge pages it is 0-15%
    ahead."""
    element = torch.tensor([], dtype=dtype).element_size()
    sizes = [out * inp for out, inp in shapes]
    size = sum(sizes)
    count = max(1, min(PROBE_MAX_COPIES, PROBE_BYTES // (size * element)))
    memory = huge_page_buffer(count * size * element).view(dtype).view(count, size)
    copies = [[part.view(shape) for part, shape in zip(row.split(sizes), shapes, strict=True)]
              for row in memory]
    if values is not None:
        for weights in copies:
            for weight, value in zip(weights, values, strict=True):
                weight.copy_(value)
    return copies


@functools.cache
def gemv_row_limit(shapes: tuple[tuple[int, int], ...], dtype: torch.dtype,
                   rival: Callable[[Tensor, Tensor], Tensor],
                   prepare: Callable[[Tensor], Tensor] | None = None) -> int:
    """Up to how many rows (0 to `MAX_ROWS`) one kernel call over weights of `shapes`
    (`[out, in]` each, one input) and `dtype` takes on this CPU rather than `rival(x,
    prepare(weight))` for each weight in turn: the largest of `PROBE_ROWS` at which, and at
    every smaller probe, the rival did not measure `ROW_LIMIT_MARGIN` faster (0 without the
    kernel).

    Measured once per process and shapes as a step uses weights: the kernel's calls bound once
    (as a replayed step's are) over `probe_copies`, the rival over what `prepare` makes of
    them, in turns, best of five."""
    if not gemv_available():
        return 0
    gen = torch.Generator().manual_seed(0)
    limit = 0
    with torch.inference_mode():
        copies = probe_copies(shapes, dtype,
                              [torch.randn(shape, generator=gen).to(dtype) for shape in shapes])
        operands = [[w if prepare is None else prepare(w) for w in ws] for ws in copies]
        plans = [GemvPlan(ws, dtype=dtype) for ws in copies]
        for rows in PROBE_ROWS:
            x = torch.randn(rows, shapes[0][1], generator=gen).to(dtype)  # one input
            out = torch.empty(rows, plans[0].width, dtype=dtype)
            calls = [plan.bind(x, out) for plan in plans]
            times = best_times({
                "gemv": lambda x, calls=calls: [call() for call in calls],
                "rival": lambda x: [rival(x, w) for ws in operands for w in ws],
            }, [x])
            if times["rival"] < (1 - ROW_LIMIT_MARGIN) * times["gemv"]:
                break
            limit = rows if rows < PROBE_ROWS[-1] else MAX_ROWS
    return limit


def fetch_ahead(weight_dtype: torch.dtype, rows: int) -> bool:
    """Whether the kernel reads weights of `weight_dtype` (float32, bfloat16 or int8) faster
    at `rows` input rows when it fetches each weight row `csrc/gemv.c`'s PREFETCH bytes ahead
    into L2. Some CPUs need it for one thread to keep memory busy (a Xeon: 9.8 -> 11.3 GB/s);
    on others the hardware prefetcher does it alone and the extra requests slow it (an AMD
    EPYC, float32 at one row: 25-26 -> 22 GB/s); so it is measured, once per process for each
    weight type and each of the kernel's tile shapes (one or two rows, three or four, more)."""
    return _fetch_ahead(weight_dtype, 1 if rows <= 2 else 4 if rows <= 4 else MAX_ROWS)


@functools.cache
def _fetch_ahead(weight_dtype: torch.dtype, rows: int) -> bool:
    """`fetch_ahead` at `rows` (1, 4 or 8): one kernel call over each weight of
    `probe_copies`, fetching ahead and not, `FETCH_PROBE_ROUNDS` times, which goes first
    alternating; the one faster in most rounds wins. Pairs taken back to back see the same
    memory: on a shared machine whose bandwidth drifts by a third from one second to the next,
    the best of each over all rounds would compare two different machines."""
    if not gemv_available():
        return False
    shape = FETCH_PROBE_SHAPE
    with torch.inference_mode():
        copies = probe_copies([shape], weight_dtype)
        if weight_dtype == torch.int8:
            scales = torch.full((shape[0], shape[1] // FETCH_PROBE_GROUP), 0.01)
            plans = [GemvPlan([Int8Weight(ws[0].fill_(1), scales, FETCH_PROBE_GROUP)])
                     for ws in copies]
        else:
            plans = [GemvPlan([ws[0].fill_(0.01)]) for ws in copies]
        x = torch.ones(rows, shape[1])
        out = torch.empty(rows, shape[0])
        calls = {ahead: [plan.bind(x, out, ahead=ahead) for plan in plans]
                 for ahead in (False, True)}

        def seconds(ahead: bool) -> float:
            start = time.thread_time()
            for call in calls[ahead]:
                call()
            return time.thread_time() - start

        seconds(False), seconds(True)  # warm-up
        wins = 0
        for round_ in range(FETCH_PROBE_ROUNDS):
            first = bool(round_ % 2)
            times = {first: seconds(first), not first: seconds(not first)}  # in this order
            wins += times[True] < times[False]
    return wins > FETCH_PROBE_ROUNDS // 2
