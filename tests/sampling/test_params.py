"""`SamplingParams`' ranges: a value is refused naming its field, or it is one the sampler computes
with (no exception, a token inside the vocabulary, a log-probability that is a number).

The values are the extremes a client can send: int64's and uint64's limits and one beyond,
integers too long for a float, huge and tiny floats, inf and NaN, strings, lists, None and bools.
The engine-level twin of these tests (bad requests beside normal ones in one batch) is
`tests/engine/test_isolation.py`.
"""

from __future__ import annotations

import math
import re
from dataclasses import fields

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.sampling.params import (
    MAX_INT64,
    MAX_LENGTH_PENALTY,
    MAX_LOGPROBS,
    MAX_SEED,
    SamplingParams,
)
from minipaged.sampling.sampler import (
    Sampler,
    SamplingRow,
    derive_seed,
    make_generator,
    min_tokens_banned_ids,
)

FIELDS = [f.name for f in fields(SamplingParams)]
INT_FIELDS = ["n", "top_k", "max_tokens", "min_tokens", "beam_width", "logprobs", "seed"]
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "length_penalty"]
EXTREMES = [
    2**63, 2**63 - 1, -(2**63) - 1, -(2**63), 2**64, 2**64 - 1, 10**400, -(10**400),
    -1, 0, 1, 2, MAX_LOGPROBS + 1, True, False, None,
    math.inf, -math.inf, math.nan, 1e308, -1e308, 5e-324, 1e-300, 1e-5, 0.5, -0.5, 2.0, 2.5,
    -2.0, MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY + 0.5, "1", "", "a", [], [1], [""], ["a"],
    [2**63], [2**63 - 1], [-1], [True], {}, (1, 2), b"1",
]
extreme_values = st.one_of(
    st.sampled_from(EXTREMES),
    st.integers(),
    st.floats(),
    st.text(max_size=3),
    st.lists(st.one_of(st.integers(), st.text(max_size=2), st.none()), max_size=3),
)
# Valid starting points, so that a changed field meets each mode's rules.
BASES = [
    {},
    {"temperature": 0.0},
    {"temperature": 0.8, "top_k": 5, "top_p": 0.9, "min_p": 0.05, "seed": 3, "n": 2},
    {"use_beam_search": True, "beam_width": 3, "n": 2, "temperature": 0.0},
    {"min_tokens": 2, "stop_token_ids": [1, 2], "repetition_penalty": 1.3, "logprobs": 2},
]
# A field's value can break a rule it shares with another field; the error then names either.
SHARED_RULES = [
    {"min_tokens", "max_tokens"},
    {"n", "temperature", "beam_width", "use_beam_search"},
    {"temperature", "top_k", "top_p", "min_p", "beam_width", "length_penalty", "use_beam_search"},
]
VOCAB = 32
EOS = 1


def related(a: str, b: str) -> bool:
    return a == b or any(a in rule and b in rule for rule in SHARED_RULES)


