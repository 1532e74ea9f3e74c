"""OpenAI's rules for messages and lengths, and every numeric field's range, over real HTTP.

A server on a tiny random LLaMA with the bundled tokenizer (context 1,024 tokens) runs in this
process (`ServerThread`). The property test sends each field of both endpoints extreme and
wrong-typed JSON values beside a normal greedy request and checks the answer is a 400 naming
the field (or a 200 where the value is valid) and the greedy request finishes exactly as alone.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from http_checks import assert_drained, assert_healthy_now
from hypothesis import given
from hypothesis import strategies as st
from tiny_models import tiny_llama_parts

from minipaged.engine.engine import EngineConfig, LLMEngine
from minipaged.server.app import build_app
from minipaged.server.launch import ServerThread
from minipaged.server.protocol import MAX_STOP_STRINGS

MODEL = "tiny"
CONTEXT = 1024
VOCAB = 49152
ENGINE = dict(num_gpu_blocks=200, num_cpu_blocks=0, block_size=16, max_num_seqs=32)
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# A normal request sent beside the hostile ones: greedy, so its answer is fixed.
GREEDY = {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def url(bundled_tokenizer):
    model, config = tiny_llama_parts(vocab_size=VOCAB, max_position_embeddings=CONTEXT)
    engine = LLMEngine(model, config, bundled_tokenizer, EngineConfig(**ENGINE))
    with ServerThread(build_app(engine, MODEL)) as server:
        yield server.url


def post(url: str, endpoint: str, body: dict | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(url + PATHS[endpoint], content=body, timeout=60)
    return httpx.post(url + PATHS[endpoint], json=body, timeout=60)


def assert_400(response: httpx.Response, param: str) -> str:
    """A 400 in OpenAI's shape naming `param`; returns the message."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "BadRequestError" and error["code"] == 400
    return error["message"]


# -- messages -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("messages", "words"),
    [
        ([{"role": "hacker", "content": "Hi"}], ["messages.0.role", "'user'", "hacker"]),
        ([{"role": "user"}], ["messages.0", "content is required in a user message"]),
        ([{"role": "system"}, {"role": "user", "content": "Hi"}], ["system message"]),
        ([{"role": "user", "content": "Hi"}, {"role": "user", "content": None}], ["messages.1"]),
    ],
)
def test_unknown_roles_and_missing_content_are_400(url, messages, words):
    message = assert_400(post(url, "chat", CHAT | {"messages": messages}), "messages")
    for word in words:
        assert word in message
    assert_healthy_now(url)


def test_an_assistant_message_may_have_no_content(url):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "Again"},
    ]
    assert post(url, "chat", CHAT | {"messages": messages}).status_code == 200


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_more_stop_strings_than_the_cap_are_400(url, endpoint):
    body = COMPLETION if endpoint == "completions" else CHAT
    many = [f"stop{i}" for i in range(1000)]
    message = assert_400(post(url, endpoint, body | {"stop": many}), "stop")
    assert f"at most {MAX_STOP_STRINGS} stop strings, got 1000" in message
    fits = [f"stop{i}" for i in range(MAX_STOP_STRINGS)]
    assert post(url, endpoint, body | {"stop": fits}).status_code == 200


# -- lengths --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "change", "field"),
    [
        ("completions", {"max_tokens": 10**12}, "max_tokens"),
        ("completions", {"max_tokens": CONTEXT}, "max_tokens"),
        ("completions", {"prompt": [5] * 1000, "max_tokens": 25}, "max_tokens"),
        ("completions", {"prompt": ["Hi", [5] * 1000], "max_tokens": 25}, "max_tokens"),
        ("chat", {"max_tokens": 10**12}, "max_tokens"),
        ("chat", {"max_tokens": None, "max_completion_tokens": 2**63 - 1}, "max_completion_tokens"),
    ],
)
def test_prompt_plus_max_tokens_beyond_the_context_is_400_naming_both(
    url, bundled_tokenizer, endpoint, change, field
):
    body = (COMPLETION if endpoint == "completions" else CHAT) | change
    message = assert_400(post(url, endpoint, body), field)
    requested = change.get("max_tokens") or change.get("max_completion_tokens")
    if endpoint == "completions":
        prompt = body["prompt"]
        prompts = (
            prompt if isinstance(prompt, list) and isinstance(prompt[0], list | str) else [prompt]
        )
        lens = [
            len(p) if isinstance(p, list) else len(bundled_tokenizer.encode(p)) for p in prompts
        ]
        prompt_len, where = max(lens), "prompt"
    else:
        prompt_len = len(bundled_tokenizer.apply_chat_template(body["messages"], tokenize=True))
        where = "messages"
    assert message.startswith(
        f"This model's maximum context length is {CONTEXT} tokens. However, you requested "
        f"{prompt_len + requested} tokens ({prompt_len} in the {where}, {requested} in the "
        "completion"
    ), message
    assert_drained(url)


