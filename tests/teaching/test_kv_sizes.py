"""KV bytes per token and the batch memory allows, against the vLLM paper's own figures."""

from __future__ import annotations

import pytest

from teaching.kv_sizes import (
    OPT_13B,
    OPT_13B_A100_CACHE_TOKENS,
    kv_bytes_per_token,
    requests_that_fit,
    thousands,
)


def test_opt_13b_keeps_800_kb_per_token_as_the_paper_says():
    per_token = kv_bytes_per_token(OPT_13B.num_layers, OPT_13B.num_kv_heads, OPT_13B.head_dim, 2)
    assert per_token == 2 * 40 * 5120 * 2 == 819_200  # "800 KB" (§3)


def test_the_bundled_models_shape():
    assert kv_bytes_per_token(30, 3, 64, 4) == 46_080  # SmolLM2-135M in float32


def test_requests_that_fit():
    assert requests_that_fit(15_000, 2048) == 7
    assert requests_that_fit(15_000, 500) == 30
    assert requests_that_fit(-5, 10) == 0
    with pytest.raises(ValueError, match="tokens_per_request"):
        requests_that_fit(10, 0)
    with pytest.raises(ValueError, match="head_dim"):
        kv_bytes_per_token(1, 1, 0, 2)


def test_the_one_opt_13b_cache_figure_is_the_papers_15_7k():
    assert OPT_13B_A100_CACHE_TOKENS == 12 * 2**30 // 819_200 == 15_728
    assert thousands(OPT_13B_A100_CACHE_TOKENS) == "15.7K"  # Table 1's "Max. # KV slots"
