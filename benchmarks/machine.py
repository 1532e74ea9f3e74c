"""What every benchmark records beside its numbers: the machine it ran on.

Benchmarks run as scripts (`python benchmarks/NAME.py`), so this module sits next to them and is
imported as `from machine import machine_info`.
"""

from __future__ import annotations

import os
import platform


def machine_info(**extra: object) -> dict[str, object]:
    """Platform, processor, Python, cores, torch, and the load at the time of the call.

    The 1-minute load average is recorded because other work on a shared machine slows every
    side of a comparison; ratios measured in one run are what to read.
    """
    info: dict[str, object] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        info["torch"] = None
    return info | extra
