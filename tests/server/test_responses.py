"""`minipaged.server.responses` on its own: OpenAI's shapes for random outputs.

The engine's deltas of a stream, cut at random points, must come out of `ChoiceStream` as deltas
that add up to the final text and tokens, with offsets that say what was sent before and the
finish reason exactly once. Whole responses built for random requests have the OpenAI shape,
choice indices `prompt_index * n + sample_index`, log-probabilities ranked and texts decoded as
OpenAI does (a byte fragment becomes U+FFFD), and usage counts that add up.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from minipaged.sampling.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minipaged.server.responses import (
    ChoiceStream,
    chat_response,
    chat_role_chunk,
    completion_logprobs,
    completion_response,
    usage_chunk,
)

VOCAB = 12


class ByteTokenizer:
    """Token t is the bytes of `chr(t + 0x3b1)` (Greek letters, two bytes each), except that odd
    tokens are their first byte only: a fragment that is not valid UTF-8 alone."""

    def token_bytes(self, token_id: int) -> bytes:
        whole = chr(token_id + 0x3B1).encode()
        return whole[:1] if token_id % 2 else whole


def reference_text(token_id: int) -> str:
    return ByteTokenizer().token_bytes(token_id).decode("utf-8", errors="replace")


@st.composite
def completion(draw, index: int, with_logprobs: bool) -> CompletionOutput:
    token_ids = draw(st.lists(st.integers(0, VOCAB - 1), max_size=6))
    logprobs = None
    if with_logprobs:
        logprobs = []
        for t in token_ids:
            alts = draw(st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-20, 0), max_size=4))
            logprobs.append({**alts, t: draw(st.floats(-20, 0))})
    text = draw(st.text(max_size=10))
    reason = draw(st.sampled_from(["stop", "length", "abort"]))
    return CompletionOutput(index, text, token_ids, None, logprobs, reason)


@st.composite
def request_output(draw, n: int, with_logprobs: bool) -> RequestOutput:
    prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8))
    cached = draw(st.integers(0, len(prompt)))
    outputs = [draw(completion(i, with_logprobs)) for i in range(n)]
    metrics = RequestMetrics(arrival_time=0.0, num_cached_tokens=cached)
    return RequestOutput("r", None, prompt, outputs, True, metrics)


@st.composite
def requests(draw) -> tuple[int, bool, list[RequestOutput]]:
    n, with_logprobs = draw(st.integers(1, 3)), draw(st.booleans())
    outputs = draw(st.lists(request_output(n, with_logprobs), min_size=1, max_size=3))
    return n, with_logprobs, outputs


def assert_usage_adds_up(usage: dict, outputs: list[RequestOutput]) -> None:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    assert usage == {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt + completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": sum(o.metrics.num_cached_tokens for o in outputs)
        },
    }


def piece_of(c: CompletionOutput, start: tuple[int, int], end: tuple[int, int],
             last: bool) -> CompletionOutput:
    """The engine's delta of `c` between two (characters, tokens) marks; the finish in the last."""
    (chars, tokens), (end_chars, end_tokens) = start, end
    logprobs = None if c.logprobs is None else c.logprobs[tokens:end_tokens]
    return CompletionOutput(c.index, c.text[chars:end_chars], c.token_ids[tokens:end_tokens], None,
                            logprobs, c.finish_reason if last else None)


@given(request=requests(), data=st.data())
def test_stream_deltas_add_up_to_the_final_output(request, data) -> None:
    """The engine's deltas, cut at random points, come out as the chunks' deltas: joined they
    are the final text (and tokens, where log-probabilities show them), with offsets that say
    what was sent before, the finish reason exactly once, and every token counted."""
    n, _, outputs = request
    stream = ChoiceStream(n)
    sent: dict[int, list] = {}
    for prompt_index, final in enumerate(outputs):
        marks = [[(0, 0)] for _ in final.outputs]
        for _ in range(data.draw(st.integers(0, 4))):  # each mark at or after the one before
            for own, c in zip(marks, final.outputs, strict=True):
                chars, tokens = own[-1]
                own.append((data.draw(st.integers(chars, len(c.text))),
                            data.draw(st.integers(tokens, len(c.token_ids)))))
        for own, c in zip(marks, final.outputs, strict=True):
            own.append((len(c.text), len(c.token_ids)))
        for step in range(len(marks[0]) - 1):
            last = step == len(marks[0]) - 2
            pieces = [piece_of(c, own[step], own[step + 1], last)
                      for own, c in zip(marks, final.outputs, strict=True)]
            output = RequestOutput("r", None, final.prompt_token_ids, pieces, last)
            for delta in stream.deltas(prompt_index, output):
                got = sent.setdefault(delta.index, [])
                assert not any(d.finish_reason for d in got), "news after the finish"
                assert delta.text_offset == sum(len(d.text) for d in got)
                got.append(delta)
    assert stream.num_tokens == sum(len(c.token_ids) for o in outputs for c in o.outputs)
    for prompt_index, final in enumerate(outputs):
        for c in final.outputs:
            deltas = sent[prompt_index * n + c.index]
            assert "".join(d.text for d in deltas) == c.text
            if c.logprobs is not None:
                assert [t for d in deltas for t in d.token_ids] == c.token_ids
                assert [lp for d in deltas for lp in d.logprobs] == c.logprobs
            assert [d.finish_reason for d in deltas if d.finish_reason] == [c.finish_reason]
            assert deltas[-1].finish_reason == c.finish_reason


