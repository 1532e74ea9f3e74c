"""Request and sequence state, and the vLLM-shaped output of a request.

A request (`SequenceGroup`) holds one or more sequences: one for a plain request, `n` for
parallel sampling, `beam_width` live beams for beam search. They start from the same prompt and
share its KV blocks through `fork` (the vLLM paper, section 4.4). A sequence moves through
WAITING -> RUNNING <-> (preempted: WAITING or SWAPPED) -> FINISHED_*; the scheduler moves it, the
engine appends tokens and asks `minipaged.sampling.stopping.check_stop` whether it is done.

Nothing here touches the KV cache or a tensor (bar the per-sample random generators), so the
scheduler and the simulator can use these types unchanged.
"""

from __future__ import annotations

import copy
import enum
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from minipaged.sampling.beam_scoring import beam_search_score
from minipaged.sampling.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minipaged.sampling.params import SamplingParams, SamplingType
from minipaged.sampling.sampler import SamplingRow, make_generator, min_tokens_banned_ids

# --- data types --------------------------------------------------------------------------------


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life; the FINISHED_* values say why it ended."""

    __hash__ = object.__hash__  # members are singletons: hashed by identity, in C

    WAITING = "waiting"  # not yet scheduled, or preempted by recomputation
    RUNNING = "running"  # its KV blocks are in the GPU pool
    SWAPPED = "swapped"  # preempted: its KV blocks are in the CPU pool
    FINISHED_STOPPED = "finished_stopped"  # EOS, a stop token or a stop string
    FINISHED_LENGTH_CAPPED = "finished_length_capped"  # max_tokens or the model's context
    FINISHED_ABORTED = "finished_aborted"  # the user aborted the request
    FINISHED_IGNORED = "finished_ignored"  # rejected before it ran (e.g. prompt too long)
    FINISHED_ERROR = "finished_error"  # the step computing it failed (model or sampler)

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's / vLLM's finish reason: "stop", "length", "abort", "error", or None while
        unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_IGNORED: "length",
    SequenceStatus.FINISHED_ERROR: "error",
}


class IncrementalDetokenizer(Protocol):
    """What a sequence needs from a detokenizer (e.g.
    `minipaged.tokenizer.tokenizer.IncrementalDetokenizer`).

    `push` takes the next output token and returns the text it completes (possibly "", while a
    multi-byte character is still incomplete); `text` is everything so far. An optional `fork()`
    returning an independent copy is used when a sequence forks.
    """

    text: str

    def push(self, token_id: int) -> str: ...


@dataclass(frozen=True)
class StopDecision:
    """Why a sequence must finish, and how much of its text to keep (`check_stop`)."""

    status: SequenceStatus
    stop_reason: int | str | None = None  # token id or stop string; None for length
    text_end: int | None = None  # cut output_text to [:text_end]; None keeps it all


# --- sequences ---------------------------------------------------------------------------------


class Sequence:
    """One token stream: the prompt, the tokens generated so far and their text.

    The one owner of the sequence's token counts: its length (`get_len`, prompt and output)
    and `num_computed_tokens`, the tokens whose K/V are in the cache; the scheduler grows the
    latter (chunked prefill, decode), resets it when a preemption drops the blocks, and tells
    the KV cache manager the length its blocks must cover. `sample_index` says which of a
    request's `n` samples this is (it picks the seeded generator).
    """

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: Collection[int],
        detokenizer: IncrementalDetokenizer | None = None,
        sample_index: int = 0,
    ) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError(f"sequence {seq_id}: the prompt must contain at least one token")
        self.seq_id = seq_id
        self.token_ids: list[int] = list(prompt_token_ids)  # the prompt, then the output
        self.num_prompt_tokens = len(self.token_ids)
        self.status = SequenceStatus.WAITING
        self.cumulative_logprob = 0.0
        self.output_logprobs: list[dict[int, float]] = []
        self.num_computed_tokens = 0
        self.output_text = ""
        self.new_char_count = 0  # characters the last append_token added to output_text
        self.detokenizer = detokenizer
        self.sample_index = sample_index
        self.stop_reason: int | str | None = None

    def __repr__(self) -> str:
        return (f"Sequence(seq_id={self.seq_id}, status={self.status.name}, "
                f"prompt_len={self.get_prompt_len()}, output_len={self.get_output_len()})")

    # lengths and tokens: one list, appended to, never copied on a step
    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def get_len(self) -> int:
        return len(self.token_ids)

    def get_prompt_len(self) -> int:
        return self.num_prompt_tokens

    def get_output_len(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def is_finished(self) -> bool:
        return self.status in _FINISH_REASONS

    # changes
    def append_token(
        self, token_id: int, logprob: float, logprobs: dict[int, float] | None = None
    ) -> str:
        """Add a sampled token; returns the text it completes (detokenizer permitting)."""
        self.token_ids.append(token_id)
        self.cumulative_logprob += logprob
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
        new_text = self.detokenizer.push(token_id) if self.detokenizer is not None else ""
        self.output_text += new_text
        self.new_char_count = len(new_text)
        return new_text

    def finish(self, decision: StopDecision) -> None:
        """Apply `check_stop`'s decision."""
        self.status = decision.status
        self.stop_reason = decision.stop_reason
        if decision.text_end is not None:
            self.output_text = self.output_text[: decision.text_end]

    def reset_for_recompute(self) -> None:
        """Preempted by recomputation: the KV blocks are gone; prompt and output are prefilled
        again on resumption (the vLLM paper, section 4.5)."""
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING

    def fork(self, new_seq_id: int, sample_index: int | None = None) -> Sequence:
        """A copy that continues independently (parallel sampling, beam search).

        The KV blocks are forked separately, by the KV cache manager.
        """
        child = copy.copy(self)
        child.seq_id = new_seq_id
        child.token_ids = list(self.token_ids)
        child.output_logprobs = list(self.output_logprobs)
        child.detokenizer = _fork_detokenizer(self.detokenizer)
        if sample_index is not None:
            child.sample_index = sample_index
        return child

    def beam_search_score(
        self, length_penalty: float, eos_token_ids: Collection[int] = ()
    ) -> float:
        """vLLM's beam score: the length counts prompt + output tokens, minus a final EOS."""
        seq_len = self.get_len()
        if self.get_output_len() and self.token_ids[-1] in eos_token_ids:
            seq_len -= 1
        return beam_search_score(self.cumulative_logprob, seq_len, length_penalty)


