"""The user-facing layer on the bundled SmolLM2: the command line, streaming, request metrics.

The model is loaded once per test session; every `LLM(...)` the command line builds reuses it
(`LLMEngine.from_pretrained` is patched to wrap the loaded weights in a fresh engine with the
flags' configuration, which the patch records so the tests can check the flags got through).

References: the model's greedy answer to "What is the capital of France?" is a documented fact
(TOOLCHAIN.md, checked against transformers); other outputs are compared with `generate_dense`,
the cache-free oracle, and streamed text with the engine's own final text.
"""

from __future__ import annotations

import builtins
import os
from dataclasses import dataclass, field

import pytest
import torch

from minipaged import cli, engine_config, llm
from minipaged.dense import generate_dense
from minipaged.engine import LLMEngine
from minipaged.engine_config import EngineConfig
from minipaged.llm import stream_text
from minipaged.sampling import SamplingParams
from minipaged.scheduler import FCFSScheduler

QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."  # TOOLCHAIN.md: float32 greedy, chat template


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: on a CPU shared with other work, two threads wait on each other at every
    parallel region of a step (measured: a 40-token answer in 2.5 s with one, 14-21 s with two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def bundled():
    """The bundled model's weights, config and tokenizer, loaded once."""
    engine = LLMEngine.from_pretrained(num_gpu_blocks=1, num_cpu_blocks=0)
    return engine.runner.model, engine.model_config, engine.tokenizer


def make_engine(bundled, **kwargs) -> LLMEngine:
    model, model_config, tokenizer = bundled
    kwargs.setdefault("num_gpu_blocks", 96)
    kwargs.setdefault("num_cpu_blocks", 32)
    return LLMEngine(model, model_config, tokenizer, EngineConfig(**kwargs))


@dataclass
class Loads:
    """What `LLM(...)` asked `LLMEngine.from_pretrained` for, call by call."""

    calls: list[dict] = field(default_factory=list)
    engines: list[LLMEngine] = field(default_factory=list)


@pytest.fixture
def loads(bundled, monkeypatch) -> Loads:
    record = Loads()

    def from_pretrained(cls, model=None, **kwargs):
        record.calls.append({"model": model, **kwargs})
        if kwargs.get("num_gpu_blocks") is None:  # keep the test's cache small
            kwargs["kv_cache_memory"] = 0.1
        kwargs["swap_space"] = min(kwargs.get("swap_space", 1.0), 0.05)
        engine = make_engine(bundled, **kwargs)
        record.engines.append(engine)
        return engine

    monkeypatch.setattr(LLMEngine, "from_pretrained", classmethod(from_pretrained))
    return record


def chat_ids(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)


# -- the command line -----------------------------------------------------------------------------


def test_chat_one_shot_answers_greedily(loads, capsys):
    assert cli.main(["chat", QUESTION]) == 0
    assert capsys.readouterr().out == ANSWER + "\n"
    assert loads.calls[0]["scheduler"] == "fcfs" and loads.calls[0]["model"] is None


def test_generate_several_prompts_equals_dense_greedy(bundled, loads, capsys):
    model, _, tokenizer = bundled
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]
    argv = ["generate", *prompts, "--max-tokens", "6", "--ignore-eos", "--block-size", "8",
            "--num-gpu-blocks", "40", "--no-prefix-caching"]
    assert cli.main(argv) == 0
    ids = [tokenizer.encode(p, add_special_tokens=True) for p in prompts]
    expected = [p + tokenizer.decode(out, skip_special_tokens=True)
                for p, out in zip(prompts, generate_dense(model, ids, 6), strict=True)]
    assert capsys.readouterr().out == "".join(line + "\n" for line in expected)
    call = loads.calls[0]
    assert (call["block_size"], call["num_gpu_blocks"]) == (8, 40)
    assert call["enable_prefix_caching"] is False


