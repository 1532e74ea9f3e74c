"""Layer 13 -- simulation: the schedulers driven by a measured cost model instead of a model,
paper-shaped request traces, and the profiling that calibrates the cost model on a real engine.
"""

from __future__ import annotations

from minipaged.sim.profiling import profile_engine
from minipaged.sim.simulator import SimulationResult, simulate
from minipaged.sim.traces import TraceRequest

__all__ = [
    "SimulationResult",
    "TraceRequest",
    "profile_engine",
    "simulate",
]
