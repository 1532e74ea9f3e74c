"""Bounded, off-loop request parsing: the body cap (413), the length bound checked before
tokenizing, and the worker pool, driven over real HTTP while `/health` is probed.

The server runs in this process on a free port of 127.0.0.1 (`ServerThread`) around a tiny
random LLaMA with the bundled tokenizer's vocabulary; its context is 1,024 tokens.
"""

from __future__ import annotations

import json
import select
import socket
import threading

import httpx
import pytest
import torch
from http_checks import HealthProbe, assert_drained, assert_healthy_now
from hypothesis import given
from hypothesis import strategies as st
from tiny_models import tiny_llama_parts

from minipaged.engine.engine import EngineConfig, LLMEngine
from minipaged.server.app import build_app
from minipaged.server.launch import ServerThread
from minipaged.server.preprocess import DEFAULT_MAX_REQUEST_BODY_BYTES, Preprocessor
from minipaged.tokenizer.tokenizer import Tokenizer

MODEL = "tiny"
CONTEXT = 1024
ENGINE = dict(num_gpu_blocks=160, num_cpu_blocks=0, block_size=16, max_num_seqs=32)
BIG = 20 * 2**20  # the 20 MB body


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class RecordingTokenizer(Tokenizer):
    """The bundled tokenizer, noting each encode and template rendering, and on which thread."""

    calls: list[tuple[str, str]]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.calls.append(("encode", threading.current_thread().name))
        return super().encode(text, add_special_tokens)

    def apply_chat_template(self, *args, **kwargs):
        self.calls.append(("template", threading.current_thread().name))
        return super().apply_chat_template(*args, **kwargs)


@pytest.fixture(scope="module")
def tokenizer(bundled_path) -> RecordingTokenizer:
    recording = RecordingTokenizer.from_pretrained(bundled_path)
    recording.calls = []
    return recording


@pytest.fixture(scope="module")
def server(tokenizer):
    model, config = tiny_llama_parts(vocab_size=49152, max_position_embeddings=CONTEXT)
    engine = LLMEngine(model, config, tokenizer, EngineConfig(**ENGINE))
    with ServerThread(build_app(engine, MODEL)) as running:
        yield running


def short_completion(url: str) -> httpx.Response:
    body = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=5)


def send_chunked(url: str, path: str, payload: bytes, chunk: int = 2**16) -> tuple[bytes, int]:
    """POST `payload` with chunked transfer encoding over a raw socket, watching for an answer
    after every chunk; return (the answer's bytes, how many payload bytes were sent by then)."""
    host, port = url.removeprefix("http://").split(":")
    sent = 0
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n"
        )
        sock.sendall(head.encode())
        try:
            while sent < len(payload):
                piece = payload[sent : sent + chunk]
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                sent += len(piece)
                if select.select([sock], [], [], 0)[0]:
                    break  # the server answered before the body ended
            else:
                sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed while we were still sending
        answer = b""
        try:
            while data := sock.recv(2**16):
                answer += data
                if b"\r\n\r\n" in answer and answer.endswith(b"}"):
                    break
        except (ConnectionResetError, TimeoutError):
            pass
    return answer, sent


# -- the body cap ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_20_mb_body_is_413_before_it_is_read_whole_while_health_answers(server, path):
    text = "word " * (BIG // 5)
    if path == "/v1/completions":
        payload = json.dumps({"prompt": text, "max_tokens": 4}).encode()
    else:
        payload = json.dumps({"messages": [{"role": "user", "content": text}]}).encode()
    with HealthProbe(server.url):
        answer, sent = send_chunked(server.url, path, payload)
        assert short_completion(server.url).status_code == 200  # others are served meanwhile
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    error = json.loads(answer[answer.index(b"\r\n\r\n") + 4 :])["error"]
    assert error["code"] == 413 and str(DEFAULT_MAX_REQUEST_BODY_BYTES) in error["message"]
    assert sent < len(payload) // 2  # refused while most of the body was still unsent
    assert_drained(server.url)


def test_a_declared_20_mb_body_is_413_at_once(server):
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Length: {BIG}\r\n\r\n"
            '{"prompt": "'.encode()
        )  # and not a byte more: the answer cannot wait for the body
        answer = sock.recv(2**16)
    assert answer.startswith(b"HTTP/1.1 413"), answer
    assert_healthy_now(server.url)


