"""A tensor-parallel rank: where its shard comes from, how it starts, and the workers' loop.

Every rank, rank 0 included, starts the same way: load its shard of the model and make it its
platform's (`load_shard`, `minipaged.models.tensor_parallel`); once every rank has (a worker
reports it to rank 0), join the process group, so that neither the rendezvous nor the first
collectives wait on anyone's loading; then build a `ModelRunner` over the shard, which sizes
its own shard of the paged KV cache (its KV heads) after a profile whose collectives meet the
other ranks', and keep the ranks' smallest cache (`keep_smallest_cache`). A worker (ranks
1..N-1, `worker_main`) then receives each step's plan -- the batch entries and cache operations
rank 0's scheduler produced -- over a pipe from rank 0, runs the same `execute` (whose
collectives meet rank 0's), and drops the logits: only rank 0 samples.

On one machine rank 0 starts each worker as `python -m minipaged.runner.parallel FD`
(`start_worker`), a fresh interpreter that imports only minipaged and whatever the rank's `RankSpec`
names, never the caller's main module: a script read from standard input, one without an `if
__name__ == "__main__":` guard, `python -c` and a notebook all start workers alike (the
`multiprocessing` spawn start re-imports the caller's main module in every child). The worker's end
of a socket pair is its inherited descriptor FD; the spec (and the model's shards, when they are in
memory) comes over it, pickled.

A worker never outlives its parent: the pipe's end-of-file, a parent that is no longer alive,
or a collective that fails (a dead peer) or times out all end its loop and its process.

Under `torchrun` (several machines, or one) the launcher starts every rank: the plans then go
out as a broadcast over a gloo group of their own (`PlanBroadcast`), whose long timeout lets a
worker wait for the next step however long the engine is idle, while the model's collectives
keep their short one.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator
from contextlib import suppress
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from minipaged.models.checkpoint.model_config import ModelConfig
from minipaged.models.layers import CausalLM
from minipaged.models.registry import build_model, load_model
from minipaged.models.tensor_parallel import TensorParallel, kv_heads, q_heads, shard_state_dict
from minipaged.platforms import Platform, get_platform, platform_class
from minipaged.runner.config import RunnerConfig
from minipaged.runner.model_runner import ModelRunner
from minipaged.sched.output import SchedulerOutput

logger = logging.getLogger(__name__)

# How often an idle worker checks that its parent is still alive.
PARENT_CHECK_S = 1.0
READY = "ready"
# How long a `torchrun` worker waits for rank 0's next plan (an idle engine sends none).
IDLE_TIMEOUT = timedelta(days=30)
# The module a worker process runs (`python -m`): `minipaged/runner/parallel/__main__.py`.
WORKER_MODULE = "minipaged.runner.parallel"
# The folder that holds the `minipaged` package, put on a worker's path before anything else.
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])

Plan = SchedulerOutput  # one step's work, the same for every rank
LoadedModel = tuple[CausalLM, ModelConfig]  # a rank's shard of the model, and its config


class ShardSource(Protocol):
    """Where every rank finds its shard of the model (pickled to the worker processes)."""

    def load(self, tp: TensorParallel, dtype: torch.dtype, device: torch.device) -> LoadedModel: ...


@dataclass(frozen=True)
class CheckpointShards:
    """A checkpoint file or folder: each rank reads only its own slices of it."""

    path: str

    def load(self, tp: TensorParallel, dtype: torch.dtype, device: torch.device) -> LoadedModel:
        return load_model(Path(self.path), dtype=dtype, device=device, progress=False, tp=tp)


@dataclass(frozen=True)
class StateDictShards:
    """A whole model in memory (Hugging Face names and layout): each rank keeps its slices."""

    config: ModelConfig
    state_dict: dict[str, Tensor]

    def load(self, tp: TensorParallel, dtype: torch.dtype, device: torch.device) -> LoadedModel:
        shard = shard_state_dict(self.config, self.state_dict, tp)
        return build_model(self.config, shard, dtype=dtype, device=device, tp=tp), self.config


@dataclass(frozen=True)
class RankSpec:
    """Everything one rank needs to start (picklable: it is sent to the worker process).
    `platform` builds the rank's platform from its config (`get_platform`; a test's stand-in
    grants a chosen memory budget)."""

    rank: int
    world_size: int
    source: ShardSource
    init_method: str  # tcp://127.0.0.1:PORT, rank 0's store
    config: RunnerConfig  # the engine's, settled; each rank takes its own device from it
    local_rank: int | None = None  # the rank's device on its machine (None: `rank`)
    platform: Callable[[RunnerConfig], Platform] = get_platform

    def set_threads(self) -> None:
        """This process's torch threads: the platform's for a rank (`rank_threads`)."""
        threads = platform_class(self.config.device).rank_threads
        if threads is not None:
            torch.set_num_threads(threads)


@dataclass(frozen=True)
class TorchrunRank:
    """This process's place when `torchrun` started it (its environment variables)."""

    rank: int
    world_size: int
    local_rank: int


