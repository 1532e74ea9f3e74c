"""Layer 8 -- sequences and sampling: `SamplingParams`, the sampler, beam-search scoring,
stop rules, a request's sequences and its outputs.
"""

from __future__ import annotations

from minipaged.sampling.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minipaged.sampling.params import RequestOutputKind, SamplingParams, SamplingType
from minipaged.sampling.sampler import Sampler
from minipaged.sampling.sequence import GroupMember, Sequence, SequenceGroup, SequenceStatus

__all__ = [
    "CompletionOutput",
    "GroupMember",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "Sampler",
    "SamplingParams",
    "SamplingType",
    "Sequence",
    "SequenceGroup",
    "SequenceStatus",
]
