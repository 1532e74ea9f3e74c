"""Kernel calls with their arguments fixed (`KernelCall`), and a list of them made in one call
into C (`KernelCalls`, `csrc/calls.c`): how a replayed decode step runs its ~330 kernels.

Every kernel of this layer has, beside its C function, an entry `<kernel>_call(const void
*args)` that takes all its arguments as one struct (`csrc/*.c`, mirrored field for field by a
`ctypes.Structure` in the kernel's module) and returns 0, or nonzero where it refuses them. A
call through ctypes converts each Python argument on every call: 1-4 us for the 7-17 arguments
of these kernels, as much as the small kernels themselves compute at one row and, over a
decode step's 331 calls, about a tenth of the step of a bfloat16 SmolLM2
(`benchmarks/cpu/roofline.py` profiles the step). A `KernelCall` fills its struct once; a
`KernelCalls` passes a whole list of them to one C loop, as a CUDA graph replays its kernels.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from pathlib import Path

from minipaged.kernels.cpu.build import native_loader, profiled

SOURCE = Path(__file__).with_name("csrc") / "calls.c"
ENTRY = ([ctypes.c_void_p], ctypes.c_int)  # every kernel's `<kernel>_call`: (args) -> status


# `run_calls`, built and loaded once per process (`native_loader`); None without.
_library = native_loader(SOURCE, {
    "run_calls": ([ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int64),
})


def kernel_calls_available() -> bool:
    """Whether `KernelCalls` can run here (its loop built, as every kernel is, by the C
    compiler)."""
    return _library() is not None


def c_array(kind: type, values: Sequence) -> ctypes.Array:
    """A C array of `kind` holding `values`."""
    return (kind * len(values))(*values)


def require_native(library: ctypes.CDLL | None, what: str) -> ctypes.CDLL:
    """`library` (a kernel module's `_library()`), or `RuntimeError` saying that the native CPU
    `what` could not be built here: a bound call needs its kernel."""
    if library is None:
        raise RuntimeError(f"the native CPU {what} could not be built here")
    return library


class KernelCall:
    """A kernel's entry (`<kernel>_call`, loaded with the signature `ENTRY`) and its argument
    struct, filled once: `call()` makes the call and returns the kernel's status, 0 where it
    took the arguments. The struct holds raw pointers: the tensors behind them must live as
    long as the call (its binder keeps them); `keep` holds anything else they point into."""

    __slots__ = ("entry", "args", "keep", "args_address")

    def __init__(self, entry: Callable[[int], int], args: ctypes.Structure,
                 keep: object = None) -> None:
        self.entry, self.args, self.keep = entry, args, keep
        self.args_address = ctypes.addressof(args)

    def __call__(self) -> int:
        return self.entry(self.args_address)

    def run_as(self, name: str) -> int:
        """`self()`, listed as `name` in torch's profiler (`build.profiled`): a one-off call."""
        with profiled(name):
            return self()

    @property
    def entry_address(self) -> int:
        """The entry's address in its library, as C calls it."""
        return ctypes.cast(self.entry, ctypes.c_void_p).value or 0


class KernelCalls:
    """`calls`, made in order by one call into C (`run_calls`): `run()` returns nothing and
    raises `RuntimeError` naming the first call that refused its arguments (the calls after it
    are not made). Holds the calls, and so what they hold."""

    def __init__(self, calls: Sequence[KernelCall]) -> None:
        library = require_native(_library(), "call loop")
        self.calls = list(calls)
        entries = c_array(ctypes.c_void_p, [call.entry_address for call in self.calls])
        args = c_array(ctypes.c_void_p, [call.args_address for call in self.calls])
        self._arrays = (entries, args)
        self._run = functools.partial(library.run_calls, len(self.calls), entries, args)

    def __len__(self) -> int:
        return len(self.calls)

    def run(self) -> None:
        made = self._run()
        if made != len(self.calls):
            raise RuntimeError(f"kernel call {made} of {len(self.calls)} refused its arguments "
                               f"({self.calls[made].entry.__name__})")