def torchrun_rank() -> TorchrunRank | None:
    """This process's `torchrun` rank, or None when `torchrun` did not start it."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    env = os.environ
    return TorchrunRank(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]))


class PlanBroadcast:
    """Rank 0's plans to every rank as broadcasts over a gloo group with a long timeout (one
    group of every rank; created by each rank after `join_group`, in the same order)."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)

    def send(self, plan: Plan | None) -> None:
        dist.broadcast_object_list([plan], src=0, group=self.group)

    def __iter__(self) -> Iterator[Plan]:
        while True:
            box: list[Plan | None] = [None]
            dist.broadcast_object_list(box, src=0, group=self.group)
            if box[0] is None:
                return
            yield box[0]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that is free now (for the process group's store, or a server
    started in another process)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def load_shard(spec: RankSpec) -> tuple[tuple, dict[str, Any]]:
    """The `ModelRunner` arguments of this rank: its shard of the model, already made its
    platform's (the part of a start that takes each rank its own time, done before the ranks
    meet), the model's config, its settled config on its own device, run eagerly (a capture
    would run collectives on one rank alone), its platform and its heads (its shard of the KV
    cache)."""
    tp = TensorParallel(spec.rank, spec.world_size)
    index = spec.rank if spec.local_rank is None else spec.local_rank
    device = platform_class(spec.config.device).rank_device(spec.config.torch_device, index)
    config = replace(spec.config, device=str(device), enforce_eager=True)
    model, model_config = spec.source.load(tp, config.torch_dtype, device)
    platform = spec.platform(config)
    model = platform.load(model.to(device, config.torch_dtype).eval(), config.quantization)
    heads = (len(q_heads(model_config, tp)), len(kv_heads(model_config, tp)))
    return (model, model_config, config), dict(platform=platform, heads=heads, loaded=True)


def join_group(spec: RankSpec) -> None:
    """Join the default process group (the platform's collectives: gloo on CPU, NCCL on CUDA)
    over rank 0's TCP store."""
    config = spec.config
    dist.init_process_group(
        platform_class(config.device).collective_backend,
        init_method=spec.init_method,
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=config.tensor_parallel_timeout),
    )


def keep_smallest_cache(runner: ModelRunner) -> None:
    """Every rank sized its shard of the KV cache after its weights and a profile (whose
    collectives met the other ranks'): all use the smallest count, which rank 0's scheduler
    plans with (a rank with more room leaves the rest of its cache unused)."""
    blocks = torch.tensor([runner.num_gpu_blocks], device=runner.device)
    dist.all_reduce(blocks, op=dist.ReduceOp.MIN)
    runner.num_gpu_blocks = int(blocks.item())


def start_runner(spec: RankSpec, args: tuple, kwargs: dict[str, Any]) -> ModelRunner:
    """A worker rank's runner over its loaded shard (`load_shard`'s arguments): join the group,
    build it, keep the ranks' smallest cache."""
    join_group(spec)
    runner = ModelRunner(*args, **kwargs)
    keep_smallest_cache(runner)
    return runner


@dataclass
class WorkerProcess:
    """A worker rank as rank 0 holds it: its `python -m minipaged.runner.parallel` process and rank
    0's end of the socket pair between them."""

    rank: int
    process: subprocess.Popen
    conn: Connection

    def exited(self, when: str) -> str:
        """What an error says of it once it has exited: its rank, process id and exit status
        (minus the number of the signal that ended it), and `when`."""
        return (f"tensor-parallel worker rank {self.rank} (pid {self.process.pid}) exited with "
                f"code {self.process.poll()} {when}")

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace_s: float, term_s: float) -> None:
        """Wait up to `grace_s` for it to leave, then terminate it and wait up to `term_s`,
        then kill it (a stopped or wedged process ignores SIGTERM); reaped in every case."""
        for timeout_s, stop in ((grace_s, self.process.terminate), (term_s, self.process.kill)):
            try:
                self.process.wait(timeout_s)
                return
            except subprocess.TimeoutExpired:
                stop()
        self.process.wait()


