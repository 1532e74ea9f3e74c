"""The request contract (docs/layers/12-engine.md), hunted through the public API.

Every request handed to `add_request` is either rejected at once -- `ValueError` / `TypeError`
naming the field, the engine exactly as before -- or it finishes with a finish reason within a
bounded number of steps. A `hypothesis.stateful` machine drives a tiny model with a real
tokenizer and a KV cache small enough to preempt, under FCFS and MLFQ and both preemption modes:
it adds valid and invalid requests, aborts live and unknown ids, opens, advances, interleaves and
closes streams, and steps. After every step the KV manager's invariants hold; every finished
request meets the output contract; at the end no request is left and every block is free.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field

import pytest
import tokenizers
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from tiny_models import run_bounded, tiny_engine, tiny_llama_parts

from minipaged.engine.engine import EngineConfig, LLMEngine
from minipaged.engine.llm import stream_text
from minipaged.sampling.params import RequestOutputKind, SamplingParams
from minipaged.sched.cost_model import CostModel
from minipaged.tokenizer.tokenizer import Tokenizer

EOS = "<eos>"
CORPUS = [
    "the cat sat on the mat. ", "paged attention keeps blocks. ", "héllo wörld ",
    "日本語のテキスト", "emoji 🙂🙃 ", "x = [1, 2, 3]\n", "the the the ", "stop here STOP there ",
]
MAX_TOKENS = 8
MAX_STEPS_TO_DRAIN = 400  # a bound on how long any admitted request may take once work stops


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory) -> Tokenizer:
    """A byte-level BPE trained here, with one special token (EOS, id 0)."""
    tk = tokenizers.Tokenizer(tokenizers.models.BPE())
    tk.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[EOS],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(CORPUS * 4, trainer)
    folder = tmp_path_factory.mktemp("tokenizer")
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return Tokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def tiny_parts(tiny_tokenizer):
    return tiny_llama_parts(
        vocab_size=tiny_tokenizer.vocab_size,
        max_position_embeddings=64,
        initializer_range=0.3,
        eos_token_id=0,
    )


# -- the examples of the issue, and the other admission checks ----------------------------------


@pytest.fixture(scope="module")
def small():
    """A random two-layer LLaMA of 64 tokens, no tokenizer (requests are token ids)."""
    return tiny_llama_parts()


def drained(engine: LLMEngine) -> bool:
    engine.kv_manager.check_invariants()
    return (
        not engine.has_unfinished_requests()
        and engine.kv_manager.num_free_blocks == engine.kv_manager.num_gpu_blocks
    )


def test_stop_token_id_outside_the_vocabulary_is_rejected_at_admission(small) -> None:
    engine = tiny_engine(small, num_gpu_blocks=32)
    params = SamplingParams(stop_token_ids=[10**6], min_tokens=2, max_tokens=4)
    with pytest.raises(ValueError, match=r"stop_token_ids \[1000000\]"):
        engine.add_request("a", [1, 2, 3], params)
    assert drained(engine) and engine.get_num_unfinished_requests() == 0


@pytest.mark.parametrize(
    "params, field",
    [
        (SamplingParams(n=3, temperature=1.0), "n=3"),
        (SamplingParams(use_beam_search=True, beam_width=3, temperature=0.0), "beam_width=3"),
    ],
)
def test_width_above_max_num_seqs_is_rejected_at_admission(small, params, field) -> None:
    engine = tiny_engine(small, num_gpu_blocks=32, max_num_seqs=2)
    with pytest.raises(ValueError, match=f"{field}.*max_num_seqs=2"):
        engine.add_request("a", [1, 2, 3], params)
    assert drained(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("beams", [False, True])
def test_a_preempted_group_always_comes_back(small, mode, beams) -> None:
    """Two groups of four that cannot grow together: the later one is preempted and must be
    resumed with its prompt blocks shared again, as they were counted at admission."""
    engine = tiny_engine(
        small, block_size=4, num_gpu_blocks=20, num_cpu_blocks=40, preemption_mode=mode,
        enable_prefix_caching=False,
    )
    if beams:
        params = SamplingParams(use_beam_search=True, beam_width=4, temperature=0.0, max_tokens=12)
    else:
        params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    for i in range(2):
        engine.add_request(f"g{i}", list(range(1 + i, 17 + i)), params)
    finals = run_bounded(engine)
    assert engine.scheduler.num_preemptions > 0
    assert sorted(finals) == ["g0", "g1"]
    assert {c.finish_reason for o in finals.values() for c in o.outputs} <= {"stop", "length"}
    assert drained(engine)


def test_interleaved_streams_each_get_all_their_outputs(small) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    reference = tiny_engine(small, num_gpu_blocks=32)
    for i in range(3):
        reference.add_request(f"r{i}", [5 + i, 6, 7], params)
    expected = {k: v.outputs[0].token_ids for k, v in reference.run_until_done().items()}
    engine = tiny_engine(small, num_gpu_blocks=32)
    streams = {}
    for i in range(3):
        engine.add_request(f"r{i}", [5 + i, 6, 7], params)
    streams = {f"r{i}": engine.stream(f"r{i}") for i in range(2)}  # r2 has no stream
    seen: dict[str, list] = {k: [] for k in streams}
    while streams:
        for request_id in sorted(streams):
            output = next(streams[request_id], None)
            if output is None:
                del streams[request_id]
                continue
            seen[request_id].append(output)
    for request_id, outputs in seen.items():  # deltas: a token each, none lost
        assert [o.finished for o in outputs] == [False] * 5 + [True]
        assert [t for o in outputs for t in o.outputs[0].token_ids] == expected[request_id]
        assert [len(o.outputs[0].token_ids) for o in outputs] == [1] * 6
    run_bounded(engine)
    assert drained(engine)


@pytest.mark.parametrize("how", ["close", "break", "drop"])
def test_closing_a_stream_aborts_its_request(small, how) -> None:
    engine = tiny_engine(small, num_gpu_blocks=32)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request("a", [1, 2, 3], params)
    engine.add_request("b", [4, 5, 6], params)
    stream = engine.stream("a")
    if how == "close":
        next(stream)
        stream.close()
    elif how == "break":
        for _ in stream:
            break
        del stream
    else:
        next(stream)
        del stream
    assert engine.get_sampling_params("a") is None
    finals = run_bounded(engine)
    assert list(finals) == ["b"] and drained(engine)


def test_closing_stream_text_aborts_its_request(tiny_tokenizer, tiny_parts) -> None:
    engine = LLMEngine(*tiny_parts, tiny_tokenizer, EngineConfig(num_gpu_blocks=32))
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    request_id = engine.add_request(None, "the cat", params)
    pieces = stream_text(engine, request_id)
    next(pieces)
    pieces.close()
    assert engine.get_sampling_params(request_id) is None and drained(engine)


def test_a_beam_ending_on_a_stop_token_drops_its_text_as_sampling_does(
    tiny_tokenizer, tiny_parts
) -> None:
    """Every token stops these requests at once: the stop token's text is cut from the output
    of a finished beam exactly as from a sampled sequence's (found by the thorough profile)."""
    engine = LLMEngine(*tiny_parts, tiny_tokenizer, EngineConfig(num_gpu_blocks=32))
    stops = list(range(1, tiny_tokenizer.vocab_size))
    beam = SamplingParams(
        use_beam_search=True, beam_width=2, n=2, temperature=0.0, max_tokens=4,
        stop_token_ids=stops,
    )
    engine.add_request("beam", "the cat", beam)
    engine.add_request("greedy", "the cat", SamplingParams(temperature=0.0, max_tokens=4,
                                                           stop_token_ids=stops))
    finals = run_bounded(engine)
    assert sorted(finals) == ["beam", "greedy"] and drained(engine)
    for output in finals.values():
        for completion in output.outputs:
            assert completion.finish_reason == "stop" and len(completion.token_ids) == 1
            assert completion.text == ""


