"""A request's way in and out of the engine (docs/layers/12-engine.md, "The request contract").

In: what `LLMEngine.add_request` checks before a request is queued. Everything a client
sends that can be checked without running the model is checked here: the prompt's type and
token ids, the parameters' type and every token id they name. A bad request raises `TypeError`
(wrong kind of value) or `ValueError` (a value out of range) naming the field and the value,
before the engine changes anything. What needs the scheduler's sizes (lengths,
widths, the cache) is `Scheduler.check_request`.

Out: `RequestStream`, what `LLMEngine.stream` returns -- one request's outputs, kept for it by
the engine whichever stream steps; closing it aborts the request.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import numbers
from collections import deque
from collections.abc import Iterator
from typing import Any, Protocol

from minipaged.sampling.outputs import RequestOutput
from minipaged.sampling.params import SamplingParams, shown


def check_params(params: object, vocab_size: int, has_tokenizer: bool) -> SamplingParams:
    """The request's own copy of `params` (None: the defaults), checked again and against the
    model: `top_k` and every stop token id within the vocabulary.

    The copy re-runs every check of `SamplingParams` on the values the object holds now (a field
    set after construction is checked too), and the engine keeps it, so that changing the
    caller's object later cannot reach a running request (vLLM clones them alike).
    """
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params must be a SamplingParams, got {shown(params)}")
    params = dataclasses.replace(params)
    if params.top_k > vocab_size:
        raise ValueError(
            f"top_k must be 0 (off) or at most the vocabulary's {vocab_size} tokens, "
            f"got {params.top_k}"
        )
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    if params.stop and not has_tokenizer:
        raise ValueError("stop strings need a tokenizer to detokenize the output")
    return params


def prompt_token_ids(
    prompt: object, tokenizer: Any | None, vocab_size: int
) -> tuple[str | None, list[int]]:
    """(the prompt's text or None, its token ids): a text is encoded, token ids are checked."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer; pass token ids instead")
        token_ids = tokenizer.encode(prompt, add_special_tokens=True)
        text: str | None = prompt
    elif isinstance(prompt, collections.abc.Sequence) and not isinstance(prompt, bytes):
        wrong = [t for t in prompt if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
        if wrong:
            raise TypeError(f"prompt token ids must be ints, got {wrong[0]!r}")
        token_ids, text = [int(t) for t in prompt], None
    else:
        raise TypeError(f"prompt must be a string or a sequence of token ids, got {prompt!r}")
    if not token_ids:
        raise ValueError("the prompt is empty: it must contain at least one token")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    return text, token_ids


class StreamingEngine(Protocol):
    """What a stream needs of the engine (`LLMEngine`)."""

    def step(self, *, final_only: bool = False) -> list[RequestOutput]: ...

    def get_sampling_params(self, request_id: str) -> SamplingParams | None: ...

    def close_stream(self, request_id: str, pending: deque[RequestOutput]) -> None: ...


class RequestStream(Iterator[RequestOutput]):
    """An open stream over one request's outputs: `pending` is the queue the engine fills with
    them; iterating steps the engine while it is empty."""

    def __init__(
        self, engine: StreamingEngine, request_id: str, pending: deque[RequestOutput]
    ) -> None:
        self.engine, self.request_id, self._pending = engine, request_id, pending

    def __next__(self) -> RequestOutput:
        engine, pending = self.engine, self._pending
        while not pending:
            if engine.get_sampling_params(self.request_id) is None:  # aborted elsewhere
                self.close()
                raise StopIteration
            engine.step(final_only=True)  # this stream's output, and no one else's unread
        output = pending.popleft()
        if output.finished:
            self.close()
        return output

    def close(self) -> None:
        """Stop following the request and abort it if it is still running."""
        self.engine.close_stream(self.request_id, self._pending)

    def __del__(self) -> None:
        self.close()
