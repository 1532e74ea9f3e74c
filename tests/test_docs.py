"""The docs site and the notebooks as a reader gets them.

The site builds with `mkdocs build --strict`; every internal link and `#anchor` of the built
HTML leads to a page and an element that exist (parsed with the stdlib's `html.parser`), and no
page loads anything from another host (the site works offline). Every repository file the prose
names (README, changelog, docs pages, notebooks) exists. Every notebook fits the rendered
page: code lines of at most 88 characters, figures at most ~9 in wide at ~110 dpi (read from the
PNG outputs' headers), no warnings or local file paths in its outputs. A failure lists every
offending cell, counted from 0 as in the file's "cells" list.

What the prose claims is held to the code: a module or class a notebook or page names imports
from where the prose says; a comparison a notebook states in words ("weaker", "within a few",
"never crosses", "the paper's ranges") is asserted by the code cell right after it, so that a
run whose numbers say otherwise fails (`test_a_planted_contradiction_fails` shows both checks
catching a planted error); every package's docstring carries the layer number of the README's
table; every layer page has a picture.

The build takes a few seconds; the tests that need it share one build, on one xdist worker.
"""

from __future__ import annotations

import base64
import json
import os
import re
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

pytestmark = pytest.mark.xdist_group("docs")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

MAX_CODE_LINE = 88  # characters: what a notebook page's code column shows without scrolling
MAX_FIGURE_WIDTH = 1000  # pixels: ~9 in at ~110 dpi, shown unscaled on a notebook page
MIN_FIGURE_DPI = 100  # below it a figure's 10-point labels are under 14 pixels high
BUILD_TIMEOUT = 300  # seconds; a build takes a few

# Elements whose URL attribute the browser loads or follows, and the attribute.
URL_ATTRIBUTES = {"a": "href", "link": "href", "img": "src", "script": "src", "source": "src",
                  "iframe": "src"}
# A local file path in an output: an absolute Unix path under a user or system folder, or a
# Python installation's package folder.
LOCAL_PATH = re.compile(r"(?<![\w.:/])/(?:home|root|work|tmp|Users|usr|opt|var|srv)/|site-packages")


# -- reading the built site -----------------------------------------------------------------------


@dataclass
class Page:
    """What a built HTML page offers (the ids its anchors can name) and refers to."""

    ids: set[str] = field(default_factory=set)
    urls: list[tuple[str, str]] = field(default_factory=list)  # (tag, url)


class PageParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.page = Page()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        for name in ("id", "name"):
            if values.get(name):
                self.page.ids.add(values[name])
        url = values.get(URL_ATTRIBUTES.get(tag, ""))
        if url is not None:
            self.page.urls.append((tag, url))


def parse_site(site: Path) -> dict[Path, Page]:
    pages = {}
    for path in sorted(site.rglob("*.html")):
        parser = PageParser()
        parser.feed(path.read_text(encoding="utf-8"))
        pages[path] = parser.page
    return pages


def is_external(url: str) -> bool:
    return bool(urlsplit(url).scheme) or url.startswith("//")


def broken(site: Path, pages: dict[Path, Page], source: Path, url: str) -> str | None:
    """Why an internal `url` on page `source` leads nowhere; None when it resolves."""
    parts = urlsplit(url)
    path = unquote(parts.path)
    if not path:
        target = source
    elif path.startswith("/"):  # root-relative (the 404 page's links)
        target = site / path.lstrip("/")
    else:
        target = source.parent / path
    target = target.resolve()
    if target.is_dir():
        target = target / "index.html"
    if not target.is_relative_to(site.resolve()):
        return "leads outside the site"
    if not target.is_file():
        return "no such file"
    fragment = unquote(parts.fragment)
    if fragment and target.suffix == ".html" and fragment not in pages[target].ids:
        return f"no element with id {fragment!r} in {target.relative_to(site.resolve())}"
    return None


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built strict (any warning fails) into a temporary folder."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=BUILD_TIMEOUT)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-4000:]}"
    return out.resolve()


# -- the site -------------------------------------------------------------------------------------


def test_every_internal_link_and_anchor_resolves(site):
    pages = parse_site(site)
    assert site / "index.html" in pages
    assert site / "notebooks" / "01_tokenizer" / "index.html" in pages
    failures = []
    checked = 0
    for source, page in pages.items():
        for _, url in page.urls:
            if is_external(url):
                continue
            checked += 1
            reason = broken(site, pages, source, url)
            if reason:
                failures.append(f"{source.relative_to(site)}: {url} ({reason})")
    assert checked > 100  # the navigation alone links every page from every page
    assert not failures, "\n".join(failures)