def test_engine_chosen_ids_never_collide_with_callers(small) -> None:
    engine = tiny_engine(small, num_gpu_blocks=32)
    engine.add_request("0", [1, 2])
    engine.add_request("1", [1, 2])
    assert engine.add_request(None, [1, 2]) not in ("0", "1")


@pytest.mark.parametrize(
    "prompt, kwargs, error, message",
    [
        (b"bytes", {}, TypeError, "prompt must be a string or a sequence"),
        (None, {}, TypeError, "prompt must be a string or a sequence"),
        (7, {}, TypeError, "prompt must be a string or a sequence"),
        ([1.5, 2], {}, TypeError, "prompt token ids must be ints, got 1.5"),
        ([True, 2], {}, TypeError, "prompt token ids must be ints, got True"),
        ([[1, 2]], {}, TypeError, "prompt token ids must be ints"),
        ([], {}, ValueError, "the prompt is empty"),
        ([64], {}, ValueError, r"prompt token ids \[64\] are outside the vocabulary \[0, 64\)"),
        ([-1], {}, ValueError, "outside the vocabulary"),
        ([1], {"stop_token_ids": [64]}, ValueError, "stop_token_ids"),
        ([1], {"stop": ["x"]}, ValueError, "stop strings need a tokenizer"),
        (list(range(1, 40)) * 2, {}, ValueError, "context"),
        ([1], {"max_tokens": 60}, ValueError, "KV blocks"),
    ],
)
def test_bad_input_is_rejected_naming_the_field(small, prompt, kwargs, error, message) -> None:
    engine = tiny_engine(small, num_gpu_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(error, match=message):
        engine.add_request("x", prompt, SamplingParams(**kwargs))
    assert drained(engine) and engine.get_num_unfinished_requests() == 0


def test_parameters_must_be_sampling_params(small) -> None:
    engine = tiny_engine(small, num_gpu_blocks=4)
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
        engine.add_request("x", [1], {"max_tokens": 3})
    assert drained(engine)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_model_len=0), "max_model_len"),
        (dict(max_model_len=-5), "max_model_len"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(num_cpu_blocks=-1), "num_cpu_blocks"),
    ],
)
def test_settings_that_make_no_sense_are_rejected(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_logprobs_are_capped_at_20_and_beam_search_returns_them(small) -> None:
    with pytest.raises(ValueError, match=r"logprobs must be None or an integer in \[0, 20\]"):
        SamplingParams(logprobs=21)
    engine = tiny_engine(small, num_gpu_blocks=32)
    params = SamplingParams(
        use_beam_search=True, beam_width=2, n=2, temperature=0.0, max_tokens=4, logprobs=2
    )
    engine.add_request("b", [1, 2, 3], params)
    final = run_bounded(engine)["b"]
    for completion in final.outputs:
        assert completion.logprobs is not None
        assert len(completion.logprobs) == len(completion.token_ids)


POISON = 37  # a prompt token the failing model cannot take


class FailingModel(torch.nn.Module):
    """The model, failing in the forward pass of any batch holding the token `POISON`
    ("model"), or at forward pass `fail_at` handing the sampler logits over no token at all, on
    which sampling fails for every request of that step ("sampler")."""

    def __init__(self, model: torch.nn.Module, fail_at: int, where: str) -> None:
        super().__init__()
        self.model, self.fail_at, self.where, self.calls = model, fail_at, where, 0

    def forward(self, input_ids, *args):
        self.calls += 1
        if self.where == "model" and bool((input_ids == POISON).any()):
            raise RuntimeError("injected fault in the forward pass")
        return self.model(input_ids, *args)

    def compute_logits(self, hidden):
        logits = self.model.compute_logits(hidden)
        failing = self.where == "sampler" and self.calls == self.fail_at
        return logits[:, :0] if failing else logits


@pytest.mark.parametrize("where", ["model", "sampler"])
@pytest.mark.parametrize("fail_at", [1, 3, 6])
def test_a_failing_step_ends_only_the_requests_that_cause_it(small, fail_at, where) -> None:
    """A forward pass that fails because of one request's input ends that request alone with
    "error"; the others finish exactly as they would alone. A step whose sampling fails for
    every request alike ends those requests; the rest go on."""
    model, config = small
    # Eager: the fault is injected by the wrapper's Python, which a replayed step never runs.
    engine = LLMEngine(
        FailingModel(model, fail_at, where), config, None,
        EngineConfig(num_gpu_blocks=32, block_size=4, max_num_seqs=2, enforce_eager=True),
    )
    records = []
    engine.add_step_observer(records.append)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    poisoned = f"r{fail_at % 4}"
    prompts = {f"r{i}": [1 + i, 2, 3] for i in range(4)}
    if where == "model":
        prompts[poisoned] = [1, POISON, 3]
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    finals = run_bounded(engine)
    assert sorted(finals) == sorted(prompts)
    reasons = {k: v.outputs[0].finish_reason for k, v in finals.items()}
    failed = {request_id for r in records for request_id in r.failed}
    assert failed == {k for k, reason in reasons.items() if reason == "error"}
    if where == "model":
        assert failed == {poisoned}
        alone = tiny_engine(small, num_gpu_blocks=32, block_size=4)
        for request_id, prompt in prompts.items():
            if request_id != poisoned:
                alone.add_request(request_id, prompt, params)
        expected = run_bounded(alone)
        for request_id, output in expected.items():
            assert finals[request_id].outputs[0].token_ids == output.outputs[0].token_ids
    else:
        assert 1 <= len(failed) <= 2 and "length" in reasons.values()  # the others went on
    assert drained(engine)


# -- what a client may send ---------------------------------------------------------------------

texts = st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=24)
token_prompts = st.lists(st.integers(0, 299), min_size=1, max_size=30)


