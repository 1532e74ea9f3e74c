"""The engine against the dense oracle: every request of a batch, with and without preemption.

A tiny random LLaMA (built with `transformers`, loaded by minipaged) keeps each step cheap; greedy
outputs must equal `generate_dense`'s token for token, whatever the scheduler did on the way.
"""

from __future__ import annotations

import copy
import random
import sys
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from tiny_models import assert_engine_drained, dense_last_logits, tiny_engine, tiny_llama_parts

from minipaged.engine.config import EngineConfig
from minipaged.engine.engine import LLMEngine
from minipaged.engine.llm import LLM
from minipaged.engine.record import StepRecord
from minipaged.kv.manager import KVCacheManager
from minipaged.sampling.params import SamplingParams
from minipaged.sched.base import RequestRejectedError, SchedulerConfig, SchedulerOutput
from minipaged.sched.fcfs import FCFSScheduler
from minipaged.testing.dense import generate_dense

VOCAB = 96
EOS = 1  # ignored unless a test says otherwise: random models emit it at random


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama_parts(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        max_position_embeddings=512,
        initializer_range=0.3,  # wide logits: greedy choices far from ties
        eos_token_id=EOS,
    )


def make_engine(tiny, **kwargs) -> LLMEngine:
    kwargs.setdefault("num_gpu_blocks", 256)
    kwargs.setdefault("num_cpu_blocks", 256)
    kwargs.setdefault("block_size", 8)
    return tiny_engine(tiny, **kwargs)


def random_prompts(count: int, seed: int, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(2, VOCAB) for _ in range(shared_prefix)]
    return [
        prefix + [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 40))] for _ in range(count)
    ]


def run_greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(None, p, params) for p in prompts]
    finals = engine.run_until_done()
    return [finals[i].outputs[0].token_ids for i in ids]


@pytest.fixture(scope="module")
def batch_and_oracle(tiny):
    model, _ = tiny
    prompts = random_prompts(32, seed=1)
    return prompts, generate_dense(model, prompts, max_new_tokens=12)


@pytest.mark.parametrize(
    "engine_kwargs, expect_preemption",
    [
        (dict(), False),
        (dict(num_gpu_blocks=24, preemption_mode="recompute"), True),
        (dict(num_gpu_blocks=24, preemption_mode="swap"), True),
        (dict(max_num_batched_tokens=16, max_num_seqs=5), False),  # chunked prefill
        (dict(enable_prefix_caching=False, num_gpu_blocks=24), True),
    ],
    ids=["roomy", "recompute", "swap", "chunked", "no-prefix-cache"],
)
def test_greedy_batch_equals_dense(tiny, batch_and_oracle, engine_kwargs, expect_preemption):
    prompts, expected = batch_and_oracle
    engine = make_engine(tiny, **engine_kwargs)
    assert run_greedy(engine, prompts, max_tokens=12) == expected
    assert (engine.scheduler.num_preemptions > 0) == expect_preemption
    assert_engine_drained(engine)


def test_prefix_cache_hits_and_same_outputs(tiny):
    model, _ = tiny
    prompts = random_prompts(8, seed=2, shared_prefix=24)
    expected = generate_dense(model, prompts, max_new_tokens=6)
    engine = make_engine(tiny, max_num_seqs=1)  # one at a time: later prompts find the prefix
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ids = [engine.add_request(None, p, params) for p in prompts]
    finals = engine.run_until_done()
    assert [finals[i].outputs[0].token_ids for i in ids] == expected
    cached = [finals[i].metrics.num_cached_tokens for i in ids]
    assert cached[0] == 0 and all(c == 24 for c in cached[1:])  # 3 full blocks of 8
    assert engine.kv_manager.prefix_cache_hits >= 3 * 7
    assert_engine_drained(engine)


