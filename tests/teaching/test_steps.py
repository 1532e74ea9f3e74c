"""Reading step records: slots, idle slots, prompt chunks, a step's batch as text."""

from __future__ import annotations

from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from minipaged.sched.cost_model import OPT_13B_A100  # noqa: E402
from minipaged.sched.fcfs import FCFSScheduler  # noqa: E402
from minipaged.sched.output import SchedulerConfig  # noqa: E402
from minipaged.sim.simulator import simulate  # noqa: E402
from minipaged.sim.traces import TraceRequest  # noqa: E402
from teaching import pictures  # noqa: E402
from teaching.steps import (  # noqa: E402
    first_step,
    idle_slot_steps,
    prefill_chunks,
    slot_lanes,
    step_work,
)


def work(request_id: str, tokens: int = 1, prefill: bool = False, seq_id: int = 0):
    return SimpleNamespace(request_id=request_id, seq_id=seq_id, is_prefill=prefill,
                           num_new_tokens=tokens)


def record(index: int, *scheduled):
    return SimpleNamespace(index=index, scheduled=list(scheduled))


# Three steps: a and b start; a decodes while b is gone and c takes the lowest free slot.
RECORDS = [
    record(0, work("a", 5, True), work("b", 3, True)),
    record(1, work("a"), work("b")),
    record(2, work("c", 4, True), work("a")),
]


def test_a_sequence_keeps_its_slot_and_a_newcomer_takes_the_lowest_free_one():
    assert slot_lanes(RECORDS, 3) == [["a", "b", None], ["a", "b", None], ["a", "c", None]]
    assert idle_slot_steps(RECORDS, 3) == 3
    assert idle_slot_steps(RECORDS, 3) == sum(row.count(None) for row in slot_lanes(RECORDS, 3))
    with pytest.raises(ValueError, match="step 0 ran 2 sequences in 1 slots"):
        slot_lanes(RECORDS, 1)


def test_samples_of_one_request_take_a_slot_each():
    forked = [record(0, work("a", 4, True)), record(1, work("a"), work("a", seq_id=1))]
    assert slot_lanes(forked, 2) == [["a", None], ["a", "a"]]


def test_prompt_chunks_first_steps_and_the_printed_batch():
    assert prefill_chunks(RECORDS, "a") == [(0, 5)]
    assert prefill_chunks(RECORDS, "c") == [(2, 4)]
    assert first_step(RECORDS, "c") == 2 and first_step(RECORDS, "z") is None
    assert step_work(RECORDS[2]) == "c:4P, a:1D"


def simulated(lengths: list[int], num_slots: int):
    trace = [TraceRequest(0.0, 8, n) for n in lengths]
    config = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=num_slots,
                             max_model_len=64)
    return simulate(trace, OPT_13B_A100, FCFSScheduler, num_gpu_blocks=64, config=config,
                    record_steps=True).steps


def test_continuous_batching_of_the_notebook_by_hand():
    """Notebook 06's six requests of 4, 16, 6, 16, 2 and 8 tokens on 3 slots, through the real
    FCFS scheduler (simulated): a finished request's slot is refilled the next step, so the
    batch runs 20 steps with 8 idle slot-steps, all after the last request was admitted."""
    steps = simulated([4, 16, 6, 16, 2, 8], 3)
    lanes = slot_lanes(steps, 3)
    assert len(steps) == 20 and idle_slot_steps(steps, 3) == 3 * 20 - 52
    assert lanes[4][0] == "3" and lanes[6][2] == "4" and lanes[8][2] == "5"
    fig = pictures.draw_slot_use({"continuous": steps, "again": steps}, 3)
    assert fig.get_figwidth() <= 9
    texts = [t for t in fig.findobj(matplotlib.text.Text) if t.get_text().strip()]
    assert min(t.get_fontsize() for t in texts) >= pictures.FONT
    assert any("20 steps, 8 idle slot-steps" in t.get_text() for t in texts)
    plt.close(fig)