def _fork_detokenizer(
    detokenizer: IncrementalDetokenizer | None,
) -> IncrementalDetokenizer | None:
    """An independent copy of a detokenizer's state (its `fork()` if it has one).

    Otherwise a deep copy that shares only the (large, read-only) `tokenizer` attribute: the
    state of a half-decoded multi-byte character must not be shared between the two sequences.
    """
    if detokenizer is None:
        return None
    fork = getattr(detokenizer, "fork", None)
    if callable(fork):
        return fork()
    tokenizer = getattr(detokenizer, "tokenizer", None)
    memo = {} if tokenizer is None else {id(tokenizer): tokenizer}
    return copy.deepcopy(detokenizer, memo)


# --- requests ----------------------------------------------------------------------------------


class SequenceGroup:
    """One request: its sequences, sampling parameters, timing and the user's prompt text."""

    def __init__(
        self,
        request_id: str,
        seqs: list[Sequence],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        prompt: str | None = None,
    ) -> None:
        if not seqs:
            raise ValueError(f"request {request_id!r} needs at least one sequence")
        self.request_id = request_id
        self.seqs = list(seqs)
        self.sampling_params = sampling_params
        self.prompt = prompt
        self.metrics = RequestMetrics(time.monotonic() if arrival_time is None else arrival_time)
        self._generators: dict[int, torch.Generator] = {}
        self._rows: dict[int, SamplingRow] = {}  # by sample index: rows without per-step state
        self._prompt_token_ids = seqs[0].prompt_token_ids  # every output's, never copied again
        # By sample index: the characters and tokens of its output that deltas have sent, or
        # None once its end was sent.
        self._sent: dict[int, tuple[int, int] | None] = {}

    def __repr__(self) -> str:
        return f"SequenceGroup(request_id={self.request_id!r}, seqs={self.seqs})"

    @property
    def arrival_time(self) -> float:
        return self.metrics.arrival_time

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._prompt_token_ids

    # looking up sequences
    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        return [seq for seq in self.seqs if status is None or seq.status == status]

    def get_unfinished_seqs(self) -> list[Sequence]:
        return [seq for seq in self.seqs if seq.status not in _FINISH_REASONS]

    def find(self, seq_id: int) -> Sequence:
        for seq in self.seqs:
            if seq.seq_id == seq_id:
                return seq
        raise KeyError(f"request {self.request_id!r} has no sequence {seq_id}")

    def add(self, seq: Sequence) -> None:
        if any(s.seq_id == seq.seq_id for s in self.seqs):
            raise ValueError(f"request {self.request_id!r} already has sequence {seq.seq_id}")
        self.seqs.append(seq)

    def remove(self, seq_id: int) -> None:
        self.seqs.remove(self.find(seq_id))

    def is_finished(self) -> bool:
        return all(seq.status in _FINISH_REASONS for seq in self.seqs)

    @property
    def max_width(self) -> int:
        """The most sequences this request has alive at once: `beam_width` live beams for beam
        search, else its `n` samples."""
        params = self.sampling_params
        return params.beam_width if params.use_beam_search else params.n

    # sampling
    def generator_for(
        self, sample_index: int, device: torch.device | str = "cpu"
    ) -> torch.Generator | None:
        """The seeded generator of sample `sample_index` on `device`, the logits' (None unless
        the request is seeded)."""
        params = self.sampling_params
        if params.sampling_type != SamplingType.RANDOM_SEED or params.seed is None:
            return None
        if sample_index not in self._generators:  # a request's logits stay on one device
            self._generators[sample_index] = make_generator(params.seed, sample_index, device)
        return self._generators[sample_index]

    def sampling_row(
        self, seq: Sequence, eos_token_ids: Collection[int] = (), device: torch.device | str = "cpu"
    ) -> SamplingRow:
        """What the sampler needs for `seq`'s next token on logits on `device`: its history
        (copied only when penalties read it), its generator, its bans. Without penalties or
        bans a sample's row is the same every step: it is made once."""
        if (row := self._rows.get(seq.sample_index)) is not None:
            return row
        params = self.sampling_params
        history = (seq.prompt_token_ids, seq.output_token_ids) if params.has_penalties else ()
        banned = min_tokens_banned_ids(params, len(seq.token_ids) - seq.num_prompt_tokens,
                                       eos_token_ids) if params.min_tokens else ()
        generator = None if params.seed is None else self.generator_for(seq.sample_index, device)
        row = SamplingRow(params, *history, generator=generator, banned_token_ids=banned)
        if not (history or banned):
            self._rows[seq.sample_index] = row
        return row

    def by_beam_score(
        self, seqs: list[Sequence], eos_token_ids: Collection[int] = ()
    ) -> list[Sequence]:
        """`seqs`, best first by their length-penalised `Sequence.beam_search_score`."""
        penalty = self.sampling_params.length_penalty
        return sorted(seqs, key=lambda s: s.beam_search_score(penalty, eos_token_ids), reverse=True)

    # output
    def to_request_output(self, eos_token_ids: Collection[int] = ()) -> RequestOutput:
        """The request as the user sees it: samples in index order, or the best `n` beams.
        While a sample runs, the end of its text that may be the start of a stop string is
        held back (as vLLM does), so streamed text never has to be taken back when the stop
        string completes and is cut off."""
        params = self.sampling_params
        if params.use_beam_search:
            indexed = list(enumerate(self.by_beam_score(self.seqs, eos_token_ids)[: params.n]))
        else:
            indexed = [(s.sample_index, s) for s in sorted(self.seqs, key=lambda s: s.sample_index)]
        return self._request_output(
            [self._completion(index, seq, 0, self._shown_chars(seq), 0) for index, seq in indexed])

    def to_delta_output(self, eos_token_ids: Collection[int] = ()) -> RequestOutput | None:
        """What the request gained since its last delta (vLLM's `RequestOutputKind.DELTA`):
        each sample with news, its new text, tokens and log-probabilities, and its finish
        reason once; None when there is no news. Beam search's best beams may change their
        past, so its one delta is the whole output, when it finishes. Each piece is copied
        once: a delta costs what the step added, whatever the output's length."""
        if self.sampling_params.use_beam_search:
            return self.to_request_output(eos_token_ids) if self.is_finished() else None
        outputs = []
        for seq in sorted(self.seqs, key=lambda s: s.sample_index):
            sent = self._sent.get(seq.sample_index, (0, 0))
            if sent is None:  # its end was sent
                continue
            (chars, tokens), shown = sent, self._shown_chars(seq)
            done = seq.status.finish_reason is not None
            if shown == chars and seq.num_prompt_tokens + tokens == len(seq.token_ids) and not done:
                continue
            outputs.append(self._completion(seq.sample_index, seq, chars, shown, tokens))
            self._sent[seq.sample_index] = None if done else (shown, seq.get_output_len())
        return self._request_output(outputs) if outputs else None

    def _completion(
        self, index: int, seq: Sequence, chars: int, shown: int, tokens: int
    ) -> CompletionOutput:
        """`seq` as output `index`: its text from character `chars` up to `shown`, its output
        tokens (and log-probabilities, when asked for) from the `tokens`-th on; each a copy."""
        asked = self.sampling_params.logprobs is not None
        return CompletionOutput(
            index, seq.output_text[chars:shown], seq.token_ids[seq.num_prompt_tokens + tokens:],
            seq.cumulative_logprob, seq.output_logprobs[tokens:] if asked else None,
            seq.status.finish_reason, seq.stop_reason,
        )

    def _shown_chars(self, seq: Sequence) -> int:
        """How much of `seq`'s text an output shows: all of it once finished, else all but the
        end that may begin a stop string (the longest stop string but its last character)."""
        params, text_len = self.sampling_params, len(seq.output_text)
        if seq.is_finished() or params.use_beam_search:  # a beam's text is never streamed
            return text_len
        return max(0, text_len - max(map(len, params.stop), default=1) + 1)

    def _request_output(self, outputs: list[CompletionOutput]) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self._prompt_token_ids,
            outputs=outputs,
            finished=self.is_finished(),
            metrics=self.metrics,
        )


class GroupMember(NamedTuple):
    """A sequence with the request it belongs to: how the scheduler resolves a planned
    `ScheduledSequence`'s ids to its objects (`Scheduler.resolve`), and what the sampling step
    works on, one per sequence that samples."""

    group: SequenceGroup
    seq: Sequence
