"""The offline API: vLLM's `LLM` (`generate`, `chat`, `chat_stream`) and `stream_text`.

Everything here drives an `LLMEngine` through its public surface: add requests, step until they
finish, read their outputs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import fields
from pathlib import Path
from typing import Any

from minipaged.engine.config import EngineConfig
from minipaged.engine.engine import LLMEngine, RequestStream
from minipaged.sampling.outputs import RequestOutput
from minipaged.sampling.params import SamplingParams


class LLM(AbstractContextManager["LLM"]):
    """vLLM's offline entry point: `LLM().generate(prompts, params)` and `LLM().chat(messages)`.

    `LLM(tensor_parallel_size=N)` splits the model over N processes; `close()` (or a `with`
    block) stops them, as does the end of the program.
    """

    def __init__(self, model: str | Path | None = None, **engine_kwargs: Any) -> None:
        if model is not None and not isinstance(model, (str, Path)):
            raise TypeError(f"model must be a str, a Path or None, got {model!r}")
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(engine_kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown arguments {unknown}; known: {sorted(known)}")
        self.engine = LLMEngine.from_pretrained(model, **engine_kwargs)
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop the engine's worker processes (tensor parallelism); nothing else to release."""
        self.engine.close()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete every prompt (text, or token ids); outputs come back in prompt order."""
        prompt_list = [prompts] if isinstance(prompts, str) else list(prompts)
        return self._run([(p, None) for p in prompt_list], sampling_params, use_tqdm)

    def chat(
        self,
        messages: Sequence[dict[str, str]] | Sequence[Sequence[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of messages) or several, with the chat template.
        Each output's `prompt` is the rendered conversation."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self._chat_prompt(c) for c in conversations]  # type: ignore[arg-type]
        return self._run(prompts, sampling_params, use_tqdm)

    def chat_stream(
        self, messages: Sequence[dict[str, str]], sampling_params: SamplingParams | None = None
    ) -> Iterator[str]:
        """Yield the answer's text piece by piece as the engine produces it; closing the
        generator aborts the request."""
        token_ids, text = self._chat_prompt(messages)
        request_id = self.engine.add_request(None, token_ids, sampling_params, prompt_text=text)
        yield from stream_text(self.engine, request_id)

    def _run(
        self,
        prompts: list[tuple[str | Sequence[int], str | None]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        """Add every (prompt, its text) request, all or nothing, and step until all are done."""
        params = _per_prompt(sampling_params, len(prompts))
        ids = []
        try:
            for (prompt, text), p in zip(prompts, params, strict=True):
                ids.append(self.engine.add_request(None, prompt, p, prompt_text=text))
        except BaseException:
            for request_id in ids:  # all or nothing: do not leave half a batch queued
                self.engine.abort_request(request_id)
            raise
        finals = self.engine.run_until_done(use_tqdm=use_tqdm)
        return [finals[i] for i in ids]

    def _chat_prompt(self, conversation: Sequence[dict[str, str]]) -> tuple[list[int], str]:
        """The token ids of a conversation rendered by the chat template, and the text."""
        text = self.tokenizer.apply_chat_template(
            list(conversation), add_generation_prompt=True, tokenize=False
        )
        return self.tokenizer.encode(text), text


def stream_text(engine: LLMEngine, request_id: str) -> Iterator[str]:
    """Step the engine and yield the new text of the first completion of `request_id`.

    The pieces join up to the final text: text that may begin a stop string is held back until
    the stop string is ruled out (then shown) or completed (then cut off, never shown). Beam
    search's best beam may change its past, so its text comes in one piece at the end. Closing
    the generator (or dropping it) closes the engine's stream, which aborts the request.
    """
    return _pieces(engine.stream(request_id))


def _pieces(stream: RequestStream) -> Iterator[str]:
    try:
        for output in stream:  # deltas: each holds the text its step added
            yield from (c.text for c in output.outputs if c.index == 0 and c.text)
    finally:
        stream.close()


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"{len(params)} sampling params for {count} prompts")
    return params