def test_the_site_loads_nothing_from_other_hosts(site):
    """Stylesheets, scripts, fonts and images come with the site (`theme: font: false`), so it
    reads the same offline; only plain links (`<a href>`) may point elsewhere."""
    loaded = [
        f"{source.relative_to(site)}: <{tag}> {url}"
        for source, page in parse_site(site).items()
        for tag, url in page.urls
        if tag != "a" and is_external(url) and not url.startswith("data:")
    ]
    assert not loaded, "\n".join(loaded)


def test_broken_links_and_anchors_are_found(tmp_path):
    """The checker itself: a missing page, a missing anchor and a link out of the site are
    reported; a good link, a good anchor and a root-relative link are not."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "index.html").write_text('<h2 id="here">x</h2>')
    (tmp_path / "index.html").write_text("")
    pages = parse_site(tmp_path)
    source = tmp_path / "a" / "index.html"
    assert broken(tmp_path, pages, source, "#here") is None
    assert broken(tmp_path, pages, source, "../a/#here") is None
    assert broken(tmp_path, pages, source, "/a/") is None
    assert broken(tmp_path, pages, source, "../") is None
    assert "no element" in broken(tmp_path, pages, source, "#gone")
    assert "no such file" in broken(tmp_path, pages, source, "../b/")
    assert "outside" in broken(tmp_path, pages, source, "../../x/")


# -- the files the pages name ---------------------------------------------------------------------

# A repository path a page names in backticks: under a top-level folder (`minipaged/sched/mlfq.py`,
# `benchmarks/results/fastserve*.json`), or a top-level document (`CHANGELOG.md`). Bare file
# names (`config.json`, `mlfq.py` in a table of modules) and other projects' paths are not read.
NAMED_PATH = re.compile(r"`([\w./*-]+\.(?:md|py|json|ipynb|svg|toml|yml))`")
TOP_LEVEL_DOCUMENT = re.compile(r"[A-Z][A-Z_]*\.md")


def named_paths(text: str, top_level: set[str]) -> set[str]:
    """The repository paths `text` names (see NAMED_PATH), given the repository's top level."""
    return {
        name
        for name in NAMED_PATH.findall(text)
        if ("/" in name and name.split("/")[0] in top_level) or TOP_LEVEL_DOCUMENT.fullmatch(name)
    }


def page_texts() -> list[tuple[str, str]]:
    """(where, text) of the README, the changelog, every docs page and every notebook's prose."""
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("**/*.md"))]
    texts = [(str(page.relative_to(ROOT)), page.read_text(encoding="utf-8")) for page in pages]
    for notebook in NOTEBOOKS:
        prose = [text_of(c["source"]) for c in cells(notebook) if c["cell_type"] == "markdown"]
        texts.append((str(notebook.relative_to(ROOT)), "\n".join(prose)))
    return texts


def test_every_file_a_page_names_exists():
    """A design document, a module, a benchmark's JSON: what the prose names is in the repository
    (the project's design document is docs/architecture.md, not one outside it)."""
    top_level = {entry.name for entry in ROOT.iterdir()}
    missing = [
        f"{where}: {name}"
        for where, text in page_texts()
        for name in sorted(named_paths(text, top_level))
        if not any(ROOT.glob(name))
    ]
    assert not missing, "\n".join(missing)


def test_named_paths_reads_repository_paths_only():
    text = "`DESIGN.md`, `minipaged/sched/mlfq.py`, `results/*.json`, `other/x.py`, `config.json`"
    assert named_paths(text, {"minipaged", "results"}) == {
        "DESIGN.md",
        "minipaged/sched/mlfq.py",
        "results/*.json",
    }


# -- the notebooks --------------------------------------------------------------------------------


def cells(notebook: Path) -> list[dict]:
    return json.loads(notebook.read_text(encoding="utf-8"))["cells"]


def text_of(value: str | list[str]) -> str:
    return value if isinstance(value, str) else "".join(value)


