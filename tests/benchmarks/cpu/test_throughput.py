"""The step log of the throughput benchmark (`cpu.throughput.StepLog`), which sets every step of a
real engine run against its floor: what it counts must add up to the run it watched.

Over random request sets on a tiny engine (chunked prefill, so prompts come in pieces): every
step is logged once, the tokens it logs add up to every prompt token plus every sampled token
but each request's last (sampled, never computed), and the rows it logs as sampling add up to
the tokens the requests got.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import tiny_engine, tiny_llama_parts

sys.path.insert(0, str(Path(__file__).parents[3] / "benchmarks"))

from cpu.throughput import StepLog  # noqa: E402
from minipaged.sampling.params import SamplingParams  # noqa: E402

PARTS = tiny_llama_parts()


@given(requests=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12)), min_size=1,
                         max_size=5))
@settings(max_examples=15, deadline=None)
def test_the_step_log_adds_up_to_the_run(requests):
    engine = tiny_engine(PARTS, num_gpu_blocks=64, block_size=4, max_num_batched_tokens=16,
                         enable_prefix_caching=False)
    log = StepLog()
    engine.add_step_observer(log)
    for i, (prompt_len, new_tokens) in enumerate(requests):
        engine.add_request(f"r{i}", [(i + j) % 60 + 1 for j in range(prompt_len)],
                           SamplingParams(max_tokens=new_tokens, ignore_eos=True,
                                          temperature=0))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    prompt_tokens = sum(p for p, _ in requests)
    output_tokens = sum(n for _, n in requests)
    assert len(log.step_s) == len(log.tokens) == len(log.logits_rows) == steps
    assert sum(log.tokens) == prompt_tokens + output_tokens - len(requests)
    assert sum(log.logits_rows) == output_tokens
    assert all(n <= 16 for n in log.tokens)
