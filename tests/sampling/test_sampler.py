"""Layer 7: SamplingParams validation, the sampler against straightforward references, beam search.

References are written per row and per token in plain Python (float64), the opposite of the
vectorised code they check.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections import Counter
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.platforms.cpu import CPUPlatform
from minipaged.sampling.beam_scoring import (
    BeamCandidate,
    beam_search_candidates,
    beam_search_is_done,
    beam_search_score,
)
from minipaged.sampling.params import SamplingParams, SamplingType
from minipaged.sampling.sampler import (
    Sampler,
    SamplingRow,
    apply_min_p,
    apply_temperature,
    apply_top_k_top_p,
    derive_seed,
    make_generator,
    min_tokens_banned_ids,
)

# --- SamplingParams ----------------------------------------------------------------------------

INVALID = [
    ("n", {"n": 0}),
    ("n", {"n": 1.5}),
    ("temperature", {"temperature": -0.1}),
    ("temperature", {"temperature": math.nan}),
    ("temperature", {"temperature": math.inf}),
    ("top_k", {"top_k": -2}),
    ("top_k", {"top_k": 2.0}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.01}),
    ("min_p", {"min_p": -0.01}),
    ("min_p", {"min_p": 1.5}),
    ("seed", {"seed": -1}),
    ("seed", {"seed": 2**64}),
    ("seed", {"seed": "7"}),
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": None}),
    ("min_tokens", {"min_tokens": -1}),
    ("min_tokens", {"min_tokens": 20, "max_tokens": 10}),
    ("stop", {"stop": ""}),
    ("stop", {"stop": ["ok", ""]}),
    ("stop", {"stop": 5}),
    ("stop_token_ids", {"stop_token_ids": [-1]}),
    ("stop_token_ids", {"stop_token_ids": "2"}),
    ("ignore_eos", {"ignore_eos": 1}),
    ("logprobs", {"logprobs": -1}),
    ("presence_penalty", {"presence_penalty": 2.5}),
    ("presence_penalty", {"presence_penalty": -2.01}),
    ("frequency_penalty", {"frequency_penalty": -3}),
    ("frequency_penalty", {"frequency_penalty": 2.01}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("repetition_penalty", {"repetition_penalty": -1.0}),
    ("use_beam_search", {"use_beam_search": "yes"}),
    ("beam_width", {"beam_width": 0, "use_beam_search": True, "temperature": 0}),
    ("beam_width", {"beam_width": 2}),  # beam width without beam search
    ("length_penalty", {"length_penalty": 0.5}),  # length penalty without beam search
    ("length_penalty", {"length_penalty": math.nan, "use_beam_search": True, "temperature": 0}),
    ("n", {"n": 3, "beam_width": 2, "use_beam_search": True, "temperature": 0}),
    ("temperature", {"use_beam_search": True, "beam_width": 2}),
    ("top_k", {"use_beam_search": True, "beam_width": 2, "temperature": 0, "top_k": 5}),
    ("top_p", {"use_beam_search": True, "beam_width": 2, "temperature": 0, "top_p": 0.9}),
    ("min_p", {"use_beam_search": True, "beam_width": 2, "temperature": 0, "min_p": 0.1}),
    ("n", {"n": 2, "temperature": 0}),  # greedy n > 1 would repeat one output
]


@pytest.mark.parametrize(("name", "kwargs"), INVALID, ids=[f"{n}-{kw}" for n, kw in INVALID])
def test_invalid_sampling_params_name_the_field(name, kwargs):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_k, p.top_p, p.min_p, p.max_tokens) == (1, 1.0, 0, 1.0, 0, 16)
    assert p.stop == [] and p.stop_token_ids == [] and p.sampling_type == SamplingType.RANDOM
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's old "off"
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(temperature=0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    assert SamplingParams(seed=3).sampling_type == SamplingType.RANDOM_SEED
    beam = SamplingParams(n=2, use_beam_search=True, beam_width=4, temperature=0)
    assert beam.sampling_type == SamplingType.BEAM and beam.greedy


def test_min_tokens_bans_stop_tokens_and_eos_until_reached():
    p = SamplingParams(min_tokens=3, stop_token_ids=[7, 9])
    assert sorted(min_tokens_banned_ids(p, 0, [2])) == [2, 7, 9]
    assert sorted(min_tokens_banned_ids(p, 2, [2])) == [2, 7, 9]
    assert min_tokens_banned_ids(p, 3, [2]) == []
    ignore = SamplingParams(min_tokens=3, stop_token_ids=[7], ignore_eos=True)
    assert min_tokens_banned_ids(ignore, 0, [2]) == [7]


# --- references --------------------------------------------------------------------------------


def reference_penalties(row, prompt, output, presence, frequency, repetition):
    counts = Counter(output)
    out = []
    for v, x in enumerate(row):
        if v in prompt or counts[v] > 0:
            x = x / repetition if x > 0 else x * repetition
        x -= frequency * counts[v] + presence * (counts[v] > 0)
        out.append(x)
    return out


def reference_kept(row, temperature, top_k, top_p, min_p, eps):
    """Tokens that top-k, top-p and min-p keep, tie-breaking aside.

    eps > 0: every token some tie-breaking (or float rounding) could keep -- a superset.
    eps < 0: every token each tie-breaking must keep -- a subset.
    """
    z = [x / temperature for x in row]
    vocab = range(len(z))
    # top-k: v is in when fewer than k tokens are (surely / possibly) above it
    if 0 < top_k < len(z):
        if eps > 0:
            keep = {v for v in vocab if sum(z[u] > z[v] + eps for u in vocab) < top_k}
        else:
            keep = {v for v in vocab if sum(z[u] >= z[v] + eps for u in vocab if u != v) < top_k}
    else:
        keep = set(vocab)
    # top-p over the renormalised survivors
    if top_p < 1.0:
        zmax = max(z)
        weight = {v: math.exp(z[v] - zmax) for v in vocab}
        total = sum(weight[v] for v in keep)
        if eps > 0:
            keep = {
                v
                for v in keep
                if sum(weight[u] for u in keep if z[u] > z[v] + eps) / total < top_p + eps
            }
        else:
            loose = reference_kept(row, temperature, top_k, 1.0, 0.0, -eps)
            keep = {
                v
                for v in keep
                if sum(weight[u] for u in loose if u != v and z[u] >= z[v] + eps) / total
                < top_p + eps
            }
    if min_p > 0.0:
        zmax = max(z)
        keep = {v for v in keep if z[v] - zmax >= math.log(min_p) - eps}
    return keep


def processed_kept(logits, rows):
    """Tokens with finite logits after the sampler's truncation functions."""
    t = torch.tensor([r.params.temperature for r in rows])
    out = apply_temperature(logits, t)
    out = apply_top_k_top_p(
        out,
        torch.tensor([r.params.top_k for r in rows]),
        torch.tensor([r.params.top_p for r in rows]),
    )
    out = apply_min_p(out, torch.tensor([r.params.min_p for r in rows]))
    return [set(torch.nonzero(torch.isfinite(r)).flatten().tolist()) for r in out]


