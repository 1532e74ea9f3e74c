"""The engine's sampling step without a model, for scheduler tests: each sequence that needs
logits gets a made-up token and is finished when its stop rule says so; and the queue invariant
those tests check after every step."""

from __future__ import annotations

from minipaged.sampling.stopping import check_stop
from minipaged.sched.base import Scheduler, SchedulerOutput


def sample_made_up_tokens(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """Append a token (a function of the sequence's length) to every sequence of `out` that
    produces one this step, and finish those whose stop rule (max_tokens, ...) now holds."""
    sampling = [item for item in out.scheduled if item.needs_logits]
    for group, seq in scheduler.resolve(sampling):
        seq.append_token(3 + seq.get_len() % 11, -0.5)
        decision = check_stop(seq, group.sampling_params)
        if decision is not None:
            seq.finish(decision)


def assert_queues_follow_status(scheduler: Scheduler) -> None:
    """Every unfinished group sits in exactly one queue: the one of its sequences' status
    (`Scheduler.states`)."""
    seen = []
    for status, state in scheduler.states.items():
        for group in state.queue:
            assert {s.status for s in group.get_unfinished_seqs()} == {status}, group
            seen.append(group.request_id)
    assert len(seen) == len(set(seen))
