"""The engine: model runner + scheduler + sampler behind vLLM's `LLMEngine` API.

`LLMEngine` is the loop a server drives: `add_request`, then `step` until nothing is left; each
step schedules, runs one forward pass over the paged KV cache, samples, and returns what changed.
Outside code sees the engine only through this surface: `get_request` for a request's current
output, and step observers (`add_step_observer`) that receive a `StepRecord` after every step
-- what was scheduled, moved and preempted, and how long each part took. The offline API on top
(`LLM`, `stream_text`) is `minipaged.engine.llm`.

A step (docs/architecture.md, "One step of the engine") is schedule -> execute -> update: the
scheduler plans it (`SchedulerOutput`), the runner executes the plan (block movements, then the
forward pass), and the `OutputProcessor` (`minipaged.engine.postprocess`) owns everything after:
sampling, forks, beams, stops, freeing blocks, request metrics. The simulator steps the same
engine with a runner that advances a cost model's clock instead of running a model.
"""

from __future__ import annotations

import collections.abc
import contextlib
import gc
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from minipaged.engine.config import EngineConfig
from minipaged.engine.postprocess import OutputProcessor, StepUpdate
from minipaged.engine.record import StepRecord, StepTimings
from minipaged.engine.requests import RequestStream, check_params, prompt_token_ids
from minipaged.models.checkpoint.model_config import ModelConfig
from minipaged.platforms import Platform
from minipaged.runner.model_runner import ModelRunner
from minipaged.runner.parallel.runner import WorkerDiedError, build_runner
from minipaged.runner.parallel.worker import CheckpointShards, ShardSource
from minipaged.runner.profiler import profile_runner
from minipaged.sampling.outputs import RequestOutput
from minipaged.sampling.params import RequestOutputKind, SamplingParams
from minipaged.sampling.sampler import Sampler
from minipaged.sampling.sequence import SequenceGroup
from minipaged.sched.base import Scheduler
from minipaged.sched.cost_model import CostModel
from minipaged.sched.output import SchedulerOutput
from minipaged.sched.registry import build_scheduler, needs_cost_model

StepObserver = Callable[[StepRecord], None]
logger = logging.getLogger(__name__)


# -- the engine -----------------------------------------------------------------------------------


