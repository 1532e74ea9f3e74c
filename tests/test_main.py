"""The user-facing layer on the bundled SmolLM2: the command line, the interactive chat,
streaming, request metrics.

The model is conftest's session fixture; every `LLM(...)` the command line builds reuses it
(`LLMEngine.from_pretrained` is patched to wrap the loaded weights in a fresh engine with the
flags' configuration, which the patch records so the tests can check the flags got through).
The interactive chat reads its lines through a patched `input()`.

References: the model's greedy answer to "What is the capital of France?" is a documented fact
(checked against transformers); other outputs are compared with `generate_dense`,
the cache-free oracle, and streamed text with the engine's own final text.
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field

import pytest
import torch

from minipaged import __main__ as cli
from minipaged.engine import llm as llm_module
from minipaged.engine.config import EngineConfig
from minipaged.engine.engine import LLMEngine
from minipaged.engine.llm import stream_text
from minipaged.sampling.params import SamplingParams
from minipaged.sched import registry
from minipaged.sched.fcfs import FCFSScheduler
from minipaged.testing.dense import generate_dense

QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."  # float32 greedy, chat template
# Plain greedy decoding for chat: its default repetition penalty applies at any temperature.
GREEDY = ["--temperature", "0", "--repetition-penalty", "1"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: on a CPU shared with other work, two threads wait on each other at every
    parallel region of a step (measured: a 40-token answer in 2.5 s with one, 14-21 s with two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def bundled(bundled_model, bundled_tokenizer):
    """The bundled model's weights, config and tokenizer (conftest's session fixtures)."""
    model, model_config = bundled_model
    return model, model_config, bundled_tokenizer


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
    assert cli.main(["chat", QUESTION, "--temperature", "0"]) == 0
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
    monkeypatch.setitem(registry.SCHEDULERS, "test-fcfs", FCFSScheduler)
    assert cli.main(["generate", "Hi", "--scheduler", "test-fcfs", "--max-tokens", "2"]) == 0
    assert loads.calls[0]["scheduler"] == "test-fcfs"
    assert loads.engines[0].config.scheduler == "test-fcfs"
    assert capsys.readouterr().out.startswith("Hi")


def test_interactive_chat_streams_and_ends_on_exit(loads, capsys, monkeypatch):
    lines = iter([QUESTION, "And of Italy?", "", "/exit"])
    prompts: list[str] = []

    def fake_input(prompt: str = "") -> str:
        prompts.append(prompt)
        return next(lines)  # a call after /exit would raise StopIteration

    pieces: list[list[str]] = []

    def spy_stream_text(engine, request_id):
        pieces.append([])
        for piece in stream_text(engine, request_id):
            pieces[-1].append(piece)
            yield piece

    monkeypatch.setattr(builtins, "input", fake_input)
    monkeypatch.setattr(llm_module, "stream_text", spy_stream_text)
    assert cli.main(["chat", "--max-tokens", "12", *GREEDY]) == 0
    out = capsys.readouterr().out
    assert prompts == ["you> "] * 4  # the blank line is skipped, /exit ends
    assert len(pieces) == 2 and all(len(p) > 1 for p in pieces)  # streamed, piece by piece
    answers = [line.removeprefix("bot> ") for line in out.splitlines() if line.startswith("bot> ")]
    assert answers == ["".join(p) for p in pieces]
    assert answers[0] == ANSWER  # the first turn is the one-shot answer
    # The second turn saw the first answer: it is the dense greedy answer to the conversation.
    engine = loads.engines[0]
    conversation = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": ANSWER},
                    {"role": "user", "content": "And of Italy?"}]
    assert answers[1] == dense_answer(engine, conversation, 12)


def dense_answer(engine: LLMEngine, conversation: list[dict[str, str]], max_tokens: int) -> str:
    """The cache-free oracle's greedy answer to a conversation."""
    ids = engine.tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                               tokenize=True)
    eos = engine.processor.eos_token_ids
    dense = generate_dense(engine.runner.model, [ids], max_tokens, eos)[0]
    return engine.tokenizer.decode(dense, skip_special_tokens=True)


