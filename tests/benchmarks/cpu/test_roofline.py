"""The parts of the roofline benchmark that decide its floors.

* `weight_bytes` (the bytes of the bandwidth floor): a tied head and its embedding are counted
  once, an untied embedding and the rotary tables not at all, tensors and not the one buffer a
  laid-out model's weights share.
* `time_decode_steps` (the paired floor): a read follows every timed decode step and no other
  step, so each step's floor is read at the step's own moment.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_models import tiny_engine, tiny_llama_parts

sys.path.insert(0, str(Path(__file__).parents[3] / "benchmarks"))

from cpu.roofline import time_decode_steps, weight_bytes  # noqa: E402
from minipaged.models.layers import RotaryEmbedding  # noqa: E402
from minipaged.platforms.cpu.weight_layout import lay_out_weights  # noqa: E402

PARTS = tiny_llama_parts()


def rotary() -> RotaryEmbedding:
    """Rotary tables of 32 positions (what `RotaryEmbedding` reads of a model's config)."""
    return RotaryEmbedding(SimpleNamespace(head_dim=4, rope_theta=10000.0, rope_scaling=None,
                                           max_position_embeddings=32))


class TinyLM(torch.nn.Module):
    """An embedding, one projection, a head (tied or not) and rotary tables."""

    def __init__(self, tie: bool, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8, dtype=dtype)
        self.proj = torch.nn.Linear(8, 8, bias=False, dtype=dtype)
        self.head = torch.nn.Linear(8, 50, bias=False, dtype=dtype)
        if tie:
            self.head.weight = self.embed.weight
        self.rotary = rotary()


def test_weight_bytes_count_a_tied_head_once_and_skip_an_untied_embedding_and_rotary():
    assert weight_bytes(TinyLM(tie=True)) == (8 * 8 + 50 * 8) * 4
    assert weight_bytes(TinyLM(tie=False)) == (8 * 8 + 50 * 8) * 4
    assert weight_bytes(TinyLM(tie=False, dtype=torch.bfloat16)) == (8 * 8 + 50 * 8) * 2
    model = TinyLM(tie=False)
    model.register_buffer("scales", torch.ones(50))  # a quantised head's scales are read too
    assert weight_bytes(model) == (8 * 8 + 50 * 8 + 50) * 4


def test_weight_bytes_count_tensors_not_the_one_buffer_they_share_once_laid_out():
    for tie in (True, False):
        model = TinyLM(tie=tie)
        lay_out_weights(model)  # every weight a view of one buffer, the embedding included
        assert model.embed.weight.untyped_storage().data_ptr() == \
            model.proj.weight.untyped_storage().data_ptr()
        assert weight_bytes(model) == (8 * 8 + 50 * 8) * 4


@dataclass(frozen=True)
class Quantised:
    """What a quantised layer holds outside its parameters: int8 values and float scales."""

    data: torch.Tensor
    scales: torch.Tensor


def test_weight_bytes_count_the_int8_values_and_scales_a_layer_holds_instead_of_its_weight():
    model = TinyLM(tie=False)
    model.proj.int8 = Quantised(torch.zeros(8, 8, dtype=torch.int8), torch.ones(8, 2))
    model.proj.weight = None
    assert weight_bytes(model) == 8 * 8 + 8 * 2 * 4 + 50 * 8 * 4


class StepCountingRead:
    """A stand-in for the read buffer: `sum()` notes how many steps the engine had made."""

    def __init__(self, steps: list) -> None:
        self.steps, self.after = steps, []

    def sum(self) -> None:
        self.after.append(len(self.steps))


@pytest.mark.parametrize("rows", [1, 3])
def test_a_read_follows_every_timed_decode_step_and_no_other(rows):
    engine = tiny_engine(PARTS, num_gpu_blocks=64, block_size=4, enable_prefix_caching=False)
    records = []
    engine.add_step_observer(records.append)
    read = StepCountingRead(records)
    timed = time_decode_steps(engine, rows, context=6, read=read, steps=5)
    decodes = [i + 1 for i, r in enumerate(records)  # steps made when a read would follow
               if all(w.num_new_tokens == 1 for w in r.scheduled)]
    assert read.after == decodes  # one read right after each decode step, none elsewhere
    assert len(records) > len(decodes)  # the prefill steps were not followed by a read
    # the first decode step is left out (warm-up): every later one is timed, with its read
    assert len(timed.step_s) == len(timed.forward_s) == len(timed.read_s) == len(decodes) - 1
    assert len(timed.step_s) >= 5
    assert timed.context_tokens == sorted(timed.context_tokens)
    assert min(timed.context_tokens) >= rows * (6 + 1)
    assert not engine.has_unfinished_requests()
