"""Running the app under uvicorn: in the foreground (`minipaged serve`) or on a thread.

`serve` is the command's main loop. On SIGINT / SIGTERM uvicorn stops accepting connections
and waits for the open ones; requests still running `shutdown_timeout` seconds later are ended
by stopping the engine loop, which aborts them in the engine and ends each response cleanly (a
stream with an error event and `[DONE]`, a whole answer with a 503). A second signal, of either
kind, ends the grace period at once the same way. Then the app's shutdown runs and the process
returns with status 0, whatever sequence of signals came: `Server` records signals instead of
letting uvicorn re-raise them, and `serve` ignores the signals that arrive once it is done,
while the process exits.

`ServerThread` runs the same server on a thread, on a free port of 127.0.0.1 (the tests and
the notebook): a context manager that starts it, waits until it answers and always stops it.
`free_port` (the tensor-parallel workers') and `wait_until_healthy` serve those who start it
in a child process instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import threading
import time
from types import FrameType
from typing import Any

import httpx
import uvicorn

from minipaged.runner.parallel.worker import free_port as free_port  # re-exported

LOG_LEVEL = "warning"
# Seconds uvicorn waits beyond `shutdown_timeout` before it cancels what is left by force.
BACKSTOP = 5.0


class Server(uvicorn.Server):
    """uvicorn's server; `shutdown_timeout` seconds into a shutdown, or at a second signal, it
    stops the app's engine loop (`app.state.engine_loop`), which ends the requests still open.
    `signals` lists the SIGINT / SIGTERM it received."""

    def __init__(self, app: Any, shutdown_timeout: float, **config: Any) -> None:
        super().__init__(
            uvicorn.Config(app, timeout_graceful_shutdown=shutdown_timeout + BACKSTOP, **config)
        )
        self.engine_loop = app.state.engine_loop
        self.shutdown_timeout = shutdown_timeout
        self.signals: list[int] = []

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """uvicorn's signal handler, without its two exits by the signal: it neither re-raises
        the signals once the server is done (that would end the process by the signal) nor
        force-quits at a second SIGINT (that would skip the app's shutdown). The first signal
        starts the graceful shutdown; any later one aborts what is still running now."""
        self.signals.append(sig)
        if self.should_exit:
            self.engine_loop.stop(0.0)
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(
            self.shutdown_timeout, self.engine_loop.stop, 0.0
        )
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def serve(app: Any, host: str, port: int, shutdown_timeout: float = 5.0) -> list[int]:
    """Serve `app` until SIGINT or SIGTERM; return the signals the server received.

    Meant to end the process: SIGINT and SIGTERM are ignored outside the server's run and
    after it returns. Ignored, not handled: Python's finalization resets signals that have a
    Python handler to their default (a late signal would then kill the exiting process),
    but leaves ignored ones alone."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # uvicorn's handlers replace this while it runs
    server = Server(app, shutdown_timeout, host=host, port=port, log_level="info")
    server.run()
    return server.signals


class ServerThread:
    """`with ServerThread(app) as server:` serves `app` at `server.url` until the block ends."""

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        start_timeout: float = 30.0,
        shutdown_timeout: float = 1.0,
    ) -> None:
        self.app = app
        self.host = host
        self.start_timeout = start_timeout
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, 0))  # the OS picks a free port
        self.port = self._socket.getsockname()[1]
        self._server = Server(app, shutdown_timeout, log_level=LOG_LEVEL)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server at {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._socket.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def wait_until_healthy(url: str, timeout: float, process: subprocess.Popen | None = None) -> None:
    """Poll `url/health` until it answers 200; fail if `process` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server at {url} exited with status {process.returncode}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server at {url} did not answer within {timeout} s")
        time.sleep(0.1)
