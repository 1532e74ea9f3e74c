"""The CUDA platform (`minipaged.platforms.cuda`): its ladder of captured batch sizes, its
attention operations, and on a GPU its CUDA graphs and memory accounting.

* `graph_ladder` (1, 2, 4, 8, then every 16, and `max_num_seqs` itself) covers every decode
  batch up to `max_num_seqs` with less than 16 rows of padding past 8.
* `triton_ops` are the Triton kernels of `minipaged.kernels`; swaps are the reference's copy.
* On a GPU (`benchmarks/gpu/check.py` runs them; a CPU-only run skips them): a runner
  replaying its decode steps from CUDA graphs gives the eager runner's logits and K/V, over
  several steps and batch sizes padded up the ladder; the KV cache's budget falls by what the
  profile step holds at its peak.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tiny_models import plan_of, scheduled, tiny_llama_parts

from minipaged.attention.reference import swap_blocks
from minipaged.platforms.base import GiB
from minipaged.platforms.cuda import CUDAPlatform, graph_ladder, triton_ops
from minipaged.runner.config import RunnerConfig
from minipaged.runner.model_runner import ModelRunner

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@given(st.integers(1, 600))
def test_the_ladder_covers_every_batch_with_little_padding(max_num_seqs):
    sizes = graph_ladder(max_num_seqs)
    assert list(sizes) == sorted(set(sizes)) and sizes[-1] == max_num_seqs
    small = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    if max_num_seqs < 8 and max_num_seqs not in small:
        small.append(max_num_seqs)  # the largest size is always captured
    assert [s for s in sizes if s <= 8] == small
    assert all(s % 16 == 0 for s in sizes[:-1] if s > 8)
    for rows in range(1, max_num_seqs + 1):
        size = next(s for s in sizes if s >= rows)
        assert size - rows < (16 if rows > 8 else rows)  # never twice the rows past 8


def test_a_platform_captures_its_ladder_unless_eager():
    assert CUDAPlatform(torch.device("cuda"), max_num_seqs=40).graph_sizes == (1, 2, 4, 8, 16,
                                                                                32, 40)
    assert CUDAPlatform(torch.device("cuda"), capture=False).graph_sizes == ()
    with pytest.raises(ValueError, match="quantization 'int8' needs a platform that has it"):
        RunnerConfig(device="cuda", quantization="int8")
    assert (CUDAPlatform.collective_backend, CUDAPlatform.pin_memory) == ("nccl", True)
    assert RunnerConfig(device="cuda").max_num_seqs == 256  # vLLM's batch limits


def test_its_attention_is_the_triton_kernels():
    import minipaged.kernels as kernels

    ops = triton_ops()
    assert ops is triton_ops() and ops.name == "triton"
    assert ops.paged_attention is kernels.paged_attention
    assert ops.reshape_and_cache is kernels.reshape_and_cache
    assert ops.copy_blocks is kernels.copy_blocks
    assert ops.swap_blocks is swap_blocks
    assert CUDAPlatform(torch.device("cuda")).attention is ops


def steps(rows: int) -> list:
    """A prefill of `rows` sequences, then three decode steps of them."""
    tables = [[2 * i, 2 * i + 1] for i in range(rows)]
    plans = [[scheduled([1 + i, 2, 3], 0, t, seq_id=i) for i, t in enumerate(tables)]]
    plans += [[scheduled([5 + s], 3 + s, t, seq_id=i) for i, t in enumerate(tables)]
              for s in range(3)]
    return plans


@GPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replayed_cuda_graphs_give_the_eager_runners_logits_and_caches(dtype):
    model, config = tiny_llama_parts()
    model = model.to(dtype)
    # The same kernels; the captured attention is bound by the context limit, not the step's
    # longest context, so its split may differ: sums in another order.
    tolerance = (dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32
                 else dict(atol=2e-2, rtol=2e-2))

    def runner(eager: bool) -> ModelRunner:
        settings = RunnerConfig(device="cuda", dtype=str(dtype).removeprefix("torch."),
                                block_size=4, num_gpu_blocks=64, num_cpu_blocks=0,
                                enforce_eager=eager, max_num_seqs=24)
        return ModelRunner(copy.deepcopy(model), config, settings)

    replaying, eager = runner(False), runner(True)
    assert isinstance(replaying.platform, CUDAPlatform) and replaying.graphs is not None
    assert eager.graphs is None
    captured = []
    real = replaying.platform.capture
    replaying.platform.capture = lambda forward: captured.append(1) or real(forward)
    for rows in (3, 1, 17):  # padded to 4, 1 and 24
        for cache in replaying.kv_caches + eager.kv_caches:
            cache.zero_()
        for entries in steps(rows):
            ours = replaying.execute(plan_of(entries)).clone()
            torch.testing.assert_close(ours, eager.execute(plan_of(entries)), **tolerance)
        for a, b in zip(replaying.kv_caches, eager.kv_caches, strict=True):
            torch.testing.assert_close(a, b, **tolerance)
    assert len(captured) == 3


@GPU
def test_the_kv_budget_falls_by_what_the_profile_holds_at_its_peak():
    platform = CUDAPlatform(torch.device("cuda"))
    held = []

    def profile(nbytes: int) -> None:
        held.append(torch.empty(nbytes, dtype=torch.uint8, device="cuda"))
        held.clear()  # freed again: the peak counts, not what is left

    settings = RunnerConfig(device="cuda", gpu_memory_utilization=0.5, kv_cache_memory=4.0)
    light = platform.kv_cache_bytes([lambda: profile(1 << 20)], settings)
    heavy = platform.kv_cache_bytes([lambda: profile(1 << 30)], settings)
    both = platform.kv_cache_bytes([lambda: profile(1 << 30), lambda: profile(1 << 29)],
                                   settings)  # a step's peak and a capture's: held together
    assert abs((heavy - both) - (1 << 29)) < 64 << 20
    total = torch.cuda.get_device_properties(0).total_memory
    assert light < 0.5 * total
    assert abs((light - heavy) - ((1 << 30) - (1 << 20))) < 64 << 20
    assert heavy != 4.0 * GiB  # measured, not the CPU's configured size
