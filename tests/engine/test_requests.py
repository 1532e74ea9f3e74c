"""`minipaged.engine.requests` on its own: the admission checks and the stream of one request.

The checks are hunted with random prompts and parameters against the rule they state (an id is
admitted iff it lies in [0, vocab_size); a wrong kind of value is a `TypeError`, a wrong value a
`ValueError`, each naming the field); the stream is driven by a scripted engine that delivers
outputs on a random schedule, so its order, its end and its closing are checked step by step.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minipaged.engine.requests import RequestStream, check_params, prompt_token_ids
from minipaged.sampling.outputs import RequestOutput
from minipaged.sampling.params import SamplingParams

VOCAB = 50


class RecordingTokenizer:
    """Encodes a text as its characters' code points modulo `modulo`, recording each call."""

    def __init__(self, modulo: int) -> None:
        self.modulo, self.calls = modulo, []

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        self.calls.append((text, add_special_tokens))
        return [ord(c) % self.modulo for c in text]


# -- check_params --------------------------------------------------------------------------------


@given(
    vocab=st.integers(1, 100),
    ids=st.lists(st.integers(0, 150), max_size=8),
    has_tokenizer=st.booleans(),
)
def test_stop_token_ids_are_admitted_iff_inside_the_vocabulary(vocab, ids, has_tokenizer) -> None:
    params = SamplingParams(stop_token_ids=ids)
    outside = [t for t in ids if t >= vocab]
    if outside:
        with pytest.raises(ValueError, match="stop_token_ids") as info:
            check_params(params, vocab, has_tokenizer)
        assert str(outside[:5]) in str(info.value)
    else:
        assert check_params(params, vocab, has_tokenizer) == params
        assert params.stop_token_ids == ids  # the checks leave the request's values alone


def test_the_request_keeps_its_own_copy_checked_again() -> None:
    """A field set after construction is checked at admission, and changing the caller's object
    after it cannot reach the admitted request (top_k=2**63 set so made the sampler raise
    inside a step, ending every request of the batch)."""
    params = SamplingParams(temperature=0.5, stop_token_ids=[3])
    admitted = check_params(params, VOCAB, has_tokenizer=False)
    assert admitted == params and admitted is not params
    params.top_k, params.stop_token_ids[0] = 2**63, 10**30
    assert (admitted.top_k, admitted.stop_token_ids) == (0, [3])
    with pytest.raises(ValueError, match=r"^stop_token_ids must"):
        check_params(params, VOCAB, has_tokenizer=False)
    params.stop_token_ids = []
    with pytest.raises(ValueError, match=r"^top_k must"):
        check_params(params, VOCAB, has_tokenizer=False)


@given(top_k=st.integers(0, 3 * VOCAB))
def test_top_k_is_admitted_up_to_the_vocabulary(top_k) -> None:
    params = SamplingParams(top_k=top_k)
    if top_k > VOCAB:
        with pytest.raises(ValueError, match=rf"^top_k must .*vocabulary's {VOCAB} tokens"):
            check_params(params, VOCAB, has_tokenizer=False)
    else:
        assert check_params(params, VOCAB, has_tokenizer=False).top_k == top_k


def test_no_params_means_the_defaults() -> None:
    assert check_params(None, VOCAB, has_tokenizer=False) == SamplingParams()


@pytest.mark.parametrize("params", [{"temperature": 0.5}, "greedy", 1, object()])
def test_params_of_another_type_are_a_type_error_naming_the_field(params) -> None:
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
        check_params(params, VOCAB, has_tokenizer=True)


@given(stop=st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=3))
def test_stop_strings_are_admitted_only_with_a_tokenizer(stop) -> None:
    params = SamplingParams(stop=stop)
    assert check_params(params, VOCAB, has_tokenizer=True) == params
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        check_params(params, VOCAB, has_tokenizer=False)


# -- prompt_token_ids ----------------------------------------------------------------------------


@given(
    ids=st.lists(st.integers(-5, 2 * VOCAB), max_size=10),
    kind=st.sampled_from([list, tuple, lambda ids: list(np.array(ids, dtype=np.int64))]),
)
def test_token_id_prompts_are_admitted_iff_every_id_is_in_the_vocabulary(ids, kind) -> None:
    prompt = kind(ids)
    bad = [t for t in ids if not 0 <= t < VOCAB]
    if not ids:
        with pytest.raises(ValueError, match="the prompt is empty"):
            prompt_token_ids(prompt, None, VOCAB)
    elif bad:
        with pytest.raises(ValueError, match="prompt token ids") as info:
            prompt_token_ids(prompt, None, VOCAB)
        assert str(bad[:5]) in str(info.value)
    else:
        text, token_ids = prompt_token_ids(prompt, None, VOCAB)
        assert text is None and token_ids == ids
        assert all(type(t) is int for t in token_ids)  # numpy ints become Python ints


