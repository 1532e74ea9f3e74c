"""The engine: model runner + scheduler + sampler behind vLLM's API (`LLMEngine`, `LLM`).

`LLMEngine` is the loop a server would drive: `add_request`, then `step` until nothing is left;
each step schedules, runs one forward pass over the paged KV cache, samples, and returns what
changed. `LLM` is the offline convenience on top: `generate` and `chat` over lists of prompts.

Within a step (DESIGN.md, "The data that flows"):
schedule -> run (swaps, copy-on-write copies, forward) -> record the computed tokens ->
sample (fork parallel samples, advance beams, check stops) -> free what finished -> outputs.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from minipaged.config import ModelConfig
from minipaged.cost_model import CostModel
from minipaged.mlfq import MLFQConfig
from minipaged.runner import BatchEntry, CacheOps, GiB, ModelRunner, num_blocks_for_memory
from minipaged.sampling import (
    Sampler,
    SamplingParams,
    beam_search_candidates,
    beam_search_is_done,
)
from minipaged.scheduler import ScheduledSequence, SchedulerConfig
from minipaged.scheduler_registry import SCHEDULERS, build_scheduler, needs_cost_model
from minipaged.sequence import (
    RequestOutput,
    SequenceGroup,
    SequenceStatus,
    StopDecision,
    check_stop,
)
from minipaged.sequence import (
    Sequence as Seq,
)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# -- configuration --------------------------------------------------------------------------------


@dataclass
class EngineConfig:
    """Everything `LLM(...)` / `LLMEngine.from_pretrained(...)` accepts besides the model path."""

    dtype: str = "float32"
    device: str | None = None  # None: "cuda" when available, else "cpu"
    block_size: int = 16
    num_gpu_blocks: int | None = None  # None: from kv_cache_memory / gpu_memory_utilization
    kv_cache_memory: float = 1.0  # GiB of KV cache on a CPU device
    gpu_memory_utilization: float = 0.9  # fraction of a CUDA device's memory for model + cache
    swap_space: float = 1.0  # GiB of host memory for swapped-out blocks
    num_cpu_blocks: int | None = None  # None: from swap_space
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's own context length
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduler: str = "fcfs"
    # MLFQ schedulers: settings replacing the variant's (`MLFQConfig`), and a ready cost model
    # (`CostModel`) so that the engine need not profile this model at start-up.
    mlfq: MLFQConfig | None = None
    cost_model: CostModel | None = None
    preemption_mode: str | None = None  # None: recompute single sequences, swap groups
    attention_backend: str | None = None  # None: Triton on CUDA, PyTorch elsewhere
    seed: int = 0  # the engine's generator, for requests without a seed of their own

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(
                f"scheduler must be one of {sorted(SCHEDULERS)}, got {self.scheduler!r}"
            )
        if self.mlfq is not None and not needs_cost_model(self.scheduler):
            raise ValueError(f"mlfq settings need an MLFQ scheduler, got {self.scheduler!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# -- the engine -----------------------------------------------------------------------------------


class LLMEngine:
    """Continuous batching over a paged KV cache, one `step()` at a time."""

    def __init__(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        tokenizer: Any | None = None,
        config: EngineConfig | None = None,
    ) -> None:
        self.config = config = config or EngineConfig()
        self.model_config = model_config
        self.tokenizer = tokenizer
        device, dtype = config.torch_device, config.torch_dtype
        self.max_model_len = min(
            config.max_model_len or model_config.max_position_embeddings,
            model_config.max_position_embeddings,
        )
        num_gpu_blocks = config.num_gpu_blocks or self._blocks_that_fit(device, dtype)
        num_cpu_blocks = config.num_cpu_blocks
        if num_cpu_blocks is None:
            num_cpu_blocks = num_blocks_for_memory(
                model_config, config.block_size, dtype, config.swap_space * GiB
            )
        self.runner = ModelRunner(
            model.to(device=device, dtype=dtype).eval(),
            model_config,
            block_size=config.block_size,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks,
            device=device,
            dtype=dtype,
            attention_backend=config.attention_backend,
        )
        cost_model = None
        if needs_cost_model(config.scheduler):
            # Skip-join MLFQ predicts prefill times (FastServe §4.1): given, or measured here.
            cost_model = config.cost_model or CostModel.profile(self.runner)
        self.scheduler = build_scheduler(
            config.scheduler,
            SchedulerConfig(
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                preemption_mode=config.preemption_mode,
            ),
            num_device_blocks=num_gpu_blocks,
            block_size=config.block_size,
            num_host_blocks=num_cpu_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            mlfq=config.mlfq,
            cost_model=cost_model,
        )
        self.kv_cache = self.scheduler.kv_cache
        self.sampler = Sampler(torch.Generator().manual_seed(config.seed))
        self.eos_token_ids = frozenset(model_config.eos_token_ids) | (
            {tokenizer.eos_token_id} if tokenizer and tokenizer.eos_token_id is not None else set()
        )
        self._groups: dict[str, SequenceGroup] = {}
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()

    @classmethod
    def from_pretrained(cls, model: str | Path | None = None, **kwargs: Any) -> LLMEngine:
        """Load a model folder or GGUF file (default: the bundled SmolLM2) with its tokenizer."""
        from minipaged.checkpoint import default_model_path
        from minipaged.model import load_model
        from minipaged.tokenizer import Tokenizer

        config = EngineConfig(**kwargs)
        path = Path(model) if model is not None else default_model_path()
        nn_model, model_config = load_model(path, dtype=config.torch_dtype, device="cpu")
        return cls(nn_model, model_config, Tokenizer.from_pretrained(path), config)

    def _blocks_that_fit(self, device: torch.device, dtype: torch.dtype) -> int:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            budget = free - (1 - self.config.gpu_memory_utilization) * total
        else:
            budget = self.config.kv_cache_memory * GiB
        blocks = num_blocks_for_memory(self.model_config, self.config.block_size, dtype, budget)
        if blocks < 1:
            raise ValueError("no memory left for even one KV block; lower the model size")
        return blocks

    # -- requests ---------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str | None,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request (text, or token ids); return its id. Bad input raises `ValueError`
        naming the problem and leaves the engine untouched."""
        params = sampling_params or SamplingParams()
        request_id = str(next(self._request_ids)) if request_id is None else str(request_id)
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer to detokenize the output")
        seq = Seq(next(self._seq_ids), token_ids, self._detokenizer())
        group = SequenceGroup(request_id, [seq], params, arrival_time, prompt=text)
        self.scheduler.add(group)  # rejects a request that can never fit
        self._groups[request_id] = group
        return request_id

    def _tokenize(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids instead")
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            text: str | None = prompt
        else:
            token_ids, text = [int(t) for t in prompt], None
        if not token_ids:
            raise ValueError("the prompt is empty: it must contain at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return text, token_ids

    def _detokenizer(self) -> Any | None:
        if self.tokenizer is None:
            return None
        from minipaged.tokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(self.tokenizer, skip_special_tokens=True)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and return its blocks; False when it is unknown or already done."""
        group = self.scheduler.abort(str(request_id))
        if group is None:
            return False
        group.metrics.finished_time = time.monotonic()
        self._groups.pop(group.request_id, None)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    # -- one step ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, compute and sample one step; return the requests that got new tokens."""
        out = self.scheduler.schedule(time.monotonic())
        entries = [
            BatchEntry(
                s.token_ids, s.start, self.kv_cache.block_table(s.seq.seq_id), s.needs_logits
            )
            for s in out.scheduled
        ]
        logits = self.runner.execute(entries, CacheOps(out.swap_in, out.swap_out, out.copy))
        self.scheduler.mark_computed(out)
        sampling = [s for s in out.scheduled if s.needs_logits]
        touched = self._sample(sampling, logits)
        for group in self.scheduler.finish_step():
            group.metrics.finished_time = time.monotonic()
            self._groups.pop(group.request_id, None)
        return [self._request_output(g) for g in touched]

    def _request_output(self, group: SequenceGroup) -> RequestOutput:
        """The user's view of a request. While a sample runs, the end of its text that may be
        the start of a stop string is held back (as vLLM does), so streamed text never has to be
        taken back when the stop string completes and is cut off."""
        output = group.to_request_output(self.eos_token_ids)
        hold_back = max((len(stop) for stop in group.sampling_params.stop), default=1) - 1
        if hold_back and not group.sampling_params.use_beam_search:
            by_index = {seq.sample_index: seq for seq in group.seqs}
            for completion in output.outputs:
                completion.text = by_index[completion.index].stream_text(hold_back)
        return output

    def stream(self, request_id: str) -> Iterator[RequestOutput]:
        """Step the engine until `request_id` finishes, yielding its output after every step
        that gave it new tokens; the last one is `finished`. Other requests advance meanwhile.

        Each output holds the whole text so far (vLLM's cumulative outputs); successive texts
        only grow, so `text[len(previous):]` is the new piece (see `stream_text`).
        """
        request_id = str(request_id)
        if request_id not in self._groups:
            raise ValueError(f"unknown or finished request {request_id!r}")
        while self.has_unfinished_requests():
            for output in self.step():
                if output.request_id == request_id:
                    yield output
                    if output.finished:
                        return

    def _sample(self, items: list[ScheduledSequence], logits: Tensor) -> list[SequenceGroup]:
        """Turn each sampling sequence's logits into its next token(s)."""
        rows_of: dict[str, list[int]] = {}
        groups: dict[str, SequenceGroup] = {}
        for row, item in enumerate(items):
            rows_of.setdefault(item.group.request_id, []).append(row)
            groups[item.group.request_id] = item.group
        plain_seqs: list[Seq] = []
        plain_rows: list[int] = []
        now = time.monotonic()
        for request_id, group in groups.items():
            rows = rows_of[request_id]
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
            if group.sampling_params.use_beam_search:
                self._beam_search_step(group, [items[r].seq for r in rows], logits[rows])
                continue
            seqs = [items[r].seq for r in rows]
            if len(group.seqs) < group.sampling_params.n:  # the prompt is done: fork n samples
                seqs += self._fork_samples(group, seqs[0])
                rows = rows + [rows[0]] * (len(seqs) - 1)
            plain_seqs += seqs
            plain_rows += rows
        if plain_seqs:
            self._sample_plain(plain_seqs, logits[plain_rows], groups)
        return list(groups.values())

    def _fork_samples(self, group: SequenceGroup, parent: Seq) -> list[Seq]:
        """Parallel sampling (vLLM paper §4.4): samples 1..n-1 share the prompt's blocks."""
        children = []
        for index in range(len(group.seqs), group.sampling_params.n):
            child = parent.fork(next(self._seq_ids), sample_index=index)
            self.kv_cache.fork(parent.seq_id, child.seq_id)
            group.add(child)
            children.append(child)
        return children

    def _sample_plain(
        self, seqs: list[Seq], logits: Tensor, groups: dict[str, SequenceGroup]
    ) -> None:
        owner = {seq.seq_id: group for group in groups.values() for seq in group.seqs}
        rows = [owner[s.seq_id].sampling_row(s, self.eos_token_ids) for s in seqs]
        result = self.sampler(logits, rows)
        tokens, logprobs = result.token_ids.tolist(), result.logprobs.tolist()
        for i, seq in enumerate(seqs):
            seq.append_token(tokens[i], logprobs[i], result.logprobs_dict(i))
            self._check_stop(seq, owner[seq.seq_id].sampling_params)

    def _check_stop(self, seq: Seq, params: SamplingParams) -> None:
        decision = check_stop(seq, params, self.eos_token_ids, self.max_model_len)
        if decision is not None:
            seq.finish(decision)

    # -- beam search ------------------------------------------------------------------------------

    def _beam_search_step(self, group: SequenceGroup, beams: list[Seq], logits: Tensor) -> None:
        """Advance a request's live beams by one token (vLLM v0 / Hugging Face beam search).

        The `2 * beam_width` best (beam, token) continuations are ranked; those ending in EOS
        among the top `beam_width` become finished hypotheses, the best `beam_width` others the
        new live beams. A beam chosen several times forks (sharing its blocks, vLLM paper §4.4);
        a beam chosen by nobody is freed. Only `beam_width` best hypotheses are kept.
        """
        params = group.sampling_params
        width = params.beam_width
        rows = [group.sampling_row(b, self.eos_token_ids) for b in beams]
        next_logprobs = self.sampler.beam_logprobs(logits, rows)
        cumulative = torch.tensor([b.cumulative_logprob for b in beams])
        candidates = beam_search_candidates(cumulative, next_logprobs, 2 * width)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)

        finishing = [c for c in candidates[:width] if c.token_id in stops]
        live = [c for c in candidates if c.token_id not in stops][:width]
        # Fork before any parent changes: a child starts from its parent as it was.
        assigned: list[tuple[Seq, Any]] = []
        used: set[int] = set()
        for cand in live:
            parent = beams[cand.parent]
            if cand.parent in used:
                child = parent.fork(next(self._seq_ids))
                self.kv_cache.fork(parent.seq_id, child.seq_id)
                group.add(child)
                assigned.append((child, cand))
            else:
                used.add(cand.parent)
                assigned.append((parent, cand))
        for cand in finishing:
            hypothesis = beams[cand.parent].fork(next(self._seq_ids))  # no blocks: it is done
            hypothesis.append_token(cand.token_id, cand.logprob)
            hypothesis.finish(StopDecision(SequenceStatus.FINISHED_STOPPED, cand.token_id))
            group.add(hypothesis)
        for index, beam in enumerate(beams):
            if index not in used:
                self._drop(group, beam)
        for beam, cand in assigned:
            beam.append_token(cand.token_id, cand.logprob)
            decision = check_stop(beam, params, (), self.max_model_len)
            if decision is not None:  # max_tokens or the context: the beam ends as it is
                beam.finish(decision)
        self._prune_hypotheses(group)
        if self._beam_search_done(group):
            for beam in group.get_unfinished_seqs():
                self._drop(group, beam)

    def _drop(self, group: SequenceGroup, seq: Seq) -> None:
        if seq.seq_id in self.kv_cache:
            self.kv_cache.free(seq.seq_id)
        group.remove(seq.seq_id)

    def _prune_hypotheses(self, group: SequenceGroup) -> None:
        """Keep the `beam_width` best finished beams."""
        params = group.sampling_params
        done = sorted(
            group.get_finished_seqs(),
            key=lambda s: s.beam_search_score(params.length_penalty, self.eos_token_ids),
            reverse=True,
        )
        for seq in done[params.beam_width :]:
            self._drop(group, seq)

    def _beam_search_done(self, group: SequenceGroup) -> bool:
        params = group.sampling_params
        live = group.get_unfinished_seqs()
        if not live:
            return True
        done = group.get_finished_seqs()
        scores = [s.beam_search_score(params.length_penalty, self.eos_token_ids) for s in done]
        best = max(live, key=lambda s: s.cumulative_logprob)
        return beam_search_is_done(
            best_running_cumulative_logprob=best.cumulative_logprob,
            best_running_len=best.get_len(),
            worst_finished_score=min(scores) if scores else None,
            num_finished=len(done),
            beam_width=params.beam_width,
            length_penalty=params.length_penalty,
        )

    # -- driving it to completion ------------------------------------------------------------------

    def run_until_done(self, use_tqdm: bool = False) -> dict[str, RequestOutput]:
        """Step until every request finished; return the final output of each."""
        finals: dict[str, RequestOutput] = {}
        total = len(self._groups)
        with tqdm(total=total, desc="requests", disable=not use_tqdm, unit="req") as bar:
            while self.has_unfinished_requests():
                for output in self.step():
                    if output.finished:
                        finals[output.request_id] = output
                        bar.update(1)
        return finals


# -- the offline API ------------------------------------------------------------------------------


class LLM:
    """vLLM's offline entry point: `LLM().generate(prompts, params)` and `LLM().chat(messages)`."""

    def __init__(self, model: str | Path | None = None, **engine_kwargs: Any) -> None:
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(engine_kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown arguments {unknown}; known: {sorted(known)}")
        self.engine = LLMEngine.from_pretrained(model, **engine_kwargs)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete every prompt (text, or token ids); outputs come back in prompt order."""
        prompt_list = [prompts] if isinstance(prompts, str) else list(prompts)
        params = _per_prompt(sampling_params, len(prompt_list))
        ids = []
        try:
            for prompt, p in zip(prompt_list, params, strict=True):
                ids.append(self.engine.add_request(None, prompt, p))
        except ValueError:
            for request_id in ids:  # all or nothing: do not leave half a batch queued
                self.engine.abort_request(request_id)
            raise
        finals = self.engine.run_until_done(use_tqdm=use_tqdm)
        return [finals[i] for i in ids]

    def chat(
        self,
        messages: Sequence[dict[str, str]] | Sequence[Sequence[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of messages) or several, with the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self._chat_prompt(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat_stream(
        self, messages: Sequence[dict[str, str]], sampling_params: SamplingParams | None = None
    ) -> Iterator[str]:
        """Yield the answer's text piece by piece as the engine produces it."""
        request_id = self.engine.add_request(None, self._chat_prompt(messages), sampling_params)
        yield from stream_text(self.engine, request_id)

    def _chat_prompt(self, conversation: Sequence[dict[str, str]]) -> list[int]:
        return self.tokenizer.apply_chat_template(
            list(conversation), add_generation_prompt=True, tokenize=True
        )


def stream_text(engine: LLMEngine, request_id: str) -> Iterator[str]:
    """Step the engine and yield the new text of the first completion of `request_id`.

    The pieces join up to the final text: text that may begin a stop string is held back until
    the stop string is ruled out (then shown) or completed (then cut off, never shown). Beam
    search's best beam may change its past, so its text comes in one piece at the end.
    """
    group = engine._groups.get(str(request_id))
    beams = group is not None and group.sampling_params.use_beam_search
    shown = ""
    for output in engine.stream(request_id):
        if beams and not output.finished:
            continue
        text = output.outputs[0].text
        if len(text) > len(shown):
            yield text[len(shown) :]
            shown = text


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"{len(params)} sampling params for {count} prompts")
    return params


__all__: Iterable[str] = ["EngineConfig", "LLMEngine", "LLM", "stream_text"]
