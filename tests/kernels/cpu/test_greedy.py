"""The greedy kernel (`greedy_tokens`) against PyTorch's argmax and log_softmax.

Hypothesis draws batches of logits from tiny to large magnitudes, with ties for the largest
value (the kernel must take the first, as argmax does), and NaNs and infinities, which the
kernel leaves to the sampler's general path by answering None.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.kernels.cpu.greedy import greedy_tokens, greedy_tokens_available


def test_the_kernel_is_built_on_this_machine():
    assert greedy_tokens_available()


@given(rows=st.integers(1, 5), vocab=st.sampled_from([1, 2, 17, 64, 1000, 49152]),
       scale=st.sampled_from([1e-3, 1.0, 30.0, 1e4]), ties=st.booleans(),
       seed=st.integers(0, 2**16))
@settings(max_examples=40, deadline=None)
def test_equals_argmax_and_log_softmax(rows, vocab, scale, ties, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * scale
    if ties and vocab > 2:  # the largest value twice, the later copy first in no way
        top = logits.max(dim=-1, keepdim=True).values
        logits[:, vocab // 2] = top[:, 0]
        logits[:, vocab - 1] = top[:, 0]
    chosen = greedy_tokens(logits)
    assert chosen is not None
    token_ids, logprobs = chosen
    assert token_ids.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert torch.equal(token_ids, logits.argmax(dim=-1))
    reference = torch.log_softmax(logits.double(), dim=-1)
    for row, (token, logprob) in enumerate(zip(token_ids.tolist(), logprobs.tolist(),
                                               strict=True)):
        assert math.isclose(logprob, float(reference[row, token]), rel_tol=1e-5, abs_tol=1e-6)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_row_with_a_nan_or_an_infinity_is_left_to_the_general_path(bad):
    logits = torch.randn(3, 50)
    logits[1, 7] = bad
    assert greedy_tokens(logits) is None


def test_it_refuses_logits_it_cannot_read():
    with pytest.raises(ValueError, match="contiguous float32"):
        greedy_tokens(torch.randn(2, 8).bfloat16())
    with pytest.raises(ValueError, match="contiguous float32"):
        greedy_tokens(torch.randn(8, 2).t())
