"""`minipaged serve`: the OpenAI-compatible HTTP server, driven by real HTTP clients.

Servers run in this process on a free port of 127.0.0.1 (`ServerThread`, stopped by its
fixture whatever happens); the signal tests start `minipaged.server.launch.serve` in a child
process. Where the model does not matter the engine holds a tiny random LLaMA with the bundled
tokenizer's vocabulary (so text goes in and comes out); where it does, the bundled SmolLM2.

References: what the engine gives offline for the same seeded request (seeded sampling does
not depend on the batch), and the bundled model's documented greedy answer (TOOLCHAIN.md).
Clients: the official `openai` package, and raw `httpx` for framing, errors and disconnects.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import torch
from http_checks import assert_drained, metrics
from tiny_models import tiny_llama_parts

from minipaged.engine.engine import EngineConfig, LLMEngine
from minipaged.sampling.params import SamplingParams
from minipaged.server.app import build_app
from minipaged.server.launch import ServerThread, free_port, wait_until_healthy
from minipaged.server.serve_command import served_model_name

openai = pytest.importorskip("openai")

MODEL = "tiny"
ENGINE = dict(num_gpu_blocks=160, num_cpu_blocks=32, block_size=16, max_num_seqs=64)
QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."  # TOOLCHAIN.md: float32 greedy, chat template


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_parts():
    """A two-layer random LLaMA over the bundled tokenizer's 49,152 tokens."""
    return tiny_llama_parts(vocab_size=49152, max_position_embeddings=1024)


def make_engine(parts, tokenizer, **overrides) -> LLMEngine:
    model, config = parts
    return LLMEngine(model, config, tokenizer, EngineConfig(**(ENGINE | overrides)))


@pytest.fixture(scope="module")
def tiny(tiny_parts, bundled_tokenizer):
    """A running server on the tiny model: (server, its engine loop, offline(...))."""

    def offline(prompts, params: SamplingParams | list[SamplingParams]):
        """What the engine gives offline: every prompt at once (with its own parameters, or
        all with the same), run to the end."""
        engine = make_engine(tiny_parts, bundled_tokenizer)
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        ids = [engine.add_request(None, p, q) for p, q in zip(prompts, params, strict=True)]
        finals = engine.run_until_done()
        return [finals[i] for i in ids]

    app = build_app(make_engine(tiny_parts, bundled_tokenizer), MODEL)
    with ServerThread(app) as server:
        yield server, app.state.engine_loop, offline


@pytest.fixture
def client(tiny):
    server, _, _ = tiny
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as c:
        yield c
    assert_drained(server.url)  # every test leaves the engine empty and every block free


def seeded(seed: int, **kwargs) -> dict:
    """A seeded random request that runs to `max_tokens` (the fields of `SamplingParams`)."""
    return dict(temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True) | kwargs


def seeded_call(seed: int, **kwargs) -> dict:
    """The same as keyword arguments of the `openai` client (vLLM's extras go in extra_body)."""
    fields = seeded(seed, **kwargs)
    return fields | {"extra_body": {"ignore_eos": fields.pop("ignore_eos")}}


def sse_events(lines) -> list[str]:
    """The `data:` payloads of an SSE body, checking its framing on the way."""
    events, expect_blank = [], False
    for line in lines:
        if expect_blank:
            assert line == "", f"an event must end with a blank line, got {line!r}"
            expect_blank = False
            continue
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        events.append(line.removeprefix("data: "))
        expect_blank = True
    return events


# -- completions and chat through the official client ---------------------------------------------


def test_completion_equals_offline_with_usage(tiny, client):
    _, _, offline = tiny
    answer = client.completions.create(model=MODEL, prompt="Once upon a time", **seeded_call(1))
    (reference,) = offline(["Once upon a time"], SamplingParams(**seeded(1)))
    (choice,) = answer.choices
    assert choice.text == reference.outputs[0].text
    assert choice.finish_reason == "length"
    assert answer.usage.prompt_tokens == len(reference.prompt_token_ids)
    assert answer.usage.completion_tokens == 8
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + 8
    assert answer.model == MODEL and answer.object == "text_completion"


