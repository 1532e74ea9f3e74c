"""A request's own parameters can never end another request (issue 28, "Isolation").

Hypothesis gives requests extreme and wrong-typed values in any `SamplingParams` field (int64's
and uint64's limits and one beyond, integers too long for a float, huge floats, inf, NaN,
strings, lists, None, bools), set at construction or on the object afterwards, and adds them
through `LLMEngine.add_request` of a tiny engine while normal greedy requests run in the same
batches. Each bad request is refused at once with a TypeError / ValueError naming its field, or
runs to a normal finish; the normal requests finish with exactly the tokens they get alone; no
block leaks. (`top_k=2**63` used to pass and make the sampler raise inside the step, ending
every request of the batch with "error".)
"""

from __future__ import annotations

import math
import re
from dataclasses import fields

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import assert_engine_drained, run_bounded, tiny_engine, tiny_llama_parts

from minipaged.sampling.params import SamplingParams

FIELDS = [f.name for f in fields(SamplingParams)]
EXTREMES = [
    2**63, 2**63 - 1, -(2**63) - 1, -(2**63), 2**64, 2**64 - 1, 10**400, -1, 0, 1, 2, 3, 21, 64,
    65, True, False, None, math.inf, -math.inf, math.nan, 1e308, -1e308, 5e-324, 1e-300, 1e-5,
    0.5, -0.5, 2.0, 2.5, -2.0, 10.0, 10.5, "1", "", "a", [], [1], [""], ["a"], [2**63], [63],
    [64], [-1], [True], {}, b"1",
]
extreme_values = st.one_of(
    st.sampled_from(EXTREMES),
    st.integers(),
    st.floats(),
    st.text(max_size=3),
    st.lists(st.one_of(st.integers(-2, 70), st.text(max_size=2)), max_size=3),
)
BASES = [
    {"temperature": 0.0, "max_tokens": 5},
    {"temperature": 0.9, "top_k": 8, "top_p": 0.9, "seed": 1, "n": 2, "max_tokens": 5},
    {"use_beam_search": True, "beam_width": 2, "temperature": 0.0, "max_tokens": 4},
    {"min_tokens": 2, "stop_token_ids": [3], "repetition_penalty": 1.2, "logprobs": 2,
     "max_tokens": 5},
]
# Rules that hold between fields: a refusal may name any field of a rule the changed one is in.
SHARED_RULES = [
    {"min_tokens", "max_tokens"},
    {"n", "temperature", "beam_width", "use_beam_search", "max_tokens"},
    {"temperature", "top_k", "top_p", "min_p", "beam_width", "length_penalty", "use_beam_search"},
]
NORMAL_PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ENGINE = dict(num_gpu_blocks=160, num_cpu_blocks=32, block_size=4, max_model_len=24)


@pytest.fixture(scope="module")
def parts():
    return tiny_llama_parts()


@pytest.fixture(scope="module")
def alone(parts) -> list[list[int]]:
    """Each normal prompt's greedy tokens with nothing else running."""
    tokens = []
    for prompt in NORMAL_PROMPTS:
        engine = tiny_engine(parts, **ENGINE)
        request_id = engine.add_request(None, prompt, GREEDY)
        tokens.append(run_bounded(engine)[request_id].outputs[0].token_ids)
    return tokens


def names_a_related_field(message: str, field: str) -> bool:
    named = set(re.findall(r"\b\w+\b", message)) & set(FIELDS)
    return any(n == field or any(n in r and field in r for r in SHARED_RULES) for n in named)


def bad_params(base: dict, field: str, value: object, afterwards: bool) -> SamplingParams:
    """`base` with `field` set to `value`: at construction, or on the object after it."""
    if not afterwards:
        return SamplingParams(**{**base, field: value})
    params = SamplingParams(**base)
    setattr(params, field, value)
    return params


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    bad=st.lists(
        st.tuples(st.sampled_from(BASES), st.sampled_from(FIELDS), extreme_values,
                  st.booleans()),
        min_size=1, max_size=3,
    ),
    first=st.booleans(),
)
def test_bad_parameters_never_end_other_requests(parts, alone, bad, first) -> None:
    engine = tiny_engine(parts, **ENGINE)
    normal = []
    if first:
        normal = [engine.add_request(None, p, GREEDY) for p in NORMAL_PROMPTS]
    admitted = []
    for base, field, value, afterwards in bad:
        try:
            params = bad_params(base, field, value, afterwards)
            admitted.append(engine.add_request(None, [5, 6, 7], params))
        except (TypeError, ValueError) as exc:
            assert names_a_related_field(str(exc), field), (field, value, str(exc))
    if not first:
        engine.step()  # the bad requests run a step before the normal ones join
        normal = [engine.add_request(None, p, GREEDY) for p in NORMAL_PROMPTS]
    finals = run_bounded(engine)
    for request_id, expected in zip(normal, alone, strict=True):
        completion = finals[request_id].outputs[0]
        assert completion.finish_reason == "length" and completion.token_ids == expected
    for request_id in admitted:
        if request_id in finals:  # (one that finished in the step before the normal ones)
            reasons = {c.finish_reason for c in finals[request_id].outputs}
            assert reasons <= {"stop", "length"}, reasons
    assert_engine_drained(engine)


@pytest.mark.parametrize("field, value", [("top_k", 2**63), ("top_k", 65), ("seed", 2**64),
                                          ("stop_token_ids", [2**63]), ("logprobs", 10**6)])
def test_a_field_set_after_construction_is_refused_at_admission(parts, field, value) -> None:
    """The values of issue 28's report, set on a valid object (no construction check runs)."""
    engine = tiny_engine(parts, **ENGINE)
    normal = engine.add_request(None, NORMAL_PROMPTS[0], GREEDY)
    params = SamplingParams(temperature=0.7)
    setattr(params, field, value)
    with pytest.raises(ValueError, match=rf"^{field} must"):
        engine.add_request(None, [5, 6, 7], params)
    assert run_bounded(engine)[normal].outputs[0].finish_reason == "length"
    assert_engine_drained(engine)