def test_parallel_sampling_seeded_is_reproducible_and_batch_independent(tiny):
    prompt = random_prompts(1, seed=3)[0]
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)

    def run(with_neighbours: bool) -> list[list[int]]:
        engine = make_engine(tiny)
        if with_neighbours:
            for other in random_prompts(5, seed=4):
                engine.add_request(None, other, SamplingParams(temperature=1.0, max_tokens=7))
        rid = engine.add_request(None, prompt, params)
        finals = engine.run_until_done()
        assert_engine_drained(engine)
        return [c.token_ids for c in finals[rid].outputs]

    alone = run(False)
    assert len(alone) == 4 and len({tuple(s) for s in alone}) > 1  # samples differ
    assert run(False) == alone
    assert run(True) == alone


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_random_sampling_draws_on_the_logits_device(tiny, device, monkeypatch):
    """Temperature > 0, seeds, top-k / top-p and n > 1 on every device present: every request
    finishes, a seed gives its samples again, and every generator the engine makes lives on
    the device of the logits it draws for (the engine's own, made for unseeded requests, and
    each seeded sample's): a generator made without a device, on the CPU, is caught here."""
    made: list[str | None] = []
    real = torch.Generator

    def recording_generator(device: str | torch.device | None = None) -> torch.Generator:
        caller = sys._getframe(1).f_globals["__name__"]  # a platform's set-up probes are not
        if caller.startswith(("minipaged.engine", "minipaged.sampling")):  # sampling's
            made.append(None if device is None else torch.device(device).type)
        return real() if device is None else real(device=device)

    monkeypatch.setattr(torch, "Generator", recording_generator)
    model, config = tiny
    if device != "cpu":
        model = copy.deepcopy(model).to(device)
    seeded = SamplingParams(n=3, temperature=0.8, seed=11, top_k=20, top_p=0.9, max_tokens=6,
                            ignore_eos=True)
    unseeded = SamplingParams(n=2, temperature=0.6, top_p=0.95, max_tokens=5, ignore_eos=True)

    def run() -> list[list[int]]:
        engine = make_engine((model, config), device=device, dtype="float32")
        prompts = random_prompts(2, seed=9)
        ids = [engine.add_request(None, prompts[0], seeded),
               engine.add_request(None, prompts[1], unseeded)]
        finals = engine.run_until_done()
        assert_engine_drained(engine)
        outs = [finals[i].outputs for i in ids]
        assert [len(o) for o in outs] == [3, 2]
        assert all(c.finish_reason == "length" and len(c.token_ids) == p.max_tokens
                   for o, p in zip(outs, (seeded, unseeded), strict=True) for c in o)
        return [c.token_ids for c in outs[0]]

    assert run() == run()  # the seeded request's samples, again
    assert made and set(made) == {device}


def reference_beam_search(model, prompt, width, max_tokens, length_penalty=1.0):
    """Beam search by brute force: every beam recomputed densely, all continuations ranked."""
    beams = [([], 0.0)]
    finished: list[tuple[list[int], float]] = []
    for _ in range(max_tokens):
        scored = []
        for tokens, cum in beams:
            logits = dense_last_logits(model, prompt + tokens)
            logprobs = torch.log_softmax(logits, dim=-1)
            for tok in range(VOCAB):
                scored.append((cum + float(logprobs[tok]), tokens, tok))
        scored.sort(key=lambda x: -x[0])
        beams = [(tokens + [tok], score) for score, tokens, tok in scored[:width]]
    finished = beams
    key = lambda b: b[1] / (len(prompt) + len(b[0])) ** length_penalty  # noqa: E731
    return [tokens for tokens, _ in sorted(finished, key=key, reverse=True)]


