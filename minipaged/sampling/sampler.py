"""The batched sampler: one row of logits per sequence in, one token per sequence out.

It follows the order of vLLM's sampler so that the knobs of `SamplingParams` mean what vLLM
users expect:

1. bans (stop tokens before `min_tokens` are reached),
2. penalties: repetition (over prompt + output), then frequency and presence (over the output),
3. greedy rows take the argmax here; random rows go on with
4. temperature, 5. top-k, 6. top-p, 7. min-p, 8. a draw from the remaining distribution.

Everything is vectorised over the batch; the only Python loop over rows draws the random noise
of seeded rows from their own `torch.Generator`, which is what makes a seeded request give the
same tokens whichever other requests share its batch.

No row's settings can make the sampler raise, whatever `SamplingParams` lets through: each
setting enters its tensor within what that tensor holds (`top_k` cut to the vocabulary,
temperature and repetition penalty to float32's positive range), a banned id outside the
vocabulary bans nothing, and the logits stay computable (`finite_logits`): an extreme penalty or
temperature can push a logit to +-inf, a row that bans every token leaves none to draw.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from minipaged.sampling.params import MAX_SEED, SamplingParams

# --- data types --------------------------------------------------------------------------------


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of the logits.

    `generator` is the row's own generator (seeded requests); None draws from the sampler's
    generator. `banned_token_ids` are forced to probability 0 (see `min_tokens_banned_ids`).
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    generator: torch.Generator | None = None
    banned_token_ids: Sequence[int] = ()


@dataclass
class SamplerOutput:
    """The sampled tokens of one step, row for row.

    `top_token_ids` / `top_logprobs` hold the `K` most likely tokens of every row, where `K` is the
    largest `logprobs` asked for in the batch (None when no row asked); `to_host` cuts each
    row's share.
    """

    token_ids: Tensor  # [B] int64
    logprobs: Tensor  # [B] float32, log-probability of the sampled token
    top_token_ids: Tensor | None = None  # [B, K] int64
    top_logprobs: Tensor | None = None  # [B, K] float32
    num_logprobs: list[int | None] = field(default_factory=list)  # per row, as asked

    def to_host(self) -> list[tuple[int, float, dict[int, float] | None]]:
        """Each row's sampled token, its log-probability and vLLM's per-token logprobs (the
        row's top `logprobs` alternatives plus the sampled token; None when the row did not ask
        for logprobs), on the host: the tokens and log-probabilities in one device-to-host copy
        (float64 holds every token id and float32 exactly), the alternatives in a second one,
        only when a row asked for them."""
        ids, logprobs = torch.stack((self.token_ids.double(), self.logprobs.double())).tolist()
        top_ids = top_logprobs = [[]] * len(ids)  # no row asked for alternatives
        if self.top_token_ids is not None and self.top_logprobs is not None:
            top_ids, top_logprobs = self.top_token_ids.tolist(), self.top_logprobs.tolist()
        rows = []
        for row, k in enumerate(self.num_logprobs):
            token, alternatives = int(ids[row]), None
            if k is not None:
                alternatives = dict(zip(top_ids[row][:k], top_logprobs[row][:k], strict=True))
                alternatives[token] = logprobs[row]
            rows.append((token, logprobs[row], alternatives))
        return rows


# --- seeds and bans ----------------------------------------------------------------------------


def derive_seed(seed: int, sample_index: int) -> int:
    """The seed of sample `sample_index` of a request seeded with `seed`.

    Sample 0 uses `seed` itself, so the first sample of an `n > 1` request equals the same request
    with `n = 1`; the others get distinct, well-mixed seeds (SplitMix64 of the pair).
    """
    if sample_index == 0:
        return seed
    x = (seed + 0x9E3779B97F4A7C15 * sample_index) % MAX_SEED
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % MAX_SEED
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % MAX_SEED
    return x ^ (x >> 31)


def make_generator(
    seed: int, sample_index: int = 0, device: torch.device | str = "cpu"
) -> torch.Generator:
    """The random generator of one sample of a seeded request, on the device of the logits it
    draws noise for: the noise is drawn where the logits are, with no copy and no sync (a seed
    then means the same draws on one kind of device, as in vLLM)."""
    return torch.Generator(device=device).manual_seed(derive_seed(seed, sample_index))


def min_tokens_banned_ids(
    params: SamplingParams, num_output_tokens: int, eos_token_ids: Collection[int]
) -> list[int]:
    """The tokens that may not be sampled yet: every stop token while `min_tokens` is unmet.

    EOS counts as a stop token unless `ignore_eos` (then it is an ordinary token).
    """
    if num_output_tokens >= params.min_tokens:
        return []
    banned = list(params.stop_token_ids)
    if not params.ignore_eos:
        banned += [t for t in eos_token_ids if t not in banned]
    return banned


# --- logits processing: each takes [B, V] logits and returns new [B, V] logits ---------------


def apply_bans(logits: Tensor, banned: Sequence[Sequence[int]]) -> Tensor:
    """Set the banned tokens of each row to -inf (ids outside the vocabulary ban nothing)."""
    vocab_size = logits.shape[1]
    pairs = [(i, t) for i, ids in enumerate(banned) for t in ids if 0 <= t < vocab_size]
    if not pairs:
        return logits
    rows, cols = torch.tensor(pairs).to(logits.device, non_blocking=True).T
    out = logits.clone()
    out[rows, cols] = -math.inf
    return out


def token_counts(token_ids: Sequence[Sequence[int]], vocab_size: int, device) -> Tensor:
    """How often each token occurs in each row's history: [B, V] int64."""
    batch = len(token_ids)
    longest = max((len(ids) for ids in token_ids), default=0)
    counts = torch.zeros(batch, vocab_size + 1, dtype=torch.int64, device=device)
    # Pad with the extra column `vocab_size`, counted and then dropped.
    padded = torch.full((batch, longest), vocab_size, dtype=torch.int64)
    for i, ids in enumerate(token_ids):
        if len(ids):
            row = torch.as_tensor(list(ids), dtype=torch.int64)
            if int(row.min()) < 0 or int(row.max()) >= vocab_size:
                raise ValueError(f"token ids in row {i}'s history must lie in [0, {vocab_size})")
            padded[i, : len(ids)] = row
    padded = padded.to(device, non_blocking=True)
    counts.scatter_add_(1, padded, torch.ones_like(padded))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    presence_penalty: Tensor,
    frequency_penalty: Tensor,
    repetition_penalty: Tensor,
) -> Tensor:
    """vLLM's penalties: per-row values [B] (0, 0, 1 = none).

    Repetition (Keskar et al., CTRL): a token seen in the prompt or the output has its logit
    divided by the penalty when positive and multiplied by it when negative. Frequency and
    presence (OpenAI): subtract `frequency * count + presence * (count > 0)`, counting only the
    output.
    """
    vocab_size = logits.shape[1]
    output_counts = token_counts(output_token_ids, vocab_size, logits.device)
    prompt_seen = token_counts(prompt_token_ids, vocab_size, logits.device) > 0
    rep = repetition_penalty[:, None].to(logits.device, logits.dtype, non_blocking=True)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    out = torch.where(prompt_seen | (output_counts > 0), penalised, logits)
    frequency = frequency_penalty[:, None].to(logits.device, logits.dtype, non_blocking=True)
    presence = presence_penalty[:, None].to(logits.device, logits.dtype, non_blocking=True)
    out = out - frequency * output_counts.to(logits.dtype)
    return out - presence * (output_counts > 0).to(logits.dtype)


