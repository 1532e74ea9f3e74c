"""The parts of the llama.cpp peer benchmark that decide its numbers.

* `peers.worker.Peer._fill` is llama.cpp's side of the comparison (continuous batching on the
  C API): replayed with a fake `llama_batch` and fake logits, every request must get its whole
  prompt at positions 0, 1, ... in order, its logits row exactly once per new token, exactly its
  `output_len` tokens, and no call more than `N_BATCH` tokens (hypothesis over request sets).
* `peers.llamacpp.agreement`: identical requests and the tokens before the first difference.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parents[3] / "benchmarks"))

from peers import worker  # noqa: E402
from peers.llamacpp import agreement  # noqa: E402
from peers.worker import N_BATCH, Peer, Sequence  # noqa: E402


class FakeBatch(SimpleNamespace):
    """A `llama_batch` of `N_BATCH` rows: the fields `_fill` writes, as Python lists."""

    def __init__(self) -> None:
        super().__init__(token=[0] * N_BATCH, pos=[0] * N_BATCH, n_seq_id=[0] * N_BATCH,
                         seq_id=[[0] for _ in range(N_BATCH)], logits=[False] * N_BATCH,
                         n_tokens=0)


def serve(requests: list[tuple[list[int], int]]) -> tuple[list[Sequence], list[list[tuple]]]:
    """`Peer.run`'s loop with the model replaced by `next token = 1000 + position`; returns the
    sequences and, per call, each row's (seq_id, token, pos, logits)."""
    seqs = [Sequence(i, p, n) for i, (p, n) in enumerate(requests)]
    batch, calls = FakeBatch(), []
    while not all(s.done for s in seqs):
        rows = Peer._fill(batch, seqs)
        assert 0 < batch.n_tokens == len(rows) <= N_BATCH
        calls.append([(batch.seq_id[i][0], batch.token[i], batch.pos[i], batch.logits[i])
                      for i in range(batch.n_tokens)])
        for i, (seq, _) in enumerate(rows):
            assert (seq is not None) == batch.logits[i]
            if seq is not None:
                seq.tokens.append(1000 + batch.pos[i])
        assert len(calls) < 10_000, "no progress"
    return seqs, calls


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3000), st.integers(1, 40)), min_size=1, max_size=12))
def test_every_request_gets_its_prompt_in_order_and_exactly_its_tokens(lengths):
    requests = [([10 * i + j for j in range(p)], n) for i, (p, n) in enumerate(lengths)]
    seqs, calls = serve(requests)
    for seq, (prompt, n) in zip(seqs, requests, strict=True):
        rows = [r for call in calls for r in call if r[0] == seq.seq_id]
        assert [r[2] for r in rows] == list(range(len(prompt) + n - 1))  # positions in order
        assert [r[1] for r in rows[:len(prompt)]] == prompt
        # each generated token is fed back as the next input, at the next position
        assert [r[1] for r in rows[len(prompt):]] == seq.tokens[:-1]
        assert seq.tokens == [1000 + pos for pos in range(len(prompt) - 1, len(prompt) + n - 1)]
        assert [r[3] for r in rows] == [False] * (len(prompt) - 1) + [True] * n
    for call in calls:  # a sequence that generates puts exactly one token in a call
        decoding = [r[0] for r in call if r[2] >= len(requests[r[0]][0])]
        assert len(decoding) == len(set(decoding))


def test_a_prompt_longer_than_a_batch_is_fed_in_chunks_of_n_batch():
    _, calls = serve([(list(range(N_BATCH + 5)), 2)])
    assert [len(c) for c in calls] == [N_BATCH, 5, 1]


def test_the_worker_imports_neither_torch_nor_minipaged():
    """It runs in the peer's own environment, which has neither."""
    tree = ast.parse(Path(worker.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import | ast.ImportFrom)
                for alias in (node.names if isinstance(node, ast.Import)
                              else [SimpleNamespace(name=node.module or "")])}
    assert "llama_cpp" in imported and not imported & {"torch", "minipaged"}
    # its folder is first on its path: a module there named like the package would shadow it
    assert not (Path(worker.__file__).parent / "llama_cpp.py").exists()


def test_agreement_counts_identical_requests_and_tokens_before_the_first_difference():
    reference = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10]]
    result = agreement([[1, 2, 3, 4], [5, 0], [0, 8, 9, 10]], reference)
    assert result == {"identical_requests": "1/3", "tokens_before_first_difference": 0.5}
