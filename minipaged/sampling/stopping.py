"""When a sequence is finished: EOS, stop tokens, stop strings, `max_tokens` and the context.

`check_stop` is the rule (vLLM v0's order), a pure function of the sequence after its last
`append_token`; `finish_if_stopped` applies it. The engine calls it for every sampled token, and
the simulator for every made-up one, so both stop sequences at the same step.
"""

from __future__ import annotations

from collections.abc import Collection

from minipaged.sampling.params import SamplingParams
from minipaged.sampling.sequence import Sequence, SequenceStatus, StopDecision


def check_stop(
    seq: Sequence,
    params: SamplingParams,
    eos_token_ids: Collection[int] = (),
    max_model_len: int | None = None,
) -> StopDecision | None:
    """Whether `seq` is finished after its last `append_token`; None if it goes on.

    In order (as vLLM v0): a sequence that fills the model's context stops ("length") whatever
    else; before `min_tokens` output tokens nothing else stops it; then EOS (unless
    `ignore_eos`) or a token of `stop_token_ids` stops it, their text removed; then a stop string
    anywhere in the text the last token completed -- also one that began in earlier tokens --
    stops it, the text cut where the stop string begins; finally `max_tokens` ("length").
    """
    if max_model_len is not None and len(seq.token_ids) >= max_model_len:
        return StopDecision(SequenceStatus.FINISHED_LENGTH_CAPPED)
    num_output = len(seq.token_ids) - seq.num_prompt_tokens
    if num_output == 0:
        return None
    if num_output >= params.min_tokens:
        last = seq.token_ids[-1]
        text_without_last = len(seq.output_text) - seq.new_char_count
        if (not params.ignore_eos and last in eos_token_ids) or last in params.stop_token_ids:
            return StopDecision(SequenceStatus.FINISHED_STOPPED, last, text_without_last)
        found = params.stop and find_stop_string(seq.output_text, seq.new_char_count, params.stop)
        if found:
            stop, index = found
            return StopDecision(SequenceStatus.FINISHED_STOPPED, stop, index)
    if num_output >= params.max_tokens:
        return StopDecision(SequenceStatus.FINISHED_LENGTH_CAPPED)
    return None


def finish_if_stopped(
    seq: Sequence,
    params: SamplingParams,
    eos_token_ids: Collection[int] = (),
    max_model_len: int | None = None,
) -> bool:
    """Apply `check_stop` to `seq`; True when it finished. Every sampled token goes through
    this, in the engine and in the simulator alike."""
    if (decision := check_stop(seq, params, eos_token_ids, max_model_len)) is not None:
        seq.finish(decision)
    return decision is not None


def find_stop_string(
    text: str, new_char_count: int, stops: Collection[str]
) -> tuple[str, int] | None:
    """The earliest stop string that ends within the last `new_char_count` characters of `text`.

    Earlier text was checked when it arrived, so only matches that end in the new characters are
    new; they may begin before them (a stop string split across tokens). Returns the stop string
    and where it begins, or None.
    """
    if new_char_count <= 0 or not stops:
        return None
    first_new = len(text) - new_char_count
    found = [(stop, text.find(stop, max(0, first_new - len(stop) + 1))) for stop in stops]
    return min((f for f in found if f[1] != -1), key=lambda f: f[1], default=None)