@st.composite
def sampling_kwargs(draw) -> dict:
    """Any mix of the knobs a request can set, valid or not (SamplingParams decides)."""
    kw: dict = {"max_tokens": draw(st.integers(1, MAX_TOKENS))}
    if draw(st.booleans()):
        kw["min_tokens"] = draw(st.integers(0, kw["max_tokens"]))
    if draw(st.booleans()):
        kw["use_beam_search"] = True
        kw["beam_width"] = draw(st.integers(1, 3))
        kw["n"] = draw(st.integers(1, kw["beam_width"]))
        kw["temperature"] = 0.0
    else:
        kw["n"] = draw(st.integers(1, 3))
        kw["temperature"] = draw(st.sampled_from([0.0, 0.7, 1.0]))
        if draw(st.booleans()):
            kw["seed"] = draw(st.integers(0, 2**16))
        if draw(st.booleans()):
            kw["top_k"] = draw(st.integers(0, 20))
            kw["top_p"] = draw(st.sampled_from([0.5, 0.9, 1.0]))
    if draw(st.booleans()):
        kw["stop"] = draw(st.lists(st.sampled_from(["the", "STOP", ".", "🙂", "é"]), max_size=2))
    if draw(st.booleans()):
        kw["stop_token_ids"] = draw(st.lists(st.integers(0, 299), max_size=2))
    if draw(st.booleans()):
        kw["ignore_eos"] = True
    if draw(st.booleans()):
        kw["logprobs"] = draw(st.integers(0, 3))
    if draw(st.booleans()):
        kw["repetition_penalty"] = draw(st.sampled_from([1.0, 1.3]))
        kw["presence_penalty"] = draw(st.sampled_from([0.0, 0.5]))
        kw["frequency_penalty"] = draw(st.sampled_from([0.0, 0.5]))
    if draw(st.booleans()):  # what `step` returns of it: the contract holds for every kind
        kw["output_kind"] = draw(st.sampled_from(list(RequestOutputKind)))
    return kw