def test_beam_search_equals_brute_force_reference(tiny):
    model, _ = tiny
    prompt = random_prompts(1, seed=5)[0][:6]
    width, max_tokens = 3, 4
    expected = reference_beam_search(model, prompt, width, max_tokens)
    engine = make_engine(tiny)
    params = SamplingParams(
        use_beam_search=True,
        beam_width=width,
        n=width,
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
    )
    rid = engine.add_request(None, prompt, params)
    out = engine.run_until_done()[rid]
    assert [c.token_ids for c in out.outputs] == expected
    assert_engine_drained(engine)


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(prompt=[]), "empty"),
        (dict(prompt=[VOCAB + 3]), "outside the vocabulary"),
        (dict(prompt=[5] * 600), "context"),
        (dict(prompt=[5] * 10, params=SamplingParams(max_tokens=400)), "KV blocks"),
    ],
    ids=["empty", "out-of-vocab", "too-long", "never-fits"],
)
def test_bad_requests_are_rejected_and_others_finish(tiny, bad, message):
    model, _ = tiny
    engine = make_engine(tiny, num_gpu_blocks=40)
    prompts = random_prompts(3, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    ids = [engine.add_request(None, p, params) for p in prompts]
    engine.step()  # the good requests are already under way
    with pytest.raises(ValueError, match=message):
        engine.add_request(None, bad["prompt"], bad.get("params", params))
    finals = engine.run_until_done()
    assert [finals[i].outputs[0].token_ids for i in ids] == generate_dense(model, prompts, 5)
    assert_engine_drained(engine)


def test_the_package_exports_the_public_api():
    import minipaged

    assert (minipaged.LLM, minipaged.LLMEngine, minipaged.EngineConfig) == (
        LLM,
        LLMEngine,
        EngineConfig,
    )
    assert minipaged.SamplingParams is SamplingParams and minipaged.StepRecord is StepRecord


def test_rejection_is_a_value_error_subclass():
    assert issubclass(RequestRejectedError, ValueError)


def test_abort_returns_blocks_and_others_finish(tiny):
    model, _ = tiny
    engine = make_engine(tiny)
    prompts = random_prompts(4, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ids = [engine.add_request(None, p, params) for p in prompts]
    engine.step()
    engine.step()
    assert engine.abort_request(ids[1])
    assert not engine.abort_request("no-such-request")
    finals = engine.run_until_done()
    expected = generate_dense(model, prompts, 8)
    assert ids[1] not in finals
    assert [finals[i].outputs[0].token_ids for i in (ids[0], ids[2], ids[3])] == [
        expected[0],
        expected[2],
        expected[3],
    ]
    assert_engine_drained(engine)


@given(st.data())
@settings(max_examples=10)
def test_eos_and_stop_tokens_end_sequences_like_dense(tiny, data):
    model, _ = tiny
    prompts = random_prompts(4, seed=data.draw(st.integers(0, 1000)))
    dense = generate_dense(model, prompts, 10)
    stop_token = data.draw(st.sampled_from([t for seq in dense for t in seq]))
    engine = make_engine(tiny)
    params = SamplingParams(
        temperature=0.0, max_tokens=10, stop_token_ids=[stop_token], ignore_eos=True
    )
    ids = [engine.add_request(None, p, params) for p in prompts]
    finals = engine.run_until_done()
    for rid, expected in zip(ids, dense, strict=True):
        completion = finals[rid].outputs[0]
        cut = expected.index(stop_token) + 1 if stop_token in expected else len(expected)
        assert completion.token_ids == expected[:cut]
        assert completion.finish_reason == ("stop" if stop_token in expected else "length")
    assert_engine_drained(engine)


class EngineMachine(RuleBasedStateMachine):
    """Random add / abort / step sequences on a small cache: invariants after every step, every
    request not aborted finishes, and every block comes back."""

    tiny = None  # set by the test below (a module fixture cannot reach a state machine)

    def __init__(self) -> None:
        super().__init__()
        self.engine = make_engine(
            self.tiny,
            num_gpu_blocks=20,
            num_cpu_blocks=12,
            max_num_batched_tokens=32,
            max_num_seqs=6,
        )
        self.live: set[str] = set()
        self.aborted: set[str] = set()
        self.finished: set[str] = set()

    @rule(
        length=st.integers(1, 30),
        max_tokens=st.integers(1, 12),
        n=st.integers(1, 3),
        seed=st.integers(0, 9),
    )
    def add(self, length, max_tokens, n, seed):
        rng = random.Random(seed)
        prompt = [rng.randrange(2, VOCAB) for _ in range(length)]
        params = SamplingParams(n=n, temperature=0.8, seed=seed, max_tokens=max_tokens)
        try:
            self.live.add(self.engine.add_request(None, prompt, params))
        except ValueError:
            pass  # too big for this cache: rejected, engine untouched (checked by invariants)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        assert self.engine.abort_request(rid)
        self.live.discard(rid)
        self.aborted.add(rid)

    @rule()
    def step(self):
        for out in self.engine.step():
            if out.finished:
                assert out.request_id in self.live
                self.live.discard(out.request_id)
                self.finished.add(out.request_id)

    @invariant()
    def allocator_consistent(self):
        self.engine.kv_manager.check_invariants()

    def teardown(self):
        for out in self.engine.run_until_done().values():
            self.live.discard(out.request_id)
        assert not self.live
        assert self.engine.kv_manager.num_free_blocks == self.engine.kv_manager.num_gpu_blocks


def test_engine_state_machine(tiny):
    EngineMachine.tiny = tiny
    EngineMachine.TestCase.settings = settings(
        max_examples=30, stateful_step_count=25, deadline=None
    )
    EngineMachine.TestCase().runTest()


# -- the public surface: request lookup, step records, a scheduler given at construction ---------


def test_get_request_follows_a_request_until_one_step_after_it_finished(tiny):
    engine = make_engine(tiny)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    rid = engine.add_request("r", random_prompts(1, seed=9)[0], params)
    longer = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    other = engine.add_request("o", random_prompts(1, seed=10)[0], longer)
    before = engine.get_request(rid)
    assert before.outputs[0].token_ids == [] and not before.finished
    assert engine.get_sampling_params(rid) == params  # the request's own copy (check_params)
    outputs = {}
    while rid not in outputs or not outputs[rid].finished:
        outputs.update({o.request_id: o for o in engine.step()})
        now = engine.get_request(rid)
        assert now.outputs[0].token_ids == outputs[rid].outputs[0].token_ids
    assert engine.get_request(rid).finished and engine.get_sampling_params(rid) is None
    engine.step()  # the next step forgets it
    assert engine.get_request(rid) is None and engine.get_request("no-such-request") is None
    assert engine.abort_request(other) and engine.get_request(other) is None
    assert_engine_drained(engine)


class RecordingScheduler(FCFSScheduler):
    """FCFS that keeps every `SchedulerOutput` it returns (handed to the engine at construction)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.outputs: list[SchedulerOutput] = []

    def schedule(self, now: float) -> SchedulerOutput:
        self.outputs.append(super().schedule(now))
        return self.outputs[-1]


def recording_engine(tiny, num_blocks: int, **config) -> tuple[LLMEngine, RecordingScheduler]:
    model, model_config = tiny
    scheduler = RecordingScheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=512, **config),
        KVCacheManager(num_blocks, 8, num_cpu_blocks=64, enable_prefix_caching=False),
    )
    return LLMEngine(model, model_config, scheduler=scheduler), scheduler


def test_a_scheduler_given_at_construction_serves_the_engine(tiny, batch_and_oracle):
    prompts, expected = batch_and_oracle
    engine, scheduler = recording_engine(tiny, num_blocks=24, preemption_mode="swap")
    assert engine.scheduler is scheduler and engine.kv_manager is scheduler.kv_manager
    assert engine.runner.kv_caches[0].shape[1] == 24  # the pools take the scheduler's sizes
    assert run_greedy(engine, prompts[:12], max_tokens=12) == expected[:12]
    assert len(scheduler.outputs) > 0 and scheduler.num_preemptions > 0
    assert_engine_drained(engine)


def test_step_records_are_what_the_scheduler_decided(tiny):
    engine, scheduler = recording_engine(tiny, num_blocks=16, preemption_mode="swap")
    records: list[StepRecord] = []
    engine.add_step_observer(records.append)
    prompts = random_prompts(6, seed=11)
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    ids = [engine.add_request(None, p, params) for p in prompts]
    finals = engine.run_until_done()
    assert [r.index for r in records] == list(range(len(scheduler.outputs)))  # one per step
    for record, out in zip(records, scheduler.outputs, strict=True):
        assert record.plan is out  # the scheduler's plan, carried once to the runner and here
        for work in record.scheduled:  # the table covers the tokens the step computed
            assert len(work.block_table) * 8 >= work.start + work.num_new_tokens
        t = record.timings
        assert min(t.schedule_s, t.forward_s, t.update_s, t.outputs_s) >= 0
        assert t.schedule_s + t.forward_s + t.update_s + t.outputs_s <= t.total_s + 1e-9
        assert record.start <= record.end and record.failed == ()
    assert any(r.plan.swap_out for r in records) and any(r.plan.copy for r in records)
    # Swapping keeps the K/V, so every token of every sample was computed exactly once.
    computed: dict[int, int] = {}
    for work in (w for r in records for w in r.scheduled):
        computed[work.seq_id] = computed.get(work.seq_id, 0) + work.num_new_tokens
    assert all(len(c.token_ids) == 10 for rid in ids for c in finals[rid].outputs)
    assert sum(computed.values()) == sum(
        len(p) + sum(len(c.token_ids) - 1 for c in finals[rid].outputs)
        for rid, p in zip(ids, prompts, strict=True)
    )
    engine.remove_step_observer(records.append)
    engine.add_request(None, prompts[0], params)
    seen = len(records)
    engine.run_until_done()
    assert len(records) == seen  # removed: no more calls


def test_chat_outputs_carry_the_rendered_prompt(bundled_model, bundled_tokenizer, monkeypatch):
    model, model_config = bundled_model

    def from_pretrained(cls, path=None, **kwargs):
        config = EngineConfig(num_gpu_blocks=32, num_cpu_blocks=0)
        return LLMEngine(model, model_config, bundled_tokenizer, config)

    monkeypatch.setattr(LLMEngine, "from_pretrained", classmethod(from_pretrained))
    llm = LLM()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0.0, max_tokens=3)
    (out,) = llm.chat(messages, params, use_tqdm=False)
    template = bundled_tokenizer.apply_chat_template
    assert out.prompt == template(messages, add_generation_prompt=True)
    assert out.prompt_token_ids == template(messages, add_generation_prompt=True, tokenize=True)
    assert "".join(llm.chat_stream(messages, params)) == out.outputs[0].text
    with pytest.raises(ValueError, match="prompt_text"):
        llm.engine.add_request(None, "Hi", params, prompt_text="Hi")


def test_an_engine_dropped_is_collected_when_the_next_one_is_built(tiny):
    """Start-up freezes what it made out of the garbage collector (steps then scan only what
    they make); an engine dropped since, whose objects hold cycles, must not stay frozen when
    another is built, or a notebook or a test suite that builds many keeps them all."""
    engine = make_engine(tiny)
    run_greedy(engine, random_prompts(2, seed=0), max_tokens=3)
    engine.observer_of_itself = engine  # a cycle, as a spy or an observer may make
    gone = weakref.ref(engine.runner.kv_caches[0])
    del engine
    make_engine(tiny)
    assert gone() is None
