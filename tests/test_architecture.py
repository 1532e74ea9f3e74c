"""The shape of the code base, checked from its source.

* `LAYERS` below is the package's layer order: each subpackage of `minipaged/` (and `kernels/`,
  imported as `minipaged.kernels`) is one layer, or two where a nested subpackage is a layer of its
  own below or above its parent (`models.checkpoint`, `runner.parallel`); a module imports
  only its own layer or the ones listed before it; the module import graph has no cycle.
  Imports inside functions and under `TYPE_CHECKING` count: a lazy import is still an import.
  `docs/architecture.md`'s table lists the same layers in the same order.
* Every subpackage names its public face (`__all__` in its `__init__.py`); the package's own
  folder holds its top-level layers and nothing else, no other folder more than 12 modules and
  subpackages (`__init__` and the command line's `__main__` aside), and no two modules of one
  folder share a name prefix.
* No module reads another module's private names (`obj._name`, `from x import _name`) in
  `minipaged/`, `kernels/`, `benchmarks/` or the notebooks, and nothing outside the engine
  replaces an engine's parts by assignment.
* No module of the core (`minipaged/`, `kernels/`) is over 500 lines.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MAX_MODULE_LINES = 500
MAX_FOLDER_ENTRIES = 12

# The layers, bottom-up: a unit imports only units at or before its own position.
LAYERS = (
    "tokenizer",  # 1
    "models.checkpoint",  # 2
    "models",  # 3: written once, in plain PyTorch
    "kv",  # 4
    "attention",  # 5: the contract and the reference
    "kernels",  # 6: the platforms' kernels, in `kernels/` (Triton's and the CPU's C)
    "platforms",  # 7: each device's speed behind one seam, the runner's to call
    "sampling",  # 8
    "sched",  # 9
    "runner",  # 10
    "runner.parallel",  # 11
    "engine",  # 12
    "sim",  # 13
    "server",  # 14
    "__main__",  # 15: the command line (with the package's own `__init__`)
    "testing",  # 16: the oracles tests and notebooks compare against
)

# Names an object outside the engine must never be given by assignment.
ENGINE_PARTS = frozenset(
    {"scheduler", "kv_manager", "runner", "sampler", "processor", "tokenizer", "model"}
)
ENGINE_MODULES = frozenset({"minipaged.engine.engine"})

# Private names of *other* libraries that are their only public way in, with the reason.
ALLOWED_PRIVATE = {
    "_linear_pointwise": "oneDNN's fused linear is registered only as torch.ops.mkldnn's op",
    "_reorder_linear_weight": "so is the packing of a weight for it",
    "_is_mkldnn_bf16_supported": "oneDNN's own word on whether its bfloat16 path runs on this "
                                 "CPU (torch.testing asks it too)",
    "_version": "torch's in-place version counter, the one sign that a packed copy is stale",
    "_profiler_enabled": "whether a torch profiler runs (torch's own record_function asks it): "
                         "entering a record_function costs ~7 us even when none does",
    "_replace": "a NamedTuple's copy with fields changed: public API, underscored so that no "
                "field name can clash with it",
    "_C": "torch._C.DisableTorchFunction: a capture's recorder does not watch the platform's "
          "own code (torch's documented idiom inside __torch_function__; no public name)",
}


# -- reading the source ---------------------------------------------------------------------------


def core_files() -> list[Path]:
    return sorted((ROOT / "minipaged").rglob("*.py")) + sorted((ROOT / "kernels").rglob("*.py"))


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "kernels":
        parts = ["minipaged", "kernels", *parts[1:]]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def unit_of(module: str) -> str:
    """The layer unit of a module: the longest entry of `LAYERS` its dotted path starts with
    (a nested layer such as `models.checkpoint` before its parent's); the package itself is
    the front end's."""
    path = module.removeprefix("minipaged").removeprefix(".")
    if not path:
        return "__main__"
    matches = [u for u in LAYERS if path == u or path.startswith(u + ".")]
    return max(matches, key=len) if matches else path.split(".")[0]


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
            names = [f"{base}.{a.name}" for a in node.names]
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


def test_every_module_belongs_to_a_layer() -> None:
    units = {unit_of(m) for m in import_graph()}
    assert units - set(LAYERS) == set(), f"units not in LAYERS: {sorted(units - set(LAYERS))}"
    assert set(LAYERS) - units == set(), f"LAYERS names missing units: {set(LAYERS) - units}"


def test_imports_only_go_down_the_layers() -> None:
    rank = {unit: i for i, unit in enumerate(LAYERS)}
    upward = [
        f"{a} ({unit_of(a)}) imports {b} ({unit_of(b)})"
        for a, targets in import_graph().items()
        for b in sorted(targets)
        if rank[unit_of(b)] > rank[unit_of(a)]
    ]
    assert not upward, "imports that go up the layers:\n" + "\n".join(upward)


def test_nothing_in_the_package_imports_the_test_oracles() -> None:
    found = [
        f"{a} imports {b}"
        for a, targets in import_graph().items()
        for b in targets
        if unit_of(b) == "testing" and unit_of(a) != "testing"
    ]
    assert not found, "\n".join(found)


def test_the_architecture_page_lists_the_layers_in_order() -> None:
    """One row per layer in docs/architecture.md, numbered from 1 in `LAYERS`' order."""
    text = ARCHITECTURE.read_text().split("## Layers", 1)
    assert len(text) == 2, "docs/architecture.md has no '## Layers' section"
    rows = []
    for line in text[1].split("\n## ", 1)[0].splitlines():
        row = re.match(r"\|\s*(\d+)\s*\|\s*`([\w/.]+)`", line)
        if row:
            path = row.group(2).removeprefix("minipaged/").removesuffix("/").removesuffix(".py")
            rows.append((int(row.group(1)), path.replace("/", ".")))
    assert rows == list(enumerate(LAYERS, start=1))


def test_every_subpackage_names_its_public_face() -> None:
    inits = [p for p in core_files() if p.name == "__init__.py" and p.parent != ROOT / "minipaged"]
    missing = []
    for path in inits:
        tree = ast.parse(path.read_text())
        names = {
            t.id
            for node in tree.body
            if isinstance(node, ast.Assign | ast.AnnAssign)
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Name)
        }
        if "__all__" not in names:
            missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"subpackages without __all__: {missing}"


