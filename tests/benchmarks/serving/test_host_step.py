"""The host-step benchmark (`benchmarks/serving/host_step.py`) measures the engine it means to:
its stand-in model's greedy walk comes out of replayed decode steps token for token, so the
steps it times computed what they claim; and a short run reports every phase of every size.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[3] / "benchmarks"))

from minipaged.sampling.params import SamplingParams  # noqa: E402
from serving.host_step import PHASES, VOCAB, run, stand_in_engine  # noqa: E402


def test_replayed_decode_steps_follow_the_stand_in_walk():
    engine = stand_in_engine(3, 64)
    prompts = [[5, 9, 2], [7] * 17, list(range(1, 33))]  # within, at and past a block's end
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ids = [engine.add_request(None, p, params) for p in prompts]
    finals = engine.run_until_done()
    assert engine.runner.platform.replays > 0  # decode steps came from replays
    for request_id, prompt in zip(ids, prompts, strict=True):
        tokens = list(prompt)
        for _ in range(params.max_tokens):  # the next token hashes the last and its position
            tokens.append((tokens[-1] * 31 + len(tokens) - 1) % VOCAB)
        assert finals[request_id].outputs[0].token_ids == tokens[len(prompt):]


def test_a_short_run_reports_every_phase():
    result = run(num_seqs=4, steps=3, seed=0)
    assert (result["num_seqs"], result["steps"]) == (4, 3)
    assert set(result["phase_ms_median"]) == set(PHASES)
    assert all(ms >= 0 for ms in result["phase_ms_median"].values())