# --- hypothesis strategies ---------------------------------------------------------------------

VOCAB = 12


@st.composite
def logits_rows(draw, num_rows):
    # Values from a coarse grid make ties common, which is where truncation is easiest to get wrong.
    value = st.one_of(
        st.floats(-6, 6, allow_nan=False, width=32), st.sampled_from([-1.0, 0.0, 0.5, 2.0])
    )
    return torch.tensor(
        [[draw(value) for _ in range(VOCAB)] for _ in range(num_rows)], dtype=torch.float32
    )


@st.composite
def random_params(draw, seeded=None):
    seed = None
    if seeded is True or (seeded is None and draw(st.booleans())):
        seed = draw(st.integers(0, 2**63))
    return SamplingParams(
        temperature=draw(st.sampled_from([0.3, 0.7, 1.0, 2.5])),
        top_k=draw(st.sampled_from([0, 1, 2, 5, VOCAB, VOCAB + 3])),
        top_p=draw(st.sampled_from([1.0, 0.95, 0.6, 0.2, 0.01])),
        min_p=draw(st.sampled_from([0.0, 0.05, 0.3, 1.0])),
        seed=seed,
    )


# --- the sampler -------------------------------------------------------------------------------


@given(st.data())
def test_greedy_rows_take_the_argmax_whatever_their_neighbours(data):
    batch = data.draw(st.integers(1, 6))
    logits = data.draw(logits_rows(batch))
    greedy = [data.draw(st.booleans()) for _ in range(batch)]
    rows = [
        SamplingRow(SamplingParams(temperature=0) if g else data.draw(random_params()))
        for g in greedy
    ]
    for row in rows:
        if row.params.seed is not None:
            row.generator = make_generator(row.params.seed)
    out = Sampler()(logits, rows)
    for i in range(batch):
        if greedy[i]:
            assert out.token_ids[i] == max(range(VOCAB), key=lambda v: (logits[i, v], -v))


