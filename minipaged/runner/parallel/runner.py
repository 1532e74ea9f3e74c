"""Rank 0 of a tensor-parallel engine: the runner the engine steps, and the factory that picks it.

`TensorParallelRunner` keeps `ModelRunner`'s contract -- `execute(entries, cache_ops)` returns
the logits of a step -- so the engine, the scheduler and the KV cache manager stay as they are:
one scheduler, on rank 0, plans each step; the runner sends the plan (the batch entries and the
block movements, a small pickled object) to every worker, runs its own shard's forward pass,
whose collectives meet the workers', and gets the whole logits from the vocabulary-parallel
head (`minipaged.models.tensor_parallel`). On one machine the workers are `python -m
minipaged.runner.parallel` processes, independent of the caller's main module, joined over a TCP
store on 127.0.0.1 and sent plans over a socket pair each; under `torchrun` the launcher starts them
and plans go out as broadcasts (`minipaged.runner.parallel.worker`).

A worker that dies is noticed before a step is sent (its process is gone) or by the step's
collectives (they fail, or time out after `tensor_parallel_timeout` seconds): the runner then
raises `WorkerDiedError` naming the rank, and stops every other worker. The workers stop with
`close()`, when the runner is collected, or when the interpreter exits.
"""

from __future__ import annotations

import time
import weakref
from contextlib import suppress
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor, nn

from minipaged.models.checkpoint.model_config import ModelConfig
from minipaged.models.tensor_parallel import (
    SINGLE_RANK,
    TensorParallelError,
    check_shardable,
    checkpoint_state_dict,
)
from minipaged.runner.config import RunnerConfig
from minipaged.runner.model_runner import ModelRunner
from minipaged.runner.parallel.worker import (
    READY,
    PlanBroadcast,
    RankSpec,
    ShardSource,
    StateDictShards,
    WorkerProcess,
    free_port,
    join_group,
    keep_smallest_cache,
    load_shard,
    send_spec,
    start_worker,
    torchrun_rank,
    torchrun_worker,
)
from minipaged.sched.output import SchedulerOutput

# How long `close()` waits for a worker to leave before terminating it, then killing it.
JOIN_TIMEOUT_S = 2.0


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process died (or stopped answering): the engine cannot go on."""


class TensorParallelRunner(ModelRunner):
    """Rank 0's `ModelRunner` (its shard of the model and of the KV cache), driving the others.

    One tensor-parallel runner per process at a time: the ranks use the default process group.
    """

    def __init__(
        self, spec: RankSpec, start_timeout_s: float = 600.0, launched: bool = False
    ) -> None:
        """Start `spec.world_size - 1` workers from `spec` (rank 0's), load rank 0's shard and
        wait until every worker has loaded its own (at most `start_timeout_s`), then join the
        group and build rank 0's runner as each worker builds its own (`start_runner`).
        `launched`: `torchrun` started the other ranks (`torchrun_worker`); plans go out as
        broadcasts."""
        if dist.is_initialized():
            raise RuntimeError(
                "a tensor-parallel engine is already running in this process; close() it first"
            )
        self.world_size, self.timeout_s = spec.world_size, spec.config.tensor_parallel_timeout
        self.closed = False
        # Rank 0 runs as many torch threads as each worker (the platform's `rank_threads`);
        # restored by `close()`.
        self._threads_before = torch.get_num_threads()
        spec.set_threads()
        self._workers: list[WorkerProcess] = []
        self._broadcast: PlanBroadcast | None = None
        self._finalizer = weakref.finalize(self, stop_workers, self._workers)
        try:
            # Every interpreter starts at once; then each gets its spec (a pickled state dict
            # waits in the socket until its worker has imported torch and reads it).
            for rank in range(1, 1 if launched else spec.world_size):
                self._workers.append(start_worker(rank))
            for worker in self._workers:
                try:
                    send_spec(worker, replace(spec, rank=worker.rank))
                except OSError:  # it exited before reading its spec
                    raise died_while_loading(worker) from None
            args, kwargs = load_shard(spec)  # while the workers load theirs
            self._wait_ready(start_timeout_s)
            join_group(spec)  # then every rank's runner: their profiles' collectives meet
            super().__init__(*args, **kwargs)
            keep_smallest_cache(self)
            if launched:
                self._broadcast = PlanBroadcast()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for worker in self._workers:
            rank, conn = worker.rank, worker.conn
            while not conn.poll(0.1):
                if not worker.is_alive():
                    raise died_while_loading(worker)
                if time.monotonic() > deadline:
                    raise WorkerDiedError(
                        f"tensor-parallel worker rank {rank} did not load within {timeout_s} s"
                    )
            try:
                message = conn.recv()
            except (EOFError, OSError):  # its end of the pipe closed: the worker is exiting
                raise died_while_loading(worker) from None
            if message != READY:
                raise WorkerDiedError(f"tensor-parallel worker rank {rank} failed:\n{message}")

    # -- one step -------------------------------------------------------------------------------

    def apply_cache_ops(self, plan: SchedulerOutput) -> None:
        """Move blocks on every rank's shard of the KV cache (also outside a step: profilers
        time swaps this way): a step with the plan's block movements and no sequences."""
        if plan.moves_blocks:
            self.execute(replace(plan, scheduled=[]))

    def execute(self, plan: SchedulerOutput) -> Tensor:
        """`ModelRunner.execute` on every rank: send the step's plan to every worker, run rank
        0's share, return the logits."""
        if self.closed:
            raise WorkerDiedError("the tensor-parallel runner is closed")
        self._check_workers()
        try:
            if self._broadcast is not None:
                self._broadcast.send(plan)
            for worker in self._workers:
                worker.conn.send(plan)
            return super().execute(plan)
        except ValueError:
            raise  # a plan every rank rejects alike, before any collective
        except Exception as exc:
            time.sleep(0.1)  # let a dying worker's exit be seen
            self._broadcast = None  # its group is broken too: nothing more goes through it
            self._check_workers()
            self.close()
            raise WorkerDiedError(
                f"a tensor-parallel collective failed or waited more than {self.timeout_s} s "
                f"for worker ranks 1..{self.world_size - 1}, which are alive but did not answer "
                f"(stopped or wedged?): {exc}"
            ) from exc

    def _check_workers(self) -> None:
        """Raise `WorkerDiedError` naming the first worker that is no longer alive."""
        for worker in self._workers:
            if not worker.is_alive():
                self.close()
                raise WorkerDiedError(worker.exited("(it died): the engine cannot continue"))

    @property
    def worker_pids(self) -> list[int]:
        """The process ids of ranks 1..N-1 (for tests and monitoring)."""
        return [worker.process.pid for worker in self._workers]

    def close(self) -> None:
        """Stop every worker and leave the process group; idempotent."""
        if self._broadcast is not None and not self.closed:
            self._broadcast.send(None)  # the `torchrun` workers' loop ends
        if not self.closed:
            torch.set_num_threads(self._threads_before)
        self.closed = True
        self._finalizer()
        if dist.is_initialized():
            dist.destroy_process_group()


