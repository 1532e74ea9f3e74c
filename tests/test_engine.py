"""The engine against the dense oracle: every request of a batch, with and without preemption.

A tiny random LLaMA (built with `transformers`, loaded by minipaged) keeps each step cheap; greedy
outputs must equal `generate_dense`'s token for token, whatever the scheduler did on the way.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from tiny_models import assert_engine_drained, dense_last_logits, tiny_engine, tiny_llama_parts

from minipaged.dense import generate_dense
from minipaged.engine import LLMEngine
from minipaged.sampling import SamplingParams
from minipaged.scheduler import RequestRejectedError

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
    assert engine.kv_cache.prefix_cache_hits >= 3 * 7
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
        self.engine.kv_cache.check_invariants()

    def teardown(self):
        for out in self.engine.run_until_done().values():
            self.live.discard(out.request_id)
        assert not self.live
        assert self.engine.kv_cache.num_free_blocks == self.engine.kv_cache.num_blocks


def test_engine_state_machine(tiny):
    EngineMachine.tiny = tiny
    EngineMachine.TestCase.settings = settings(
        max_examples=30, stateful_step_count=25, deadline=None
    )
    EngineMachine.TestCase().runTest()