@given(st.data())
def test_without_free_host_reads_only_the_sampled_tokens_leave_the_device(data):
    """A GPU's sampler (`host_reads_free=False`) waits for the device once a step, in
    `to_host`: no `bool()`, `item()` or `tolist()` of a tensor before it, whatever the rows ask
    (seeds, truncation, penalties, bans, logprobs), and its tokens are the host-reading
    sampler's, NaN and infinite logits included."""
    batch = data.draw(st.integers(1, 5))
    logits = data.draw(logits_rows(batch))
    for row in range(batch):  # NaN, +-inf, and whole rows of -inf, here and there
        column = data.draw(st.integers(0, VOCAB - 1))
        logits[row, column] = data.draw(st.sampled_from([0.0, math.nan, math.inf, -math.inf]))
    if data.draw(st.booleans()):
        logits[0] = -math.inf
    penalised = SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.5,
                               logprobs=2)
    params = [data.draw(st.one_of(random_params(seeded=True), st.just(penalised)))
              for _ in range(batch)]

    def rows():
        return [SamplingRow(p, [1, 2], [3], make_generator(p.seed) if p.seed is not None else None,
                            banned_token_ids=[4]) for p in params]

    expected = Sampler(host_reads_free=True)(logits, rows()).to_host()
    reads: list[str] = []
    with contextlib.ExitStack() as spies:
        for name in ("__bool__", "item", "tolist"):
            real = getattr(torch.Tensor, name)

            def spy(self, *args, _name=name, _real=real):
                reads.append(_name)
                return _real(self, *args)

            spies.enter_context(mock.patch.object(torch.Tensor, name, spy))
        out = Sampler(host_reads_free=False)(logits, rows())
        assert reads == []
        assert out.to_host() == expected
    assert reads[0] == "tolist"  # the one copy of the step's tokens (and their alternatives)


