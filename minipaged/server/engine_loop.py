"""The engine loop: one thread owns the engine; HTTP handlers talk to it through queues.

`LLMEngine` is not thread-safe and need not be: only this loop's thread calls `add_request`,
`step` and `abort_request`. Handlers run on the server's asyncio event loop; they hand the
loop *commands* (add these prompts, abort that request) and read their outputs from an
`asyncio.Queue` of their own:

    handler --submit()--> commands --(loop thread)--> engine.add_request
    engine.step() --outputs--> call_soon_threadsafe --> that request's queue --> handler

Between two steps the loop runs every pending command, so an abort takes effect before the
next step and the request's blocks are free by then. With no work it sleeps on an event
(no polling) until a command wakes it. Outputs of one step are delivered in one callback per
event loop, each to the queue of the request it belongs to, so interleaved streams never see
each other's text.

If the engine raises, the loop records the error, fails every open request and stops; `alive`
turns False (the server's `/health` says 503). `stop()` ends it cleanly: requests still open
are aborted and their handlers told the server is shutting down.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from minipaged.sampling.params import RequestOutputKind, SamplingParams
from minipaged.sampling.sequence import RequestOutput
from minipaged.server.metrics import ServerMetrics, read_engine_stats

logger = logging.getLogger(__name__)

# -- data types -----------------------------------------------------------------------------------


class EngineLoopError(RuntimeError):
    """The engine loop is not running: it was stopped, or the engine failed."""


@dataclass
class Submission:
    """One HTTP request: its engine requests (one per prompt) and the queue they report to.

    The queue receives `(prompt index, RequestOutput)` after every step that gave the prompt
    an output of its `output_kind` (a stream's deltas, a whole answer's final output), or an
    `EngineLoopError` if the loop stops first.
    """

    request_id: str
    engine_ids: list[str]
    event_loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


@dataclass
class _Route:
    """Where the outputs of one engine request go."""

    submission: Submission
    prompt_index: int
    deltas: bool  # its outputs are deltas (DELTA), else whole outputs
    num_tokens: int = 0  # output tokens counted so far (for the generated-tokens counter)

    def count(self, output: RequestOutput, whole: bool = False) -> int:
        """The output tokens `output` (a step's, or `whole`: the request's whole output so
        far) reports that were not counted yet."""
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        new = num_tokens if self.deltas and not whole else num_tokens - self.num_tokens
        self.num_tokens += new
        return new


# -- the loop -------------------------------------------------------------------------------------


class EngineLoop:
    """Owns an `LLMEngine` on a background thread; `submit` / `stream` / `abort` from asyncio."""

    def __init__(self, engine: Any, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics or ServerMetrics()
        self.error: BaseException | None = None
        self.num_steps = 0
        self.num_wakeups = 0  # loop iterations, counted so a test can see it sleeps when idle
        self._commands: deque[tuple[Callable[[], None], concurrent.futures.Future | None]] = deque()
        self._lock = threading.Lock()  # guards _commands and _closed
        self._closed = False
        self._stopping = False
        self._wake = threading.Event()
        self._routes: dict[str, _Route] = {}
        self._thread = threading.Thread(target=self._run, name="minipaged-engine", daemon=True)
        self._publish_stats()

    # -- lifetime ---------------------------------------------------------------------------------

    def start(self) -> None:
        if not self._thread.is_alive() and not self._closed:
            self._thread.start()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Abort what is still open, end the thread and wait for it (idempotent)."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None and not self._stopping

    # -- the handlers' side (asyncio) -------------------------------------------------------------

    async def submit(
        self,
        request_id: str,
        prompts: Sequence[str | list[int]],
        params: SamplingParams,
        arrival_time: float | None = None,
        texts: Sequence[str | None] | None = None,
    ) -> Submission:
        """Add every prompt of a request to the engine, all or none (`texts`: the text each
        token-id prompt was made from, reported as its output's `prompt`).

        Raises the engine's `ValueError` (a prompt too long, out of the vocabulary, ...) with
        nothing left behind, or `EngineLoopError` when the loop is not running.
        """
        engine_ids = [request_id]
        if len(prompts) > 1:
            engine_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        submission = Submission(request_id, engine_ids, asyncio.get_running_loop())
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        texts = [None] * len(prompts) if texts is None else texts

        def add() -> None:
            added: list[str] = []
            try:
                for index, (engine_id, prompt) in enumerate(zip(engine_ids, prompts, strict=True)):
                    text = texts[index] if not isinstance(prompt, str) else None
                    self.engine.add_request(
                        engine_id, prompt, params, arrival_time, prompt_text=text
                    )
                    added.append(engine_id)
                    deltas = params.output_kind is RequestOutputKind.DELTA
                    self._routes[engine_id] = _Route(submission, index, deltas)
            except Exception as exc:
                for engine_id in added:
                    self.engine.abort_request(engine_id)
                    del self._routes[engine_id]
                accepted.set_exception(exc)
                return
            accepted.set_result(None)

        self._enqueue(add, accepted)
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:  # the client left while we waited: undo the add
            self.abort(submission)
            raise
        return submission

    async def stream(self, submission: Submission) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield `(prompt index, output)` until every prompt finished. Leaving early (the
        client disconnected, the handler was cancelled) aborts what is unfinished."""
        open_prompts = set(range(len(submission.engine_ids)))
        try:
            while open_prompts:
                item = await submission.queue.get()
                if isinstance(item, BaseException):
                    raise item
                index, output = item
                if output.finished:
                    open_prompts.discard(index)
                yield index, output
        finally:
            if open_prompts:
                self.abort(submission)

    async def results(self, submission: Submission) -> list[RequestOutput]:
        """The final output of each prompt, in prompt order."""
        finals = {i: output async for i, output in self.stream(submission) if output.finished}
        return [finals[i] for i in range(len(submission.engine_ids))]

    def abort(self, submission: Submission) -> None:
        """Abort the unfinished engine requests of `submission` before the next step (from any
        thread; does not wait; a no-op for finished ones or once the loop has stopped)."""

        def abort() -> None:
            for engine_id in submission.engine_ids:
                route = self._routes.pop(engine_id, None)
                if route is not None and (output := self.engine.get_request(engine_id)):
                    self.metrics.generation_tokens.inc(route.count(output, whole=True))
                if route is not None and self.engine.abort_request(engine_id):
                    self.metrics.observe_aborted()
            self._publish_stats()

        try:
            self._enqueue(abort, None)
        except EngineLoopError:
            pass  # the loop aborted everything when it stopped

    # -- the loop's side (its thread) -------------------------------------------------------------

    def _enqueue(self, command: Callable[[], None], future: concurrent.futures.Future | None):
        with self._lock:
            if self._closed:
                raise EngineLoopError(self._why_closed())
            self._commands.append((command, future))
        self._wake.set()

    def _run(self) -> None:
        try:
            while True:
                self.num_wakeups += 1
                self._wake.clear()
                self._run_commands()
                if self._stopping:
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    self._wake.wait()
        except BaseException as exc:  # the engine failed: report it, fail every open request
            self.error = exc
            logger.exception("the engine loop stopped on an error")
        finally:
            self._close()

    def _run_commands(self) -> None:
        while True:
            with self._lock:
                if not self._commands:
                    return
                command, future = self._commands.popleft()
            if future is None or future.set_running_or_notify_cancel():
                command()

    def _step(self) -> None:
        outputs = self.engine.step()
        self.num_steps += 1
        items: list[tuple[Submission, Any]] = []
        for output in outputs:
            route = self._routes.get(output.request_id)
            if route is None:
                continue
            self.metrics.generation_tokens.inc(route.count(output))
            if output.finished:
                del self._routes[output.request_id]
                self.metrics.observe_finished(output)
            items.append((route.submission, (route.prompt_index, output)))
        self._publish_stats()
        self._deliver(items)

    def _deliver(self, items: list[tuple[Submission, Any]]) -> None:
        """Put each item on its submission's queue, in one callback per event loop."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for submission, item in items:
            batches.setdefault(submission.event_loop, []).append((submission.queue, item))
        for event_loop, batch in batches.items():
            try:
                event_loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                for engine_id, route in list(self._routes.items()):
                    if route.submission.event_loop is event_loop:
                        del self._routes[engine_id]
                        self.engine.abort_request(engine_id)

    def _publish_stats(self) -> None:
        self.metrics.stats = read_engine_stats(self.engine)

    def _close(self) -> None:
        """Refuse new commands; fail the waiting ones and every open request."""
        with self._lock:
            self._closed = True
            pending = list(self._commands)
            self._commands.clear()
        error = EngineLoopError(self._why_closed())
        for _, future in pending:
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(error)
        items = [(route.submission, error) for route in self._routes.values()]
        if self.error is None:
            for engine_id in self._routes:
                self.engine.abort_request(engine_id)
            self._publish_stats()
        self._routes.clear()  # so that _deliver has nothing left to abort
        self._deliver(items)

    def _why_closed(self) -> str:
        if self.error is not None:
            return f"the engine failed: {type(self.error).__name__}: {self.error}"
        return "the server is shutting down"


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)
