"""A step replayed on a CPU: the CPU's answer to CUDA graphs, captured from the model's forward.

At one request a decode step is memory-bound: it reads every weight once, ~10-25 ms for
SmolLM2 on a server CPU. Run through the model's modules, the same step also pays Python for
every call (module calls, shape checks, new tensors, one `ctypes` call per kernel: ~0.3 ms a
layer, as much as the bandwidth itself). CUDA records a step's kernel launches once and replays
them (a CUDA graph); vLLM and nano-vllm capture one per batch size from the model's forward.

`capture` does the same on a CPU. It runs the forward once over the runner's static buffers
under a `Recorder`: each of the platform's modules (`minipaged.platforms.cpu.modules`,
`.linear`, the attention ops) does its work by binding a kernel call over its input and output
tensors (`KernelCall`) and running it through `launch`, which also appends the call to the
recording. Between the modules the model computes nothing, only views (its layers are written
so: `minipaged.models.layers`), so the recorded calls, made again in order over the same
buffers, are the step: `Replay.run` makes them in one call into C (`KernelCalls`). The model is
never described a second time: any family whose every computation the platform's modules
cover replays.

The buffers the modules make while a step is captured come from an `Arena` (`empty`) that every
captured size shares, as CUDA graphs share one memory pool: a replay keeps nothing from one
step to the next, so the captured sizes together hold the buffers of the largest one.

The recording refuses what it cannot replay: the `Recorder` watches every PyTorch operator the
forward runs outside the platform's code and raises `CaptureError` for one that computes
(whose output is not a view of its inputs, or a 0-dim check such as a batch's range; or that
writes into a tensor it was handed, in place), which a replay would silently skip; so does a
module whose kernel does not take its input (a GEMM past the few-row kernel's rows). The runner
then runs such steps through the modules.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from minipaged.kernels.cpu.build import profiled
from minipaged.kernels.cpu.calls import KernelCall, KernelCalls

PROFILER_NAME = "minipaged::replay"  # a replayed step, as torch's profiler lists it
ALIGNMENT = 64  # bytes: every arena buffer starts on a cache line
CHUNK_BYTES = 1 << 24  # the arena grows by chunks of at least this many bytes


class CaptureError(RuntimeError):
    """The forward did something a replay of its kernel calls would not repeat."""


@dataclass
class Replay:
    """A captured step: its segments in order, each a batch of kernel calls made in one call
    into C or a Python function (a look-up no kernel takes); and what the calls point into."""

    segments: list[KernelCalls | Callable[[], object]]
    keep: list[object] = field(default_factory=list)

    def run(self) -> None:
        with profiled(PROFILER_NAME):
            for segment in self.segments:
                segment.run() if isinstance(segment, KernelCalls) else segment()


class Arena:
    """The memory of the buffers made while steps are captured (module docstring): chunks of
    bytes handed out in order, each buffer after the last. `reset` starts a capture at the
    first chunk again, over the buffers of the captures before it: a replay reads nothing that
    an earlier step left, so the sizes share the memory of the largest capture."""

    def __init__(self) -> None:
        self.chunks: list[Tensor] = []
        self.storages: set[int] = set()
        self.chunk, self.offset = 0, 0  # where the next buffer goes

    def reset(self) -> None:
        self.chunk, self.offset = 0, 0

    def owns(self, tensor: Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self.storages

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """An uninitialised contiguous `shape` tensor of `dtype` in the arena (its own tensor
        over the chunk's memory, not a view of the chunk)."""
        nbytes = -(-max(math.prod(shape) * dtype.itemsize, 1) // ALIGNMENT) * ALIGNMENT
        while (self.chunk < len(self.chunks)
               and self.offset + nbytes > self.chunks[self.chunk].numel()):
            self.chunk, self.offset = self.chunk + 1, 0
        if self.chunk == len(self.chunks):
            chunk = torch.empty(max(nbytes, CHUNK_BYTES), dtype=torch.uint8)
            self.chunks.append(chunk)
            self.storages.add(chunk.untyped_storage().data_ptr())
        storage = self.chunks[self.chunk].untyped_storage()
        strides = torch.empty(shape, device="meta").stride()
        tensor = torch.empty(0, dtype=dtype).set_(storage, self.offset // dtype.itemsize,
                                                  shape, strides)
        self.offset += nbytes
        return tensor


class Recorder(TorchFunctionMode):
    """Records the kernel calls of one forward (module docstring) and refuses the operators a
    replay would not repeat."""

    def __init__(self, arena: Arena) -> None:
        super().__init__()
        self.arena = arena
        self.calls: list[KernelCall] = []
        self.segments: list[KernelCalls | Callable[[], object]] = []
        self.keep: list[object] = [arena]

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _writes_in_place(func, kwargs) or not _views_only(out, (args, kwargs)):
            name = getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))
            raise CaptureError(f"{name} computes outside the platform's modules: a replay "
                               "would not repeat it")
        return out

    def add_call(self, call: KernelCall, tensors: tuple[Tensor, ...]) -> None:
        self.calls.append(call)
        self._keep(tensors)

    def add_python(self, fn: Callable[[], object], tensors: tuple[Tensor, ...]) -> None:
        self._close_calls()
        self.segments.append(fn)
        self._keep(tensors)

    def _keep(self, tensors: tuple[Tensor, ...]) -> None:
        """Hold what the calls point into, but the arena's buffers: the arena holds those."""
        self.keep.extend(t for t in tensors if not self.arena.owns(t))

    def _close_calls(self) -> None:
        if self.calls:
            self.segments.append(KernelCalls(self.calls))
            self.calls = []

    def replay(self) -> Replay:
        self._close_calls()
        return Replay(self.segments, self.keep)