@given(st.data())
@settings(deadline=None)
def test_an_all_greedy_batch_takes_the_kernel_and_agrees_with_the_pytorch_path(data):
    """Greedy rows with nothing to ban, penalise or list take one call of the platform's
    `greedy_tokens` (the CPU's C kernel, `minipaged.kernels.cpu.greedy`); its tokens equal the
    PyTorch path's and its log-probabilities agree with them up to a sum's order. Rows with a
    NaN or an infinity, or a row that asks for top logprobs, go the PyTorch way whole."""
    batch = data.draw(st.integers(1, 6))
    logits = data.draw(logits_rows(batch))
    if data.draw(st.booleans()):
        logits[data.draw(st.integers(0, batch - 1)), 0] = data.draw(
            st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    logprobs = data.draw(st.sampled_from([None, 0, 2]))
    rows = [SamplingRow(SamplingParams(temperature=0, logprobs=logprobs)) for _ in range(batch)]
    calls = []
    platform = CPUPlatform(torch.device("cpu"))
    fast = Sampler(greedy_tokens=lambda x: calls.append(x) or platform.greedy_tokens(x))(
        logits, rows)
    slow = Sampler()(logits, rows)
    assert (len(calls) == 1) == (logprobs != 2)
    assert torch.equal(fast.token_ids, slow.token_ids)
    torch.testing.assert_close(fast.logprobs, slow.logprobs, rtol=1e-5, atol=1e-6)
    assert fast.num_logprobs == slow.num_logprobs == [logprobs] * batch


@given(st.data())
def test_truncation_keeps_exactly_the_reference_set(data):
    batch = data.draw(st.integers(1, 4))
    logits = data.draw(logits_rows(batch))
    rows = [SamplingRow(data.draw(random_params())) for _ in range(batch)]
    kept = processed_kept(logits, rows)
    for i, row in enumerate(rows):
        p = row.params
        args = (logits[i].double().tolist(), p.temperature, p.top_k, p.top_p, p.min_p)
        surely = reference_kept(*args, eps=-1e-4)
        possibly = reference_kept(*args, eps=1e-4)
        assert surely <= kept[i] <= possibly, (p, sorted(surely), sorted(kept[i]))
        assert kept[i], "at least the most likely token survives"


@settings(max_examples=20)
@given(st.data())
def test_sampled_tokens_lie_in_the_allowed_set(data):
    logits = data.draw(logits_rows(3)).repeat(40, 1)  # each row drawn 40 times
    params = [data.draw(random_params(seeded=False)) for _ in range(3)]
    rows = [SamplingRow(params[i % 3]) for i in range(logits.shape[0])]
    out = Sampler(torch.Generator().manual_seed(data.draw(st.integers(0, 1000))))(logits, rows)
    for i, token in enumerate(out.token_ids.tolist()):
        p = params[i % 3]
        allowed = reference_kept(
            logits[i].double().tolist(), p.temperature, p.top_k, p.top_p, p.min_p, eps=1e-4
        )
        assert token in allowed


@given(st.data())
def test_penalties_match_the_per_token_reference(data):
    batch = data.draw(st.integers(1, 5))
    logits = data.draw(logits_rows(batch))
    history = st.lists(st.integers(0, VOCAB - 1), max_size=15)
    rows = [
        SamplingRow(
            SamplingParams(
                temperature=0,
                presence_penalty=data.draw(st.sampled_from([0.0, -1.5, 0.4, 2.0])),
                frequency_penalty=data.draw(st.sampled_from([0.0, -0.7, 0.3, 2.0])),
                repetition_penalty=data.draw(st.sampled_from([1.0, 0.5, 1.3, 3.0])),
            ),
            prompt_token_ids=data.draw(history),
            output_token_ids=data.draw(history),
        )
        for _ in range(batch)
    ]
    got = Sampler().process_logits(logits, rows)
    for i, row in enumerate(rows):
        p = row.params
        want = reference_penalties(
            logits[i].tolist(),
            set(row.prompt_token_ids),
            row.output_token_ids,
            p.presence_penalty,
            p.frequency_penalty,
            p.repetition_penalty,
        )
        torch.testing.assert_close(got[i], torch.tensor(want), rtol=1e-5, atol=1e-5)


def test_banned_tokens_are_never_sampled():
    logits = torch.tensor([[0.0, 9.0, 8.0, 0.0]]).repeat(64, 1)
    rows = [SamplingRow(SamplingParams(temperature=5.0), banned_token_ids=[1, 2])] * 64
    out = Sampler(torch.Generator().manual_seed(0))(logits, rows)
    assert set(out.token_ids.tolist()) <= {0, 3}
    greedy = Sampler()(logits[:1], [SamplingRow(SamplingParams(temperature=0), (), (), None, [1])])
    assert greedy.token_ids.tolist() == [2]


@given(st.data())
def test_seeded_rows_do_not_depend_on_the_batch(data):
    """A seeded row samples the same tokens alone, in any batch and at any position, step after
    step, because its noise comes only from its own generator."""
    num_seeded = data.draw(st.integers(1, 3))
    num_others = data.draw(st.integers(0, 3))
    num_steps = 3
    logits = data.draw(logits_rows(num_seeded + num_others))
    params = [data.draw(random_params(seeded=True)) for _ in range(num_seeded)]
    params += [data.draw(random_params(seeded=False)) for _ in range(num_others)]
    order = data.draw(st.permutations(range(num_seeded + num_others)))

    def run(indices):
        gens = {i: make_generator(params[i].seed) for i in indices if i < num_seeded}
        tokens = []
        for _ in range(num_steps):
            rows = [SamplingRow(params[i], generator=gens.get(i)) for i in indices]
            out = Sampler()(logits[list(indices)], rows)
            tokens.append(dict(zip(indices, out.token_ids.tolist(), strict=True)))
        return tokens

    batched = run(order)
    for i in range(num_seeded):
        alone = run([i])
        assert [step[i] for step in alone] == [step[i] for step in batched]


def test_seeds_give_different_streams():
    logits = torch.zeros(1, 1000)
    draws = {}
    for seed, index in [(0, 0), (1, 0), (0, 1), (0, 2)]:
        gen = make_generator(seed, index)
        rows = [SamplingRow(SamplingParams(seed=seed), generator=gen)]
        draws[seed, index] = [int(Sampler()(logits, rows).token_ids[0]) for _ in range(5)]
    assert len({tuple(d) for d in draws.values()}) == 4
    again = make_generator(0, 1)
    rows = [SamplingRow(SamplingParams(seed=0), generator=again)]
    assert [int(Sampler()(logits, rows).token_ids[0]) for _ in range(5)] == draws[0, 1]


def test_derived_seeds():
    assert derive_seed(1234, 0) == 1234  # sample 0 of n equals the n = 1 request
    seeds = {derive_seed(s, i) for s in range(20) for i in range(1, 20)}
    assert len(seeds) == 19 * 20 and all(0 <= x < 2**64 for x in seeds)


CHI2_CRITICAL_0_001 = {
    2: 13.816,
    3: 16.266,
    4: 18.467,
    5: 20.515,
}  # chi-square quantiles, p = 0.001


def reference_distribution(row, temperature, top_k, top_p, min_p):
    kept = reference_kept(row, temperature, top_k, top_p, min_p, eps=0.0)
    weight = [math.exp(x / temperature) if v in kept else 0.0 for v, x in enumerate(row)]
    return [w / sum(weight) for w in weight]


def chi_square(counts, probs, draws):
    return (
        sum((counts[v] - draws * p) ** 2 / (draws * p) for v, p in enumerate(probs) if p > 0)
        + sum(counts[v] for v, p in enumerate(probs) if p == 0) * 1e9
    )


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(0.7, 0, 1.0, 0.0), (1.5, 4, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.15)],
)
def test_sample_frequencies_follow_the_distribution(temperature, top_k, top_p, min_p, seeded):
    row = [0.0, 0.5, 1.0, 2.0, -0.5, 1.5]
    draws = 6000
    params = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=0 if seeded else None
    )
    # seeded: every draw from its own generator (the per-row path); else one sampler generator
    rows = [
        SamplingRow(params, generator=make_generator(0, i) if seeded else None)
        for i in range(draws)
    ]
    out = Sampler(torch.Generator().manual_seed(1))(torch.tensor([row] * draws), rows)
    counts = Counter(out.token_ids.tolist())
    probs = reference_distribution(row, temperature, top_k, top_p, min_p)
    df = sum(p > 0 for p in probs) - 1
    assert chi_square(counts, probs, draws) < CHI2_CRITICAL_0_001[df]
    # The check has the power to see a wrong temperature.
    wrong = reference_distribution(row, temperature * 1.25, top_k, top_p, min_p)
    assert chi_square(counts, wrong, draws) > CHI2_CRITICAL_0_001[df]


