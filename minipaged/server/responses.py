"""What the server sends back: OpenAI's response, chunk, log-probability and usage shapes.

Plain dicts, built by small functions, one per shape (the field names are OpenAI's and vLLM's).
`ChoiceStream` turns the engine's deltas (what each step added to each sample) into the deltas
a stream sends: new text, new tokens and their log-probabilities, and the finish reason once,
each choice's text offset, and the tokens the usage chunk counts.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from minipaged.sampling.sequence import RequestOutput

# -- data types -----------------------------------------------------------------------------------


@dataclass
class Delta:
    """What one choice gained since the last chunk."""

    index: int  # the choice's index in the response (prompt index * n + sample index)
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    text_offset: int  # characters of this choice's text sent before `text`


class ChoiceStream:
    """Per choice, how much text was already sent; and the output tokens of all choices."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.sent_chars: dict[int, int] = {}
        self.num_tokens = 0

    def deltas(self, prompt_index: int, output: RequestOutput) -> list[Delta]:
        """The news of one engine delta (`RequestOutputKind.DELTA`); choices whose news is
        only tokens that nobody shows (no text, no finish, no log-probabilities) are left out."""
        news = []
        for completion in output.outputs:
            index = prompt_index * self.n + completion.index
            self.num_tokens += len(completion.token_ids)
            text, logprobs, done = completion.text, completion.logprobs, completion.finish_reason
            if not text and done is None and not (logprobs and completion.token_ids):
                continue
            chars = self.sent_chars.get(index, 0)
            self.sent_chars[index] = chars + len(text)
            news.append(Delta(index, text, completion.token_ids, logprobs, done, chars))
        return news


# -- common parts ---------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(outputs: Sequence[RequestOutput], completion: int | None = None) -> dict[str, Any]:
    """Token counts of a finished request: each prompt counted once, every choice's output
    (`completion`: their count, where a stream's deltas counted them)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    if completion is None:
        completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.metrics.num_cached_tokens for o in outputs if o.metrics is not None)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def token_text(tokenizer: Any, token_id: int) -> str:
    """A token as text for log-probabilities (a byte fragment becomes U+FFFD, as in OpenAI)."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def _envelope(
    request_id: str, created: int, model: str, kind: str, choices: list[Any], **extra: Any
) -> dict[str, Any]:
    """The fields every response and chunk begins with, then `choices` and any `extra`."""
    return {
        "id": request_id,
        "object": kind,
        "created": created,
        "model": model,
        "choices": choices,
        **extra,
    }


# -- completions ----------------------------------------------------------------------------------