_RECORDER: Recorder | None = None


def recording() -> Recorder | None:
    """The recorder of the capture in progress, if any."""
    return _RECORDER


@contextlib.contextmanager
def platform_code() -> Iterator[None]:
    """Marks the platform's own code, whose operators a capture need not replay (they make
    buffers or look at shapes; its kernels go through `launch`): the recorder does not watch
    them."""
    if _RECORDER is None:
        yield
        return
    with torch._C.DisableTorchFunction():
        yield


def contiguous(x: Tensor, what: str) -> Tensor:
    """`x`, or a contiguous copy of it. A capture refuses the copy, which is made now and which
    a replay would not make again; its error begins with `what`."""
    if x.is_contiguous():
        return x
    if _RECORDER is not None:
        raise CaptureError(f"{what} copied: a replay would read the copy made while capturing")
    return x.contiguous()


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> Tensor:
    """A new buffer for a module's output: `torch.empty`, or during a capture the arena's."""
    if _RECORDER is None:
        return torch.empty(shape, dtype=dtype)
    return _RECORDER.arena.empty(tuple(shape), dtype)


def launch(call: KernelCall, name: str, *tensors: Tensor) -> None:
    """Make `call` now and, during a capture, record it (holding `tensors`, what it points
    into). Raises ValueError where the kernel refuses its arguments."""
    if _RECORDER is not None:
        _RECORDER.add_call(call, tensors)
    if call.run_as(name) != 0:
        raise ValueError(f"the CPU kernel {name} refused its arguments")


def launch_python(fn: Callable[[], object], *tensors: Tensor) -> None:
    """Run `fn` now (PyTorch writing into existing buffers) and, during a capture, record it as
    a step of the replay: for the few look-ups no kernel takes."""
    if _RECORDER is not None:
        _RECORDER.add_python(fn, tensors)
    with platform_code():
        fn()


def capture(forward: Callable[[], Tensor], arena: Arena | None = None) -> tuple[Replay, Tensor]:
    """Run `forward` once, recording it, its buffers in `arena` (a new one by default; reset,
    so that the replays of the captures before share it); return the replay and the forward's
    output (a buffer the replay writes). Raises `CaptureError` where the forward cannot be
    replayed."""
    global _RECORDER
    if _RECORDER is not None:
        raise CaptureError("a capture is already in progress")
    arena = arena or Arena()
    arena.reset()
    recorder = Recorder(arena)
    _RECORDER = recorder
    try:
        with recorder, torch.inference_mode():
            out = forward()
    finally:
        _RECORDER = None
    return recorder.replay(), out


def _tensors(value: object) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


# Augmented assignments (`x += y`): in place, though their names do not end in "_".
_IN_PLACE_DUNDERS = frozenset(
    f"__i{op}__" for op in ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow",
                            "and", "or", "xor", "lshift", "rshift"))


def _writes_in_place(func: Callable[..., object], kwargs: dict[str, object]) -> bool:
    """Whether `func` writes into a tensor it was handed (`mul_`, `x += y`, `x[i] = y`,
    `out=`): it computes, though what it returns is its input, which `_views_only` accepts."""
    name = getattr(func, "__name__", "")
    return (kwargs.get("out") is not None or name == "__setitem__" or name in _IN_PLACE_DUNDERS
            or (name.endswith("_") and not name.startswith("__")))


def _views_only(out: object, inputs: object) -> bool:
    """Whether every tensor `out` holds is a view of a tensor of `inputs` or 0-dim (a check's
    scalar): what a replay may leave out."""
    outputs = [t for t in _tensors(out) if t.dim() > 0]
    if not outputs:
        return True
    storages = {t.untyped_storage().data_ptr() for t in _tensors(inputs)}
    return all(t.untyped_storage().data_ptr() in storages for t in outputs)
