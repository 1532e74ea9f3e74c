"""The greedy choice of a batch's next tokens and their log-probabilities in one C call
(`csrc/greedy.c`), for the sampler's rows that only take the most likely token.

`greedy_tokens_available()` says whether the kernel could be built (`build_native`); without a
compiler the sampler keeps its PyTorch path.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from minipaged.kernels.cpu.build import I64, POINTER, native_loader, profiled

SOURCE = Path(__file__).with_name("csrc") / "greedy.c"
PROFILER_NAME = "minipaged::greedy_tokens"


# The kernel, built and loaded once per process (`native_loader`); None without.
_library = native_loader(SOURCE, {
    "greedy_tokens": ([POINTER, I64, I64, POINTER, POINTER], ctypes.c_int),
})


def greedy_tokens_available() -> bool:
    """Whether the kernel is built and loaded in this process (building it if need be)."""
    return _library() is not None


def greedy_tokens(logits: Tensor) -> tuple[Tensor, Tensor] | None:
    """Each row's most likely token of float32 logits `[B, V]` (contiguous, on the CPU) -- the
    first of equal largest values, as `argmax` -- and its log-probability, as
    `log_softmax(logits)` gives it up to the order of a sum: `[B]` int64 and float32 tensors
    over the kernel's own output arrays (no tensor operator); None where a row holds a NaN or
    an infinity, or the kernel is not built."""
    library = _library()
    if library is None:
        return None
    if (logits.dim() != 2 or logits.dtype != torch.float32 or logits.device.type != "cpu"
            or not logits.is_contiguous()):
        raise ValueError(f"greedy_tokens takes contiguous float32 CPU logits [B, V], got "
                         f"{logits.dtype} {tuple(logits.shape)} on {logits.device}")
    rows, vocab = logits.shape
    token_ids, logprobs = (ctypes.c_int64 * rows)(), (ctypes.c_float * rows)()
    with profiled(PROFILER_NAME):
        status = library.greedy_tokens(logits.data_ptr(), rows, vocab, token_ids, logprobs)
    if status != 0:
        return None
    return (torch.frombuffer(token_ids, dtype=torch.int64),
            torch.frombuffer(logprobs, dtype=torch.float32))
