"""A real `minipaged serve` process against clients that hang up and against signals.

Each test starts `python -m minipaged serve` on a free port of 127.0.0.1 over a tiny random
LLaMA saved with a byte-level BPE tokenizer trained here (`http_checks.save_tiny_model_folder`),
and reads the server's whole log once it has exited.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from http_checks import assert_drained, assert_healthy_now, save_tiny_model_folder

from minipaged.server.launch import free_port, wait_until_healthy

# A stream that runs until the server ends it: no text from a random model is guaranteed, but
# logprobs make every token a chunk.
ENDLESS = {"prompt": "the", "max_tokens": 3000, "ignore_eos": True, "stream": True, "logprobs": 0}


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    return save_tiny_model_folder(tmp_path_factory.mktemp("served") / "tiny")


class Served:
    """`minipaged serve` in a child process; `finish()` waits for its exit and its log."""

    def __init__(self, folder: Path, shutdown_timeout: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable, "-m", "minipaged", "serve", "--model", str(folder),
            "--port", str(self.port), "--shutdown-timeout", str(shutdown_timeout),
            "--device", "cpu", "--num-gpu-blocks", "300", "--swap-space", "0.01",
        ]  # fmt: skip
        env = os.environ | {"OMP_NUM_THREADS": "1"}
        self.child = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        try:
            wait_until_healthy(self.url, 90, self.child)
        except RuntimeError:
            self.kill()
            raise

    def signal(self, sig: int) -> bool:
        """Send `sig`; False once the process is gone."""
        try:
            self.child.send_signal(sig)
        except ProcessLookupError:
            return False
        return self.child.poll() is None

    def finish(self, timeout: float = 20.0) -> tuple[int, str]:
        try:
            output, _ = self.child.communicate(timeout=timeout)
        finally:
            self.kill()
        return self.child.returncode, output

    def kill(self) -> None:
        if self.child.poll() is None:
            self.child.kill()
            self.child.communicate()


def assert_quiet(output: str) -> list[str]:
    """No traceback, error or warning in the log; returns its lines while serving."""
    for word in ("Traceback", "Exception", "ERROR", "WARNING", "ClientDisconnect"):
        assert word not in output, output
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if "Uvicorn running" in line)
    end = next(i for i, line in enumerate(lines) if "Shutting down" in line)
    return lines[start + 1 : end]


def open_stream(url: str) -> tuple[httpx.Client, httpx.Response]:
    client = httpx.Client(timeout=30)
    response = client.send(client.build_request("POST", url + "/v1/completions", json=ENDLESS),
                           stream=True)  # fmt: skip
    assert response.status_code == 200
    return client, response


def read_to_the_end(lines: Iterator[str]) -> list[str]:
    return [line for line in lines if line.startswith("data: ")]


# -- clients that hang up -------------------------------------------------------------------------


def raw_request(url: str, head: str, body: bytes, stall: float) -> None:
    """Send `head` and `body`, wait `stall` seconds, hang up without reading."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(head.encode() + body)
        time.sleep(stall)


def test_clients_that_hang_up_anywhere_leave_one_line_at_most(model_folder):
    served = Served(model_folder, shutdown_timeout=1.0)
    url = served.url
    head = "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    cases = 0
    # headers only: the body never comes
    raw_request(url, head.format(path="/v1/completions") + "Content-Length: 1000\r\n\r\n", b"", 0.3)
    # a body stalled half-way, completions and chat; a chunked body cut off
    for path in ("/v1/completions", "/v1/chat/completions"):
        partial = b'{"prompt": "the quick'
        raw_request(url, head.format(path=path) + "Content-Length: 1000\r\n\r\n", partial, 0.3)
    chunked = head.format(path="/v1/completions") + "Transfer-Encoding: chunked\r\n\r\n"
    raw_request(url, chunked, b'10\r\n{"prompt": "the ', 0.3)  # all 16 bytes of a chunk
    cases += 4
    assert_healthy_now(url)
    # mid-stream
    client, response = open_stream(url)
    lines = response.iter_lines()
    assert next(lines).startswith("data: ")
    response.close()
    client.close()
    cases += 1
    assert_healthy_now(url)
    # waiting for a whole answer
    whole = ENDLESS | {"stream": False}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=whole, timeout=0.5)
    cases += 1
    assert_healthy_now(url)
    assert_drained(url)
    assert served.signal(signal.SIGTERM)
    status, output = served.finish()
    assert status == 0, output
    serving = assert_quiet(output)
    posts = [line for line in serving if "POST /v1/" in line]
    assert len(posts) <= cases, serving
    assert all(line.startswith("INFO:") for line in serving), [
        line for line in serving if not line.startswith("INFO:")]
    assert len(serving) == len(posts) + sum("GET /" in line for line in serving)


# -- signals --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "signals",
    [
        (signal.SIGINT, signal.SIGTERM),
        (signal.SIGINT, signal.SIGINT),
        (signal.SIGTERM, signal.SIGTERM, signal.SIGINT),
    ],
    ids=lambda sigs: "-".join(signal.Signals(s).name for s in sigs),
)
def test_a_second_signal_ends_the_grace_period_and_the_exit_is_0(model_folder, signals):
    served = Served(model_folder, shutdown_timeout=600.0)  # only a second signal ends it
    client, response = open_stream(served.url)
    try:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert served.signal(signals[0])
        time.sleep(0.5)
        assert served.child.poll() is None  # the grace period: the stream still runs
        for sig in signals[1:]:
            served.signal(sig)
        events = read_to_the_end(lines)
    finally:
        response.close()
        client.close()
    status, output = served.finish()
    assert events[-1] == "data: [DONE]"
    assert "shutting down" in json.loads(events[-2].removeprefix("data: "))["error"]["message"]
    assert status == 0, output
    assert_quiet(output)


def test_signals_while_the_process_exits_never_kill_it(model_folder):
    served = Served(model_folder, shutdown_timeout=0.3)
    client, response = open_stream(served.url)
    try:
        assert served.signal(signal.SIGINT)
        events = read_to_the_end(
            response.iter_lines()
        )  # the grace period is over: the process is leaving
    finally:
        response.close()
        client.close()
    assert events[-1] == "data: [DONE]"
    sent = 0
    while served.signal((signal.SIGTERM, signal.SIGINT)[sent % 2]):  # until it is gone
        sent += 1
        time.sleep(0.005)
    status, output = served.finish()
    assert sent > 0
    assert status == 0, (sent, output)
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