def test_logprobs_are_the_penalised_distribution_and_its_top_k():
    torch.manual_seed(0)
    logits = torch.randn(3, 20)
    rows = [
        SamplingRow(SamplingParams(temperature=0, logprobs=3)),
        SamplingRow(SamplingParams(temperature=0.5, repetition_penalty=2.0), [4, 5], [6]),
        SamplingRow(SamplingParams(temperature=1.0, logprobs=0)),
    ]
    sampler = Sampler(torch.Generator().manual_seed(0))
    out = sampler(logits, rows)
    reference = torch.log_softmax(sampler.process_logits(logits, rows).double(), dim=-1)
    for i in range(3):
        token = int(out.token_ids[i])
        assert math.isclose(float(out.logprobs[i]), float(reference[i, token]), abs_tol=1e-5)
    best3 = reference[0].argsort(descending=True)[:3].tolist()
    host = out.to_host()  # (token, its logprob, the per-token logprobs asked for) per row
    assert [token for token, _, _ in host] == out.token_ids.tolist()
    assert [lp for _, lp, _ in host] == pytest.approx(out.logprobs.tolist())
    d0 = host[0][2]
    assert set(d0) == set(best3)
    assert all(math.isclose(d0[t], float(reference[0, t]), abs_tol=1e-5) for t in best3)
    assert host[1][2] is None
    assert set(host[2][2]) == {int(out.token_ids[2])}
    alone = sampler(logits[2:], rows[2:]).to_host()  # logprobs=0 alone: no alternatives at all
    assert list(alone[0][2]) == [alone[0][0]]


def test_sampler_rejects_mismatched_input():
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.zeros(2, 5), [SamplingRow(SamplingParams())])
    with pytest.raises(ValueError, match="float"):
        Sampler()(torch.zeros(1, 5, dtype=torch.int64), [SamplingRow(SamplingParams())])
    bad = SamplingRow(SamplingParams(repetition_penalty=1.2), [5], [])
    with pytest.raises(ValueError, match="history"):
        Sampler()(torch.zeros(1, 5), [bad])


# --- beam search -------------------------------------------------------------------------------