def test_a_request_that_fills_the_context_exactly_is_served(url):
    body = {"prompt": [5] * 1000, "max_tokens": CONTEXT - 1000, "ignore_eos": True}
    answer = post(url, "completions", body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == CONTEXT - 1000


def test_without_max_tokens_a_completion_gets_what_the_context_leaves(url):
    body = {"prompt": [5] * (CONTEXT - 3), "ignore_eos": True}
    answer = post(url, "completions", body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 3  # not the default 16


# -- every numeric field, extreme and wrong-typed -------------------------------------------------

SHARED_FIELDS = [
    "max_tokens", "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "min_tokens", "ignore_eos", "best_of", "stream",
]  # fmt: skip
FIELDS = [("completions", f) for f in [*SHARED_FIELDS, "logprobs", "prompt"]] + [
    ("chat", f) for f in [*SHARED_FIELDS, "max_completion_tokens", "logprobs", "top_logprobs"]
]
EXTREMES = [
    2**63, -(2**63) - 1, 2**63 - 1, -(2**63), 2**64, 10**30, -1, 0, 1, VOCAB, VOCAB + 1,
    1e308, -1e308, 5e-324, 0.5, math.nan, math.inf, -math.inf,
    "", "1", "NaN", [], [1], [2**63], [-1], ["a"], None, True, False, {},
]  # fmt: skip


def valid_for(field: str, value: object, endpoint: str) -> bool:
    """Whether the server should accept `value` in `field` of the base body (the rest are 400s
    naming the field); what SamplingParams and the served model allow."""
    if value is None:  # null is the field's default (vLLM's rule), except for the prompt
        return field != "prompt"
    is_int = isinstance(value, int) and not isinstance(value, bool)
    is_num = is_int or (isinstance(value, float) and math.isfinite(value))
    ranges = {
        "max_tokens": lambda: is_int and 1 <= value <= CONTEXT - 40,
        "max_completion_tokens": lambda: is_int and 1 <= value <= 900,
        "n": lambda: is_int and value == 1,  # n > 1 needs a temperature > 0 (base: default 1)
        "temperature": lambda: is_num and value >= 0,
        "top_p": lambda: is_num and 0 < value <= 1,
        "top_k": lambda: is_int and -1 <= value <= VOCAB,
        "min_p": lambda: is_num and 0 <= value <= 1,
        "seed": lambda: is_int and 0 <= value < 2**64,
        "stop": lambda: (
            (isinstance(value, str) and value != "")
            or (isinstance(value, list) and all(isinstance(v, str) and v for v in value))
        ),
        "stop_token_ids": lambda: value in ([], [1]),
        "presence_penalty": lambda: is_num and -2 <= value <= 2,
        "frequency_penalty": lambda: is_num and -2 <= value <= 2,
        "repetition_penalty": lambda: is_num and value > 0,
        "min_tokens": lambda: is_int and 0 <= value <= 4,
        "ignore_eos": lambda: isinstance(value, bool),
        "stream": lambda: isinstance(value, bool),
        "best_of": lambda: is_int and value == 1,
        "logprobs": lambda: (
            isinstance(value, bool) if endpoint == "chat" else is_int and 0 <= value <= 20
        ),
        "top_logprobs": lambda: False,  # a number needs logprobs=true
        "prompt": lambda: value in ("1", "NaN", [1], ["a"]),  # ["a"]: a batch of one text
    }
    return ranges[field]()


def greedy_alone(url: str) -> list[str]:
    answer = post(url, "completions", GREEDY | {"logprobs": 0})
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["logprobs"]["tokens"]


@pytest.fixture(scope="module")
def greedy_reference(url) -> list[str]:
    return greedy_alone(url)


def check_answer(endpoint: str, name: str, value: object, response: httpx.Response) -> None:
    """A 200 where `value` is valid in `name`, else a 400 naming `name`."""
    if valid_for(name, value, endpoint):
        assert response.status_code == 200, (name, value, response.text)
        if name == "stream" and value:
            assert response.text.rstrip().endswith("data: [DONE]")
    else:
        assert response.status_code == 400, (name, value, response.text)
        error = response.json()["error"]
        assert error["param"] == name, (name, value, error)
        assert name in error["message"]


@given(
    field=st.sampled_from(FIELDS),
    values=st.lists(st.sampled_from(EXTREMES), min_size=1, max_size=6, unique_by=repr),
)
def test_every_field_extreme_or_wrong_typed_is_400_naming_it_and_harms_nobody(
    url, greedy_reference, field, values
):
    endpoint, name = field
    base = COMPLETION if endpoint == "completions" else CHAT
    bodies = []
    for value in values:
        if endpoint == "chat" and name in ("max_tokens", "max_completion_tokens") and value is None:
            value = 1  # left out, a chat answer runs to the end of the context: slow, not hostile
        bodies.append((value, json.dumps(base | {name: value}).encode()))  # NaN as Python writes
    with ThreadPoolExecutor(len(bodies) + 1) as pool:  # all at once: one batch in the engine
        normal = pool.submit(greedy_alone, url)
        hostile = [(v, pool.submit(post, url, endpoint, body)) for v, body in bodies]
        assert normal.result() == greedy_reference  # the request beside them, as alone
        for value, answer in hostile:
            check_answer(endpoint, name, value, answer.result())
    assert_healthy_now(url)
    assert_drained(url)
