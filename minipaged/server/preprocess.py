"""From raw bytes to token ids, bounded and off the event loop: the request body's size cap,
the worker pool that parses, templates and tokenizes, and the length bound checked before any
text is tokenized.

Three things keep one large or slow request from stalling the others:

* `read_body` reads the body incrementally and refuses it (HTTP 413) as soon as it passes
  `max_request_body_bytes` (or at once, when its `Content-Length` says so): a 20 MB body is
  never held whole.
* `Preprocessor.run` does the CPU work of a request -- JSON parsing and validation, the chat
  template, tokenization -- on a small pool of worker threads, never on the event loop (which
  must answer `/health` and stream the other requests' tokens) nor on the engine's thread
  (which must keep stepping). The engine receives token ids.
* `Preprocessor.min_tokens` bounds a text's token count from its size alone, so a text that
  cannot fit the context is refused before it is tokenized: every token of a byte-level BPE
  stands for at most `max_token_bytes` bytes of the (normalized) text, so a text of B bytes
  has at least ceil(B / max_token_bytes) tokens -- B counting only the bytes that can become
  tokens: a vocabulary without an unknown token drops the bytes it has no token for
  (`silent_bytes`: SmolLM2 has none for 0x04, 0x1d or 0xf1).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect, Request

from minipaged.sampling.params import SamplingParams
from minipaged.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    check_context,
    not_found,
    parse_body,
)

# The largest request body accepted: about a thousand times a full 8k-token prompt as text.
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 2**20
# Threads that parse and tokenize (the event loop and the engine's thread are the others').
DEFAULT_PREPROCESS_WORKERS = 2

T = TypeVar("T")

# -- data types -----------------------------------------------------------------------------------


class ClientDisconnected(Exception):
    """The client closed the connection before its answer was ready."""


@dataclass
class Prepared:
    """A request ready for the engine: its body, parameters and prompts as token ids (with
    the text each was made from, or None for token-id prompts)."""

    body: Any
    params: SamplingParams
    prompts: list[list[int]]
    texts: list[str | None]


def body_too_large(limit: int, size: str) -> RequestError:
    return RequestError(
        f"the request body is {size} bytes, more than the limit of {limit} bytes "
        "(--max-request-body-bytes)",
        None,
        HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
        "RequestEntityTooLargeError",
    )


# -- the body -------------------------------------------------------------------------------------


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, read chunk by chunk and refused (413) once it passes `limit` bytes;
    `ClientDisconnected` if the client hangs up before sending it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit, declared)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise body_too_large(limit, f"more than {limit}")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientDisconnected from None
    return b"".join(chunks)


# -- the worker pool ------------------------------------------------------------------------------


class Preprocessor:
    """Parses, templates and tokenizes request bodies for one served model, on its own pool."""

    def __init__(
        self,
        model_name: str,
        tokenizer: Any | None,
        max_model_len: int,
        vocab_size: int,
        workers: int = DEFAULT_PREPROCESS_WORKERS,
    ) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_token_bytes = max_token_bytes(tokenizer) if tokenizer is not None else 0
        self.silent_bytes = silent_bytes(tokenizer) if tokenizer is not None else b""
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="minipaged-preprocess")

    async def run(self, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)` on the pool; its exceptions are the caller's."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, work, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- the two endpoints (run on the pool) ------------------------------------------------------

    def completion(self, raw: bytes) -> Prepared:
        body = self._parse(CompletionRequest, raw)
        texts = [p if isinstance(p, str) else None for p in body.prompts()]
        if self.tokenizer is None and any(text is not None for text in texts):
            raise RequestError("text prompts need a tokenizer; pass token ids", "prompt")
        prompts = [
            self._encode(p, True, "prompt") if isinstance(p, str) else p for p in body.prompts()
        ]
        params = body.sampling_params([len(p) for p in prompts], self.max_model_len)
        return Prepared(body, params, prompts, texts)

    def chat(self, raw: bytes) -> Prepared:
        body = self._parse(ChatCompletionRequest, raw)
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer, so no chat template", "messages")
        try:
            text = self.tokenizer.apply_chat_template(
                body.conversation(), add_generation_prompt=True, tokenize=False
            )
        except ValueError as exc:  # the template refused the conversation (TokenizerError too)
            raise RequestError(f"messages: {exc}", "messages") from None
        prompt = self._encode(text, False, "messages")  # templates write their own bos
        params = body.sampling_params(len(prompt), self.max_model_len)
        return Prepared(body, params, [prompt], [text])

    def _parse(self, model: type[T], raw: bytes) -> T:
        """The body, checked for what needs neither the prompt's tokens nor the context."""
        body = parse_body(model, raw)
        if body.model is not None and body.model != self.model_name:
            raise not_found(f"The model `{body.model}` does not exist.", "model")
        body.check_supported()
        body.check_model_limits(self.vocab_size)
        return body

    # -- lengths ----------------------------------------------------------------------------------

    def min_tokens(self, text: str) -> int:
        """A lower bound of the number of tokens `text` encodes to, from its size alone."""
        normalizer = self.tokenizer.normalizer
        normalized = normalizer(text) if normalizer is not None else text
        data = normalized.encode("utf-8", errors="surrogatepass")
        return math.ceil(len(data.translate(None, self.silent_bytes)) / self.max_token_bytes)

    def check_text(self, text: str, prompt_field: str) -> None:
        """Refuse a text whose size alone proves it leaves no room in the context, before it is
        tokenized. (A text that passes has at most `max_model_len * max_token_bytes` bytes,
        cheap to tokenize; `max_tokens` is then checked against its exact length.)"""
        bound = self.min_tokens(text)
        check_context(bound, None, self.max_model_len, prompt_field, "", "at least ")

    def _encode(self, text: str, add_special_tokens: bool, field: str) -> list[int]:
        """`text`'s token ids, once `check_text` has passed it (the callers have refused text
        without a tokenizer)."""
        self.check_text(text, field)
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except UnicodeEncodeError as exc:  # JSON may spell lone surrogates, UTF-8 cannot
            raise RequestError(f"the text is not valid Unicode: {exc.reason}", field) from None


def silent_bytes(tokenizer: Any) -> bytes:
    """The byte values that encode to no token: those the vocabulary has no one-byte token for,
    which a byte-level BPE without an unknown token drops (as `tokenizers` does)."""
    if getattr(tokenizer, "unk_token_id", None) is not None:
        return b""
    single = {tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)}
    return bytes(b for b in range(256) if bytes([b]) not in single)


def max_token_bytes(tokenizer: Any) -> int:
    """The most bytes any token of `tokenizer` stands for (added tokens included)."""
    longest = max(len(tokenizer.token_bytes(i)) for i in range(tokenizer.vocab_size))
    added = max((len(t.content.encode("utf-8")) for t in tokenizer.added_tokens), default=0)
    return max(1, longest, added)