def png_size(data: bytes) -> tuple[int, int, float | None]:
    """(width, height, dots per inch) from a PNG's header; dpi None when it records none."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk comes first
    dpi = None
    at = data.find(b"pHYs")
    if at > 0:
        per_x, _, unit = struct.unpack(">IIB", data[at + 4 : at + 13])
        if unit == 1:  # pixels per metre
            dpi = per_x * 0.0254
    return width, height, dpi


def figures(notebook: Path) -> list[tuple[int, int, float | None]]:
    """(cell index, width, dpi) of every PNG output of the notebook."""
    found = []
    for index, cell in enumerate(cells(notebook)):
        for output in cell.get("outputs", []):
            png = output.get("data", {}).get("image/png")
            if png is not None:
                width, _, dpi = png_size(base64.b64decode(text_of(png)))
                found.append((index, width, dpi))
    return found


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_code_lines_fit_the_page(notebook):
    long_lines = [
        f"cell {index}, line {number}: {len(line)} characters"
        for index, cell in enumerate(cells(notebook))
        if cell["cell_type"] == "code"
        for number, line in enumerate(text_of(cell["source"]).splitlines(), 1)
        if len(line) > MAX_CODE_LINE
    ]
    assert not long_lines, "\n".join(long_lines)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_figures_fit_the_page(notebook):
    too_wide = [f"cell {index}: {width} px wide" for index, width, _ in figures(notebook)
                if width > MAX_FIGURE_WIDTH]
    assert not too_wide, "\n".join(too_wide)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_figures_have_legible_labels(notebook):
    low = [f"cell {index}: {dpi:.0f} dpi" for index, _, dpi in figures(notebook)
           if dpi is not None and dpi < MIN_FIGURE_DPI - 0.5]
    assert not low, "\n".join(low)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_outputs_show_no_warning_or_local_path(notebook):
    shown = []
    for index, cell in enumerate(cells(notebook)):
        for output in cell.get("outputs", []):
            text = text_of(output.get("text", "")) + text_of(
                output.get("data", {}).get("text/plain", "")
            ) + "\n".join(output.get("traceback", []))
            if output.get("name") == "stderr" and "Warning" in text:
                shown.append(f"cell {index}: a warning: {text.strip()[:80]}")
            if LOCAL_PATH.search(text):
                shown.append(f"cell {index}: a local path: {LOCAL_PATH.search(text).group()}")
    assert not shown, "\n".join(shown)


def test_png_size_reads_width_and_dpi():
    """The header reader on a PNG made here: 3 x 2 pixels at 110 dpi."""
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(
            ">I", zlib.crc32(kind + body)
        )

    per_metre = round(110 / 0.0254)
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 3, 2, 8, 0, 0, 0, 0))
           + chunk(b"pHYs", struct.pack(">IIB", per_metre, per_metre, 1))
           + chunk(b"IDAT", zlib.compress(b"\x00\x00\x00\x00" * 2)) + chunk(b"IEND", b""))
    width, height, dpi = png_size(png)
    assert (width, height) == (3, 2) and abs(dpi - 110) < 0.01


# -- what a reader meets: short cells, public names, no lab-notebook prose -----------------------

MAX_CODE_CELL_LINES = 25  # a cell a reader takes in at once; longer harness is a helper module
# Words of a lab notebook, not of a page that states what is: a machine the reader does not have,
# an issue tracker the reader does not see, a working session. `docs/benchmarks.md` records the
# machines its measurements were made on: its prose names a machine by its CPU ("on the AMD
# EPYC"), never as "this machine" or "here", and only its result tables are left unread.
ISSUE_REFERENCE = re.compile(r"(?i)\bissue #\d+")
SESSION_WORDS = re.compile(r"(?i)\b(?:this session|last session|throwaway)\b")
MACHINE_WORDS = re.compile(
    r"(?i)\bthis (?:shared |run's )?machine\b|\bon this (?:\d+-core )?CPU\b|\bthis \d+-core\b"
    r"|\bthis (?:CPU|core)\b|\b(?:Xeon|EPYC|machine|CPU|VM|GPU) here\b|\bload average\b"
)
MEASUREMENT_PAGES = {"docs/benchmarks.md"}  # their result tables may name what ran them


def reader_texts() -> list[tuple[str, str]]:
    """(where, text) of every docs page and every notebook's prose."""
    pages = sorted((ROOT / "docs").glob("**/*.md"))
    texts = [(str(page.relative_to(ROOT)), page.read_text(encoding="utf-8")) for page in pages]
    for notebook in NOTEBOOKS:
        for index, cell in enumerate(cells(notebook)):
            if cell["cell_type"] == "markdown":
                texts.append((f"{notebook.relative_to(ROOT)} cell {index}",
                              text_of(cell["source"])))
    return texts


