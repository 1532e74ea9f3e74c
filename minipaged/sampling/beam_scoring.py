"""Beam search's arithmetic: the length-penalised score, one step's best candidates, the stop rule.

Pure functions over log-probabilities (Hugging Face's `BeamSearchScorer`, vLLM v0's beam search);
`minipaged.engine.beam_search` runs them over a request's beams, sharing their KV blocks (the vLLM
paper, section 4.4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class BeamCandidate:
    """One continuation of a live beam: beam `parent` extended by `token_id`."""

    parent: int
    token_id: int
    logprob: float
    cumulative_logprob: float


def beam_search_score(cumulative_logprob: float, seq_len: int, length_penalty: float) -> float:
    """The length-penalised score beams are ranked by (Hugging Face / vLLM).

    `seq_len ** length_penalty` divides the summed log-probability: with `length_penalty > 0`
    longer beams are favoured (their sums are more negative), with `< 0` shorter ones. vLLM counts
    prompt + output tokens, not counting a final EOS; the caller chooses `seq_len`.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    return cumulative_logprob / (seq_len**length_penalty)


def beam_search_candidates(
    cumulative_logprobs: Tensor, next_logprobs: Tensor, num_candidates: int
) -> list[BeamCandidate]:
    """The `num_candidates` best one-token continuations of the live beams.

    Every (beam, token) pair scores `cumulative_logprobs[beam] + next_logprobs[beam, token]`;
    the best pairs over all beams are returned, best first, ties broken by (beam, token).
    Impossible continuations (score -inf) are never returned, so fewer may come back.
    The engine asks for `2 * beam_width` so that, after the candidates ending in EOS (or another
    stop) are moved to the finished list, `beam_width` live beams still remain (Hugging Face's
    `BeamSearchScorer`; vLLM v0's beam search).
    """
    if next_logprobs.ndim != 2 or cumulative_logprobs.shape != next_logprobs.shape[:1]:
        raise ValueError(
            f"need cumulative_logprobs [beams] and next_logprobs [beams, V], got "
            f"{tuple(cumulative_logprobs.shape)} and {tuple(next_logprobs.shape)}"
        )
    if num_candidates < 1:
        raise ValueError(f"num_candidates must be >= 1, got {num_candidates}")
    vocab_size = next_logprobs.shape[1]
    scores = (cumulative_logprobs[:, None] + next_logprobs).flatten()
    flat_logprobs = next_logprobs.flatten()
    # A stable descending sort keeps equal scores in (beam, token) order.
    order = scores.sort(descending=True, stable=True).indices[:num_candidates].tolist()
    # Sorted best first, so the impossible continuations (-inf) are the last ones.
    return [
        BeamCandidate(*divmod(flat, vocab_size), float(flat_logprobs[flat]), float(scores[flat]))
        for flat in order
        if float(scores[flat]) != -math.inf
    ]


def beam_search_is_done(
    *,
    best_running_cumulative_logprob: float,
    best_running_len: int,
    worst_finished_score: float | None,
    num_finished: int,
    beam_width: int,
    length_penalty: float,
    early_stopping: bool | str = False,
    max_possible_len: int | None = None,
) -> bool:
    """Whether beam search may stop with the finished beams it has (vLLM v0 / Hugging Face).

    Nothing can stop before `beam_width` beams have finished. Then `early_stopping`:
    * True: stop at once;
    * False (the default in both libraries): stop when the best live beam, scored at its current
      length, no longer beats the worst kept finished beam (a heuristic: a live beam may still
      improve under `length_penalty > 0`);
    * "never": with `length_penalty > 0` score the best live beam as if it reached
      `max_possible_len` (the best it could ever do), so stopping is exact.
    """
    if num_finished < beam_width:
        return False
    if early_stopping is True:
        return True
    assert worst_finished_score is not None
    seq_len = best_running_len
    if early_stopping == "never" and length_penalty > 0.0:
        if max_possible_len is None:
            raise ValueError('early_stopping="never" needs max_possible_len')
        seq_len = max_possible_len
    elif early_stopping not in (False, "never"):
        raise ValueError(f'early_stopping must be True, False or "never", got {early_stopping!r}')
    best_attainable = beam_search_score(best_running_cumulative_logprob, seq_len, length_penalty)
    return worst_finished_score >= best_attainable
