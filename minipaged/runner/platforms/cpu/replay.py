"""A step replayed on a CPU: the CPU's answer to CUDA graphs, captured from the model's forward.

At one request a decode step is memory-bound: it reads every weight once, ~10-25 ms for
SmolLM2 on a server CPU. Run through the model's modules, the same step also pays Python for
every call (module calls, shape checks, new tensors, one `ctypes` call per kernel: ~0.3 ms a
layer, as much as the bandwidth itself). CUDA records a step's kernel launches once and replays
them (a CUDA graph); vLLM and nano-vllm capture one per batch size from the model's forward.

`capture` does the same on a CPU. It runs the forward once over the runner's static buffers
under a `Recorder`: each of the platform's modules (`minipaged.runner.platforms.cpu.modules`,
`.linear`, the attention ops) does its work by binding a kernel call over its input and output
tensors (`KernelCall`) and running it through `launch`, which also appends the call to the
recording. Between the modules the model computes nothing, only views (its layers are written
so: `minipaged.models.layers`), so the recorded calls, made again in order over the same
buffers, are the step: `Replay.run` makes them in one call into C (`KernelCalls`). The model is
never described a second time: any family whose every computation the platform's modules
cover replays.

The recording refuses what it cannot replay: the `Recorder` watches every PyTorch operator the
forward runs outside the platform's code and raises `CaptureError` for one that computes
(whose output is not a view of its inputs, or a 0-dim check such as a batch's range; or that
writes into a tensor it was handed, in place), which a replay would silently skip; so does a
module whose kernel does not take its input (a GEMM past the few-row kernel's rows). The runner
then runs such steps through the modules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from minipaged.kernels.cpu.build import profiled
from minipaged.kernels.cpu.calls import KernelCall, KernelCalls

PROFILER_NAME = "minipaged::replay"  # a replayed step, as torch's profiler lists it


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


class Recorder(TorchFunctionMode):
    """Records the kernel calls of one forward (module docstring) and refuses the operators a
    replay would not repeat."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[KernelCall] = []
        self.segments: list[KernelCalls | Callable[[], object]] = []
        self.keep: list[object] = []
        self.depth = 0  # > 0 while the platform's own code runs

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.depth == 0 and (_writes_in_place(func, kwargs)
                                or not _views_only(out, (args, kwargs))):
            name = getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))
            raise CaptureError(f"{name} computes outside the platform's modules: a replay "
                               "would not repeat it")
        return out

    def add_call(self, call: KernelCall, keep: tuple[object, ...]) -> None:
        self.calls.append(call)
        self.keep.append(keep)

    def add_python(self, fn: Callable[[], object], keep: tuple[object, ...]) -> None:
        self._close_calls()
        self.segments.append(fn)
        self.keep.append(keep)

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
    buffers or look at shapes; its kernels go through `launch`)."""
    recorder = _RECORDER
    if recorder is None:
        yield
        return
    recorder.depth += 1
    try:
        yield
    finally:
        recorder.depth -= 1


def launch(call: KernelCall, name: str, *tensors: Tensor) -> None:
    """Make `call` now and, during a capture, record it (holding `tensors`, what it points
    into). Raises ValueError where the kernel refuses its arguments."""
    if _RECORDER is not None:
        _RECORDER.add_call(call, tensors)
    with profiled(name):
        status = call()
    if status != 0:
        raise ValueError(f"the CPU kernel {name} refused its arguments")


def launch_python(fn: Callable[[], object], *tensors: Tensor) -> None:
    """Run `fn` now (PyTorch writing into existing buffers) and, during a capture, record it as
    a step of the replay: for the few look-ups no kernel takes."""
    if _RECORDER is not None:
        _RECORDER.add_python(fn, tensors)
    with platform_code():
        fn()


def capture(forward: Callable[[], Tensor]) -> tuple[Replay, Tensor]:
    """Run `forward` once, recording it; return the replay and the forward's output (a buffer
    the replay writes). Raises `CaptureError` where the forward cannot be replayed."""
    global _RECORDER
    if _RECORDER is not None:
        raise CaptureError("a capture is already in progress")
    recorder = Recorder()
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
    storages = {t.untyped_storage().data_ptr() for t in _tensors(inputs)}
    return all(t.dim() == 0 or t.untyped_storage().data_ptr() in storages
               for t in _tensors(out))