@given(st.data())
def test_beam_candidates_equal_brute_force(data):
    beams = data.draw(st.integers(1, 4))
    vocab = data.draw(st.integers(1, 6))
    value = st.one_of(st.floats(-8, 0, width=32), st.sampled_from([-1.0, -2.0, -math.inf]))
    cum = torch.tensor([data.draw(value) for _ in range(beams)], dtype=torch.float32)
    nxt = torch.tensor(
        [[data.draw(value) for _ in range(vocab)] for _ in range(beams)], dtype=torch.float32
    )
    k = data.draw(st.integers(1, 2 * beams + 1))
    pairs = [(b, t, float(cum[b] + nxt[b, t])) for b in range(beams) for t in range(vocab)]
    pairs = [p for p in pairs if p[2] != -math.inf]
    pairs.sort(key=lambda p: (-p[2], p[0], p[1]))
    want = [BeamCandidate(b, t, float(nxt[b, t]), s) for b, t, s in pairs[:k]]
    assert beam_search_candidates(cum, nxt, k) == want


def test_wide_beam_search_finds_the_exhaustive_best():
    """With as many beams as there are prefixes, beam search is exhaustive search."""
    torch.manual_seed(0)
    vocab, steps = 3, 4
    table = torch.log_softmax(torch.randn(vocab, vocab), dim=-1)  # a bigram "model"
    start = 0
    width = vocab ** (steps - 1)
    seqs, cum = [[start]], torch.zeros(1)
    for _ in range(steps):
        next_lp = table[[s[-1] for s in seqs]]
        cands = beam_search_candidates(cum, next_lp, width)
        seqs = [seqs[c.parent] + [c.token_id] for c in cands]
        cum = torch.tensor([c.cumulative_logprob for c in cands])

    def score(path):
        return sum(float(table[a, b]) for a, b in itertools.pairwise([start, *path]))

    best = max(itertools.product(range(vocab), repeat=steps), key=score)
    assert seqs[0][1:] == list(best)
    assert math.isclose(float(cum[0]), score(best), rel_tol=1e-5)


def test_beam_score_and_stopping_rules():
    assert beam_search_score(-6.0, 3, 1.0) == -2.0
    assert beam_search_score(-6.0, 4, 0.0) == -6.0
    assert beam_search_score(-8.0, 4, 2.0) == -0.5
    with pytest.raises(ValueError, match="seq_len"):
        beam_search_score(-1.0, 0, 1.0)

    def done(best_cum, worst_finished, num_finished, **kw):
        return beam_search_is_done(
            best_running_cumulative_logprob=best_cum,
            best_running_len=10,
            worst_finished_score=worst_finished,
            num_finished=num_finished,
            beam_width=2,
            length_penalty=1.0,
            **kw,
        )

    # not enough finished beams yet, whatever the scores
    assert not done(-100.0, 0.0, 1) and not done(-100.0, 0.0, 1, early_stopping=True)
    assert done(-1.0, -5.0, 2, early_stopping=True)
    # False: the live best -20/10 = -2 cannot beat the worst finished -1.5 -> done; -1 can
    assert done(-20.0, -1.5, 2) and not done(-10.0, -1.5, 2)
    # "never": the live beam could reach length 40: -20/40 = -0.5 beats -1.5 -> not done
    assert not done(-20.0, -1.5, 2, early_stopping="never", max_possible_len=40)
    assert done(-20.0, -0.4, 2, early_stopping="never", max_possible_len=40)
    with pytest.raises(ValueError, match="early_stopping"):
        done(-20.0, -1.5, 2, early_stopping="sometimes")


def test_beam_candidates_reject_bad_shapes():
    with pytest.raises(ValueError, match="beams"):
        beam_search_candidates(torch.zeros(2), torch.zeros(3, 4), 2)
    with pytest.raises(ValueError, match="num_candidates"):
        beam_search_candidates(torch.zeros(2), torch.zeros(2, 4), 0)


def test_beam_logprobs_apply_bans_and_penalties():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    p = SamplingParams(use_beam_search=True, beam_width=2, temperature=0, repetition_penalty=2.0)
    lp = Sampler().beam_logprobs(logits, [SamplingRow(p, [2], [], banned_token_ids=[0])])
    want = torch.log_softmax(torch.tensor([[-math.inf, 2.0, 1.5]]), dim=-1)
    torch.testing.assert_close(lp, want)