def test_completion_stream_joins_to_the_offline_text_and_ends_with_usage(tiny, client):
    _, _, offline = tiny
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="The sea",
            stream=True,
            stream_options={"include_usage": True},
            **seeded_call(2, max_tokens=10),
        )
    )
    (reference,) = offline(["The sea"], SamplingParams(**seeded(2, max_tokens=10)))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_batch_of_prompts_with_n_2_gives_every_sample_in_order(tiny, client):
    _, _, offline = tiny
    prompts = ["Red", [17, 18, 19]]
    answer = client.completions.create(model=MODEL, prompt=prompts, n=2, **seeded_call(3))
    references = offline(prompts, SamplingParams(n=2, **seeded(3)))
    expected = [c.text for r in references for c in r.outputs]
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert [c.text for c in answer.choices] == expected
    assert expected[0] != expected[1]  # two different samples, not one twice
    assert answer.usage.completion_tokens == 4 * 8
    assert answer.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in references)


def test_completion_logprobs_are_the_engine_s(tiny, client, bundled_tokenizer):
    _, _, offline = tiny
    answer = client.completions.create(model=MODEL, prompt="Hi", logprobs=3, **seeded_call(4))
    (reference,) = offline(["Hi"], SamplingParams(logprobs=3, **seeded(4)))
    logprobs, ref = answer.choices[0].logprobs, reference.outputs[0]
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 8
    for i, token_id in enumerate(ref.token_ids):
        text = bundled_tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")
        assert logprobs.tokens[i] == text
        assert logprobs.token_logprobs[i] == pytest.approx(ref.logprobs[i][token_id])
        assert logprobs.top_logprobs[i][text] == pytest.approx(ref.logprobs[i][token_id])
        assert 3 <= len(logprobs.top_logprobs[i]) <= 4  # the top 3 and the sampled token
    assert logprobs.text_offset[0] == 0
    assert logprobs.text_offset[1:] == [
        logprobs.text_offset[i] + len(logprobs.tokens[i]) for i in range(7)
    ]


def test_chat_stream_equals_the_whole_answer_with_logprobs(client):
    messages = [{"role": "user", "content": "Tell me a story."}]
    params = dict(model=MODEL, messages=messages, logprobs=True, top_logprobs=2, **seeded_call(5))
    whole = client.chat.completions.create(**params)
    chunks = list(
        client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **params
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"
    content = whole.choices[0].logprobs.content
    assert len(content) == 8 == whole.usage.completion_tokens
    for token in content:
        assert len(token.top_logprobs) == 2
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob >= token.logprob - 1
        assert bytes(token.bytes).decode("utf-8", errors="replace") == token.token
    streamed_logprobs = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert [t.logprob for t in streamed_logprobs] == pytest.approx([t.logprob for t in content])
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens > 20  # the template's


def test_chat_n_2_gives_two_choices(client):
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2, **seeded_call(6)
    )
    assert [c.index for c in answer.choices] == [0, 1]
    assert answer.choices[0].message.content != answer.choices[1].message.content
    assert answer.usage.completion_tokens == 16


def test_stop_strings_are_cut_from_streamed_and_whole_text(tiny, client):
    _, _, offline = tiny
    (free,) = offline(["Go"], SamplingParams(**seeded(7, max_tokens=12)))
    stop = free.outputs[0].text[5:9]  # four characters from the middle of the free answer
    whole = client.completions.create(
        model=MODEL, prompt="Go", stop=[stop], **seeded_call(7, max_tokens=12)
    )
    chunks = client.completions.create(
        model=MODEL, prompt="Go", stop=stop, stream=True, **seeded_call(7, max_tokens=12)
    )
    streamed = "".join(c.choices[0].text for c in chunks)
    assert whole.choices[0].text == streamed == free.outputs[0].text.split(stop)[0]
    assert whole.choices[0].finish_reason == "stop"