def apply_temperature(logits: Tensor, temperature: Tensor) -> Tensor:
    """Divide each row by its temperature [B] (the caller keeps temperature-0 rows out)."""
    return logits / temperature[:, None].to(logits.device, logits.dtype, non_blocking=True)


def apply_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Keep each row's `top_k` [B] highest logits (0 = all), then its nucleus of mass `top_p` [B].

    The nucleus (Holtzman et al., "The Curious Case of Neural Text Degeneration") is the shortest
    run of most likely tokens whose probability, renormalised after top-k, reaches `top_p`: a
    token survives when the tokens ranked before it hold less than `top_p`. The most likely token
    always survives. Ties are broken by token id (a stable sort), so exactly `top_k` survive.
    """
    vocab_size = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab_size, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), vocab_size)
    k = k.to(logits.device, non_blocking=True)
    sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], -math.inf)

    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    p = top_p.to(logits.device, logits.dtype, non_blocking=True)[:, None]
    sorted_logits = sorted_logits.masked_fill((mass_before >= p) & (p < 1.0), -math.inf)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens less likely than `min_p` [B] times the row's most likely token."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.to(logits.device, probs.dtype, non_blocking=True)[:, None]
    threshold = threshold * probs.max(dim=-1, keepdim=True)[0]
    return logits.masked_fill(probs < threshold, -math.inf)


def finite_logits(logits: Tensor, fallback: Tensor, ask_host: bool = True) -> Tensor:
    """`logits` that softmax can take: NaN becomes -inf, +inf the largest finite value, and a
    row with no finite logit left (every token banned, or pushed to -inf) takes its `fallback`
    row. Finite logits and -inf (a banned or cut token) stay as they are.

    Every row's maximum is finite exactly when there is nothing to do (a NaN makes it NaN, a +inf
    makes it +inf, a row of -inf makes it -inf): with `ask_host` (where the host reads the
    device's values for free: a CPU) that one reduction decides whether the passes over the
    logits run at all (1 ms on [64, 49152] where one pass takes 30 ms). Without, the passes
    always run and no value leaves the device: on a GPU they cost less than the sync.
    """
    if ask_host and bool(logits.amax(dim=-1).isfinite().all()):
        return logits
    top = torch.finfo(logits.dtype).max
    out = logits.nan_to_num(nan=-math.inf, posinf=top, neginf=-math.inf)
    dead = out.amax(dim=-1, keepdim=True) == -math.inf  # no finite logit left in the row
    return torch.where(dead, fallback.nan_to_num(nan=0.0, posinf=top, neginf=-top), out)


# --- the sampler -------------------------------------------------------------------------------


@dataclass(eq=False)
class Sampler:
    """Samples one token per row of a [B, V] logits batch; see the module docstring for the order.

    The unseeded random rows draw from `generator`, which must live on the logits' device;
    with a `seed`, it is made on the logits' device at its first use there (`generator_on`;
    both None: torch's default generator of that device). Seeded rows'
    generators live on the logits' device too (`make_generator`). `greedy_tokens`, a platform's
    (`minipaged.platforms.Platform.greedy_tokens`), takes batches of plain greedy rows in one
    call: each row's argmax and its log-probability, or None to leave them to PyTorch.
    """

    generator: torch.Generator | None = None
    greedy_tokens: Callable[[Tensor], tuple[Tensor, Tensor] | None] | None = None
    seed: int | None = None
    # Whether the host reads the logits' values for free (`Platform.host_reads_free`): where
    # not, nothing but `SamplerOutput.to_host` waits for the device.
    host_reads_free: bool = True

    def generator_on(self, device: torch.device) -> torch.Generator | None:
        """The generator of the unseeded random rows of logits on `device` (class docstring)."""
        if self.seed is not None and (self.generator is None or self.generator.device != device):
            self.generator = torch.Generator(device=device).manual_seed(self.seed)
        return self.generator

    def __call__(self, logits: Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        greedy = self._greedy_only(logits, rows)
        if greedy is not None:
            return greedy
        processed = self.process_logits(logits, rows)
        logprobs = torch.log_softmax(processed, dim=-1)
        token_ids = processed.argmax(dim=-1)

        random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
        if random_rows:
            token_ids[random_rows] = self._sample_random(
                processed[random_rows], [rows[i] for i in random_rows]
            )

        out = SamplerOutput(token_ids, logprobs.gather(1, token_ids[:, None])[:, 0],
                            num_logprobs=[row.params.logprobs for row in rows])
        max_k = max(filter(None, out.num_logprobs), default=0)  # None and 0 list none
        if max_k > 0:
            top = logprobs.topk(min(max_k, logprobs.shape[1]), dim=-1)
            out.top_logprobs, out.top_token_ids = top.values, top.indices
        return out

    def _greedy_only(self, logits: Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput | None:
        """The output of a batch of greedy rows with nothing to ban or penalise and no top
        logprobs to list, from the platform's `greedy_tokens` (the same tokens, the
        log-probabilities up to a sum's order); None where that does not apply, for the
        PyTorch path."""
        if (self.greedy_tokens is None or logits.dim() != 2 or logits.shape[0] != len(rows)
                or not rows):
            return None
        if any(not row.params.greedy or row.banned_token_ids or row.params.has_penalties
               or (row.params.logprobs or 0) > 0 for row in rows):
            return None
        chosen = self.greedy_tokens(logits)
        if chosen is None:  # a NaN or an infinity: `finite_logits` decides
            return None
        return SamplerOutput(*chosen, num_logprobs=[row.params.logprobs for row in rows])

    def process_logits(self, logits: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
        """Bans and penalties: the logits every row's choice and reported logprobs start from."""
        if logits.ndim != 2 or not logits.is_floating_point():
            raise ValueError(f"logits must be a float [B, V] tensor, got {tuple(logits.shape)}")
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} rows of logits but {len(rows)} sampling rows")
        raw = logits.float()
        logits = apply_bans(raw, [row.banned_token_ids for row in rows])
        if any(row.params.has_penalties for row in rows):
            logits = apply_penalties(
                logits,
                [row.prompt_token_ids for row in rows],
                [row.output_token_ids for row in rows],
                self._column(rows, "presence_penalty"),
                self._column(rows, "frequency_penalty"),
                self._column(rows, "repetition_penalty", positive=True),
            )
        return finite_logits(logits, raw, self.host_reads_free)

    def beam_logprobs(self, logits: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
        """[B, V] log-probabilities that beam search extends its beams with."""
        return torch.log_softmax(self.process_logits(logits, rows), dim=-1)

    def _sample_random(self, logits: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
        scaled = apply_temperature(logits, self._column(rows, "temperature", positive=True))
        logits = finite_logits(scaled, logits, self.host_reads_free)
        if any(row.params.top_k > 0 or row.params.top_p < 1.0 for row in rows):
            top_k = torch.tensor([min(row.params.top_k, logits.shape[1]) for row in rows])
            top_p = self._column(rows, "top_p", positive=True)
            logits = apply_top_k_top_p(logits, top_k, top_p)
        if any(row.params.min_p > 0.0 for row in rows):
            logits = apply_min_p(logits, self._column(rows, "min_p"))
        probs = logits.softmax(dim=-1)
        return (probs / self._exponential_noise(probs, rows)).argmax(dim=-1)

    def _exponential_noise(self, probs: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
        """q ~ Exp(1), one per entry: argmax(p / q) is then a draw from p (the "exponential race":
        the first of independent Exp(p_i)-clocks to ring is token i with probability p_i).

        Seeded rows draw from their own generator, so their draws do not depend on the batch.
        """
        noise = torch.empty_like(probs).exponential_(generator=self.generator_on(probs.device))
        for i, row in enumerate(rows):
            if row.generator is not None:
                noise[i].exponential_(generator=row.generator)
        # Exp(1) can return 0.0 in floating point; keep the division finite.
        return noise.clamp_(min=torch.finfo(probs.dtype).tiny)

    @staticmethod
    def _column(rows: Sequence[SamplingRow], name: str, positive: bool = False) -> Tensor:
        """The float32 [B] column of setting `name`, each value clamped into float32's finite
        range (`positive`: its positive range, so that a value that is > 0 stays > 0)."""
        info = torch.finfo(torch.float32)
        values = [float(getattr(row.params, name)) for row in rows]
        column = torch.tensor(values, dtype=torch.float64)
        return column.clamp(info.tiny if positive else -info.max, info.max).float()
