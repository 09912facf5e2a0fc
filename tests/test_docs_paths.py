"""Every repository path the documents name exists: README.md and docs/*.md, in their inline
code (`...`) and their link targets, and the rooted paths of their fenced blocks; and every
picture they embed (``![...](pictures/x.svg)``) is an SVG that draws.

How a name is read, so that each form points at one place:

- **rooted**: a word beginning with ``vmlend/``, ``tests/``, ``bench/``, ``kernel-tier/``,
  ``docs/``, ``xml-templates/`` or ``.ci/`` is relative to the repository's root
  (``vmlend/topology/paths.py``, ``tests/kernel/``).
- **package-relative**: a word whose first part is a package of vmlend (``nvme``, ``sim``,
  ``ledger``...) and that names a module file (``nvme/shares.py``), a module and one of its
  names (``ledger/ledger.lend_shared``) or a directory (``sim/nvme/``) is relative to
  ``vmlend/``: the docs say ``sim/backend.py`` where the package is plain from the text.
- **dotted**: ``vmlend.a.b`` is the module ``vmlend/a/b.py`` or the package ``vmlend/a/b/``;
  with more parts (``vmlend.a.b.name``, ``vmlend.a.b.Class.method(...)``), the longest
  prefix that is a module must define the next part at its top level (a def, class,
  assignment or import).
- **bare module file**: a word without a slash ending in ``.py``, ``.sh``, ``.c`` or ``.patch``
  (``ntb.py``, the table of a package's modules) names a tracked file of that name somewhere
  in the tree.
- **test id**: ``path::test_name`` is the path as above, and ``test_name`` is defined in it.
- **link**: a markdown link's target (``pictures/fabric.svg``) is relative to the document's
  directory, as a renderer reads it.
- ``<placeholder>``, ``*`` and ``...`` are wildcards: at least one file matches.

Not read as repository paths: absolute paths and ``<root>/...`` (a host's files), URIs,
``hooks/...`` (libvirt's hooks directory has the name; the repository's one file there is
``hooks/vmlend-qemu``), ``build/`` and ``.venv/`` (made by ``make``, git-ignored), and words
whose first part is not a package of vmlend (registry keys such as ``holds/<fdid>``, cable
names such as ``mxs824/gamma:0``). ``NOT_PATHS`` lists the few words that look like paths and
are something else, each with what it is."""

from __future__ import annotations

import ast
import functools
import importlib
import re
from pathlib import Path

import pytest
from lxml import etree

from tests.support.paths import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

#: Top-level directories of the repository a rooted name starts with.
ROOTS = ("vmlend", "tests", "bench", "kernel-tier", "docs", "xml-templates", ".ci")
#: Words of the docs that look like repository paths and are not, with what they are.
NOT_PATHS = {
    "vmlend/1": "the format tag of the CLI's JSON output",
    "roles.sh": "the script `vmlend registry roles` writes for the operator (docs/cluster.md)",
}

_CODE = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```[^\n]*\n.*?^```", re.S | re.M)
#: A word inside code: what a path can be made of, placeholders and globs included.
_WORD = re.compile(r"[\w.<>*/{}:\-…]+")
#: A picture a document embeds: ``![what it shows](target)``.
_PICTURE = re.compile(r"!\[[^\]\n]*\]\(([^)\s]+)\)")
_SVG = "{http://www.w3.org/2000/svg}"
_BARE_FILE = re.compile(r"^[\w-]+\.(py|sh|c|patch)$")
_DOTTED = re.compile(r"^vmlend(\.\w+)+$")


@functools.cache
def _packages() -> frozenset[str]:
    src = REPO / "vmlend"
    return frozenset(p.name for p in src.iterdir() if (p / "__init__.py").exists())


@functools.cache
def _tracked_names() -> frozenset[str]:
    """The file names anywhere in the source trees (for bare module names)."""
    names: set[str] = set()
    for root in (*ROOTS, "hooks"):
        for p in (REPO / root).rglob("*"):
            if "__pycache__" not in p.parts and p.is_file():
                names.add(p.name)
    return frozenset(names)


def _glob(base: Path, rel: str) -> bool:
    """Whether ``rel`` below ``base`` exists, ``<x>``, ``*`` and ``...`` matching anything."""
    pattern = re.sub(r"<[^>]*>|\.\.\.|…", "*", rel).rstrip("/")
    if not pattern or pattern == ".":
        return base.exists()
    if "*" not in pattern:
        return (base / pattern).exists()
    return any(base.glob(pattern))