@given(
    ids=st.lists(st.integers(0, VOCAB - 1), max_size=4),
    wrong=st.sampled_from([True, False, 1.0, 2.5, "3", None, b"4", [5]]),
    at=st.integers(0, 4),
)
def test_a_token_id_that_is_not_an_int_is_a_type_error_naming_it(ids, wrong, at) -> None:
    prompt = ids[:at] + [wrong] + ids[at:]
    with pytest.raises(TypeError, match="prompt token ids must be ints") as info:
        prompt_token_ids(prompt, None, VOCAB)
    assert repr(wrong) in str(info.value)


@pytest.mark.parametrize("prompt", [b"\x01\x02", 7, None, {1, 2}, {"a": 1}, 3.0])
def test_a_prompt_of_another_kind_is_a_type_error_naming_the_field(prompt) -> None:
    with pytest.raises(TypeError, match="prompt must be a string or a sequence of token ids"):
        prompt_token_ids(prompt, RecordingTokenizer(VOCAB), VOCAB)


@given(text=st.text(max_size=12), modulo=st.integers(1, 2 * VOCAB))
def test_a_text_prompt_is_encoded_with_special_tokens_then_checked(text, modulo) -> None:
    tokenizer = RecordingTokenizer(modulo)
    encoded = [ord(c) % modulo for c in text]
    if not encoded:
        with pytest.raises(ValueError, match="the prompt is empty"):
            prompt_token_ids(text, tokenizer, VOCAB)
    elif any(t >= VOCAB for t in encoded):  # a tokenizer larger than the model's vocabulary
        with pytest.raises(ValueError, match="outside the vocabulary"):
            prompt_token_ids(text, tokenizer, VOCAB)
    else:
        assert prompt_token_ids(text, tokenizer, VOCAB) == (text, encoded)
    assert tokenizer.calls == [(text, True)]


def test_a_text_prompt_without_a_tokenizer_is_rejected() -> None:
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        prompt_token_ids("hello", None, VOCAB)


# -- RequestStream -------------------------------------------------------------------------------


class ScriptedEngine:
    """An engine that, at each step, delivers the next batch of the script to the stream's
    queue; the request ends (its parameters vanish) when a finished output is delivered or the
    stream is closed. `abort_at` aborts the request from elsewhere before that step."""

    def __init__(self, script: list[list[RequestOutput]], abort_at: int | None) -> None:
        self.script, self.abort_at = script, abort_at
        self.steps, self.closes, self.live = 0, [], True
        self.pending: deque[RequestOutput] = deque()

    def step(self, *, final_only: bool = False) -> list[RequestOutput]:
        assert final_only, "a stream builds no output that nobody reads"
        assert self.live, "a stream stepped the engine for a request that is gone"
        batch = self.script[self.steps] if self.steps < len(self.script) else []
        self.steps += 1
        self.pending.extend(batch)
        if any(o.finished for o in batch) or self.steps == self.abort_at:
            self.live = False
        return batch

    def get_sampling_params(self, request_id: str) -> SamplingParams | None:
        return SamplingParams() if self.live else None

    def close_stream(self, request_id: str, pending: deque[RequestOutput]) -> None:
        assert pending is self.pending
        self.closes.append(request_id)
        self.live = False


def output(i: int, finished: bool) -> RequestOutput:
    return RequestOutput(f"r{i}", None, [1], [], finished)


@given(
    batches=st.lists(st.integers(0, 3), min_size=1, max_size=8),
    abort_at=st.none() | st.integers(1, 8),
)
def test_a_stream_yields_each_delivered_output_in_order_and_ends_with_its_request(
    batches, abort_at
) -> None:
    """Empty steps are stepped through; the stream ends after the finished output, or at once
    when the request is aborted elsewhere; either way the engine hears the close, and the stream
    never steps the engine for a request that is gone."""
    count, script = 0, []
    for size in batches:
        script.append([output(count + j, False) for j in range(size)])
        count += size
    script.append([output(count, True)])
    engine = ScriptedEngine(script, abort_at)
    stream = RequestStream(engine, "req", engine.pending)
    got = list(stream)
    delivered = [o for batch in script[: engine.steps] for o in batch]
    assert got == delivered
    finished_seen = bool(got) and got[-1].finished
    assert finished_seen == (abort_at is None or abort_at > len(batches))
    assert [o.finished for o in got].count(True) == int(finished_seen)
    assert engine.closes and set(engine.closes) == {"req"}  # closing again is harmless
    steps = engine.steps
    with pytest.raises(StopIteration):
        next(stream)
    assert engine.steps == steps


def test_closing_a_stream_before_it_ends_tells_the_engine_every_time() -> None:
    engine = ScriptedEngine([[output(0, False)], [output(1, True)]], abort_at=None)
    stream = RequestStream(engine, "req", engine.pending)
    assert next(stream) == output(0, False)
    stream.close()
    assert engine.closes == ["req"] and not engine.live
    del stream  # collection closes again: the engine's close must be idempotent
    assert engine.closes == ["req", "req"]