def completion_logprobs(
    tokenizer: Any, token_ids: Sequence[int], logprobs: Sequence[dict[int, float]], offset: int
) -> dict[str, Any]:
    """The completions shape: parallel lists of tokens, their log-probabilities, the top
    alternatives of each (the chosen token included) and where each token starts in the text."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, alternatives in zip(token_ids, logprobs, strict=True):
        text = token_text(tokenizer, token_id)
        tokens.append(text)
        token_logprobs.append(alternatives[token_id])
        ranked: dict[str, float] = {}  # keyed by text: two byte fragments both read U+FFFD
        for t, lp in _ranked(alternatives):
            ranked.setdefault(token_text(tokenizer, t), lp)  # the more likely one's stays
        top.append(ranked)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def completion_choice(tokenizer: Any, delta: Delta) -> dict[str, Any]:
    logprobs = None if delta.logprobs is None else completion_logprobs(
        tokenizer, delta.token_ids, delta.logprobs, delta.text_offset)
    return {
        "index": delta.index,
        "text": delta.text,
        "logprobs": logprobs,
        "finish_reason": delta.finish_reason,
    }


def completion_chunk(
    request_id: str, created: int, model: str, tokenizer: Any, deltas: Sequence[Delta]
) -> dict[str, Any]:
    choices = [completion_choice(tokenizer, d) for d in deltas]
    return _envelope(request_id, created, model, "text_completion", choices)


def completion_response(
    request_id: str, created: int, model: str, tokenizer: Any, outputs: Sequence[RequestOutput]
) -> dict[str, Any]:
    """The whole answer of a non-streamed completion (choices in prompt, then sample order)."""
    choices = [completion_choice(tokenizer, d) for d in _final_deltas(outputs)]
    return _envelope(request_id, created, model, "text_completion", choices, usage=usage(outputs))


# -- chat -----------------------------------------------------------------------------------------


def chat_logprobs(
    tokenizer: Any, token_ids: Sequence[int], logprobs: Sequence[dict[int, float]], top_k: int
) -> dict[str, Any]:
    """The chat shape: per token its text, bytes, log-probability and `top_k` alternatives."""
    content = [
        {
            **_chat_token(tokenizer, token_id, alternatives[token_id]),
            "top_logprobs": [
                _chat_token(tokenizer, t, lp) for t, lp in _ranked(alternatives)[:top_k]
            ],
        }
        for token_id, alternatives in zip(token_ids, logprobs, strict=True)
    ]
    return {"content": content}


def _chat_token(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    """One token of the chat shape: its text, log-probability and UTF-8 bytes."""
    return {
        "token": token_text(tokenizer, token_id),
        "logprob": logprob,
        "bytes": list(tokenizer.token_bytes(token_id)) if tokenizer is not None else [],
    }


def chat_choice(tokenizer: Any, delta: Delta, top_k: int, stream: bool) -> dict[str, Any]:
    logprobs = None if delta.logprobs is None else chat_logprobs(
        tokenizer, delta.token_ids, delta.logprobs, top_k)
    if stream:
        text = {"delta": {"content": delta.text} if delta.text else {}}
    else:
        text = {"message": {"role": "assistant", "content": delta.text}}
    return {"index": delta.index, **text, "logprobs": logprobs,
            "finish_reason": delta.finish_reason}


def chat_chunk(
    request_id: str, created: int, model: str, tokenizer: Any, deltas: Sequence[Delta], top_k: int
) -> dict[str, Any]:
    choices = [chat_choice(tokenizer, d, top_k, stream=True) for d in deltas]
    return _envelope(request_id, created, model, "chat.completion.chunk", choices)


def chat_role_chunk(request_id: str, created: int, model: str, num_choices: int) -> dict[str, Any]:
    """A stream's first chunk: every choice opens an assistant message (as OpenAI's does)."""
    choices = [
        {
            "index": i,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        for i in range(num_choices)
    ]
    return _envelope(request_id, created, model, "chat.completion.chunk", choices)


def chat_response(
    request_id: str, created: int, model: str, tokenizer: Any, output: RequestOutput, top_k: int
) -> dict[str, Any]:
    choices = [chat_choice(tokenizer, d, top_k, stream=False) for d in _final_deltas([output])]
    return _envelope(request_id, created, model, "chat.completion", choices, usage=usage([output]))


def usage_chunk(
    request_id: str, created: int, model: str, kind: str, outputs: Sequence[RequestOutput],
    completion: int | None = None,
) -> dict[str, Any]:
    """A stream's last chunk with `stream_options.include_usage`: no choices, only usage
    (`completion`: the output tokens its deltas counted)."""
    return _envelope(request_id, created, model, kind, [], usage=usage(outputs, completion))


# -- helpers --------------------------------------------------------------------------------------


def _final_deltas(outputs: Sequence[RequestOutput]) -> list[Delta]:
    """Each choice's whole output as one delta (choices in prompt, then sample order)."""
    n = max((len(o.outputs) for o in outputs), default=1)
    return [
        Delta(i * n + c.index, c.text, list(c.token_ids), c.logprobs, c.finish_reason, 0)
        for i, o in enumerate(outputs)
        for c in o.outputs
    ]


def _ranked(alternatives: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(alternatives.items(), key=lambda item: item[1], reverse=True)
