"""The committed results are found from the repository's root or from any folder below it."""

from __future__ import annotations

from pathlib import Path

import pytest

from teaching.results import load_result, repository_root

ROOT = Path(__file__).resolve().parents[2]


def test_found_from_the_root_and_from_the_notebooks_folder():
    assert repository_root(ROOT) == ROOT
    assert repository_root(ROOT / "notebooks") == ROOT
    assert "traces" in load_result("memory_waste", ROOT / "notebooks")


def test_a_folder_outside_any_repository_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="benchmarks/results"):
        repository_root(tmp_path)