def typed(monkeypatch, *lines: str | type[BaseException]) -> list[str]:
    """Make `input()` return `lines` one by one (an exception class is raised instead, as
    Ctrl-C and Ctrl-D make `input()` raise); return the prompts it showed. The prompt goes to
    stdout, as the real `input()` writes it."""
    queue = list(lines)
    prompts: list[str] = []

    def fake_input(prompt: str = "") -> str:
        prompts.append(prompt)
        print(prompt, end="")
        line = queue.pop(0)  # a call past the last line raises IndexError
        if isinstance(line, type):
            raise line
        print(line)  # the terminal echoes what was typed
        return line

    monkeypatch.setattr(builtins, "input", fake_input)
    return prompts


def count_streams(monkeypatch) -> list[str]:
    """Record the request id of every answer the chat streams."""
    streamed: list[str] = []

    def spy_stream_text(engine, request_id):
        streamed.append(request_id)
        yield from stream_text(engine, request_id)

    monkeypatch.setattr(llm_module, "stream_text", spy_stream_text)
    return streamed


def test_interactive_chat_commands_and_blank_lines_are_not_sent(loads, capsys, monkeypatch):
    typed(monkeypatch, "/help", "", "   ", "/nope", QUESTION, "/reset", "And of Italy?", "/exit")
    streamed = count_streams(monkeypatch)
    assert cli.main(["chat", "--max-tokens", "12", *GREEDY]) == 0
    out = capsys.readouterr().out
    assert len(streamed) == 2  # only the two questions reached the model
    assert cli.CHAT_HELP in out
    assert "unknown command /nope" in out
    answers = [line.removeprefix("bot> ") for line in out.splitlines() if line.startswith("bot> ")]
    assert answers[0] == ANSWER
    # After /reset the second question is asked on its own, without the first turn.
    fresh = [{"role": "user", "content": "And of Italy?"}]
    assert answers[1] == dense_answer(loads.engines[0], fresh, 12)
    assert not loads.engines[0].has_unfinished_requests()


@pytest.mark.parametrize("after_pieces", [0, 3])
def test_ctrl_c_stops_the_answer_aborts_its_request_and_keeps_the_chat(
    loads, capsys, monkeypatch, after_pieces
):
    """Ctrl-C while the first answer streams (before its first piece, or after three): the
    request is aborted at once, the turn is left out, and the next question is answered on the
    conversation as it was before it."""
    interrupted: list[str] = []

    def interrupted_stream_text(engine, request_id):
        stream = stream_text(engine, request_id)
        if not interrupted:
            interrupted.append(request_id)
            for _ in range(after_pieces):
                yield next(stream)
            raise KeyboardInterrupt  # what Ctrl-C raises wherever the stream is
        yield from stream

    unfinished_at_prompt: list[int] = []
    prompts = typed(monkeypatch, "Write a short poem about the sea.", QUESTION, "/exit")
    real_input = builtins.input

    def checking_input(prompt: str = "") -> str:
        if loads.engines:
            unfinished_at_prompt.append(loads.engines[0].get_num_unfinished_requests())
        return real_input(prompt)

    monkeypatch.setattr(builtins, "input", checking_input)
    monkeypatch.setattr(llm_module, "stream_text", interrupted_stream_text)
    assert cli.main(["chat", "--max-tokens", "12", *GREEDY]) == 0
    out = capsys.readouterr().out
    assert prompts == ["you> "] * 3  # the session went on after Ctrl-C
    assert "answer stopped" in out
    assert unfinished_at_prompt == [0, 0, 0]  # nothing left running after the interrupt
    engine = loads.engines[0]
    assert not engine.has_unfinished_requests()
    kv = engine.kv_manager
    assert kv.num_free_blocks == kv.num_gpu_blocks  # its blocks came back
    assert not engine.abort_request(interrupted[0])  # already aborted
    answers = [line.removeprefix("bot> ") for line in out.splitlines() if line.startswith("bot> ")]
    assert answers[-1] == ANSWER  # the one-shot answer: the stopped turn is not in the chat