class LLMEngine(contextlib.AbstractContextManager["LLMEngine"]):
    """Continuous batching over a paged KV cache, one `step()` at a time.

    The scheduler is `config.scheduler` by name, or `scheduler`, ready-made with its own KV
    manager (a baseline's, say): the KV pools then take its sizes and `config.scheduler` is
    not used. With `config.tensor_parallel_size` > 1 the runner is a `TensorParallelRunner`
    (`model` a module to slice, or a `CheckpointShards` each rank reads): `close()` it.
    `clock` stamps arrivals, steps and finishes, and is the `now` the scheduler charges steps
    by: wall time, or a driver's own (CPU time, or a cost model's time in a replay).
    `runner`, ready-made, replaces the one built over `model` (the simulator's cost-model
    runner); `processor` is the class of the `OutputProcessor` (the simulator's makes up
    tokens). A `with` block returns the engine and closes it at the end.
    """

    def __init__(self, model: torch.nn.Module | ShardSource, model_config: ModelConfig,
                 tokenizer: Any | None = None, config: EngineConfig | None = None,
                 scheduler: Scheduler | None = None, clock: Callable[[], float] = time.monotonic,
                 *, runner: ModelRunner | None = None,
                 processor: type[OutputProcessor] = OutputProcessor) -> None:
        self.config = config = config or EngineConfig()
        self.clock, self.model_config, self.tokenizer = clock, model_config, tokenizer
        context = model_config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or context, context)
        sizes = {}
        if scheduler is not None:  # its KV manager gives the pools' sizes
            manager = scheduler.kv_manager
            self.max_model_len = min(self.max_model_len, scheduler.config.max_model_len)
            sizes = dict(block_size=manager.block_size, num_gpu_blocks=manager.num_gpu_blocks,
                         num_cpu_blocks=manager.num_cpu_blocks)
        # Without a size, the runner sizes its cache once its weights are placed; a runner
        # given ready holds its own.
        self.runner = runner = runner or build_runner(
            model, model_config, replace(config, max_model_len=self.max_model_len, **sizes))
        if scheduler is None:
            # Skip-join MLFQ predicts prefill times (FastServe §4.1): measured before it is built.
            cost_model = self._startup_cost_model() if needs_cost_model(config.scheduler) else None
            scheduler = build_scheduler(
                config.scheduler, config.scheduler_config(self.max_model_len),
                num_gpu_blocks=runner.num_gpu_blocks, block_size=config.block_size,
                num_cpu_blocks=runner.num_cpu_blocks,
                enable_prefix_caching=config.enable_prefix_caching, mlfq=config.mlfq,
                cost_model=cost_model,
            )
        self.scheduler = scheduler
        self.kv_manager = scheduler.kv_manager  # the scheduler's manager, named for reading
        eos_token_ids = set(model_config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos_token_ids.add(tokenizer.eos_token_id)
        platform = getattr(runner, "platform", None) or Platform(config.torch_device)
        sampler = Sampler(greedy_tokens=platform.greedy_tokens, seed=config.seed,
                          host_reads_free=platform.host_reads_free)
        self.processor = processor(scheduler, sampler, eos_token_ids=eos_token_ids,
                                   max_model_len=self.max_model_len, clock=clock)
        self._groups: dict[str, SequenceGroup] = {}
        self._finished: dict[str, RequestOutput] = {}  # requests finished in the last step
        self._streams: dict[str, collections.deque[RequestOutput]] = {}  # outputs not yet read
        self._observers: list[StepObserver] = []
        self._request_ids = itertools.count()
        self._num_steps = 0
        freeze_startup()

    @classmethod
    def from_pretrained(cls, model: str | Path | None = None, **kwargs: Any) -> LLMEngine:
        """Load a model folder or GGUF file (default: the bundled SmolLM2) with its tokenizer."""
        from minipaged.models.checkpoint.loader import checkpoint_config, default_model_path
        from minipaged.models.registry import FAMILIES, load_model
        from minipaged.tokenizer.tokenizer import Tokenizer

        config = EngineConfig(**kwargs)
        path = Path(model) if model is not None else default_model_path()
        if config.tensor_parallel_size > 1:  # every rank reads its own slices
            source, model_config = CheckpointShards(str(path)), checkpoint_config(path, FAMILIES)
        else:
            source, model_config = load_model(path, dtype=config.torch_dtype, device="cpu")
        return cls(source, model_config, Tokenizer.from_pretrained(path), config)

    def close(self) -> None:
        """Stop the runner's worker processes, if it has any (tensor parallelism)."""
        self.runner.close()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _startup_cost_model(self) -> CostModel:
        """The cost model given, or the one saved in `cost_model_file`, or a profile of this
        runner (written to `cost_model_file` when that is set)."""
        config = self.config
        if config.cost_model is not None:
            return config.cost_model
        path = None if config.cost_model_file is None else Path(config.cost_model_file)
        if path is not None and path.exists():
            return CostModel.load(path)
        cost_model = profile_runner(self.runner, progress=True)
        if path is not None:
            cost_model.save(path)
        return cost_model

    # -- requests ---------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str | None,
        prompt: str | collections.abc.Sequence[int],
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        *,
        prompt_text: str | None = None,
    ) -> str:
        """Queue a request (text, or token ids); return its id. `prompt_text` is the text that
        token ids were made from (a rendered chat prompt, say), reported as the output's
        `prompt`. Bad input raises `TypeError` / `ValueError` naming the field and the value
        and leaves the engine untouched (`minipaged.admission`, `Scheduler.check_request`)."""
        vocab = self.model_config.vocab_size
        params = check_params(sampling_params, vocab, self.tokenizer is not None)
        if prompt_text is not None and isinstance(prompt, str):
            raise ValueError("prompt_text names the text of token-id prompts, not of text ones")
        if request_id is None:  # the next free number: never an id a caller's request holds now
            request_id = next(i for i in map(str, self._request_ids) if i not in self._groups)
        request_id = str(request_id)
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = prompt_token_ids(prompt, self.tokenizer, vocab)
        seq = self.processor.new_sequence(token_ids, self._detokenizer())
        prompt_text = text if text is not None else prompt_text
        arrival_time = self.clock() if arrival_time is None else arrival_time
        group = SequenceGroup(request_id, [seq], params, arrival_time, prompt=prompt_text)
        self.scheduler.add(group)  # rejects a request that can never fit
        self._groups[request_id] = group
        return request_id

    def _detokenizer(self) -> Any | None:
        if self.tokenizer is None:
            return None
        from minipaged.tokenizer.tokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(self.tokenizer, skip_special_tokens=True)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and return its blocks; False when it is unknown or already done."""
        group = self.processor.abort(str(request_id))
        if group is not None:
            self._groups.pop(group.request_id, None)
        return group is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    def get_request(self, request_id: str) -> RequestOutput | None:
        """The current output of a running request, or the final one of a request that finished
        in the last step; None for any other id."""
        request_id, eos = str(request_id), self.processor.eos_token_ids
        group = self._groups.get(request_id)
        return self._finished.get(request_id) if group is None else group.to_request_output(eos)

    def get_sampling_params(self, request_id: str) -> SamplingParams | None:
        """The sampling parameters of a running request (None when it is not running)."""
        group = self._groups.get(str(request_id))
        return None if group is None else group.sampling_params

    # -- observing steps --------------------------------------------------------------------------

    def add_step_observer(self, observer: StepObserver) -> None:
        """Call `observer(record)` after every step with that step's `StepRecord`."""
        self._observers.append(observer)

    def remove_step_observer(self, observer: StepObserver) -> None:
        """Stop calling an observer added by `add_step_observer`."""
        self._observers.remove(observer)

    # -- one step ---------------------------------------------------------------------------------

    def step(self, *, final_only: bool = False) -> list[RequestOutput]:
        """Schedule, execute and update one step; return the outputs of the requests that got
        new tokens or finished. `final_only` (vLLM's FINAL_ONLY: `run_until_done`, streams)
        builds only those of the requests that finished or have an open stream (which queues
        them): no output is built that nobody reads."""
        marks, start = [time.perf_counter()], self.clock()
        plan = self.scheduler.schedule(start)
        marks.append(time.perf_counter())
        num_running = len(self.scheduler.running)
        logits, update = self.execute(plan)
        marks.append(time.perf_counter())
        try:
            self.processor.update(update, logits)
        except Exception:  # not one request's fault (those fail alone): the step's requests end
            logger.exception("step %d failed after its forward pass", self._num_steps)
            self.processor.fail([s.request_id for s in update.plan.scheduled], update)
        marks.append(time.perf_counter())
        for group in update.finished:
            self._groups.pop(group.request_id, None)
        touched = update.touched  # with final_only, only open streams read unfinished ones
        if final_only:
            touched = [g for g in touched if g.request_id in self._streams]
        outputs = self._outputs(dict.fromkeys(touched + update.finished), final_only)
        marks.append(time.perf_counter())
        if self._observers:  # `marks`: the start, then after each phase
            phases = [b - a for a, b in itertools.pairwise(marks)]
            record = StepRecord(
                self._num_steps, start, self.clock(), plan, num_running,
                levels=self.scheduler.queue_levels(), failed=tuple(update.failed),
                timings=StepTimings(*phases, total_s=marks[-1] - marks[0]),
            )
            for observer in list(self._observers):
                observer(record)
        self._num_steps += 1
        return outputs

    def execute(self, plan: SchedulerOutput) -> tuple[torch.Tensor, StepUpdate]:
        """Run `plan` on the runner. When the forward pass fails, each request's share runs
        again on its own, and only the requests that fail alone end with "error": the update
        then carries the plan of the others (a request's input can never end another's)."""
        update = StepUpdate(plan=plan)
        try:
            return self.runner.execute(plan), update
        except WorkerDiedError:  # no step can run any more
            raise
        except Exception:
            logger.exception("step %d failed; its requests run one at a time", self._num_steps)
        rows, failed = [], []
        for request_id in dict.fromkeys(s.request_id for s in plan.scheduled):
            own = [s for s in plan.scheduled if s.request_id == request_id]
            try:  # its blocks already moved with the whole plan: only its compute again
                # a copy: the next execute may write the same buffer (a replayed step's)
                rows.append(self.runner.execute(SchedulerOutput(scheduled=own)).clone())
            except WorkerDiedError:
                raise
            except Exception:
                logger.exception("request %s failed alone; it ends with 'error'", request_id)
                failed.append(request_id)
        self.processor.fail(failed, update)
        update.plan = replace(
            plan, scheduled=[s for s in plan.scheduled if s.request_id not in failed]
        )
        return torch.cat(rows) if rows else torch.empty(0, 0), update

    def _outputs(self, groups: Iterable[SequenceGroup], final_only: bool) -> list[RequestOutput]:
        """What a step returns of the requests it changed, each as its `output_kind` asks
        (with `final_only`, all as FINAL_ONLY), and each open stream's delta, queued for it:
        nothing is built that nobody reads, and a delta copies only what the step added."""
        streams, eos = self._streams, self.processor.eos_token_ids
        outputs, self._finished = [], {}  # `_finished`: for `get_request`
        for group in groups:
            request_id = group.request_id
            kind = RequestOutputKind.FINAL_ONLY if final_only else group.sampling_params.output_kind
            final = group.to_request_output(eos) if group.is_finished() else None
            if final is not None:
                self._finished[request_id] = final
            delta = None
            if request_id in streams or kind is RequestOutputKind.DELTA:
                delta = group.to_delta_output(eos)
                if delta is not None and request_id in streams:
                    streams[request_id].append(delta)
            if kind is RequestOutputKind.CUMULATIVE:
                outputs.append(final or group.to_request_output(eos))
            elif (output := delta if kind is RequestOutputKind.DELTA else final) is not None:
                outputs.append(output)
        return outputs

    def stream(self, request_id: str) -> RequestStream:
        """Follow `request_id`: iterating yields its output after every step that gave it new
        tokens, stepping the engine when none is waiting; the last one is `finished`. Other
        requests advance meanwhile, and their outputs are kept for their own streams.

        Each output is a delta (`RequestOutputKind.DELTA`): the new text, tokens and
        log-probabilities of the samples that gained any, a sample's finish reason in its last;
        joined, a sample's pieces are its whole output (`minipaged.engine.llm.stream_text`
        joins the text). Closing the stream (`close()`, leaving a `for` loop over it that is
        then dropped, or the stream being collected) aborts the request if it has not finished.
        """
        request_id = str(request_id)
        if request_id not in self._groups:
            raise ValueError(f"unknown or finished request {request_id!r}")
        if request_id in self._streams:
            raise ValueError(f"request {request_id!r} already has an open stream")
        pending: collections.deque[RequestOutput] = collections.deque()
        self._streams[request_id] = pending
        return RequestStream(self, request_id, pending)

    def close_stream(self, request_id: str, pending: collections.deque[RequestOutput]) -> None:
        """End the stream that owns `pending`, aborting its request if it is still running."""
        if self._streams.get(request_id) is pending:
            del self._streams[request_id]
            self.abort_request(request_id)

    # -- driving it to completion ------------------------------------------------------------------

    def run_until_done(self, use_tqdm: bool = False) -> dict[str, RequestOutput]:
        """Step until every request finished; return the final output of each."""
        finals: dict[str, RequestOutput] = {}
        total = len(self._groups)
        with tqdm(total=total, desc="requests", disable=not use_tqdm, unit="req") as bar:
            while self.has_unfinished_requests():
                for output in self.step(final_only=True):
                    if output.finished:
                        finals[output.request_id] = output
                        bar.update(1)
        return finals


def freeze_startup() -> None:
    """What start-up made (the model's modules, the tokenizer's tables, captured steps) lives as
    long as the engine: frozen out of the collector's generations, so that a collection during
    serving scans only what steps make (vLLM does the same after start-up). What an earlier
    engine froze is let go of first: one dropped since (a notebook's, a test's) is collected
    here rather than kept forever."""
    if gc.get_freeze_count():  # an earlier engine's
        gc.unfreeze()
        gc.collect()
    gc.freeze()


__all__ = ["EngineConfig", "LLMEngine", "RequestStream", "StepObserver"]
