"""Dense reference generation: the oracle that the paged engine is tested against.

`DenseKVCache` keeps each sequence's keys and values in one contiguous row of a preallocated
tensor per layer: the "reserve the maximum" cache that the vLLM paper measures paging against
(Kwon et al., SOSP'23, section 3). `DenseAttentionBackend` is the models' `AttentionBackend`
over it: prompt steps attend each sequence with the attention contract's `dense_attention`,
decode steps the whole batch at once with `decode_attention`, the same sums. `generate_dense`
runs greedy generation through it, simple enough to trust on sight; the engine must reproduce
it token for token.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from minipaged.attention.contract import dense_attention
from minipaged.models.layers import CausalLM


@dataclass
class DenseKVCache:
    """Keys and values of every sequence in contiguous memory: one row per sequence.

    This is the cache that the vLLM paper measures paging against (Kwon et al., SOSP'23,
    section 3): each sequence reserves a contiguous chunk of `capacity` token slots up front,
    used or not. Layer `l` holds `keys[l]` and `values[l]`, each `[rows, H_kv, capacity, D]`;
    sequence `s` owns row `row_of[s]`, and its `j`-th token sits at `[row, :, j]`. The unused
    tail of a row is the internal fragmentation (and the spare rows the reservation) that paged
    blocks avoid. What the reservation buys is simplicity: new keys are written in place, and a
    decode step attends a plain view of the rows, with no copying. Heads come before positions
    so that each (sequence, KV head) pair's keys form one `[capacity, D]` matrix, which is what
    the batched matmul in `decode_attention` reads (Hugging Face's cache uses the same order).

    `max_seq_len` and `max_num_seqs` size the tensors when known (`generate_dense` passes the
    longest prompt plus `max_new_tokens`, and the number of prompts). They are hints, not limits:
    a layer whose tensor is too small doubles it. A freed sequence's row is reused, lowest first;
    its stale keys stay behind the new sequence's length, where nothing reads them.
    """

    num_layers: int
    max_seq_len: int = 0
    max_num_seqs: int = 0
    keys: list[Tensor | None] = field(init=False)
    values: list[Tensor | None] = field(init=False)
    row_of: dict[int, int] = field(init=False, default_factory=dict)
    # Tokens cached per layer, indexed by row: lengths[layer][row].
    lengths: list[list[int]] = field(init=False)
    free_rows: list[int] = field(init=False, default_factory=list)  # a heap: lowest row first

    def __post_init__(self) -> None:
        if self.num_layers <= 0:
            raise ValueError(f"num_layers must be positive, got {self.num_layers}")
        if self.max_seq_len < 0 or self.max_num_seqs < 0:
            raise ValueError(f"capacity hints must be >= 0, got max_seq_len={self.max_seq_len}, "
                             f"max_num_seqs={self.max_num_seqs}")
        self.keys = [None] * self.num_layers
        self.values = [None] * self.num_layers
        self.lengths = [[] for _ in range(self.num_layers)]

    def row(self, seq_id: int) -> int:
        """The row of `seq_id`, reserving the lowest free one on its first use."""
        if seq_id not in self.row_of:
            if self.free_rows:
                row = heapq.heappop(self.free_rows)
            else:
                row = len(self.lengths[0])
                for layer_lengths in self.lengths:
                    layer_lengths.append(0)
            self.row_of[seq_id] = row
        return self.row_of[seq_id]

    def length(self, seq_id: int) -> int:
        """Number of tokens cached for `seq_id` (those of the last layer; 0 if unknown)."""
        row = self.row_of.get(seq_id)
        return 0 if row is None else self.lengths[-1][row]

    def append(self, seq_id: int, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write `k`, `v [n, H_kv, D]` after sequence `seq_id`'s cached tokens of layer `layer_idx`.

        Returns views of the sequence's whole K and V for that layer, `[L, H_kv, D]`.
        """
        row = self.row(seq_id)
        start = self.lengths[layer_idx][row]
        end = start + k.shape[0]
        self._reserve(layer_idx, row + 1, end, k)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[row, :, start:end] = k.transpose(0, 1)
        values[row, :, start:end] = v.transpose(0, 1)
        self.lengths[layer_idx][row] = end
        return keys[row, :, :end].transpose(0, 1), values[row, :, :end].transpose(0, 1)

    def append_one_each(self, layer_idx: int, rows: Sequence[int], k: Tensor, v: Tensor) -> None:
        """Write one token per row, `k[i]`, `v[i] [H_kv, D]` after row `rows[i]`'s cached tokens
        of layer `layer_idx`: one indexed write for the whole batch (a decode step)."""
        lengths = self.lengths[layer_idx]
        positions = [lengths[row] for row in rows]
        self._reserve(layer_idx, max(rows) + 1, max(positions) + 1, k)
        index = (torch.tensor(rows, device=k.device), slice(None),
                 torch.tensor(positions, device=k.device))
        self.keys[layer_idx][index] = k
        self.values[layer_idx][index] = v
        for row in rows:
            lengths[row] += 1

    def free(self, seq_id: int) -> None:
        """Forget `seq_id`; its row goes back to the free rows (a no-op for an unknown id)."""
        row = self.row_of.pop(seq_id, None)
        if row is not None:
            for layer_lengths in self.lengths:
                layer_lengths[row] = 0
            heapq.heappush(self.free_rows, row)

    def _reserve(self, layer_idx: int, num_rows: int, seq_len: int, like: Tensor) -> None:
        """Make layer `layer_idx`'s tensors hold at least `num_rows` rows of `seq_len` tokens,
        allocating them (shaped after `like [n, H_kv, D]`) or doubling what is too small."""
        old = self.keys[layer_idx]
        if old is not None and old.shape[0] >= num_rows and old.shape[2] >= seq_len:
            return
        if old is None:
            rows, capacity = max(num_rows, self.max_num_seqs), max(seq_len, self.max_seq_len)
        else:
            rows = max(num_rows, old.shape[0] if old.shape[0] >= num_rows else 2 * old.shape[0])
            capacity = max(seq_len, old.shape[2] if old.shape[2] >= seq_len else 2 * old.shape[2])
        shape = (rows, like.shape[1], capacity, like.shape[2])
        # Zeros, not empty: a masked-out slot gets weight 0, and 0 * garbage could be NaN.
        for tensors in (self.keys, self.values):
            new = like.new_zeros(shape)
            if old is not None:
                new[:old.shape[0], :, :old.shape[2]] = tensors[layer_idx]
            tensors[layer_idx] = new


class DenseAttentionBackend:
    """`AttentionBackend` over a `DenseKVCache` for one step of a flat batch.

    The flat batch holds `query_lens[i]` new tokens of sequence `seq_ids[i]`, in that order (the
    same layout as `AttentionMetadata.query_start_loc`). A step with a prompt in it attends each
    sequence on its own with the oracle, `dense_attention`. A decode step (one new token per
    sequence) writes all new keys with one indexed write and attends every sequence at once with
    `decode_attention`, over a view of the cache's rows: the same sums, no Python loop and no
    copy of the cache.
    """

    def __init__(self, cache: DenseKVCache, seq_ids: Sequence[int], query_lens: Sequence[int]):
        if len(seq_ids) != len(query_lens):
            raise ValueError(f"{len(seq_ids)} sequence ids but {len(query_lens)} query lengths")
        if any(n <= 0 for n in query_lens):
            raise ValueError(f"every sequence needs at least one new token, got {list(query_lens)}")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a sequence appears twice in one step: {list(seq_ids)}")
        self.cache = cache
        self.seq_ids = list(seq_ids)
        self.query_lens = list(query_lens)
        self.num_tokens = sum(self.query_lens)
        self.is_decode = all(n == 1 for n in self.query_lens)
        if self.is_decode:
            self._plan_decode()

    def _plan_decode(self) -> None:
        """What every layer of a decode step shares: each sequence's row, the rows attended
        (0 up to the highest one in the step), and their context lengths after this step."""
        self.rows = [self.cache.row(s) for s in self.seq_ids]
        self.num_rows = max(self.rows) + 1
        # Sequence i ends up with cache.length(i) + 1 tokens. A row in the view but not in this
        # step is attended over its first slot only, and its output dropped.
        self.row_lengths = [1] * self.num_rows
        for seq_id, row in zip(self.seq_ids, self.rows, strict=True):
            self.row_lengths[row] = self.cache.length(seq_id) + 1
        self.max_len = max(self.row_lengths)
        self._index: tuple[Tensor, Tensor] | None = None  # rows and row_lengths, on q's device

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        if q.shape[0] != self.num_tokens:
            raise ValueError(f"{q.shape[0]} query tokens but query_lens sum to {self.num_tokens}")
        if self.is_decode:
            return self._decode(layer_idx, q, k, v, scale)
        outputs = []
        pieces = zip(self.seq_ids, *(t.split(self.query_lens) for t in (q, k, v)), strict=True)
        for seq_id, q_seq, k_seq, v_seq in pieces:
            keys, values = self.cache.append(seq_id, layer_idx, k_seq, v_seq)
            outputs.append(dense_attention(q_seq, keys, values, scale))
        return torch.cat(outputs)

    def _decode(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        if self._index is None:
            self._index = (torch.tensor(self.rows, device=q.device),
                           torch.tensor(self.row_lengths, device=q.device))
        rows, row_lengths = self._index
        self.cache.append_one_each(layer_idx, self.rows, k, v)
        view = (slice(0, self.num_rows), slice(None), slice(0, self.max_len))
        keys, values = self.cache.keys[layer_idx][view], self.cache.values[layer_idx][view]
        # Each query into its sequence's row; rows not in this step get zeros, dropped after.
        q_rows = q.new_zeros(self.num_rows, *q.shape[1:]).index_copy_(0, rows, q)
        return decode_attention(q_rows, keys, values, row_lengths, scale)[rows]


def decode_attention(q: Tensor, keys: Tensor, values: Tensor, lengths: Tensor,
                     scale: float) -> Tensor:
    """Attention of one new query per sequence over its first `lengths[i]` keys.

    q: `[B, H, D]`, row i the last position of sequence i; keys, values: `[B, H_kv, L, D]`, row i
    sequence i's context in its first `lengths[i]` slots (what follows is ignored); lengths `[B]`.
    Returns `[B, H, D]`, what `dense_attention(q[i:i+1], keys[i, :, :lengths[i]].transpose(0, 1),
    ...)` gives for each i. A query at the last position sees every key of its context, so the
    only mask hides the slots past each length. Query heads are grouped onto their KV head by a
    reshape (GQA, H % H_kv == 0). Computed in float32, returned in q's dtype.
    """
    num_seqs, num_heads, head_dim = q.shape
    if keys.shape[0] != num_seqs or values.shape[0] != num_seqs or lengths.shape != (num_seqs,):
        raise ValueError(f"{num_seqs} queries but {keys.shape[0]} keys, {values.shape[0]} values "
                         f"and {tuple(lengths.shape)} lengths")
    num_kv_heads, max_len = keys.shape[1], keys.shape[2]
    group = num_heads // num_kv_heads
    qg = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = (qg @ keys.float().transpose(-1, -2)) * scale  # [B, H_kv, G, L]
    past_end = torch.arange(max_len, device=q.device)[None, :] >= lengths[:, None]  # [B, L]
    scores = scores.masked_fill(past_end[:, None, None, :], float("-inf"))
    out = torch.softmax(scores, dim=-1) @ values.float()  # [B, H_kv, G, D]
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)




@torch.inference_mode()
def generate_dense(
    model: CausalLM,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_token_ids: Iterable[int] = (),
) -> list[list[int]]:
    """Greedy continuations of `prompts`, with a contiguous KV cache: the engine's oracle.

    Every step runs one flat batch: a whole prompt for a sequence's first step, then its one
    latest token. A sequence stops after `max_new_tokens` tokens or after emitting a token of
    `eos_token_ids` (which is kept in its output, as `transformers`' `generate` does). Returns
    the new tokens of each prompt, in order.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty")
        if len(prompt) + max_new_tokens > model.config.max_position_embeddings:
            raise ValueError(
                f"prompt {i} ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                f"the model's {model.config.max_position_embeddings} positions"
            )
    eos = set(eos_token_ids)
    device = next(model.parameters()).device
    cache = DenseKVCache(model.config.num_layers, max_seq_len=max(map(len, prompts), default=0)
                         + max_new_tokens, max_num_seqs=len(prompts))
    outputs: list[list[int]] = [[] for _ in prompts]
    pending = {i: list(p) for i, p in enumerate(prompts)} if max_new_tokens > 0 else {}
    while pending:
        seq_ids = list(pending)
        input_ids = [token for i in seq_ids for token in pending[i]]
        positions = [cache.length(i) + j for i in seq_ids for j in range(len(pending[i]))]
        query_lens = [len(pending[i]) for i in seq_ids]
        backend = DenseAttentionBackend(cache, seq_ids, query_lens)
        hidden = model(
            torch.tensor(input_ids, device=device), torch.tensor(positions, device=device), backend
        )
        last = torch.tensor(query_lens, device=device).cumsum(0) - 1
        next_tokens = model.compute_logits(hidden[last]).argmax(-1).tolist()
        for i, token in zip(seq_ids, next_tokens, strict=True):
            outputs[i].append(token)
            if token in eos or len(outputs[i]) == max_new_tokens:
                del pending[i]
                cache.free(i)
            else:
                pending[i] = [token]
    return outputs