def test_ctrl_c_at_the_prompt_clears_the_line(loads, capsys, monkeypatch):
    prompts = typed(monkeypatch, KeyboardInterrupt, "/exit")
    streamed = count_streams(monkeypatch)
    assert cli.main(["chat"]) == 0
    assert prompts == ["you> "] * 2 and not streamed
    assert "you> \nyou> /exit" in capsys.readouterr().out


def test_closing_the_answer_stream_aborts_its_request(loads):
    llm = llm_module.LLM()
    stream = cli.stream_answer(llm, [{"role": "user", "content": QUESTION}],
                               SamplingParams(temperature=0.0, max_tokens=12))
    assert next(stream)
    assert llm.engine.has_unfinished_requests()
    stream.close()
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.get_num_unfinished_requests() == 0


def test_interactive_chat_ends_on_eof(loads, capsys, monkeypatch):
    typed(monkeypatch, EOFError)
    assert cli.main(["chat"]) == 0
    out = capsys.readouterr().out
    assert "ends the session" in out
    assert out.endswith("you> \n")  # the shell's prompt starts on a new line


@pytest.mark.parametrize("tty", [True, False])
def test_line_editing_only_on_a_terminal(monkeypatch, tty):
    pytest.importorskip("readline")  # Python builds without it have no line editing to switch on

    class Stdin:
        def isatty(self) -> bool:
            return tty

    monkeypatch.delitem(sys.modules, "readline", raising=False)
    monkeypatch.setattr(sys, "stdin", Stdin())
    cli.enable_line_editing()
    assert ("readline" in sys.modules) == tty


# -- chat sampling ----------------------------------------------------------------------------


def repeated_trigrams(text: str) -> float:
    """The fraction of a text's word trigrams that occurred earlier in it (0: no repetition)."""
    words = text.split()
    grams = [tuple(words[i : i + 3]) for i in range(len(words) - 2)]
    return 1 - len(set(grams)) / len(grams)


def test_chat_samples_by_default_and_does_not_loop_where_greedy_does(loads, capsys):
    """Plain greedy decoding makes the bundled model repeat a line over and over on this prompt;
    the chat defaults (temperature, top-p, repetition penalty) give an answer without repeats."""
    prompt = "Write a haiku about memory pages"
    answers = {}
    for name, flags in [("greedy", GREEDY), ("default", [])]:
        assert cli.main(["chat", prompt, "--max-tokens", "40", *flags]) == 0
        answers[name] = capsys.readouterr().out
    assert repeated_trigrams(answers["greedy"]) > 0.3
    assert repeated_trigrams(answers["default"]) < 0.05


def parsed(*argv: str):
    return cli.build_parser().parse_args(["chat", *argv])


def test_chat_defaults_apply_where_no_flag_is_given():
    params = cli.chat_sampling_params(parsed())  # the bundled GGUF has no generation_config.json
    for name, value in cli.CHAT_DEFAULTS.items():
        assert getattr(params, name) == value
    params = cli.chat_sampling_params(parsed("--temperature", "0", "--max-tokens", "5"))
    assert (params.temperature, params.max_tokens, params.top_p) == (0.0, 5, 0.9)


def write_generation_config(folder, **settings) -> None:
    (folder / "generation_config.json").write_text(json.dumps(settings))


def test_generation_config_of_the_model_sets_the_chat_defaults(tmp_path):
    write_generation_config(tmp_path, do_sample=True, temperature=0.6, top_p=0.8, top_k=20,
                            repetition_penalty=1.05, max_new_tokens=100, bos_token_id=1,
                            min_p=None)
    expected = {"temperature": 0.6, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
                "max_tokens": 100}
    assert cli.model_generation_settings(tmp_path) == expected  # an HF folder
    assert cli.model_generation_settings(tmp_path / "model.gguf") == expected  # a file in it
    params = cli.chat_sampling_params(parsed("--model", str(tmp_path), "--top-k", "5"))
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.8, 5)  # the flag wins
    assert (params.repetition_penalty, params.max_tokens) == (1.05, 100)
    assert params.seed == cli.CHAT_DEFAULTS["seed"]  # not in the file: the chat default


def test_generation_config_without_sampling_means_greedy(tmp_path):
    write_generation_config(tmp_path, do_sample=False, temperature=0.9)
    assert cli.model_generation_settings(tmp_path) == {"temperature": 0.0}
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.model_generation_settings(empty) == {}