def test_folders_are_small_and_their_modules_have_distinct_prefixes() -> None:
    folders = [
        folder
        for top in (ROOT / "minipaged", ROOT / "kernels")
        for folder in (top, *(p for p in top.rglob("*") if p.is_dir()))
    ]
    problems = []
    for folder in folders:
        if folder.name in {"__pycache__", "csrc"}:
            continue
        entries = [
            p.stem
            for p in folder.iterdir()
            if (p.suffix == ".py" and p.stem not in ("__init__", "__main__"))
            or (p.is_dir() and (p / "__init__.py").exists())
        ]
        if folder == ROOT / "minipaged":  # the package's own folder: its top-level layers only
            layers = {unit for unit in LAYERS if "." not in unit and unit != "__main__"}
            if set(entries) != layers:
                problems.append(f"minipaged: {sorted(entries)} are not the top-level layers")
        elif len(entries) > MAX_FOLDER_ENTRIES:
            problems.append(f"{folder.relative_to(ROOT)}: {len(entries)} entries")
        prefixes: dict[str, list[str]] = {}
        for name in entries:
            prefixes.setdefault(name.strip("_").split("_")[0], []).append(name)
        problems += [
            f"{folder.relative_to(ROOT)}: {sorted(names)} share the prefix {prefix!r}"
            for prefix, names in prefixes.items()
            if len(names) > 1
        ]
    assert not problems, "\n".join(sorted(set(problems)))


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph`, or None."""
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
            return cycle
    return None


def package_of(module: str, graph: dict[str, set[str]]) -> str:
    """The package a module lies in; a package's `__init__` is a node of its own: the package's
    public face, which may name what its subpackages hold (the platforms' choice of one)."""
    is_package = any(other.startswith(module + ".") for other in graph)
    return f"{module}.__init__" if is_package else module.rpartition(".")[0]


def test_the_import_graph_has_no_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_package_imports_a_package_that_imports_it() -> None:
    """Collapsed to packages (a package's modules outside its subpackages and its `__init__`,
    as one node), the import graph has no cycle either: a subpackage and its parent's modules
    never import each other."""
    graph = import_graph()
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        own = package_of(module, graph)
        packages.setdefault(own, set()).update(
            package_of(t, graph) for t in targets if package_of(t, graph) != own)
    cycle = find_cycle(packages)
    assert cycle is None, "package import cycle: " + " -> ".join(cycle or [])


def test_the_model_knows_no_platform() -> None:
    """The model is written once, in plain PyTorch: nothing under `minipaged/models/` imports
    the kernels or the platforms (a platform swaps its modules in at load)."""
    found = [f"{a} imports {b}" for a, targets in import_graph().items()
             if unit_of(a) in ("models", "models.checkpoint") for b in targets
             if unit_of(b) in ("kernels", "platforms")]
    assert not found, "\n".join(found)


def device_questions(source: str) -> Iterator[str]:
    """Where `source` asks what a device is: a device's `.type` (`x.device.type`, `device.type`,
    `torch.device(...).type`), a tensor's `.is_cuda` / `.is_cpu`, or `torch.cuda`."""
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        owner = ast.unparse(node.value)
        of_a_device = owner.endswith("device") or owner.startswith("torch.device(")
        if ((node.attr == "type" and of_a_device) or node.attr in ("is_cuda", "is_cpu")
                or ast.unparse(node) == "torch.cuda"):
            yield f"line {node.lineno}: {ast.unparse(node)}"


def test_only_the_platforms_ask_what_a_device_is() -> None:
    """Every device question is the platform's (`Platform.check_and_update_config` and the
    class's facts): no module of the package outside `minipaged/platforms/` asks one."""
    platforms = ROOT / "minipaged" / "platforms"
    found = [f"{path.relative_to(ROOT)}: {question}"
             for path in sorted((ROOT / "minipaged").rglob("*.py"))
             if platforms not in path.parents
             for question in device_questions(path.read_text())]
    assert not found, "device questions outside the platforms:\n" + "\n".join(found)
    asked = list(device_questions("a = x.device.type == 'cpu'\nb = torch.device(d).type\n"
                                  "c = t.is_cuda\nd = torch.cuda.is_available()\ne = x.dtype\n"))
    assert sorted(line.split(":")[0] for line in asked) == ["line 1", "line 2", "line 3", "line 4"]


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
            "from minipaged.sched.base import _Budget\n"
            "engine._groups\nself.kv._blocks\nself._own\ncls._own\nx.__class__\nsuper()._hook\n"
        )
    )
    assert flagged == [
        "from minipaged.sched.base import _Budget",
        "line 2: engine._groups",
        "line 3: self.kv._blocks",
    ]


# -- sizes ----------------------------------------------------------------------------------------


def line_count(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_module_is_over_500_lines() -> None:
    long = {str(p.relative_to(ROOT)): line_count(p) for p in core_files()}
    long = {name: n for name, n in long.items() if n > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"

