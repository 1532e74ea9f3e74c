"""The shape of the code base, checked from its source (docs/architecture.md, "Modules by layer").

* Every module of `minipaged/` and `kernels/` is listed in the architecture document's layer
  table, and imports only modules of its own layer or of layers below it; the import graph has
  no cycle. Imports inside functions and under `TYPE_CHECKING` count: a lazy import is still an
  import.
* No module reads another module's private names (`obj._name`, `from x import _name`) in
  `minipaged/`, `kernels/`, `benchmarks/` or the notebooks, and nothing outside the engine
  replaces an engine's parts by assignment.
* No module of the core (`minipaged/`, `kernels/`) is over 400 lines.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MAX_MODULE_LINES = 400

# Names an object outside the engine must never be given by assignment.
ENGINE_PARTS = frozenset({"scheduler", "kv_cache", "runner", "sampler", "tokenizer", "model"})
ENGINE_MODULES = frozenset({"minipaged.engine"})

# Private names of *other* libraries that are their only public way in, with the reason.
ALLOWED_PRIVATE = {
    "_linear_pointwise": "oneDNN's fused linear is registered only as torch.ops.mkldnn's op",
    "_reorder_linear_weight": "so is the packing of a weight for it",
    "_version": "torch's in-place version counter, the one sign that a packed copy is stale",
}


# -- reading the source ---------------------------------------------------------------------------


def core_files() -> list[Path]:
    return sorted((ROOT / "minipaged").rglob("*.py")) + sorted((ROOT / "kernels").glob("*.py"))


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "kernels":
        parts = ["minipaged", "kernels", *parts[1:]]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def layer_table() -> dict[str, int]:
    """Module name -> layer number, from the rows of the "Modules by layer" table."""
    text = ARCHITECTURE.read_text()
    section = text.split("## Modules by layer", 1)
    assert len(section) == 2, "docs/architecture.md has no '## Modules by layer' section"
    layers: dict[str, int] = {}
    for line in section[1].split("\n## ", 1)[0].splitlines():
        row = re.match(r"\|\s*(\d+)\s*\|(.*)", line)
        if not row:
            continue
        for path in re.findall(r"`((?:minipaged|kernels)/[\w/]+\.py)`", row.group(2)):
            layers[module_name(ROOT / path)] = int(row.group(1))
    return layers


def imported_modules(tree: ast.AST, importer: str) -> Iterator[str]:
    """Every minipaged module `tree` imports, anywhere in the file."""
    package = importer if importer.endswith("__init__") else importer.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name == "minipaged" or name.startswith("minipaged."):
                yield name


def resolve(name: str, known: set[str]) -> str | None:
    """The module a dotted import name refers to (a name imported from a module -> the module)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in core_files()}
    known = set(files)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        targets = {resolve(t, known) for t in imported_modules(tree, name)}
        graph[name] = {t for t in targets if t and t != name and t != "minipaged"}
    return graph


def python_sources() -> Iterator[tuple[str, str]]:
    """(where, source) for every module of the project and every notebook code cell."""
    for folder in ("minipaged", "kernels", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield str(path.relative_to(ROOT)), path.read_text()
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        for i, cell in enumerate(cells):
            if cell["cell_type"] == "code":
                source = "".join(cell["source"])
                source = "\n".join(
                    "" if line.lstrip().startswith(("%", "!")) else line
                    for line in source.splitlines()
                )
                yield f"{path.relative_to(ROOT)} cell {i}", source


# -- layers ---------------------------------------------------------------------------------------


def test_every_module_has_a_layer() -> None:
    layers = layer_table()
    missing = sorted(set(import_graph()) - set(layers) - {"minipaged"})
    assert not missing, f"modules missing from docs/architecture.md's layer table: {missing}"
    stale = sorted(set(layers) - set(import_graph()))
    assert not stale, f"docs/architecture.md lists modules that do not exist: {stale}"


def test_imports_only_go_down_the_layers() -> None:
    layers = layer_table()
    upward = [
        f"{a} (layer {layers[a]}) imports {b} (layer {layers[b]})"
        for a, targets in import_graph().items()
        for b in sorted(targets)
        if a in layers and b in layers and layers[b] > layers[a]
    ]
    assert not upward, "imports that go up the layers:\n" + "\n".join(upward)


def test_the_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


# -- private names and engine parts ---------------------------------------------------------------


def private_accesses(source: str) -> Iterator[str]:
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minipaged"):
            for alias in node.names:
                if alias.name.startswith("_"):
                    yield f"from {node.module} import {alias.name}"
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or name.startswith("__") or name in ALLOWED_PRIVATE:
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        if isinstance(owner, ast.Call) and ast.unparse(owner.func) == "super":
            continue  # a subclass extending its base class's hook
        yield f"line {node.lineno}: {ast.unparse(node)}"


def test_no_module_reads_another_modules_private_names() -> None:
    found = [
        f"{where}: {access}"
        for where, source in python_sources()
        for access in private_accesses(source)
    ]
    assert not found, "private names read from outside their module:\n" + "\n".join(found)


def test_nothing_outside_the_engine_replaces_its_parts() -> None:
    found = []
    for where, source in python_sources():
        if module_name(ROOT / where.split(" ")[0]) in ENGINE_MODULES:
            continue
        for node in ast.walk(ast.parse(source)):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and target.attr in ENGINE_PARTS
                    and not (isinstance(target.value, ast.Name) and target.value.id == "self")
                ):
                    found.append(f"{where}: line {node.lineno}: {ast.unparse(target)} = ...")
    assert not found, "engine parts replaced by assignment:\n" + "\n".join(found)


def test_the_checks_catch_what_they_claim() -> None:
    """The private-name check flags reads through other objects and private imports only."""
    flagged = list(
        private_accesses(
            "from minipaged.scheduler import _Budget\n"
            "engine._groups\nself.kv._blocks\nself._own\ncls._own\nx.__class__\nsuper()._hook\n"
        )
    )
    assert flagged == [
        "from minipaged.scheduler import _Budget",
        "line 2: engine._groups",
        "line 3: self.kv._blocks",
    ]


# -- sizes ----------------------------------------------------------------------------------------


def line_count(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_module_is_over_400_lines() -> None:
    long = {str(p.relative_to(ROOT)): line_count(p) for p in core_files()}
    long = {name: n for name, n in long.items() if n > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"

