"""Layer 7: sequence and request state, stop conditions, outputs, seeded parallel sampling."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minipaged.sampling.outputs import RequestMetrics
from minipaged.sampling.params import SamplingParams
from minipaged.sampling.sampler import Sampler, make_generator
from minipaged.sampling.sequence import Sequence, SequenceGroup, SequenceStatus, StopDecision
from minipaged.sampling.stopping import check_stop, find_stop_string
from minipaged.tokenizer.bpe import bytes_to_unicode
from minipaged.tokenizer.tokenizer import IncrementalDetokenizer, Tokenizer

EOS = 2


class PieceDetokenizer:
    """Token `i` is the text `pieces[i]` (pieces may be "" or several characters long)."""

    def __init__(self, pieces):
        self.pieces = pieces
        self.text = ""

    def push(self, token_id):
        self.text += self.pieces[token_id]
        return self.pieces[token_id]


def byte_tokenizer() -> Tokenizer:
    """A real tokenizer whose token `b` is the byte `b` (no merges): multi-byte characters span
    several tokens."""
    return Tokenizer({char: byte for byte, char in bytes_to_unicode().items()}, [])


def test_status_finish_reasons():
    for status in (SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.SWAPPED):
        assert not status.is_finished and status.finish_reason is None
    assert SequenceStatus.FINISHED_STOPPED.finish_reason == "stop"
    assert SequenceStatus.FINISHED_LENGTH_CAPPED.finish_reason == "length"
    assert SequenceStatus.FINISHED_ABORTED.finish_reason == "abort"
    assert SequenceStatus.FINISHED_IGNORED.finish_reason == "length"
    assert all(s.is_finished for s in SequenceStatus if s.name.startswith("FINISHED"))


def test_sequence_tokens_lengths_and_logprobs():
    seq = Sequence(7, [5, 6, 9], PieceDetokenizer({1: "a", 4: "bc"}))
    assert seq.get_len() == 3
    assert seq.append_token(1, -0.5, {1: -0.5, 3: -1.5}) == "a"
    assert seq.append_token(4, -0.25) == "bc"
    assert seq.token_ids == [5, 6, 9, 1, 4]
    assert (seq.get_len(), seq.get_prompt_len(), seq.get_output_len()) == (5, 3, 2)
    assert seq.cumulative_logprob == -0.75 and seq.output_text == "abc"
    assert seq.new_char_count == 2 and seq.output_logprobs == [{1: -0.5, 3: -1.5}]
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = 4
    seq.reset_for_recompute()
    assert seq.num_computed_tokens == 0 and seq.status == SequenceStatus.WAITING
    with pytest.raises(ValueError, match="at least one token"):
        Sequence(1, [])


def test_fork_is_independent_even_in_the_middle_of_a_character():
    tokenizer = byte_tokenizer()
    parent = Sequence(0, [1], IncrementalDetokenizer(tokenizer))
    e_acute, e_grave = "é".encode(), "è".encode()  # same first byte, different second byte
    parent.append_token(ord("h"), -1.0)
    parent.append_token(e_acute[0], -1.0)  # half a character: no text yet
    assert parent.output_text == "h"
    child = parent.fork(1, sample_index=3)
    assert child.detokenizer.tokenizer is tokenizer  # shared, not copied
    parent.append_token(e_acute[1], -1.0)
    child.append_token(e_grave[1], -2.0)
    assert (parent.output_text, child.output_text) == ("hé", "hè")
    assert parent.output_token_ids[-1] != child.output_token_ids[-1]
    assert (parent.cumulative_logprob, child.cumulative_logprob) == (-3.0, -4.0)
    assert (child.seq_id, child.sample_index, parent.sample_index) == (1, 3, 0)
    assert parent.prompt_token_ids is not child.prompt_token_ids


def test_fork_uses_the_detokenizers_own_fork():
    class Forkable(PieceDetokenizer):
        def fork(self):
            clone = Forkable(self.pieces)
            clone.text, clone.forked = self.text, True
            return clone

    child = Sequence(0, [1], Forkable(["x"])).fork(1)
    assert child.detokenizer.forked


def run_until_stop(pieces, params, eos_token_ids=(), prompt=(0,), max_model_len=None):
    """Feed tokens 0, 1, 2, ... until `check_stop` says stop; return the sequence."""
    seq = Sequence(0, list(prompt), PieceDetokenizer(pieces))
    for token in range(len(pieces)):
        seq.append_token(token, 0.0)
        decision = check_stop(seq, params, eos_token_ids, max_model_len)
        if decision is not None:
            seq.finish(decision)
            break
    return seq


@given(
    pieces=st.lists(st.text(alphabet="ab c", max_size=4), min_size=1, max_size=12),
    stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_stop_strings_are_found_across_tokens_and_cut(pieces, stops):
    seq = run_until_stop(pieces, SamplingParams(stop=stops, max_tokens=len(pieces)))
    # Reference: after each token, search the whole text so far.
    text = ""
    for consumed, piece in enumerate(pieces, start=1):
        text += piece
        hits = [(text.find(s), i) for i, s in enumerate(stops) if s in text]
        if hits:
            start, which = min(hits)
            assert seq.get_output_len() == consumed
            assert seq.status == SequenceStatus.FINISHED_STOPPED
            assert seq.output_text == text[:start]
            assert seq.stop_reason == stops[which]
            return
    assert seq.status == SequenceStatus.FINISHED_LENGTH_CAPPED
    assert seq.output_text == text and seq.stop_reason is None


def test_find_stop_string_only_reports_new_matches():
    assert find_stop_string("xxSTOPyy", 2, ["STOP"]) is None  # ended before the new text
    assert find_stop_string("xxSTOP", 2, ["STOP"]) == ("STOP", 2)  # began before it
    assert find_stop_string("xxSTOP", 0, ["STOP"]) is None
    assert find_stop_string("abcd", 2, ["cd", "bc"]) == ("bc", 1)  # the earliest start wins


def test_eos_stop_tokens_min_tokens_and_lengths():
    pieces = ["a", "b", "<eos>", "c", "<s>", "d"]
    # EOS (id 2) stops and its text is removed
    seq = run_until_stop(pieces, SamplingParams(), eos_token_ids=[EOS])
    assert (seq.status.finish_reason, seq.stop_reason, seq.output_text) == ("stop", EOS, "ab")
    assert seq.output_token_ids == [0, 1, 2]
    # ignore_eos: EOS is an ordinary token, a stop token still stops
    seq = run_until_stop(
        pieces, SamplingParams(ignore_eos=True, stop_token_ids=[4]), eos_token_ids=[EOS]
    )
    assert (seq.stop_reason, seq.output_text) == (4, "ab<eos>c")
    # nothing but length stops a sequence before min_tokens
    seq = run_until_stop(pieces, SamplingParams(min_tokens=4, stop_token_ids=[4]), [EOS])
    assert (seq.get_output_len(), seq.stop_reason) == (5, 4)
    # a stop string completed before min_tokens is passed over; one completed after stops
    seq = run_until_stop(pieces, SamplingParams(min_tokens=4, stop=["a", "c"]), [EOS])
    assert (seq.get_output_len(), seq.stop_reason, seq.output_text) == (4, "c", "ab<eos>")
    # max_tokens and the model's context
    seq = run_until_stop(pieces, SamplingParams(max_tokens=2), [EOS])
    assert (seq.status.finish_reason, seq.output_text) == ("length", "ab")
    seq = run_until_stop(pieces, SamplingParams(), [EOS], prompt=[0, 0, 0], max_model_len=4)
    assert (seq.status, seq.get_len()) == (SequenceStatus.FINISHED_LENGTH_CAPPED, 4)
    # EOS as the last allowed token is a "stop", not a "length"
    seq = run_until_stop(pieces, SamplingParams(max_tokens=3), [EOS])
    assert seq.status.finish_reason == "stop"


def test_outputs_hold_back_a_possible_stop_string():
    group = SequenceGroup("r", [Sequence(0, [0], PieceDetokenizer(["hello wo"]))],
                          SamplingParams(stop=["wor", "x"]))
    seq = group.seqs[0]
    seq.append_token(0, 0.0)
    assert group.to_request_output().outputs[0].text == "hello "  # "wo" may begin "wor"
    assert group.to_delta_output().outputs[0].text == "hello "
    seq.finish(StopDecision(SequenceStatus.FINISHED_LENGTH_CAPPED))
    assert group.to_request_output().outputs[0].text == "hello wo"
    assert group.to_delta_output().outputs[0].text == "wo"
    assert group.to_delta_output() is None  # its end was sent


@given(
    pieces=st.lists(st.text(alphabet="ab c", max_size=4), min_size=1, max_size=12),
    stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), max_size=3),
    n=st.integers(1, 3),
    logprobs=st.sampled_from([None, 0]),
    silent_steps=st.sets(st.integers(0, 12)),
)
def test_deltas_add_up_to_the_cumulative_outputs(pieces, stops, n, logprobs, silent_steps):
    """Each step's delta (taken on the steps not in `silent_steps`) holds exactly what the
    cumulative output gained since the last delta: joined, a sample's deltas are its whole
    final output, and its finish reason comes once, in the last."""
    params = SamplingParams(n=n, stop=stops, max_tokens=len(pieces), logprobs=logprobs)
    seqs = [Sequence(i, [0], PieceDetokenizer(pieces), sample_index=i) for i in range(n)]
    group = SequenceGroup("r", seqs, params)
    deltas = []
    for step in range(len(pieces) + 1):
        for seq in group.get_unfinished_seqs():
            offset = seq.sample_index  # samples go their own ways
            if step < len(pieces):
                seq.append_token((step + offset) % len(pieces), -0.5, {0: -0.5})
            decision = check_stop(seq, params)
            if decision is not None:
                seq.finish(decision)
        if step not in silent_steps or group.is_finished():
            deltas.append(group.to_delta_output())
        if group.is_finished():
            break
    final = group.to_request_output()
    for completion in final.outputs:
        mine = [c for d in deltas if d is not None for c in d.outputs
                if c.index == completion.index]
        assert "".join(c.text for c in mine) == completion.text
        assert [t for c in mine for t in c.token_ids] == completion.token_ids
        if logprobs is not None:
            assert [lp for c in mine for lp in c.logprobs] == completion.logprobs
        assert [c.finish_reason for c in mine][-1] == completion.finish_reason
        assert all(c.finish_reason is None for c in mine[:-1])
        assert mine[-1].cumulative_logprob == completion.cumulative_logprob
    assert deltas[-1].finished and group.to_delta_output() is None


def test_request_metrics():
    m = RequestMetrics(arrival_time=10.0)
    assert m.time_to_first_token is None and m.latency is None
    m.first_token_time, m.finished_time = 10.5, 12.0
    assert (m.time_to_first_token, m.latency) == (0.5, 2.0)


def test_group_lookup_widths_and_abort():
    params = SamplingParams(n=3, seed=1)
    group = SequenceGroup("r1", [Sequence(0, [4, 5])], params, arrival_time=1.0, prompt="hi")
    assert group.max_width == 3
    for i in (1, 2):
        group.add(group.seqs[0].fork(i, sample_index=i))
    with pytest.raises(ValueError, match="already"):
        group.add(Sequence(1, [4, 5]))
    group.find(2).status = SequenceStatus.FINISHED_STOPPED
    assert len(group.get_unfinished_seqs()) == 2 and len(group.get_seqs()) == 3
    assert [s.seq_id for s in group.get_seqs(SequenceStatus.WAITING)] == [0, 1]
    assert not group.is_finished()
    group.remove(1)
    with pytest.raises(KeyError):
        group.find(1)
    beam = SamplingParams(use_beam_search=True, beam_width=4, n=2, temperature=0)
    assert SequenceGroup("b", [Sequence(0, [1])], beam).max_width == 4
    with pytest.raises(ValueError, match="at least one sequence"):
        SequenceGroup("e", [], params)


def test_group_generators_and_bans():
    group = SequenceGroup("r", [Sequence(0, [1])], SamplingParams(n=2, seed=5, min_tokens=1))
    gen = group.generator_for(1)
    assert group.generator_for(1) is gen  # one stream per sample, kept across steps
    draws = torch.empty(8).exponential_(generator=gen)
    assert torch.equal(draws, torch.empty(8).exponential_(generator=make_generator(5, 1)))
    row = group.sampling_row(group.seqs[0], eos_token_ids=[EOS])
    assert row.generator is group.generator_for(0) and list(row.banned_token_ids) == [EOS]
    group.seqs[0].append_token(3, 0.0)
    assert list(group.sampling_row(group.seqs[0], [EOS]).banned_token_ids) == []
    unseeded = SequenceGroup("u", [Sequence(0, [1])], SamplingParams())
    assert unseeded.generator_for(0) is None


def test_request_output_orders_samples_and_ranks_beams():
    params = SamplingParams(n=2, temperature=1.0, logprobs=1)
    group = SequenceGroup("s", [Sequence(10, [1, 2], sample_index=1)], params, prompt="p")
    group.add(Sequence(11, [1, 2], sample_index=0))
    group.seqs[0].append_token(7, -1.0, {7: -1.0})
    group.seqs[0].finish(StopDecision(SequenceStatus.FINISHED_STOPPED, stop_reason=7))
    out = group.to_request_output()
    assert [o.index for o in out.outputs] == [0, 1] and not out.finished
    assert out.outputs[1].token_ids == [7] and out.outputs[1].finish_reason == "stop"
    assert out.outputs[1].logprobs == [{7: -1.0}] and out.outputs[1].stop_reason == 7
    assert (out.request_id, out.prompt, out.prompt_token_ids) == ("s", "p", [1, 2])

    beam = SamplingParams(use_beam_search=True, beam_width=3, n=2, temperature=0)
    seqs = [Sequence(i, [1, 1]) for i in range(3)]
    for seq, lp, tokens in zip(seqs, [-3.0, -2.0, -3.0], [[5], [5], [5, 5, EOS]], strict=True):
        for t in tokens:
            seq.append_token(t, lp / len(tokens))
    # scores (length penalty 1, EOS not counted): -3/3, -2/3, -3/4
    out = SequenceGroup("b", seqs, beam).to_request_output(eos_token_ids=[EOS])
    assert [o.cumulative_logprob for o in out.outputs] == [-2.0, -3.0]
    assert [o.token_ids for o in out.outputs] == [[5], [5, 5, EOS]] and out.outputs[0].index == 0
    assert out.outputs[0].logprobs is None


def test_beam_search_score_of_a_sequence():
    seq = Sequence(0, [1, 1, 1])
    seq.append_token(4, -2.0)
    seq.append_token(EOS, -2.0)
    assert seq.beam_search_score(1.0, [EOS]) == -1.0  # 4 tokens without the EOS
    assert seq.beam_search_score(1.0) == -0.8
    assert seq.beam_search_score(0.0, [EOS]) == -4.0


def sample_requests(groups, steps, logits_table):
    """A toy engine loop: n > 1 requests sample their first token from one prompt row with each
    sample's generator, fork, then every sequence samples from `logits_table[last_token]`."""
    sampler = Sampler()
    seq_ids = iter(range(10**6))
    for group in groups:
        group.seqs = [Sequence(next(seq_ids), group.prompt_token_ids)]
    for step in range(steps):
        rows, seqs = [], []
        for group in groups:
            live = group.get_seqs()
            if step == 0:  # the prompt row, once per sample
                live = [live[0]] + [
                    live[0].fork(next(seq_ids), i) for i in range(1, group.sampling_params.n)
                ]
                group.seqs = live
            for seq in live:
                rows.append(group.sampling_row(seq))
                seqs.append(seq)
        logits = logits_table[[seq.token_ids[-1] for seq in seqs]]
        out = sampler(logits, rows)
        for seq, token, lp in zip(seqs, out.token_ids.tolist(), out.logprobs, strict=True):
            seq.append_token(token, float(lp))
    return [
        [s.output_token_ids for s in sorted(g.seqs, key=lambda s: s.sample_index)] for g in groups
    ]


def test_seeded_parallel_samples_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    vocab = 50
    table = torch.randn(vocab, vocab) * 2

    def request(rid, n, seed, temperature=0.9):
        return SequenceGroup(
            rid, [Sequence(0, [3, 4])], SamplingParams(n=n, seed=seed, temperature=temperature)
        )

    batched = sample_requests(
        [request("a", 1, None), request("b", 4, 42), request("c", 2, 7, 1.3)], 5, table
    )
    alone = sample_requests([request("b", 4, 42)], 5, table)
    assert batched[1] == alone[0]
    assert len({tuple(s) for s in alone[0]}) > 1  # the samples differ from each other
    # sample 0 of an n = 4 request is the n = 1 request with the same seed
    single = sample_requests([request("b", 1, 42)], 5, table)
    assert single[0][0] == alone[0][0]