def test_models_and_health(tiny, client):
    server, loop, _ = tiny
    (card,) = client.models.list().data
    assert card.id == MODEL and card.max_model_len == 1024
    assert httpx.get(server.url + "/health").status_code == 200


def test_the_engine_loop_sleeps_when_idle(tiny, client):
    _, loop, _ = tiny
    assert_drained(tiny[0].url)
    before = loop.num_wakeups
    time.sleep(0.3)
    assert loop.num_wakeups == before  # no polling: it waits until a command wakes it


# -- 32 concurrent streams ------------------------------------------------------------------------


def test_32_concurrent_streams_each_get_their_own_offline_text(tiny, client):
    server, loop, offline = tiny
    prompts = [f"Story number {i}:" for i in range(32)]

    async def one(aclient, i: int) -> str:
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompts[i], stream=True, **seeded_call(100 + i, max_tokens=12)
        )
        return "".join([c.choices[0].text async for c in stream])

    async def all_of_them() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none") as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(32)))

    steps = loop.num_steps
    texts = asyncio.run(all_of_them())
    steps = loop.num_steps - steps
    references = offline(
        prompts, [SamplingParams(**seeded(100 + i, max_tokens=12)) for i in range(32)]
    )
    for i, (text, reference) in enumerate(zip(texts, references, strict=True)):
        assert text == reference.outputs[0].text, f"stream {i}"
    assert len(set(texts)) == 32
    assert steps < 32 * 12 / 4  # the streams were batched together, not served one by one


# -- errors ---------------------------------------------------------------------------------------

COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
BAD = [
    # (endpoint, fields replacing the valid body's, the field the error must name)
    ("completions", {"temperature": "hot"}, "temperature"),
    ("completions", {"n": 1.5}, "n"),
    ("completions", {"stream": "yes"}, "stream"),
    ("completions", {"prompt": 5}, "prompt"),
    ("completions", {"prompt": [1, "a"]}, "prompt"),
    ("completions", {"prompt": None}, "prompt"),
    ("completions", {"stop": 3}, "stop"),
    ("completions", {"temperature": -1.0}, "temperature"),
    ("completions", {"top_p": 0.0}, "top_p"),
    ("completions", {"top_k": -2}, "top_k"),
    ("completions", {"min_p": 1.5}, "min_p"),
    ("completions", {"n": 0}, "n"),
    ("completions", {"n": 2, "temperature": 0.0}, "n"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"min_tokens": 9}, "min_tokens"),
    ("completions", {"seed": -1}, "seed"),
    ("completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"frequency_penalty": -2.5}, "frequency_penalty"),
    ("completions", {"repetition_penalty": 0.0}, "repetition_penalty"),
    ("completions", {"stop": [""]}, "stop"),
    ("completions", {"logprobs": 99}, "logprobs"),
    ("completions", {"echo": True}, "echo"),
    ("completions", {"logit_bias": {"5": 1.0}}, "logit_bias"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": [1, 2, 50000]}, "prompt"),
    ("completions", {"prompt": [5] * 1024}, "prompt"),  # no room left in the context
    ("completions", {"prompt": ["fine", [5] * 1100]}, "prompt"),  # one bad prompt of a batch
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [{"content": "no role"}]}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"max_completion_tokens": -3}, "max_completion_tokens"),
    ("chat", {"tools": [{"type": "function"}]}, "tools"),
]


@pytest.mark.parametrize(("endpoint", "change", "param"), BAD)
def test_bad_parameters_are_400_naming_the_field(tiny, endpoint, change, param):
    server, _, _ = tiny
    body = (COMPLETION if endpoint == "completions" else CHAT) | change
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    response = httpx.post(server.url + path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert param in error["message"]
    assert_drained(server.url)  # a rejected request leaves nothing behind


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b'"text"', b""])
def test_malformed_bodies_are_400(tiny, body):
    response = httpx.post(tiny[0].url + "/v1/completions", content=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] is None and error["code"] == 400 and "JSON" in error["message"]