def test_the_body_cap_is_configurable(tokenizer):
    model, config = tiny_llama_parts(vocab_size=49152, max_position_embeddings=CONTEXT)
    engine = LLMEngine(model, config, tokenizer, EngineConfig(**ENGINE))
    with ServerThread(build_app(engine, MODEL, max_request_body_bytes=100)) as small:
        fits = {"prompt": "Hi", "max_tokens": 1}
        assert httpx.post(small.url + "/v1/completions", json=fits).status_code == 200
        over = httpx.post(small.url + "/v1/completions", json=fits | {"prompt": "Hi" * 60})
        assert over.status_code == 413 and "100 bytes" in over.json()["error"]["message"]
    with pytest.raises(ValueError, match="max_request_body_bytes must be >= 1"):
        build_app(engine, MODEL, max_request_body_bytes=0)
    with pytest.raises(TypeError, match="max_request_body_bytes"):
        build_app(engine, MODEL, max_request_body_bytes="1")


# -- the length bound, before tokenizing ----------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_3_mb_prompt_is_refused_by_its_size_before_tokenizing(server, tokenizer, endpoint):
    text = "word " * (3 * 2**20 // 5)  # under the body cap, far over the context
    if endpoint == "completions":
        path, body, field = "/v1/completions", {"prompt": text, "max_tokens": 4}, "prompt"
    else:
        messages = [{"role": "user", "content": text}]
        path, body, field = "/v1/chat/completions", {"messages": messages}, "messages"
    before = len(tokenizer.calls)
    with HealthProbe(server.url):
        response = httpx.post(server.url + path, json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field
    assert f"maximum context length is {CONTEXT} tokens" in error["message"]
    assert "at least" in error["message"]  # the bound, not a count: nothing was tokenized
    calls = [kind for kind, _ in tokenizer.calls[before:]]
    assert calls == (["template"] if endpoint == "chat" else [])


def test_tokenizing_and_templating_run_on_the_worker_pool(server, tokenizer):
    tokenizer.calls.clear()
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert httpx.post(server.url + "/v1/chat/completions", json=chat).status_code == 200
    assert short_completion(server.url).status_code == 200
    assert [kind for kind, _ in tokenizer.calls] == ["template", "encode", "encode"]
    threads = [thread for _, thread in tokenizer.calls]
    assert all(t.startswith("minipaged-preprocess") for t in threads), threads


@given(text=st.text(max_size=300))
def test_the_size_bound_never_exceeds_the_token_count(tokenizer, text):
    pre = Preprocessor(MODEL, tokenizer, CONTEXT, tokenizer.vocab_size)
    try:
        assert pre.min_tokens(text) <= len(tokenizer.encode(text))
    finally:
        pre.close()


@pytest.mark.parametrize("text", ["\x1d", "\x04\x1d a", "\x1d" * 40 + "ok"])
def test_the_size_bound_leaves_out_bytes_that_encode_to_nothing(tokenizer, text):
    """The bundled vocabulary has no token for some byte values (0x04, 0x1d): they vanish."""
    pre = Preprocessor(MODEL, tokenizer, CONTEXT, tokenizer.vocab_size)
    try:
        assert b"\x1d" in pre.silent_bytes and b"a" not in pre.silent_bytes
        assert pre.min_tokens(text) <= len(tokenizer.encode(text))
    finally:
        pre.close()


def test_the_size_bound_is_sound_for_the_longest_tokens(tokenizer):
    """The bound's worst case: text made of the tokens that stand for the most bytes."""
    pre = Preprocessor(MODEL, tokenizer, CONTEXT, tokenizer.vocab_size)
    pre.close()
    longest = sorted(range(tokenizer.vocab_size), key=lambda i: -len(tokenizer.token_bytes(i)))
    text = tokenizer.decode(longest[:50] * 4)
    assert len(tokenizer.token_bytes(longest[0])) == pre.max_token_bytes
    assert pre.min_tokens(text) <= len(tokenizer.encode(text))
    assert pre.min_tokens("é" * 2**20) == -(-(2**21) // pre.max_token_bytes)  # UTF-8 bytes