bad_prompts = st.one_of(
    st.just(""), st.just([]), st.lists(st.integers(300, 10**6), min_size=1, max_size=3),
    st.lists(st.integers(-(10**6), -1), min_size=1, max_size=3), st.just([1.5, 2]),
    st.just(b"bytes"), st.just(None), st.just([[1, 2]]), st.just(list(range(1, 100))),
)
bad_kwargs = st.one_of(
    st.fixed_dictionaries({"stop_token_ids": st.just([10**6]), "min_tokens": st.just(2)}),
    st.fixed_dictionaries({"n": st.integers(9, 12), "temperature": st.just(1.0)}),
    st.fixed_dictionaries({"max_tokens": st.integers(-3, 0)}),
    st.fixed_dictionaries({"logprobs": st.integers(21, 100)}),
)


# -- the machine --------------------------------------------------------------------------------


@dataclass
class Tracked:
    """What the machine knows of one admitted request."""

    prompt_len: int
    params: SamplingParams
    streamed: dict[int, str] = field(default_factory=dict)  # index -> text seen through a stream


class RequestContract(RuleBasedStateMachine):
    """One engine, many clients; the test picks the scheduler and the preemption mode.

    A step observer checks every request that finished in a step, whoever stepped the engine
    (a stream steps it too), so the machine knows at all times which requests are live.
    """

    tokenizer: Tokenizer
    parts: tuple
    engine_kwargs: dict

    def __init__(self) -> None:
        super().__init__()
        model, config = self.parts
        self.engine = LLMEngine(model, config, self.tokenizer, EngineConfig(**self.engine_kwargs))
        self.engine.add_step_observer(self.after_step)
        self.live: dict[str, Tracked] = {}
        self.streams: dict[str, object] = {}
        self.ids = itertools.count()

    # -- helpers --
    def kv(self):
        return self.engine.kv_manager

    def snapshot(self) -> tuple:
        return (self.engine.get_num_unfinished_requests(), self.kv().num_free_blocks)

    def valid_ids(self, prompt) -> bool:
        vocab = self.engine.model_config.vocab_size
        return isinstance(prompt, list) and all(
            isinstance(t, int) and 0 <= t < vocab for t in prompt
        ) and 0 < len(prompt) < self.engine.max_model_len

    def after_step(self, record) -> None:
        self.kv().check_invariants()
        for request_id in list(self.live):
            output = self.engine.get_request(request_id)
            if output is not None and output.finished:
                self.check_finished(output)

    def check_finished(self, output) -> None:
        """The output contract of one finished request."""
        tracked = self.live.pop(output.request_id)
        params = tracked.params
        assert output.finished
        assert len(output.outputs) == params.n
        for completion in output.outputs:
            assert completion.finish_reason in ("stop", "length"), completion
            n_out = len(completion.token_ids)
            room = self.engine.max_model_len - tracked.prompt_len
            assert n_out <= min(params.max_tokens, room)
            if completion.finish_reason == "length":
                assert n_out >= min(params.min_tokens, room)
            if completion.finish_reason == "stop" and not params.use_beam_search:
                assert n_out >= params.min_tokens
            inner = completion.token_ids[:-1]
            assert not set(inner) & set(params.stop_token_ids), "a stop token inside the output"
            if params.logprobs is not None:
                assert completion.logprobs is not None and len(completion.logprobs) == n_out
            # The detokenizer holds back an unfinished UTF-8 character at the very end, where a
            # full decode shows U+FFFD: the texts agree up to that.
            kept = completion.token_ids  # a stop token's own text is not output (as in vLLM)
            if completion.finish_reason == "stop" and isinstance(completion.stop_reason, int):
                kept = kept[:-1]
            decoded = self.tokenizer.decode(kept, skip_special_tokens=True)
            decoded, text = decoded.rstrip("\ufffd"), completion.text.rstrip("\ufffd")
            if completion.finish_reason == "stop" and isinstance(completion.stop_reason, str):
                assert text == decoded[: len(text)]
                assert completion.stop_reason in params.stop
            else:
                assert text == decoded
            for stop in params.stop:
                assert stop not in completion.text
            streamed = tracked.streamed.get(completion.index, "")
            if not params.use_beam_search:
                assert completion.text.startswith(streamed), "streamed text taken back"

    # -- rules --
    @initialize()
    def start(self) -> None:
        assert not self.engine.has_unfinished_requests()

    @rule(prompt=st.one_of(texts, token_prompts), kwargs=sampling_kwargs())
    def add(self, prompt, kwargs) -> None:
        before = self.snapshot()
        try:
            params = SamplingParams(**kwargs)
            request_id = self.engine.add_request(f"r{next(self.ids)}", prompt, params)
        except (ValueError, TypeError) as error:
            assert str(error), "a rejection must say what is wrong"
            assert self.snapshot() == before
            return
        prompt_len = len(prompt) if isinstance(prompt, list) else len(
            self.tokenizer.encode(prompt, add_special_tokens=True)
        )
        self.live[request_id] = Tracked(prompt_len, params)

    @rule(prompt=st.one_of(bad_prompts, token_prompts), kwargs=st.one_of(bad_kwargs, st.just({})))
    def add_bad(self, prompt, kwargs) -> None:
        if not kwargs and self.valid_ids(prompt):
            return  # a valid request: `add` covers those
        before = self.snapshot()
        with pytest.raises((ValueError, TypeError)) as error:
            self.engine.add_request(f"r{next(self.ids)}", prompt, SamplingParams(**kwargs))
        assert str(error.value)
        assert self.snapshot() == before

    @rule()
    def step(self) -> None:
        self.engine.step()

    @rule(data=st.data())
    def abort(self, data) -> None:
        ids = sorted(self.live) + ["nobody", "r-unknown"]
        request_id = data.draw(st.sampled_from(ids))
        known = request_id in self.live
        assert self.engine.abort_request(request_id) == known
        if known:
            self.live.pop(request_id)
            self.streams.pop(request_id, None)

    @precondition(lambda self: any(r not in self.streams for r in self.live))
    @rule(data=st.data())
    def open_stream(self, data) -> None:
        unstreamed = sorted(r for r in self.live if r not in self.streams)
        request_id = data.draw(st.sampled_from(unstreamed))
        self.streams[request_id] = self.engine.stream(request_id)

    @precondition(lambda self: bool(self.streams))
    @rule(data=st.data())
    def advance_stream(self, data) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.streams)))
        live = request_id in self.live
        output = next(self.streams[request_id], None)
        if output is None:
            assert not live, "a stream ended before its request finished"
            self.streams.pop(request_id)
            return
        assert output.request_id == request_id
        tracked = self.live.get(request_id)
        for completion in output.outputs:  # deltas: what each sample's text gained
            if tracked is not None:  # still running (its final output is checked whole)
                assert not tracked.params.use_beam_search, "a beam's text streamed early"
                tracked.streamed[completion.index] = (
                    tracked.streamed.get(completion.index, "") + completion.text
                )
        if output.finished:
            self.streams.pop(request_id)
            assert request_id not in self.live  # the observer checked it as it finished

    @precondition(lambda self: bool(self.streams))
    @rule(data=st.data())
    def close_stream(self, data) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.streams)))
        self.streams.pop(request_id).close()
        assert self.engine.get_sampling_params(request_id) is None  # aborted, or finished
        self.live.pop(request_id, None)

    @invariant()
    def kv_consistent(self) -> None:
        self.kv().check_invariants()

    def teardown(self) -> None:
        for stream in list(self.streams.values()):
            stream.close()
        self.live = {k: v for k, v in self.live.items() if k not in self.streams}
        for _ in range(MAX_STEPS_TO_DRAIN):
            if not self.engine.has_unfinished_requests():
                break
            self.engine.step()
        assert not self.engine.has_unfinished_requests(), "a request never finished"
        assert not self.live, f"requests that never reported finishing: {sorted(self.live)}"
        assert self.kv().num_free_blocks == self.kv().num_gpu_blocks


