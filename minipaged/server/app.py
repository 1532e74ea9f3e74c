"""The HTTP API: vLLM's OpenAI-compatible routes over an `EngineLoop`, on FastAPI.

* `POST /v1/completions` and `POST /v1/chat/completions`, streamed as Server-Sent Events
  (`data: {json}` chunks, then `data: [DONE]`) or answered whole;
* `GET /v1/models`, `GET /health` (503 once the engine loop has died), `GET /metrics`.

A handler reads the body under its size cap, has the worker pool parse, validate, template
and tokenize it (`preprocess`, `protocol`), submits the token ids to the engine loop, and turns
the loop's outputs into OpenAI's shapes (`responses`). Every error is OpenAI's / vLLM's
`{"error": {"message", "type", "param", "code"}}`. A client that goes away aborts its request:
a stream's generator is cancelled (Starlette listens for the disconnect), a whole answer's wait
is raced against the disconnect, a body cut off is dropped; either way the engine loop drops
the request before its next step, and the log shows the one access line of the request.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from minipaged.server.engine_loop import EngineLoop, EngineLoopError, Submission
from minipaged.server.metrics import CONTENT_TYPE, ServerMetrics
from minipaged.server.preprocess import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    ClientDisconnected,
    Prepared,
    Preprocessor,
    read_body,
)
from minipaged.server.protocol import RequestError, service_unavailable
from minipaged.server.responses import (
    ChoiceStream,
    Delta,
    chat_chunk,
    chat_response,
    chat_role_chunk,
    completion_chunk,
    completion_response,
    new_id,
    now,
    usage_chunk,
)

DONE = "data: [DONE]\n\n"

# -- the routes' logic ----------------------------------------------------------------------------


class OpenAIServing:
    """The endpoints of one served model. Reads the engine's tokenizer, vocabulary and
    context length (for the worker pool); everything else goes through the engine loop."""

    def __init__(self, loop: EngineLoop, model_name: str, max_request_body_bytes: int) -> None:
        self.loop = loop
        self.model_name = model_name
        self.tokenizer = loop.engine.tokenizer
        self.max_model_len = loop.engine.max_model_len
        self.max_request_body_bytes = max_request_body_bytes
        vocab_size = loop.engine.model_config.vocab_size
        self.preprocessor = Preprocessor(model_name, self.tokenizer, self.max_model_len, vocab_size)
        self.created = now()

    # -- the two generating endpoints ------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        body, submission, created = await self._accept(
            request, self.preprocessor.completion, "cmpl", "prompt"
        )
        request_id, model = submission.request_id, self.model_name
        if body.stream:
            chunk = partial(completion_chunk, request_id, created, model, self.tokenizer)
            return self._event_stream(submission, body, created, "text_completion", chunk)
        outputs = await self._until_disconnected(request, self.loop.results(submission))
        return JSONResponse(
            completion_response(request_id, created, model, self.tokenizer, outputs)
        )

    async def chat(self, request: Request) -> Response:
        body, submission, created = await self._accept(
            request, self.preprocessor.chat, "chatcmpl", "messages"
        )
        request_id, model, top_k = submission.request_id, self.model_name, body.top_logprobs or 0
        if body.stream:
            chunk = partial(chat_chunk, request_id, created, model, self.tokenizer, top_k=top_k)
            first = chat_role_chunk(request_id, created, model, body.n)
            kind = "chat.completion.chunk"
            return self._event_stream(submission, body, created, kind, chunk, first)
        (output,) = await self._until_disconnected(request, self.loop.results(submission))
        return JSONResponse(
            chat_response(request_id, created, model, self.tokenizer, output, top_k)
        )

    # -- the other endpoints ----------------------------------------------------------------------

    async def models(self) -> dict[str, Any]:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "minipaged",
            "root": self.model_name,
            "parent": None,
            "max_model_len": self.max_model_len,
        }
        return {"object": "list", "data": [card]}

    async def health(self) -> Response:
        if not self.loop.alive:
            raise service_unavailable("the engine loop is not running")
        return Response(status_code=HTTPStatus.OK)

    async def metrics(self) -> Response:
        return Response(self.loop.metrics.render(), media_type=CONTENT_TYPE)

    # -- helpers ----------------------------------------------------------------------------------

    async def _accept(
        self, request: Request, prepare: Callable[[bytes], Prepared], prefix: str, prompt_field: str
    ) -> tuple[Any, Submission, int]:
        """Read the body, `prepare` it on the worker pool and hand its prompts to the engine
        loop (the engine's refusal is the client's 400; a stopped loop's `EngineLoopError` is
        the app's 503); return the body, the submission and the response's creation time."""
        arrival = time.monotonic()
        raw = await read_body(request, self.max_request_body_bytes)
        prepared = await self.preprocessor.run(prepare, raw)
        try:
            submission = await self.loop.submit(
                new_id(prefix), prepared.prompts, prepared.params, arrival, prepared.texts
            )
        except (ValueError, TypeError) as exc:  # empty, outside the vocabulary, too wide, ...
            raise RequestError(str(exc), _engine_field(str(exc), prompt_field)) from None
        return prepared.body, submission, now()

    def _event_stream(
        self,
        submission: Submission,
        body: Any,
        created: int,
        kind: str,
        chunk: Callable[[list[Delta]], dict[str, Any]],
        first: dict[str, Any] | None = None,
    ) -> Response:
        """SSE: `first`, a `chunk` of each step's deltas, the usage chunk if the body asks for
        it, an error event if the engine loop stops, then `[DONE]`. The background abort covers
        a client gone before the first event was even asked for.

        Each event gives the event loop a turn before the next: events already queued would
        otherwise be written back to back, and once the client has hung up, asyncio logs every
        write after the fifth to a closed socket before the hang-up is seen."""

        async def events() -> AsyncIterator[str]:
            if first is not None:
                yield _event(first, body.include_usage)
            choices = ChoiceStream(body.n)
            finals = {}
            async for index, output in self.loop.stream(submission):
                if output.finished:
                    finals[index] = output
                deltas = choices.deltas(index, output)
                if deltas:
                    yield _event(chunk(deltas), body.include_usage)
            if body.include_usage:
                outputs = [finals[i] for i in range(len(finals))]
                yield _event(
                    usage_chunk(submission.request_id, created, self.model_name, kind, outputs,
                                choices.num_tokens)
                )

        async def framed() -> AsyncIterator[str]:
            try:
                async for event in events():
                    yield event
                    await asyncio.sleep(0)
            except EngineLoopError as exc:
                yield _event(service_unavailable(str(exc)).body())
            yield DONE

        return StreamingResponse(
            framed(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
            background=BackgroundTask(self.loop.abort, submission),
        )

    async def _until_disconnected(self, request: Request, work: Awaitable[Any]) -> Any:
        """`work`'s result, unless the client disconnects first (then `work` is cancelled,
        which aborts its request); an `EngineLoopError` is the app's 503."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_disconnect(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pending in (task, gone):
                pending.cancel()
        if not task.done() or task.cancelled():
            raise ClientDisconnected
        return task.result()