def test_chat_answers_with_the_model_folders_settings(tmp_path, loads, capsys):
    write_generation_config(tmp_path, do_sample=False, max_new_tokens=12)
    assert cli.main(["chat", QUESTION, "--model", str(tmp_path)]) == 0
    assert capsys.readouterr().out == ANSWER + "\n"  # greedy, as the file says
    assert loads.calls[0]["model"] == str(tmp_path)


@pytest.mark.parametrize(
    "text, named",
    [("{not json", "generation_config.json"), ("[1, 2]", "generation_config.json"),
     (json.dumps({"top_p": 2.0}), "top_p"), (json.dumps({"max_new_tokens": 0}), "max_tokens")],
)
def test_bad_generation_config_exits_2_before_loading(tmp_path, loads, capsys, text, named):
    (tmp_path / "generation_config.json").write_text(text)
    assert cli.main(["chat", "Hi", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("minipaged: error:") and named in err
    assert not loads.calls


# -- streaming ------------------------------------------------------------------------------------


def stream_with_outputs(engine: LLMEngine, prompt, params) -> tuple[list[str], list[str], str]:
    """Stream one request: (pieces of `stream_text`, the text every step had shown, final).
    The request is CUMULATIVE: each step returns the whole text it shows, beside the stream."""
    request_id = engine.add_request(None, prompt, params)
    texts = []
    real_step = engine.step

    def spying_step(**options: bool):  # the stream steps with `final_only`; spy without
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


def test_engine_stream_yields_each_steps_delta_while_others_run(bundled):
    engine = make_engine(bundled)
    tokenizer = engine.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    longer = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    other = engine.add_request(None, chat_ids(tokenizer, "Name a colour."), longer)
    mine = engine.add_request(None, chat_ids(tokenizer, QUESTION), params)
    outputs = list(engine.stream(mine))
    assert [o.request_id for o in outputs] == [mine] * len(outputs)
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1] * 10  # a token a step
    assert "".join(o.outputs[0].text for o in outputs).startswith(ANSWER)
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


# -- the engine flags are EngineConfig's ----------------------------------------------------------


@pytest.mark.parametrize("command", [["generate", "Hi"], ["chat"], ["serve"]])
def test_every_engine_flag_defaults_to_engine_config_and_reaches_it(command):
    """The flags' defaults are read from EngineConfig's fields, not copied: with no flag given,
    every value `LLM(...)` receives is EngineConfig's default, and every parsed value named
    like a field reaches it."""
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    args = cli.build_parser().parse_args(command)
    kwargs = cli.engine_kwargs_from_args(args)
    assert set(kwargs) <= set(defaults) and len(kwargs) >= 13
    engine_names = {name for name in vars(args) if name in defaults} - set(cli.SAMPLING_FLAGS)
    assert engine_names <= set(kwargs)  # (--seed is the request's, SamplingParams.seed)
    for name, value in kwargs.items():
        assert value == defaults[name], name
    assert EngineConfig(**kwargs) == EngineConfig()


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--block-size", "16.5"], "--block-size"),
        (["--swap-space", "a lot"], "--swap-space"),
        (["--num-gpu-blocks", "many"], "--num-gpu-blocks"),
        (["--preemption-mode", "drop"], "--preemption-mode"),
        (["--tensor-parallel-size", "two"], "--tensor-parallel-size"),
    ],
)
def test_engine_flags_of_the_wrong_type_are_usage_errors_naming_the_flag(capsys, flags, named):
    assert cli.main(["generate", "Hi", *flags]) == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, field_name",
    [
        (["--swap-space", "nan"], "swap_space"),
        (["--num-gpu-blocks", str(2**31)], "num_gpu_blocks"),
        (["--max-num-seqs", "0"], "max_num_seqs"),
        (["--device", "gpu9"], "device"),
    ],
)
def test_engine_flags_out_of_range_exit_2_naming_the_field(loads, capsys, flags, field_name):
    assert cli.main(["generate", "Hi", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("minipaged: error:") and field_name in err and "Traceback" not in err
