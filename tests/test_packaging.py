"""How the package is laid out for Python's import system: `kernels/` at the repository's root is
installed as `minipaged.kernels` and must never hide another package named `kernels`.

* From the repository's root (`python -c`, which puts the current folder first on `sys.path`),
  `transformers` imports Hugging Face's `kernels` package: it must get that package (or, where it
  is not installed, no package), never the root's folder, and `minipaged.kernels` still imports.
  The root folder has no `__init__.py` for this (minipaged/kernels/__init__.py says why).
* Every subpackage of `kernels/` is listed in pyproject.toml and mapped to its folder, since the
  folder's own parent maps no more: a new one left out would be missing from an install.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, transformers
transformers.LlamaConfig
import minipaged.kernels, minipaged.kernels.cpu
from minipaged.kernels import paged_attention
try:
    import kernels
    found = getattr(kernels, "__file__", None)
except ImportError:
    found = None
print(json.dumps({"kernels": found, "cpu": minipaged.kernels.cpu.__file__}))
"""


def test_transformers_gets_its_own_kernels_package_from_the_repository_root() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, text=True,
                         capture_output=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    # Hugging Face's package where it is installed; a namespace package (no file) where not.
    assert found["kernels"] is None or not Path(found["kernels"]).is_relative_to(ROOT / "kernels")
    assert Path(found["cpu"]).resolve() == (ROOT / "kernels" / "cpu" / "__init__.py")


def test_the_root_kernels_folder_is_no_regular_package() -> None:
    assert (ROOT / "kernels").is_dir()
    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert (ROOT / "minipaged" / "kernels" / "__init__.py").is_file()


def test_every_kernels_subpackage_is_installed() -> None:
    tomllib = pytest.importorskip("tomllib")
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {
        ".".join(("minipaged", "kernels", *p.parent.relative_to(ROOT / "kernels").parts))
        for p in (ROOT / "kernels").rglob("__init__.py")
    }
    assert on_disk <= set(setuptools["packages"])
    mapped = {
        name: folder for name, folder in setuptools["package-dir"].items()
        if name.startswith("minipaged.kernels.")
    }
    # A top-level subpackage maps to its folder; a nested one lies inside its parent's.
    for name in on_disk:
        top = ".".join(name.split(".")[:3])
        assert mapped.get(top) == f"kernels/{top.rsplit('.', 1)[1]}", name