def test_unknown_model_and_route_are_404(tiny):
    url = tiny[0].url
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        response = httpx.post(url + path, json=body | {"model": "gpt-9"})
        assert response.status_code == 404
        assert response.json()["error"] | {"message": None} == {
            "message": None,
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
        assert "gpt-9" in response.json()["error"]["message"]
    assert httpx.get(url + "/v2/nothing").json()["error"]["code"] == 404


def test_raw_sse_framing_ends_with_done(tiny):
    with httpx.stream(
        "POST", tiny[0].url + "/v1/completions", json=COMPLETION | {"stream": True}
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"



def test_streams_and_whole_answers_count_every_generated_token_once(tiny):
    """A stream's engine outputs are deltas, a whole answer's its final output (each request's
    `output_kind`): the generated-tokens counter adds exactly what was generated, either way."""
    server, _, _ = tiny
    before = metrics(server.url)["minipaged:generation_tokens_total"]
    body = COMPLETION | seeded(11, max_tokens=7, n=2)
    whole = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()
    assert whole["usage"]["completion_tokens"] == 14
    stream_body = body | {"stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=stream_body) as response:
        chunks = [json.loads(e) for e in sse_events(response.iter_lines())[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 14
    texts = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}  # the same seed
    after = assert_drained(server.url)["minipaged:generation_tokens_total"]
    assert after - before == 2 * 14

# -- disconnects ----------------------------------------------------------------------------------


def test_a_client_leaving_mid_stream_aborts_its_request(tiny):
    server, _, _ = tiny
    before = metrics(server.url)
    body = COMPLETION | {"stream": True, "max_tokens": 900, "ignore_eos": True, **seeded(8)}
    body["max_tokens"] = 900
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as response:
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data: ")
            if seen == 3:
                break  # leaving the block closes the connection mid-stream
    after = assert_drained(server.url, timeout=3.0)
    aborted = 'minipaged:request_success_total{finished_reason="abort"}'
    assert after[aborted] == before.get(aborted, 0) + 1
    generated = after["minipaged:generation_tokens_total"]
    assert generated - before["minipaged:generation_tokens_total"] < 300  # far from 900


def test_a_client_leaving_a_whole_answer_aborts_it(tiny):
    server, _, _ = tiny
    before = metrics(server.url)
    body = COMPLETION | seeded(9) | {"max_tokens": 900}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    after = assert_drained(server.url, timeout=3.0)
    aborted = 'minipaged:request_success_total{finished_reason="abort"}'
    assert after[aborted] == before.get(aborted, 0) + 1


# -- a dead engine loop ---------------------------------------------------------------------------


def test_health_is_503_once_the_engine_loop_died(tiny_parts, bundled_tokenizer, monkeypatch):
    engine = make_engine(tiny_parts, bundled_tokenizer)

    def broken_step():
        raise RuntimeError("the device fell off the bus")

    monkeypatch.setattr(engine, "step", broken_step)
    with ServerThread(build_app(engine, MODEL)) as server:
        assert httpx.get(server.url + "/health").status_code == 200
        response = httpx.post(server.url + "/v1/completions", json=COMPLETION)
        assert response.status_code == 503
        assert "fell off the bus" in response.json()["error"]["message"]
        assert httpx.get(server.url + "/health").status_code == 503
        again = httpx.post(server.url + "/v1/chat/completions", json=CHAT)
        assert again.status_code == 503 and again.json()["error"]["code"] == 503


# -- the bundled model ----------------------------------------------------------------------------


def test_greedy_chat_over_http_equals_the_offline_chat(bundled_model, bundled_tokenizer):
    model, config = bundled_model
    messages = [{"role": "user", "content": QUESTION}]
    engine_config = EngineConfig(num_gpu_blocks=64, num_cpu_blocks=0)
    offline = LLMEngine(model, config, bundled_tokenizer, engine_config)
    prompt = bundled_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    request_id = offline.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=32))
    expected = offline.run_until_done()[request_id].outputs[0].text
    assert expected == ANSWER

    served = LLMEngine(model, config, bundled_tokenizer, engine_config)
    with ServerThread(build_app(served, "smol")) as server:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="none") as client:
            answer = client.chat.completions.create(
                model="smol", messages=messages, temperature=0, max_tokens=32
            )
            chunks = list(
                client.chat.completions.create(
                    model="smol",
                    messages=messages,
                    temperature=0,
                    max_tokens=32,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert answer.choices[0].message.content == streamed == expected
        assert answer.choices[0].finish_reason == "stop"
        assert answer.usage.prompt_tokens == len(prompt)
        assert answer.usage.completion_tokens == len(bundled_tokenizer.encode(ANSWER)) + 1  # EOS
        # The second request found the first one's full prompt blocks in the prefix cache.
        cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
        assert cached == len(prompt) // 16 * 16
        values = assert_drained(server.url)
    assert values["minipaged:prefix_cache_hit_rate"] > 0


# -- the command and its signals ------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import torch
    from minipaged.engine.engine import EngineConfig, LLMEngine
    from minipaged.models.registry import build_model
    from minipaged.server.app import build_app
    from minipaged.server.launch import serve

    config, weights = torch.load({weights!r}, weights_only=False)
    engine_config = EngineConfig(num_gpu_blocks=300, num_cpu_blocks=0)
    engine = LLMEngine(build_model(config, weights), config, None, engine_config)
    print("signals:", serve(build_app(engine, "tiny"), "127.0.0.1", {port}, 0.5), flush=True)
    """
)


@pytest.fixture(scope="module")
def child_weights(tmp_path_factory) -> Path:
    """A tiny random model saved for child processes (they need not import transformers)."""
    model, config = tiny_llama_parts(max_position_embeddings=4096)
    path = tmp_path_factory.mktemp("server") / "tiny.pt"
    torch.save((config, model.state_dict()), path)
    return path


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_aborts_in_flight_requests_and_exits_cleanly(sig, child_weights):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(weights=str(child_weights), port=port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        wait_until_healthy(url, 60, child)
        body = {
            "prompt": [1, 2, 3],
            "max_tokens": 4000,
            "ignore_eos": True,
            "stream": True,
            "logprobs": 0,
        }  # no tokenizer, no text: logprobs make every token a chunk
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")  # the request is running
            assert next(lines) == ""
            child.send_signal(sig)
            events = sse_events(lines)  # ends cleanly once the grace period is over
        assert events[-1] == "[DONE]"
        assert "shutting down" in json.loads(events[-2])["error"]["message"]
        output, _ = child.communicate(timeout=20)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, output
    assert f"signals: [{int(sig)}]" in output
    assert "Traceback" not in output, output


def test_serve_flags_are_checked_before_loading(capsys):
    from minipaged import __main__ as cli

    assert cli.main(["serve", "--port", "70000"]) == 2
    assert "port must be in 1..65535, got 70000" in capsys.readouterr().err
    assert cli.main(["serve", "--max-request-body-bytes", "0"]) == 2
    assert "max-request-body-bytes must be >= 1, got 0" in capsys.readouterr().err
    args = cli.build_parser().parse_args(["serve", "--model", "/models/llama-7b", "--port", "9"])
    assert (args.host, args.port, args.scheduler) == ("127.0.0.1", 9, "fcfs")
    assert served_model_name(args) == "llama-7b"
    named = cli.build_parser().parse_args(["serve", "--served-model-name", "mine"])
    assert served_model_name(named) == "mine"
