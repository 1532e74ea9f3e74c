"""The committed benchmark results the notebooks draw: `benchmarks/results/<name>.json`, found
from the repository's root whether a notebook runs from the root or from `notebooks/`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["load_result", "repository_root"]


def repository_root(start: Path | None = None) -> Path:
    """The nearest folder at or above `start` (the working directory by default) that holds
    `benchmarks/results/`; FileNotFoundError when none does."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "benchmarks" / "results").is_dir():
            return folder
    raise FileNotFoundError(f"no benchmarks/results/ at or above {here}")


def load_result(name: str, start: Path | None = None) -> dict[str, Any]:
    """The committed JSON of one benchmark, `benchmarks/results/<name>.json`."""
    path = repository_root(start) / "benchmarks" / "results" / f"{name}.json"
    return json.loads(path.read_text(encoding="utf-8"))