def sample_once(params: SamplingParams, batch_seed: int = 0) -> tuple[int, float]:
    """One token of `params` from seeded random logits, with a history to penalise."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(batch_seed)) * 4
    generator = None if params.seed is None else make_generator(params.seed, 1)
    row = SamplingRow(params, prompt_token_ids=[3, 4, 4], output_token_ids=[5, 3],
                      generator=generator,
                      banned_token_ids=min_tokens_banned_ids(params, 0, [EOS]))
    out = Sampler(torch.Generator().manual_seed(0))(logits, [row])
    return int(out.token_ids[0]), float(out.logprobs[0])


def assert_computable(params: SamplingParams) -> None:
    """What the sampler and the model rely on after construction."""
    for name in INT_FIELDS:
        value = getattr(params, name)
        if value is not None:
            assert type(value) is int and 0 <= value <= (MAX_SEED - 1 if name == "seed"
                                                          else MAX_INT64), name
    for name in FLOAT_FIELDS:
        value = getattr(params, name)
        assert not isinstance(value, bool) and math.isfinite(value), name
    assert type(params.ignore_eos) is bool and type(params.use_beam_search) is bool
    assert all(type(s) is str and s for s in params.stop)
    assert all(type(t) is int and 0 <= t <= MAX_INT64 for t in params.stop_token_ids)
    assert params.logprobs is None or params.logprobs <= MAX_LOGPROBS
    assert abs(params.length_penalty) <= MAX_LENGTH_PENALTY


@settings(max_examples=600, deadline=None)
@given(base=st.sampled_from(BASES), field=st.sampled_from(FIELDS), value=extreme_values)
def test_every_value_is_refused_naming_its_field_or_sampled_with(base, field, value) -> None:
    try:
        params = SamplingParams(**{**base, field: value})
    except ValueError as exc:
        named = re.match(r"(\w+) must", str(exc))
        assert named and named.group(1) in FIELDS, str(exc)
        assert related(field, named.group(1)), (field, str(exc))
        return
    assert_computable(params)
    token, logprob = sample_once(params)
    assert 0 <= token < VOCAB and not math.isnan(logprob)


@pytest.mark.parametrize("name", ["n", "top_k", "max_tokens", "beam_width"])
def test_integers_stop_at_the_int64_limit(name) -> None:
    base = {"use_beam_search": True, "temperature": 0.0} if name == "beam_width" else {}
    with pytest.raises(ValueError, match=rf"^{name} must .*2\*\*63"):
        SamplingParams(**base, **{name: 2**63})
    assert getattr(SamplingParams(**base, **{name: MAX_INT64}), name) == MAX_INT64
    with pytest.raises(ValueError, match=r"^stop_token_ids must"):
        SamplingParams(stop_token_ids=[2**63])


def test_an_integer_too_long_to_print_is_refused_by_its_size() -> None:
    """Python refuses to print ints of over 4,300 digits; the message still names the field."""
    with pytest.raises(ValueError, match=r"^max_tokens must .* an integer of \d+ bits"):
        SamplingParams(max_tokens=10**5000)
    with pytest.raises(ValueError, match=r"^temperature must be a finite number"):
        SamplingParams(temperature=10**400)  # an int beyond float's range is not finite


def test_the_seed_range_is_what_torch_generators_take() -> None:
    generator = torch.Generator()
    generator.manual_seed(MAX_SEED - 1)
    assert generator.initial_seed() == MAX_SEED - 1
    with pytest.raises((ValueError, RuntimeError, OverflowError)):
        generator.manual_seed(MAX_SEED)
    assert SamplingParams(seed=MAX_SEED - 1).seed == MAX_SEED - 1
    with pytest.raises(ValueError, match="^seed must"):
        SamplingParams(seed=MAX_SEED)


@given(
    seed=st.one_of(st.integers(0, MAX_SEED - 1), st.sampled_from([0, MAX_SEED - 1])),
    index=st.one_of(st.integers(0, 2**70), st.sampled_from([0, 1, MAX_INT64])),
)
def test_derived_seeds_are_seeds_torch_takes(seed, index) -> None:
    derived = derive_seed(seed, index)
    assert 0 <= derived < MAX_SEED
    assert make_generator(seed, index).initial_seed() == derived


@pytest.mark.parametrize(
    "name, value",
    [("temperature", 1e308), ("temperature", 1e-5), ("repetition_penalty", 5e-324),
     ("repetition_penalty", 1e308), ("top_p", 5e-324), ("top_k", MAX_INT64),
     ("min_p", 1.0), ("presence_penalty", -2.0), ("frequency_penalty", 2.0)],
)
def test_extreme_accepted_values_leave_the_other_rows_of_the_batch_alone(name, value) -> None:
    """A row with an extreme (accepted) setting samples a token inside the vocabulary, and the
    greedy and seeded rows beside it give exactly what they give alone."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(7)) * 30
    extreme = SamplingParams(**{name: value}, seed=11)
    greedy, seeded = SamplingParams(temperature=0.0), SamplingParams(seed=5, top_k=4)

    def rows(params_list):
        return [SamplingRow(p, prompt_token_ids=[2, 3], output_token_ids=[3],
                            generator=make_generator(p.seed) if p.seed is not None else None)
                for p in params_list]

    together = Sampler()(logits, rows([greedy, extreme, seeded]))
    assert 0 <= int(together.token_ids[1]) < VOCAB
    assert not torch.isnan(together.logprobs).any()
    alone_greedy = Sampler()(logits[:1], rows([greedy]))
    alone_seeded = Sampler()(logits[2:], rows([seeded]))
    assert int(together.token_ids[0]) == int(alone_greedy.token_ids[0])
    assert int(together.token_ids[2]) == int(alone_seeded.token_ids[0])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_that_bans_every_token_still_samples_one(temperature) -> None:
    """Stop tokens covering the whole vocabulary before `min_tokens`: the ban would leave nothing
    to draw (softmax of all -inf is NaN), so that row samples as if unbanned."""
    params = SamplingParams(temperature=temperature, min_tokens=3,
                            stop_token_ids=list(range(VOCAB)))
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2))
    banned = min_tokens_banned_ids(params, 0, [EOS])
    out = Sampler()(logits, [SamplingRow(params, banned_token_ids=banned)])
    assert 0 <= int(out.token_ids[0]) < VOCAB and math.isfinite(float(out.logprobs[0]))
    if temperature == 0.0:
        assert int(out.token_ids[0]) == int(logits.argmax())


def test_banned_ids_outside_the_vocabulary_ban_nothing() -> None:
    params = SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[MAX_INT64, VOCAB])
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    banned = min_tokens_banned_ids(params, 0, [])
    out = Sampler()(logits, [SamplingRow(params, banned_token_ids=banned)])
    assert int(out.token_ids[0]) == int(logits.argmax())