@given(request=requests(), with_tokenizer=st.booleans())
def test_completion_response_has_the_openai_shape_and_usage_adds_up(request, with_tokenizer):
    n, with_logprobs, outputs = request
    tokenizer = ByteTokenizer() if with_tokenizer else None
    body = completion_response("cmpl-1", 7, "m", tokenizer, outputs)
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert (body["id"], body["object"], body["created"], body["model"]) == (
        "cmpl-1", "text_completion", 7, "m")
    assert_usage_adds_up(body["usage"], outputs)
    finals = [(p * n + c.index, c) for p, o in enumerate(outputs) for c in o.outputs]
    assert [ch["index"] for ch in body["choices"]] == [i for i, _ in finals]
    for choice, (_, c) in zip(body["choices"], finals, strict=True):
        assert set(choice) == {"index", "text", "logprobs", "finish_reason"}
        assert (choice["text"], choice["finish_reason"]) == (c.text, c.finish_reason)
        if not with_logprobs:
            assert choice["logprobs"] is None
            continue
        lp = choice["logprobs"]
        texts = [reference_text(t) if tokenizer else f"token_id:{t}" for t in c.token_ids]
        assert lp["tokens"] == texts
        assert lp["token_logprobs"] == [alts[t] for t, alts in zip(c.token_ids, c.logprobs,
                                                                    strict=True)]
        assert lp["text_offset"] == [sum(len(x) for x in texts[:i]) for i in range(len(texts))]
        for top, alts in zip(lp["top_logprobs"], c.logprobs, strict=True):
            if tokenizer is None:  # distinct texts: every alternative is there, ranked
                assert top == {f"token_id:{t}": v for t, v in alts.items()}
                assert list(top.values()) == sorted(top.values(), reverse=True)
            else:  # alternatives with the same text share one key
                assert set(top) == {reference_text(t) for t in alts}


@given(request=requests(), top_k=st.integers(0, 5))
def test_chat_response_has_the_openai_shape_and_ranked_alternatives(request, top_k) -> None:
    n, with_logprobs, outputs = request
    output = outputs[0]
    body = chat_response("chat-1", 3, "m", ByteTokenizer(), output, top_k)
    assert (body["object"], len(body["choices"])) == ("chat.completion", n)
    assert_usage_adds_up(body["usage"], [output])
    for choice, c in zip(body["choices"], output.outputs, strict=True):
        assert choice["index"] == c.index
        assert choice["message"] == {"role": "assistant", "content": c.text}
        assert choice["finish_reason"] == c.finish_reason
        if not with_logprobs:
            assert choice["logprobs"] is None
            continue
        content = choice["logprobs"]["content"]
        assert len(content) == len(c.token_ids)
        for entry, t, alts in zip(content, c.token_ids, c.logprobs, strict=True):
            assert entry["token"] == reference_text(t)
            assert entry["bytes"] == list(ByteTokenizer().token_bytes(t))
            assert entry["logprob"] == alts[t]
            ranked = [a["logprob"] for a in entry["top_logprobs"]]
            assert ranked == sorted(alts.values(), reverse=True)[:top_k]


@given(num_choices=st.integers(0, 6), request=requests())
def test_a_chat_stream_opens_every_choice_and_ends_with_usage_only(num_choices, request):
    first = chat_role_chunk("c", 1, "m", num_choices)
    assert first["object"] == "chat.completion.chunk"
    assert [c["index"] for c in first["choices"]] == list(range(num_choices))
    assert all(c["delta"] == {"role": "assistant", "content": ""} for c in first["choices"])
    _, _, outputs = request
    last = usage_chunk("c", 1, "m", "chat.completion.chunk", outputs)
    assert last["choices"] == []
    assert_usage_adds_up(last["usage"], outputs)


def test_alternatives_sharing_a_text_keep_the_more_likely_logprob() -> None:
    alternatives = {0: -0.1, 1: -0.5, 3: -3.0}  # tokens 1 and 3 are both lone lead bytes
    body = completion_logprobs(ByteTokenizer(), [0], [alternatives], 0)
    assert body["top_logprobs"] == [{reference_text(0): -0.1, "\ufffd": -0.5}]