def prose_of(text: str) -> str:
    """`text` without its Markdown table rows (lines that start with `|`)."""
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("|"))


def lab_words(where: str, text: str) -> list[str]:
    """What in `text` reads as a lab notebook (see the patterns above); on a measurement page,
    what its prose says outside the result tables."""
    if where in MEASUREMENT_PAGES:
        text = prose_of(text)
    patterns = [ISSUE_REFERENCE, SESSION_WORDS, MACHINE_WORDS]
    return [m.group() for pattern in patterns for m in pattern.finditer(text)]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_code_cells_are_short(notebook):
    long_cells = [
        f"cell {index}: {len(text_of(cell['source']).splitlines())} lines"
        for index, cell in enumerate(cells(notebook))
        if cell["cell_type"] == "code"
        and len(text_of(cell["source"]).splitlines()) > MAX_CODE_CELL_LINES
    ]
    assert not long_cells, "\n".join(long_cells)


def private_names(source: str) -> list[str]:
    """Private names a notebook cell defines or reads: `x._name`, `from m import _name`,
    `def _name`, `class _Name` (dunder names aside)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.ImportFrom):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            names = [node.name]
        found += [n for n in names if n.startswith("_") and not n.startswith("__")]
    return found


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebooks_use_public_names_only(notebook):
    found = [
        f"cell {index}: {name}"
        for index, cell in enumerate(cells(notebook))
        if cell["cell_type"] == "code"
        for name in private_names(text_of(cell["source"]))
    ]
    assert not found, "\n".join(found)


def test_pages_and_notebooks_state_what_is():
    """No issue numbers, session words or machine words in the docs pages and the notebooks'
    prose: the numbers a notebook states are printed beside it, a machine's numbers live on the
    benchmarks page."""
    found = [f"{where}: {word!r}" for where, text in reader_texts()
             for word in lab_words(where, text)]
    assert not found, "\n".join(found)


def test_the_prose_checks_catch_what_they_claim():
    assert sorted(private_names("x._secret\nfrom m import _p\ndef _f(): pass\n"
                                "class _C: pass\ny.__class__\nself.public")) == [
        "_C", "_f", "_p", "_secret"]
    text = "As issue #21 found, on this 2-core CPU (load average 9) the Xeon here, this session"
    assert lab_words("docs/x.md", text) == ["issue #21", "this session", "on this 2-core CPU",
                                            "load average", "Xeon here"]
    assert lab_words("docs/x.md", "on this shared machine, this CPU's rate") == [
        "this shared machine", "this CPU"]
    table = "| system | CPU |\n|---|---|\n| paged | the Xeon here, load average 1 |\n"
    assert lab_words("docs/benchmarks.md", table) == []
    assert lab_words("docs/benchmarks.md", table + "On this machine, as issue #21 said") == [
        "issue #21", "this machine"]
    assert lab_words("docs/x.md", "built from scratch; here is the interface") == []


# -- what the prose claims, held to the code and the outputs --------------------------------------

# A name the prose says lives somewhere: a dotted module or attribute (`minipaged.sim.simulator`,
# `teaching.kv_sizes.OPT_13B`), a name and where it comes from ("`ToyEngine` (from
# `teaching.toy_blocks`)", "`X` in `m`"), or an inline import (`from m import A, B`).
DOTTED_NAME = re.compile(r"`((?:minipaged|teaching)(?:\.\w+)+)`")
NAME_FROM = re.compile(r"`(\w+)`,?\s+\(?(?:from|in|of)\s+`((?:minipaged|teaching)[\w.]*)`")
POSSESSIVE = re.compile(r"`((?:minipaged|teaching)[\w.]*)`'s\s+`(\w+)`")
INLINE_IMPORT = re.compile(r"`from ((?:minipaged|teaching)[\w.]*) import ([\w, ]+)`")


def named_imports(text: str) -> set[tuple[str, str | None]]:
    """(dotted path, name in it or None) for every module, class or function `text` names
    with where it lives (see the patterns above)."""
    found = {(dotted, None) for dotted in DOTTED_NAME.findall(text)}
    found |= {(where, name) for name, where in NAME_FROM.findall(text)}
    found |= set(POSSESSIVE.findall(text))
    for where, names in INLINE_IMPORT.findall(text):
        found |= {(where, name.strip()) for name in names.split(",") if name.strip()}
    return found


def resolves(dotted: str, name: str | None) -> bool:
    """Whether `dotted` imports (as a module, or as attributes of its longest importable
    prefix) and, given a name, holds it."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:] + ([name] if name else []):
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