@functools.cache
def _defines(module: Path, name: str) -> bool:
    """Whether ``module`` defines (or imports) ``name`` at its top level, or, for a module
    that loads its names on first use (PEP 562 ``__getattr__``), has it once imported."""
    tree = ast.parse(module.read_text())
    lazy = False
    for node in tree.body:
        lazy |= isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found = {node.name}
        elif isinstance(node, ast.Assign):
            found = {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found = {node.target.id}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found = {(a.asname or a.name).split(".")[0] for a in node.names}
        else:
            continue
        if name in found:
            return True
    if lazy:
        parts = module.relative_to(REPO).with_suffix("").parts
        dotted = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        return hasattr(importlib.import_module(dotted), name)
    return False


def _module(parts: list[str]) -> Path | None:
    """The file of the module ``parts`` (below the repository) names, None if none."""
    base = REPO.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _dotted(word: str) -> str | None:
    """What is wrong with a dotted name ``vmlend.a.b[.name...]``; None when nothing is."""
    parts = word.split(".")
    for n in range(len(parts), 1, -1):
        module = _module(parts[:n])
        if module is None:
            continue
        if n == len(parts) or _defines(module, parts[n]):
            return None
        return f"{'.'.join(parts[:n])} defines no {parts[n]!r}"
    return f"no module {'.'.join(parts[:2])}"


def _test_id(path: Path, test: str) -> str | None:
    if not path.is_file():
        return None  # the path's own check reports it
    if _defines(path, test):
        return None
    return f"{path.relative_to(REPO)} defines no {test}"


def check_word(word: str, doc_dir: Path, *, link: bool = False) -> str | None:
    """What is wrong with ``word`` as the name of a repository path: None when it exists or
    is not read as one (the module's docstring says how each form is read)."""
    word = word.lstrip("('\"").rstrip(".,;:)'\"")
    if word in NOT_PATHS or "://" in word:
        return None
    word, _, test = word.partition("::")
    if link:
        if word.startswith(("#", "http:", "https:", "mailto:")):
            return None
        word = word.split("#")[0]
        return None if _glob(doc_dir, word) else f"link target {word} does not exist"
    if _DOTTED.match(word):
        return _dotted(word)
    parts = word.split("/")
    if len(parts) > 1 and parts[0] in ROOTS:
        path = REPO / word.rstrip("/")
        if not _glob(REPO, word):
            return f"{word} does not exist"
        return _test_id(path, test) if test else None
    if len(parts) > 1 and parts[0] in _packages():
        module, dot, name = parts[-1].partition(".")
        if dot and name != "py" and re.fullmatch(r"\w+", module) and re.fullmatch(r"\w+", name):
            found = _module(["vmlend", *parts[:-1], module])
            if found is None:
                return f"{word}: no module vmlend/{'/'.join(parts[:-1])}/{module}.py"
            return None if _defines(found, name) else f"{word}: its module defines no {name!r}"
        if word.endswith((".py", "/")) and not _glob(REPO / "vmlend", word):
            return f"{word} (read as vmlend/{word}) does not exist"
        if test and word.endswith(".py"):
            return _test_id(REPO / "vmlend" / word, test)
        return None
    if _BARE_FILE.match(word):
        if word not in _tracked_names():
            return f"no file named {word} in the repository"
        return None
    return None


def problems(text: str, doc_dir: Path) -> list[str]:
    """Every name in ``text`` (a markdown document in ``doc_dir``) that is read as a
    repository path and does not exist, as ``line N: `name`: why``."""
    out = []

    def report(offset: int, word: str, why: str | None) -> None:
        if why is not None:
            out.append(f"line {text.count(chr(10), 0, offset) + 1}: `{word}`: {why}")

    fenced = [(m.start(), m.end()) for m in _FENCE.finditer(text)]
    for start, end in fenced:  # commands and listings: only the rooted words
        for m in _WORD.finditer(text, start, end):
            if m.group().split("/")[0] in ROOTS and "/" in m.group():
                report(m.start(), m.group(), check_word(m.group(), doc_dir))
    prose = text
    for start, end in fenced:
        prose = prose[:start] + re.sub(r"[^\n]", " ", prose[start:end]) + prose[end:]
    for m in _CODE.finditer(prose):
        for w in _WORD.finditer(m.group(1)):
            report(m.start(1) + w.start(), w.group(), check_word(w.group(), doc_dir))
    for m in _LINK.finditer(prose):
        report(m.start(1), m.group(1), check_word(m.group(1), doc_dir, link=True))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_every_path_a_document_names_exists(doc: Path) -> None:
    assert problems(doc.read_text(), doc.parent) == []


BROKEN = """
The model is `vmlend/topology/gone.py`; its sibling `vmlend/topology/paths.py` is real.
Sharing: `nvme/ledger.py` (gone) beside `nvme/shares.py`; `ledger/ledger.lend_nothing`.
Tests: `tests/unit/topology/test_paths.py::test_no_such_test`, `tests/unit/nowhere/`.
Dotted: `vmlend.topology.paths.route(topology)` is real, `vmlend.fabric.admission` is not,
and neither is `vmlend.topology.paths.no_such_name`. A bare module: `nosuchmodule.py`.
Globs: `tests/unit/domain/test_domain_*.py` match, `bench/bench_<nothing>.txt` does not.
A picture: ![x](pictures/none.svg). Not paths: `holds/<fdid>`, `mxs824/gamma:0`,
`/etc/vmlend/vmlend.toml`, `sim:///gamma`, `hooks/qemu`, `build/kernel/console.log`.

```
$ .venv/bin/python bench/bench_gone.py     # a command naming a missing script
tests/
  unit/<package>/   (a listing: relative words are not read)
```
"""


def test_each_form_of_a_missing_path_is_reported_and_the_rest_is_not() -> None:
    found = problems(BROKEN, REPO / "docs")
    words = [p.split("`")[1] for p in found]
    assert words == [
        "bench/bench_gone.py",
        "vmlend/topology/gone.py",
        "nvme/ledger.py",
        "ledger/ledger.lend_nothing",
        "tests/unit/topology/test_paths.py::test_no_such_test",
        "tests/unit/nowhere/",
        "vmlend.fabric.admission",
        "vmlend.topology.paths.no_such_name",
        "nosuchmodule.py",
        "bench/bench_<nothing>.txt",
        "pictures/none.svg",
    ], found
    assert found[0].startswith("line 12: ")  # the line of the document, counted from 1


def picture_problem(path: Path) -> str | None:
    """Why the picture at ``path`` would not draw in a reader's browser, or None: the docs
    embed Graphviz's SVGs ('make pictures'), so an SVG that parses, with a size and at least
    one drawn node (a failed drawing leaves a file cut short, or empty)."""
    if path.suffix != ".svg":
        return "not an SVG ('make pictures' draws the docs' pictures as SVG)"
    try:
        root = etree.parse(str(path)).getroot()
    except (OSError, etree.XMLSyntaxError) as e:
        return f"does not parse: {e}"
    if root.tag != f"{_SVG}svg":
        return f"its root is {root.tag}, not an SVG"
    try:
        size = [float(root.get(a, "").removesuffix("pt")) for a in ("width", "height")]
    except ValueError:
        return "has no width and height in points"
    if min(size) <= 0:
        return f"is {size[0]} by {size[1]} pt"
    if root.find(f".//{_SVG}g[@class='node']") is None:
        return "draws nothing"
    return None


def _pictures() -> list[tuple[Path, str]]:
    return [(doc, target) for doc in DOCS for target in _PICTURE.findall(doc.read_text())]


def test_the_documents_embed_their_pictures() -> None:
    targets = {target for _, target in _pictures()}
    assert {"pictures/fabric.svg", "pictures/path-via-ram.svg"} <= targets


@pytest.mark.parametrize(
    ("doc", "target"), _pictures(), ids=[f"{d.relative_to(REPO)}:{t}" for d, t in _pictures()]
)
def test_every_picture_a_document_embeds_draws(doc: Path, target: str) -> None:
    assert picture_problem(doc.parent / target) is None


_XMLNS = 'xmlns="http://www.w3.org/2000/svg"'


@pytest.mark.parametrize(
    ("name", "text", "problem"),
    [
        ("cut.svg", f'<svg {_XMLNS} width="8pt" height="8pt">', "parse"),
        ("empty.svg", "", "parse"),
        ("page.svg", "<html/>", "not an SVG"),
        ("sizeless.svg", f"<svg {_XMLNS}/>", "no width"),
        ("flat.svg", f'<svg {_XMLNS} width="0pt" height="8pt"/>', "0.0 by"),
        ("blank.svg", f'<svg {_XMLNS} width="8pt" height="8pt"/>', "nothing"),
        ("picture.png", "", "not an SVG"),
    ],
)
def test_a_picture_that_would_not_draw_is_reported(tmp_path, name, text, problem) -> None:
    path = tmp_path / name
    path.write_text(text)
    assert problem in (picture_problem(path) or "")
    assert picture_problem(tmp_path / "missing.svg") is not None