def died_while_loading(worker: WorkerProcess) -> WorkerDiedError:
    """The error for a worker that exited before it reported ready (reaped first, so that its
    exit code is known)."""
    worker.stop(JOIN_TIMEOUT_S, JOIN_TIMEOUT_S)
    return WorkerDiedError(worker.exited("while loading its shard (its output is above)"))


def stop_workers(workers: list[WorkerProcess]) -> None:
    """Ask each worker to stop, wait a moment, then terminate (and kill) any that is left."""
    for worker in workers:
        with suppress(OSError, ValueError):  # already gone
            worker.conn.send(None)
        worker.conn.close()
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for worker in workers:
        worker.stop(max(0.0, deadline - time.monotonic()), JOIN_TIMEOUT_S)


# -- choosing the runner --------------------------------------------------------------------------


def build_runner(model: nn.Module | ShardSource, model_config: ModelConfig,
                 config: RunnerConfig) -> ModelRunner:
    """The engine's runner for a settled `config`: a `ModelRunner` over `model`, or with
    `tensor_parallel_size` > 1 a `TensorParallelRunner` whose ranks take their shards of it (a
    model in memory is sliced; a `CheckpointShards` is read slice by slice on every rank), each
    sizing its shard of the KV cache after its own weights, and all keeping the smallest
    (`join_group`). The ranks always run eagerly.

    Under `torchrun`, every rank runs the same program: rank 0 gets the runner, and on any
    other rank this call serves rank 0's plans until rank 0 closes, then exits the process
    (`SystemExit(0)`), so that the program's own code runs on rank 0 only."""
    size = config.tensor_parallel_size
    if size == 1:
        if not isinstance(model, nn.Module):
            model = model.load(SINGLE_RANK, config.torch_dtype, config.torch_device)[0]
        return ModelRunner(model, model_config, config)
    check_shardable(model_config, size)
    if isinstance(model, nn.Module):
        model = StateDictShards(model_config, checkpoint_state_dict(model_config, model))
    launched = torchrun_rank()
    if launched is not None and launched.world_size != size:
        raise TensorParallelError(
            f"tensor_parallel_size {size} but torchrun started {launched.world_size} ranks"
        )
    spec = RankSpec(
        rank=0 if launched is None else launched.rank, world_size=size, source=model,
        init_method=f"tcp://127.0.0.1:{free_port()}" if launched is None else "env://",
        config=config, local_rank=None if launched is None else launched.local_rank,
    )
    if launched is not None and launched.rank != 0:
        torchrun_worker(spec)
        raise SystemExit(0)
    return TensorParallelRunner(spec, launched=launched is not None)