@pytest.fixture
def teaching_on_path(monkeypatch):
    """The notebooks import their helpers as `teaching.<module>`, from their own folder."""
    monkeypatch.syspath_prepend(str(ROOT / "notebooks"))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_names_in_notebook_prose_import_from_where_the_prose_says(notebook, teaching_on_path):
    wrong = [
        f"cell {index}: {dotted}" + (f" has no {name}" if name else " does not import")
        for index, cell in enumerate(cells(notebook))
        if cell["cell_type"] == "markdown"
        for dotted, name in sorted(named_imports(text_of(cell["source"])), key=str)
        if not resolves(dotted, name)
    ]
    assert not wrong, "\n".join(wrong)


def test_names_in_the_pages_import_from_where_they_say(teaching_on_path):
    """The same for the README and every docs page."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
    wrong = [
        f"{page.relative_to(ROOT)}: {dotted}" + (f" has no {name}" if name else "")
        for page in pages
        for dotted, name in sorted(named_imports(page.read_text(encoding="utf-8")), key=str)
        if not resolves(dotted, name)
    ]
    assert not wrong, "\n".join(wrong)


# A comparison stated in words: the code cell right after it asserts it, so that a run whose
# numbers say otherwise fails instead of printing beside a sentence it contradicts.
COMPARISON = re.compile(
    r"(?i)\b(?:weaker|stronger|never\s+cross(?:es|ed)|within\s+(?:a\s+few|the\s+paper|\d)"
    r"|(?:in|inside)\s+the\s+paper's\s+ranges?|the\s+paper's\s+ranges|coincide"
    r"|(?:near\s+)?tie\s+(?:on|at)|near\s+tie|lower\s+bound)\b"
)


def asserts(source: str) -> bool:
    import ast

    return any(isinstance(node, ast.Assert) for node in ast.walk(ast.parse(source)))


def unasserted_comparisons(notebook_cells: list[dict]) -> list[str]:
    """The markdown cells that state a comparison (COMPARISON) not followed by a code cell
    that asserts something."""
    found = []
    for index, cell in enumerate(notebook_cells):
        if cell["cell_type"] != "markdown":
            continue
        words = [m.group() for m in COMPARISON.finditer(text_of(cell["source"]))]
        after = notebook_cells[index + 1] if index + 1 < len(notebook_cells) else None
        checked = (after is not None and after["cell_type"] == "code"
                   and asserts(text_of(after["source"])))
        if words and not checked:
            found.append(f"cell {index}: {', '.join(words)!s} with no assert right after")
    return found


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_comparison_in_words_is_asserted_right_after(notebook):
    found = unasserted_comparisons(cells(notebook))
    assert not found, "\n".join(found)


def test_a_planted_contradiction_fails():
    """The checks above on a notebook planted with the two kinds of error they exist for: a
    helper named where it does not live, and a comparison its numbers contradict."""
    prose = ("`ToyEngine` (from `minipaged.testing`) plays the engine; `KVCacheManager` "
             "(from `minipaged.kv`), `minipaged.sched.mlfq`'s `SkipJoinMLFQScheduler` and "
             "`from teaching.kv_sizes import OPT_13B` are right.")
    assert named_imports(prose) == {
        ("minipaged.testing", None), ("minipaged.kv", None), ("minipaged.sched.mlfq", None),
        ("minipaged.testing", "ToyEngine"), ("minipaged.kv", "KVCacheManager"),
        ("minipaged.sched.mlfq", "SkipJoinMLFQScheduler"), ("teaching.kv_sizes", "OPT_13B")}
    assert resolves("minipaged.kv", "KVCacheManager")
    assert resolves("minipaged.sim.simulator.simulate", None)
    assert not resolves("minipaged.testing", "ToyEngine")
    assert not resolves("minipaged.no_such_module", None)

    claim = {"cell_type": "markdown", "source": "The one-level MLFQ is the weaker baseline."}
    output = {"cell_type": "code", "source": "jct = {'one level': 3.54, 'skip-join': 3.55}"}
    check = {"cell_type": "code",
             "source": "assert jct['one level'] > jct['skip-join']  # weaker: slower"}
    assert unasserted_comparisons([output, claim]) == [
        "cell 1: weaker with no assert right after"]
    assert unasserted_comparisons([output, claim, check]) == []
    wrapped = {"cell_type": "markdown", "source": "paged sustains 1.78x, inside the\npaper's range"}
    assert unasserted_comparisons([wrapped]) == ["cell 0: inside the\npaper's range with no "
                                                 "assert right after"]
    scope: dict = {}
    exec(output["source"], scope)
    with pytest.raises(AssertionError):  # the numbers contradict the sentence: the run fails
        exec(check["source"], scope)


# -- the layer numbers ----------------------------------------------------------------------------

README_ROW = re.compile(r"^\| (\d+) \| ([^|]+) \|", re.MULTILINE)
LAYER_MENTION = re.compile(r"\b[Ll]ayer (\d+)\b")


def layer_folders(readme: str, root: Path) -> dict[Path, int]:
    """The README's layer table as {package folder: layer}: each row's folders (`x/y/`) and
    dotted packages (`minipaged.kernels`), those that exist; a row naming a module file (the
    command line's `__main__.py`) has no package docstring to hold."""
    folders = {}
    for number, where in README_ROW.findall(readme):
        for name in re.findall(r"`([\w./]+)`", where):
            path = root / (name if name.endswith("/") else name.replace(".", "/"))
            if not name.endswith(".py") and path.is_dir():
                folders[path.resolve()] = int(number)
    return folders


def layer_mismatches(folders: dict[Path, int], docstrings: dict[Path, str]) -> list[str]:
    """Each package (folder -> docstring) against the README's table: a folder the table names
    opens its docstring with "Layer N --"; a package inside one names no other layer."""
    wrong = []
    for folder, doc in sorted(docstrings.items()):
        owners = [f for f in folders if folder == f or f in folder.parents]
        if not owners:
            continue
        number = folders[max(owners, key=lambda f: len(f.parts))]
        if folder in folders and not doc.startswith(f"Layer {number} -- "):
            wrong.append(f"{folder}: does not open with 'Layer {number} --'")
        wrong += [f"{folder}: says layer {n}, the README says {number}"
                  for n in LAYER_MENTION.findall(doc) if int(n) != number]
    return wrong


def test_package_docstrings_carry_the_readmes_layer_numbers():
    import ast

    folders = layer_folders((ROOT / "README.md").read_text(encoding="utf-8"), ROOT)
    assert len(set(folders.values())) >= 14, folders  # every layer but a module file's
    packages = [*(ROOT / "minipaged").rglob("__init__.py"), *(ROOT / "kernels").rglob(
        "__init__.py")]
    docstrings = {init.parent.resolve(): ast.get_docstring(ast.parse(init.read_text())) or ""
                  for init in packages}
    wrong = layer_mismatches(folders, docstrings)
    assert not wrong, "\n".join(wrong)


def test_layer_mismatches_reads_the_readme_table(tmp_path):
    readme = ("| # | subpackage |\n|---|---|\n| 7 | `pkg/platforms/` |\n| 10 | `pkg/runner/` |\n"
              "| 15 | `pkg/__main__.py` |\n")
    for folder in ("pkg/platforms/cpu", "pkg/runner"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "pkg" / "__main__.py").write_text("")
    folders = layer_folders(readme, tmp_path)
    platforms, runner = tmp_path / "pkg" / "platforms", tmp_path / "pkg" / "runner"
    assert folders == {platforms.resolve(): 7, runner.resolve(): 10}
    good = {platforms.resolve(): "Layer 7 -- platforms", runner.resolve(): "Layer 10 -- x",
            (platforms / "cpu").resolve(): "The CPU platform.", tmp_path.resolve(): "Layer 1"}
    assert layer_mismatches(folders, good) == []
    bad = good | {runner.resolve(): "Layer 9 -- x",
                  (platforms / "cpu").resolve(): "The CPU's kernels (layer 0)."}
    assert len(layer_mismatches(folders, bad)) == 3


def test_every_layer_page_has_a_picture():
    pages = sorted((ROOT / "docs" / "layers").glob("*.md"))
    picture = re.compile(r"!\[[^\]]+\]\(\.\./images/[\w.-]+\.(?:png|svg)\)")
    bare = [page.name for page in pages if not picture.search(page.read_text(encoding="utf-8"))]
    assert len(pages) == 16 and not bare, bare
