"""The CPU platform: the plain model made fast on a CPU, behind the platform seam (`Platform`).

At load (`CPUPlatform.load`) the model's modules become the CPU's subclasses (`linear`:
few-row GEMV kernel, oneDNN or MKL GEMM, int8 weights; `modules`: RMSNorm, rotary, SwiGLU and
the embedding in C), its weights are copied into one buffer on huge pages in the order a step
reads them (`weight_layout`), and the few-row choice is made per weight shape (measured once on
this CPU, or fixed by `gemv_rows` / `MINIPAGED_GEMV_ROWS`, for tests and comparisons). Decode
steps of up to `max_num_seqs` sequences may be captured from the model's forward and replayed
(`replay`), as many as every projection's kernel takes once the model is loaded; attention is
`attention.CPU_OPS`.

The CPU's answers to the device questions: float32 and a few cores' batch by default, bfloat16
native where the CPU has AMX-BF16 or AVX-512 BF16 (its flags, from /proc/cpuinfo), weight-only
int8 on one rank, gloo's collectives with one torch thread per rank, and captured steps bound to
the thread count that recorded them.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from minipaged.attention.contract import AttentionOps
from minipaged.kernels.cpu.calls import kernel_calls_available
from minipaged.kernels.cpu.gemv import fetch_ahead
from minipaged.kernels.cpu.greedy import greedy_tokens, greedy_tokens_available
from minipaged.models.layers import RMSNorm, RotaryEmbedding, SiluAndMul
from minipaged.platforms.base import (
    QUANTIZATIONS,
    CaptureUnsupported,
    Platform,
    Replay,
    logger,
    swap_modules,
)
from minipaged.platforms.cpu.attention import CPU_OPS
from minipaged.platforms.cpu.linear import (
    CPULinear,
    Int8Linear,
    choose_few_rows,
    pack_for_onednn,
)
from minipaged.platforms.cpu.modules import (
    CPUEmbedding,
    CPURMSNorm,
    CPURotaryEmbedding,
    CPUSiluAndMul,
)
from minipaged.platforms.cpu.quantization import quantize_model
from minipaged.platforms.cpu.replay import Arena, CaptureError, capture
from minipaged.platforms.cpu.weight_layout import lay_out_weights

__all__ = ["GEMV_ROWS_VARIABLE", "CPUPlatform", "cpu_flags", "replay_ladder"]

SWAPS = {nn.Linear: CPULinear, RMSNorm: CPURMSNorm, RotaryEmbedding: CPURotaryEmbedding,
         SiluAndMul: CPUSiluAndMul, nn.Embedding: CPUEmbedding}
FETCH_AHEAD_ROWS = (1, 4, 8)  # a row count of each of the GEMV kernel's tile shapes
GEMV_ROWS_VARIABLE = "MINIPAGED_GEMV_ROWS"  # fixes the few-row choice (0: no GEMV kernel)
# The x86 CPU flags (Linux's /proc/cpuinfo names) of instructions that multiply bfloat16.
BFLOAT16_CPU_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none: not Linux)."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def replay_ladder(max_rows: int) -> tuple[int, ...]:
    """The decode sizes replayed when every projection takes the kernel up to `max_rows` rows:
    every size, none padded. A padded row would cost its share of every projection (the
    kernel's work grows with each row, in tiles of 8, 4 and 1 rows), while a capture
    costs about the step it runs, its buffers in the arena every size shares."""
    return tuple(range(1, max_rows + 1))


class CPUPlatform(Platform):
    """The CPU's modules, kernels and replayed steps (module docstring). `gemv_rows` fixes up to
    how many rows every float projection takes the GEMV kernel (0: never, so no step is
    replayed); None measures it per weight shape (or reads `MINIPAGED_GEMV_ROWS`)."""

    name = "cpu"
    attention_backend = "cpu"
    quantizations = QUANTIZATIONS
    collective_backend = "gloo"
    # A rank with more threads than its share of the cores stalls every collective.
    rank_threads = 1

    def __init__(self, device: torch.device, attention: AttentionOps = CPU_OPS, *,
                 capture: bool = True, max_num_seqs: int = 256,
                 gemv_rows: int | None = None) -> None:
        super().__init__(device, attention)
        if capture and attention is CPU_OPS and kernel_calls_available():  # records its kernels
            self.graph_sizes = replay_ladder(max_num_seqs)  # `load` keeps what the kernels take
        self.arena = Arena()  # the captured steps' buffers
        env = os.environ.get(GEMV_ROWS_VARIABLE)
        self.gemv_rows = gemv_rows if gemv_rows is not None or not env else int(env)

    @classmethod
    def check_and_update_config(cls, config: Any) -> None:
        """The base's settling, and int8's rule: float32 weights on one rank."""
        super().check_and_update_config(config)
        if config.quantization is not None and (config.tensor_parallel_size != 1
                                                or config.dtype != "float32"):
            raise ValueError(
                f"quantization {config.quantization!r} runs on one rank over float32 weights: "
                f"tensor_parallel_size must be 1 and dtype float32, got "
                f"{config.tensor_parallel_size} and {config.dtype}")

    @classmethod
    def native_bfloat16(cls) -> bool:
        """AMX-BF16 or AVX-512 BF16 among the CPU's flags."""
        return bool(cpu_flags() & BFLOAT16_CPU_FLAGS)

    def capture_key(self) -> object:
        """The thread count: a recorded step's kernel calls are bound to it."""
        return torch.get_num_threads()

    def load(self, model: nn.Module, quantization: str | None = None) -> nn.Module:
        """Swap the CPU's modules in, quantise (`quantization`: one of `QUANTIZATIONS`), lay the
        weights out on huge pages and make the few-row choice of every projection."""
        swap_modules(model, SWAPS)
        if quantization is not None:
            quantize_model(model, quantization)
        head = getattr(model, "lm_head", None)
        if isinstance(head, CPULinear | Int8Linear):
            head.logits = True  # float32 logits from the kernel's call, as compute_logits's
        lay_out_weights(model)
        layers = [m for m in model.modules() if isinstance(m, CPULinear | Int8Linear)]
        for layer in layers:
            if isinstance(layer, CPULinear):
                pack_for_onednn(layer)
            choose_few_rows(layer, self.gemv_rows)
        paths = [layer.few_rows for layer in layers]
        for path in {p.plan.weight_dtype: p for p in paths if p is not None}.values():
            if path.plan.fetch_ahead_matters():
                for rows in FETCH_AHEAD_ROWS:  # measured now, not by a step's first call
                    fetch_ahead(path.plan.weight_dtype, rows)
        max_rows = min((p.max_rows if p is not None else 0 for p in paths), default=0)
        self.graph_sizes = self.graph_sizes[:max_rows]
        logger.info("cpu platform: %d projections, the GEMV kernel up to %s rows; decode steps "
                    "of up to %d sequences replayed", len(layers),
                    sorted({p.max_rows for p in paths if p is not None}) or "no",
                    len(self.graph_sizes))
        return model

    def capture(self, forward: Callable[[], Tensor]) -> tuple[Replay, Tensor]:
        """Record `forward`'s kernel calls (`replay.capture`) and return their replay."""
        try:
            replay, out = capture(forward, self.arena)
        except CaptureError as error:
            raise CaptureUnsupported(str(error)) from error
        return replay.run, out

    def greedy_tokens(self, logits: Tensor) -> tuple[Tensor, Tensor] | None:
        """One C call over finite float32 CPU logits (`minipaged.kernels.cpu.greedy`)."""
        if not (logits.dtype == torch.float32 and logits.device.type == "cpu"
                and logits.is_contiguous() and greedy_tokens_available()):
            return None
        return greedy_tokens(logits)