# -- the application ------------------------------------------------------------------------------


def build_app(
    engine: Any,
    served_model_name: str = "minipaged",
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
) -> FastAPI:
    """The ASGI app serving `engine` (an `LLMEngine`) under `served_model_name`, refusing
    bodies over `max_request_body_bytes` (413). The engine loop and the worker pool start and
    stop with the app (its lifespan); `app.state.engine_loop` is the loop."""
    if isinstance(max_request_body_bytes, bool) or not isinstance(max_request_body_bytes, int):
        raise TypeError(f"max_request_body_bytes must be an int, got {max_request_body_bytes!r}")
    if max_request_body_bytes < 1:
        raise ValueError(f"max_request_body_bytes must be >= 1, got {max_request_body_bytes}")
    loop = EngineLoop(engine, ServerMetrics())
    serving = OpenAIServing(loop, served_model_name, max_request_body_bytes)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop.start()
        try:
            yield
        finally:
            loop.stop()
            serving.preprocessor.close()

    app = FastAPI(title="minipaged", summary="An OpenAI-compatible server", lifespan=lifespan)
    app.state.engine_loop = loop
    app.add_api_route("/v1/completions", serving.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", serving.chat, methods=["POST"])
    app.add_api_route("/v1/models", serving.models, methods=["GET"])
    app.add_api_route("/health", serving.health, methods=["GET"])
    app.add_api_route("/metrics", serving.metrics, methods=["GET"])
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(EngineLoopError, _engine_stopped)
    app.add_exception_handler(ClientDisconnected, _client_gone)
    app.add_exception_handler(ClientDisconnect, _client_gone)
    app.add_exception_handler(Exception, _internal_error)
    return app


async def _request_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestError)
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Routing errors (unknown path, wrong method) in the same error shape."""
    assert isinstance(exc, HTTPException)
    status = HTTPStatus(exc.status_code)
    kind = "NotFoundError" if status == HTTPStatus.NOT_FOUND else status.phrase.replace(" ", "")
    error = RequestError(f"{request.method} {request.url.path}: {exc.detail}", None, status, kind)
    return await _request_error(request, error)


async def _engine_stopped(request: Request, exc: Exception) -> Response:
    """The engine loop stopped (a shutdown, or the engine failed) before the answer: 503."""
    return await _request_error(request, service_unavailable(str(exc)))


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


async def _internal_error(request: Request, exc: Exception) -> Response:
    status = HTTPStatus.INTERNAL_SERVER_ERROR
    error = RequestError(f"{type(exc).__name__}: {exc}", None, status, "InternalServerError")
    return await _request_error(request, error)


def _engine_field(message: str, prompt_field: str) -> str:
    """The body field an engine refusal is about: its messages name `n=` / `beam_width=` or
    `stop_token_ids` where those are the cause, else it is the prompt."""
    for name in ("stop_token_ids", "n", "beam_width"):
        if f" {name}=" in f" {message}" or message.startswith(name):
            return "n" if name == "beam_width" else name
    return prompt_field


def _event(chunk: dict[str, Any], with_usage: bool = False) -> str:
    """One Server-Sent Event. With `include_usage`, OpenAI sends `"usage": null` in every
    chunk before the last."""
    if with_usage and "usage" not in chunk:
        chunk = {**chunk, "usage": None}
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