@pytest.mark.parametrize(
    "flags, field_name",
    [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "2"], "top_p"),
        (["--top-k", "-3"], "top_k"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--repetition-penalty", "0"], "repetition_penalty"),
        (["--n", "2"], "n"),  # n > 1 with the greedy default
        (["--block-size", "0"], "block_size"),
        (["--threads", "0"], "threads"),
    ],
)
def test_bad_flag_values_exit_2_naming_the_field(loads, capsys, flags, field_name):
    assert cli.main(["generate", "Hi", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("minipaged: error:") and field_name in err
    assert "Traceback" not in err


def test_unknown_choices_are_usage_errors(loads, capsys):
    assert cli.main(["chat", "Hi", "--scheduler", "nope"]) == 2
    assert "--scheduler" in capsys.readouterr().err
    assert cli.main(["chat", "Hi", "--dtype", "float64"]) == 2
    assert not loads.calls  # nothing was loaded for bad input


def test_scheduler_choices_come_from_the_registry(loads, capsys, monkeypatch):
    monkeypatch.setitem(engine_config.SCHEDULERS, "test-fcfs", FCFSScheduler)
    assert cli.main(["generate", "Hi", "--scheduler", "test-fcfs", "--max-tokens", "2"]) == 0
    assert loads.calls[0]["scheduler"] == "test-fcfs"
    assert loads.engines[0].config.scheduler == "test-fcfs"
    assert capsys.readouterr().out.startswith("Hi")


def test_interactive_chat_streams_and_ends_on_an_empty_line(loads, capsys, monkeypatch):
    lines = iter([QUESTION, "And of Italy?", ""])
    prompts: list[str] = []

    def fake_input(prompt: str = "") -> str:
        prompts.append(prompt)
        return next(lines)  # a call after the empty line would raise StopIteration

    pieces: list[list[str]] = []

    def spy_stream_text(engine, request_id):
        pieces.append([])
        for piece in stream_text(engine, request_id):
            pieces[-1].append(piece)
            yield piece

    monkeypatch.setattr(builtins, "input", fake_input)
    monkeypatch.setattr(llm, "stream_text", spy_stream_text)
    assert cli.main(["chat", "--max-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert prompts == ["you> "] * 3
    assert len(pieces) == 2 and all(len(p) > 1 for p in pieces)  # streamed, piece by piece
    answers = [line.removeprefix("bot> ") for line in out.splitlines() if line.startswith("bot> ")]
    assert answers == ["".join(p) for p in pieces]
    assert answers[0] == ANSWER  # the first turn is the one-shot answer
    # The second turn saw the first answer: it is the dense greedy answer to the conversation.
    engine = loads.engines[0]
    conversation = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": ANSWER},
                    {"role": "user", "content": "And of Italy?"}]
    ids = engine.tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                               tokenize=True)
    dense = generate_dense(engine.runner.model, [ids], 12, engine.eos_token_ids)[0]
    assert answers[1] == engine.tokenizer.decode(dense, skip_special_tokens=True)


def test_interactive_chat_ends_on_eof(loads, capsys, monkeypatch):
    def eof(prompt: str = "") -> str:
        raise EOFError

    monkeypatch.setattr(builtins, "input", eof)
    assert cli.main(["chat"]) == 0
    assert "ends the session" in capsys.readouterr().out


# -- streaming ------------------------------------------------------------------------------------


def stream_with_outputs(engine: LLMEngine, prompt, params) -> tuple[list[str], list[str], str]:
    """Stream one request: (pieces of `stream_text`, texts of every intermediate output, final)."""
    request_id = engine.add_request(None, prompt, params)
    texts = []
    real_step = engine.step

    def spying_step():
        outputs = real_step()
        texts.extend(o.outputs[0].text for o in outputs if o.request_id == request_id)
        return outputs

    engine.step = spying_step
    pieces = list(stream_text(engine, request_id))
    return pieces, texts, texts[-1]


@pytest.fixture(scope="module")
def poem(bundled):
    """An unconstrained greedy answer whose substrings serve as stop strings."""
    _, _, tokenizer = bundled
    ids = chat_ids(tokenizer, "Write a short poem about the sea.")
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    pieces, texts, final = stream_with_outputs(make_engine(bundled), ids, params)
    assert "".join(pieces) == final and len(pieces) > 5
    return ids, final


@pytest.mark.parametrize("where", [0.2, 0.5, 0.8])
@pytest.mark.parametrize("length", [1, 4, 9])
def test_stream_holds_back_what_may_begin_a_stop_string(bundled, poem, where, length):
    ids, full = poem
    start = int(len(full) * where)
    stop = full[start : start + length]
    cut = full.find(stop)  # the first occurrence ends the answer, cut where it begins
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop, "@@@@"])
    pieces, texts, final = stream_with_outputs(make_engine(bundled), ids, params)
    assert final == full[:cut]
    assert "".join(pieces) == final
    for text in texts:  # nothing shown is ever taken back
        assert final.startswith(text)


def test_engine_stream_yields_growing_outputs_while_others_run(bundled):
    engine = make_engine(bundled)
    tokenizer = engine.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    longer = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    other = engine.add_request(None, chat_ids(tokenizer, "Name a colour."), longer)
    mine = engine.add_request(None, chat_ids(tokenizer, QUESTION), params)
    outputs = list(engine.stream(mine))
    assert [o.request_id for o in outputs] == [mine] * len(outputs)
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    assert lengths == list(range(1, 11))  # one new token per step, none skipped
    assert outputs[-1].outputs[0].text.startswith(ANSWER)
    assert other in engine.run_until_done()  # the other request was left intact
    with pytest.raises(ValueError, match="unknown"):
        next(engine.stream("no-such-request"))


# -- metrics --------------------------------------------------------------------------------------


def test_request_metrics_are_set_and_monotone(bundled):
    """Arrival <= first scheduled <= first token <= finished; preemptions counted per request
    and in total; prompt tokens found in the prefix cache (the chat template's shared system
    prompt) counted."""
    engine = make_engine(bundled, num_gpu_blocks=12, block_size=16, preemption_mode="recompute")
    tokenizer = engine.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    questions = [QUESTION, "Name a colour.", "What is 2 + 2?", "Say hello."]
    prompts = [chat_ids(tokenizer, q) for q in questions]
    first = engine.add_request(None, prompts[0], params)
    engine.step()  # the first prompt is computed: its full blocks enter the prefix cache
    ids = [first] + [engine.add_request(None, p, params) for p in prompts[1:]]
    seen = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen[output.request_id].append(output)
    finals = {i: seen[i][-1] for i in ids}
    for i in ids:
        assert all(o.metrics is not None for o in seen[i])
        m = finals[i].metrics
        assert finals[i].finished and len(finals[i].outputs[0].token_ids) == 40
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.time_to_first_token >= 0 and m.latency >= m.time_to_first_token
    preemptions = [finals[i].metrics.num_preemptions for i in ids]
    assert sum(preemptions) == engine.scheduler.num_preemptions > 0
    assert finals[first].metrics.num_cached_tokens == 0
    common = len(os.path.commonprefix(prompts))  # the system prompt and the user tag
    shared = common // 16 * 16  # in whole blocks
    assert shared > 0
    for i in ids[1:]:
        assert finals[i].metrics.num_cached_tokens >= shared
    # Preempted or not, every answer is the dense greedy one.
    dense = generate_dense(engine.runner.model, prompts, 40)
    assert [finals[i].outputs[0].token_ids for i in ids] == dense
