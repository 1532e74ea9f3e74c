"""What every benchmark records beside its numbers: the command, the date and the machine.

Benchmarks run as scripts (`python benchmarks/GROUP/NAME.py`), grouped in folders by what they
measure. Each script puts `benchmarks/` first on `sys.path`, then imports this module as
`from machine import report_header, save_report` and another folder's helpers as packages
(`from cpu.roofline import ...`).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path

# The settings that cap the instruction set a run uses (`make test TIER=...` sets them all).
ISA_CAPS = ("MINIPAGED_CPU_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
            "MKL_ENABLE_INSTRUCTIONS")


def machine_info(**extra: object) -> dict[str, object]:
    """Platform, processor, Python, cores, torch, and the load at the time of the call.

    The 1-minute load average is recorded because other work on a shared machine slows every
    side of a comparison; ratios measured in one run are what to read.
    """
    info: dict[str, object] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": _cpu_model(),
        "cpuinfo_flags": " ".join(sorted(_cpuinfo_flags())),
        "last_level_cache_bytes": last_level_cache_bytes(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        # the instruction-set tier the run was capped at (the C kernels', PyTorch's, oneDNN's),
        # where one was: a capped run measures a narrower CPU's code on this one
        "isa_caps": {name: os.environ[name] for name in ISA_CAPS if os.environ.get(name)},
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        info["torch"] = None
    return info | extra


def _cpu_model() -> str | None:
    """The CPU's model name (Linux), which decides which GEMM library is fast on it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _cpuinfo_flags() -> frozenset[str]:
    """Every feature flag of the CPU in /proc/cpuinfo (minipaged's own reader)."""
    from minipaged.platforms.cpu import cpu_flags

    return cpu_flags()


def last_level_cache_bytes() -> int | None:
    """Bytes of CPU 0's largest cache, from sysfs (Linux): a buffer that must come from memory,
    not from a cache, has to be larger than this."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text(encoding="utf-8").strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes, default=None)


def report_header(**machine_extra: object) -> dict[str, object]:
    """The first fields of every results JSON: how it was run, when (UTC) and on what."""
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(**machine_extra),
    }


def save_report(path: Path, report: dict) -> None:
    """Write `report` as indented JSON at `path`, creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