# MLFQ's queue levels come from predicted step times; a toy cost spares the engine's profiling.
TOY_COST = CostModel(base=1e-3, per_prefill_token=1e-3, per_decode_seq=1e-4, per_context_token=0.0)
CONFIGS = {
    "fcfs-recompute": dict(scheduler="fcfs", preemption_mode="recompute"),
    "fcfs-swap": dict(scheduler="fcfs", preemption_mode="swap"),
    "mlfq-swap": dict(scheduler="mlfq", preemption_mode="swap", cost_model=TOY_COST),
    "mlfq-recompute": dict(scheduler="mlfq", preemption_mode="recompute", cost_model=TOY_COST),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_request_contract(name, tiny_parts, tiny_tokenizer) -> None:
    machine = type(f"Contract_{name}", (RequestContract,), {})
    machine.parts = tiny_parts
    machine.tokenizer = tiny_tokenizer
    machine.engine_kwargs = dict(
        block_size=4, num_gpu_blocks=24, num_cpu_blocks=12, max_num_seqs=8, **CONFIGS[name]
    )
    # A fifth of the profile's examples for each of the four configurations.
    examples = max(3, settings.default.max_examples // 5)
    machine.TestCase.settings = settings(
        settings.default, stateful_step_count=15, max_examples=examples
    )
    machine.TestCase().runTest()