def start_worker(rank: int) -> WorkerProcess:
    """Start the process of worker `rank`: `python -m minipaged.runner.parallel FD`, FD its end of a
    new socket pair; it waits for its spec (`send_spec`). Standard input is not inherited;
    standard output and error are (a worker's tracebacks show where the caller's do). It runs in
    a session of its own, so that a Ctrl-C at the terminal reaches rank 0 only, which then
    stops it."""
    parent_end, child_end = multiprocessing.Pipe()  # a socket pair: both ends read and write
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_ROOT, env.get("PYTHONPATH")]))
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", WORKER_MODULE, str(child_end.fileno())],
            stdin=subprocess.DEVNULL, pass_fds=(child_end.fileno(),), env=env,
            start_new_session=True,
        )
    finally:
        child_end.close()
    return WorkerProcess(rank, process, parent_end)


def send_spec(worker: WorkerProcess, spec: RankSpec) -> None:
    """Send `spec` (plain pickle: tensors by value) and the caller's import path, so that the
    worker finds every module the spec names, e.g. a `ShardSource` of the caller's own."""
    worker.conn.send_bytes(pickle.dumps(list(sys.path)))  # first: unpickling the spec needs it
    worker.conn.send_bytes(pickle.dumps(spec, pickle.HIGHEST_PROTOCOL))


def receive_spec(conn: Connection) -> RankSpec:
    """The worker's side of `send_spec`: extend the import path, then unpickle the spec."""
    path = pickle.loads(conn.recv_bytes())
    sys.path += [entry for entry in path if entry not in sys.path]
    return pickle.loads(conn.recv_bytes())


def worker_main(conn: Connection) -> None:
    """A worker process: receive its spec, start, report ready (or the error that stopped it),
    run plans until rank 0 sends `None`, the pipe closes, the parent dies or a collective
    fails."""
    parent = os.getppid()
    try:
        spec = receive_spec(conn)
        spec.set_threads()
        args, kwargs = load_shard(spec)
    except Exception:  # noqa: BLE001 - rank 0 raises it in the parent, with this traceback
        with suppress(OSError):  # rank 0 is gone too
            conn.send(traceback.format_exc())
        return
    try:
        conn.send(READY)
    except OSError:  # rank 0 is gone
        return
    serve_plans(start_runner(spec, args, kwargs), lambda: pipe_plans(conn, parent))


def torchrun_worker(spec: RankSpec) -> None:
    """A rank `torchrun` started, other than 0: load, join, run rank 0's broadcast plans."""
    serve_plans(start_runner(spec, *load_shard(spec)), PlanBroadcast)


def pipe_plans(conn: Connection, parent: int) -> Iterator[Plan]:
    """The plans rank 0 (process `parent`) sends over the pipe, until `None`, end of file or
    the parent's death (the worker is then re-parented: its parent id changes)."""
    while os.getppid() == parent:  # checked at least every PARENT_CHECK_S
        try:
            if not conn.poll(PARENT_CHECK_S):
                continue
            plan: Plan | None = conn.recv()
        except (EOFError, OSError):  # rank 0 is gone
            return
        if plan is None:
            return
        yield plan


def same_tables(plan: Plan, tables: dict[int, tuple[int, ...]]) -> Plan:
    """`plan` with each block table equal to the last plan's table of its sequence (`tables`,
    rewritten for the next) replaced by that very object: unpickled, every table is a new
    object, and the runner's persistent rows (`BlockTables`) are kept by identity, so that
    a table rank 0 did not change costs a rank no row either."""
    scheduled = [entry._replace(block_table=tables[entry.seq_id])
                 if tables.get(entry.seq_id) == entry.block_table else entry
                 for entry in plan.scheduled]
    tables.clear()
    tables.update((entry.seq_id, entry.block_table) for entry in scheduled)
    return replace(plan, scheduled=scheduled)


def serve_plans(runner: ModelRunner, plans: Callable[[], Iterable[Plan]]) -> None:
    """Run each of `plans()` (made now, the group joined: a `PlanBroadcast` needs it) on this
    rank's shard, dropping the logits (rank 0 has them), then leave the process group."""
    tables: dict[int, tuple[int, ...]] = {}
    try:
        for plan in plans():
            try:
                runner.execute(same_tables(plan, tables))
            except ValueError:
                # A plan the runner rejects before any collective (bad metadata): rank 0
                # rejects the same plan in the same place, and the next step goes on.
                continue
            except Exception:  # a failed or timed-out collective: a peer is gone
                logger.exception("tensor-parallel rank failed; exiting")
                raise
    finally:
        dist.destroy_process_group()
