"""Schedulers by name: what `EngineConfig(scheduler=...)`, the command line and the benchmarks
choose from. Each name is a policy over the KV memory it runs on:

* "fcfs": vLLM's FCFS continuous batching over the paged `KVCacheManager` (vLLM paper §4.5);
* "mlfq", "mlfq-naive", "mlfq-fixed", "mlfq-recompute", "mlfq-reactive": FastServe's skip-join
  MLFQ and its ablation variants (§6.3) over the paged manager ("mlfq-recompute" is "mlfq"
  with `preemption_mode` "recompute");
* "static", "orca-max", "orca-pow2", "orca-oracle": the vLLM paper's baselines (§6.1) over
  contiguous reservations (`ReservationKVCacheManager`), which have no CPU pool and no prefix
  cache.

`build_scheduler` builds the scheduler with its KV manager (`scheduler.kv_manager`). A name added
to `SCHEDULERS` (a `(SchedulerConfig, KVManager) -> Scheduler` constructor) runs over the paged
manager.
"""

from __future__ import annotations

from minipaged.kv.interface import KVManager
from minipaged.kv.manager import KVCacheManager
from minipaged.kv.reservation import ReservationKVCacheManager
from minipaged.sched.base import PreemptionMode, Scheduler, SchedulerConfig, SchedulerFactory
from minipaged.sched.baselines import OrcaScheduler, StaticBatchScheduler
from minipaged.sched.cost_model import CostModel
from minipaged.sched.fcfs import FCFSScheduler
from minipaged.sched.mlfq import MLFQ_VARIANTS, MLFQConfig, check_variant_mode, mlfq_factory

SCHEDULERS: dict[str, SchedulerFactory] = {
    "fcfs": FCFSScheduler,
    **{name: variant.factory() for name, variant in MLFQ_VARIANTS.items()},
    "static": StaticBatchScheduler,
    "orca-max": OrcaScheduler,
    "orca-pow2": OrcaScheduler,
    "orca-oracle": OrcaScheduler,
}

# The baselines' reservations: (policy, static batch) of their `ReservationKVCacheManager`.
RESERVATIONS: dict[str, tuple[str, bool]] = {
    "static": ("max", True),
    "orca-max": ("max", False),
    "orca-pow2": ("pow2", False),
    "orca-oracle": ("oracle", False),
}


def needs_cost_model(name: str) -> bool:
    """Whether the scheduler predicts step times (skip-join MLFQ, FastServe §4.1): the engine
    then profiles one at start-up unless given one."""
    return _check_name(name) in MLFQ_VARIANTS


def check_preemption_mode(name: str, mode: PreemptionMode | str | None) -> None:
    """A `ValueError` when the scheduler `name` stands for one preemption mode and `mode`
    names the other ("mlfq-recompute" with "swap")."""
    variant = MLFQ_VARIANTS.get(_check_name(name))
    if variant is not None:
        check_variant_mode(variant.preemption_mode, mode, f"scheduler {name!r}")


def build_scheduler(
    name: str,
    config: SchedulerConfig,
    *,
    num_gpu_blocks: int,
    block_size: int,
    num_cpu_blocks: int = 0,
    enable_prefix_caching: bool = True,
    mlfq: MLFQConfig | None = None,
    cost_model: CostModel | None = None,
) -> Scheduler:
    """The scheduler `name` over a KV manager of `num_gpu_blocks` blocks of `block_size`
    tokens. The CPU pool and prefix caching apply to the paged schedulers only; `mlfq`
    replaces an MLFQ variant's queue settings (its preemption mode stays) and `cost_model`
    gives it its step-time predictions."""
    mlfq_scheduler = needs_cost_model(name)  # also checks the name
    if (mlfq is not None or cost_model is not None) and not mlfq_scheduler:
        raise ValueError(f"mlfq settings and a cost model need an MLFQ scheduler, got {name!r}")
    check_preemption_mode(name, config.preemption_mode)
    kv_manager: KVManager
    if name in RESERVATIONS:
        policy, static_batch = RESERVATIONS[name]
        kv_manager = ReservationKVCacheManager(
            num_gpu_blocks, block_size, policy, config.max_model_len, static_batch
        )
    else:
        kv_manager = KVCacheManager(
            num_gpu_blocks,
            block_size,
            num_cpu_blocks=num_cpu_blocks,
            enable_prefix_caching=enable_prefix_caching,
        )
    factory = SCHEDULERS[name]
    if mlfq_scheduler:
        variant = MLFQ_VARIANTS[name]
        factory = mlfq_factory(mlfq or variant.mlfq, cost_model, variant.preemption_mode)
    return factory(config, kv_manager)


def _check_name(name: str) -> str:
    if name not in SCHEDULERS:
        raise ValueError(f"scheduler must be one of {sorted(SCHEDULERS)}, got {name!r}")
    return name
