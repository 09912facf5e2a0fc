"""The imports between vmlend's first-level packages and modules form no cycle, and the
production planes do not reach into the simulator.

The graph is read from the source with ``ast``: every import a module runs (module level or in
a function), relative imports resolved; imports under ``if TYPE_CHECKING:`` are left out (they
never run). A first-level unit is ``vmlend.<name>``: a package (``vmlend/ledger/``) or a module
(``vmlend/errors.py``)."""

from __future__ import annotations

import ast
import itertools
from collections import defaultdict
from pathlib import Path

import pytest

import vmlend

ROOT = Path(vmlend.__file__).parent

# Who may import vmlend.sim: the composition root and the front ends that build a simulated
# cluster. The production planes (kernel, ledger, registry, fabric, lending, ops, hook, agent)
# never do.
MAY_IMPORT_SIM = {"vmlend.sim", "vmlend.wiring", "vmlend.cli", "vmlend.demo"}
PRODUCTION_PLANES = (
    "vmlend.kernel",
    "vmlend.ledger",
    "vmlend.registry",
    "vmlend.fabric",
    "vmlend.lending",
    "vmlend.ops",
    "vmlend.hook",
    "vmlend.agent",
)
# Rendering is shared by cli and demo and knows neither.
VIEWS_MAY_NOT_IMPORT = ("vmlend.cli", "vmlend.demo")


def _module_name(path: Path) -> tuple[str, bool]:
    """The dotted name of a source file, and whether it is a package's ``__init__``."""
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join(parts), is_package


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: all but those under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:  # the ``else:`` branch does run
                visit(child)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _imported_modules(
    module: str, is_package: bool, node: ast.Import | ast.ImportFrom
) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        package = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module or ""
    # ``from vmlend import errors`` imports the module vmlend.errors.
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def _unit(name: str) -> str | None:
    """The first-level unit ``vmlend.<name>`` a dotted name falls in; None outside vmlend or for
    the bare ``vmlend`` package."""
    parts = name.split(".")
    if parts[0] != "vmlend" or len(parts) < 2:
        return None
    unit = ".".join(parts[:2])
    if (ROOT / parts[1]).is_dir() or (ROOT / f"{parts[1]}.py").is_file():
        return unit
    return None


def package_graph() -> dict[tuple[str, str], set[str]]:
    """(importing unit, imported unit) -> the modules that make that import."""
    edges: dict[tuple[str, str], set[str]] = defaultdict(set)
    for path in sorted(ROOT.rglob("*.py")):
        module, is_package = _module_name(path)
        source = _unit(module)
        if source is None:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _runtime_imports(tree):
            for name in _imported_modules(module, is_package, node):
                target = _unit(name)
                if target is not None and target != source:
                    edges[(source, target)].add(module)
    return edges


def find_cycle(edges: dict[tuple[str, str], set[str]]) -> list[str] | None:
    """One cycle of units (first unit repeated at the end), None when there is none."""
    successors: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        successors[a].add(b)
    WHITE, GREY, BLACK = 0, 1, 2
    colour: dict[str, int] = defaultdict(int)
    stack: list[str] = []

    def visit(unit: str) -> list[str] | None:
        colour[unit] = GREY
        stack.append(unit)
        for nxt in sorted(successors[unit]):
            if colour[nxt] == GREY:
                return [*stack[stack.index(nxt) :], nxt]
            if colour[nxt] == WHITE:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        colour[unit] = BLACK
        return None

    for unit in sorted(successors):
        if colour[unit] == WHITE:
            cycle = visit(unit)
            if cycle:
                return cycle
    return None


def _describe(edges: dict[tuple[str, str], set[str]], pairs: list[tuple[str, str]]) -> str:
    return "\n".join(f"  {a} -> {b}  (in {', '.join(sorted(edges[(a, b)]))})" for a, b in pairs)


@pytest.fixture(scope="module")
def edges() -> dict[tuple[str, str], set[str]]:
    """The graph, read once for the module's tests (which only read it)."""
    return package_graph()


def test_the_graph_is_read(edges) -> None:
    # A few imports that must be seen, so an empty graph does not pass for an acyclic one.
    assert ("vmlend.cli", "vmlend.errors") in edges
    assert ("vmlend.wiring", "vmlend.sim") in edges  # function-level in wiring.fabric


def test_no_import_cycle_between_first_level_packages(edges) -> None:
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle between vmlend's packages:\n" + _describe(
        edges, list(itertools.pairwise(cycle))
    )


def test_production_planes_do_not_import_the_simulator(edges) -> None:
    bad = sorted((a, b) for a, b in edges if b == "vmlend.sim" and a not in MAY_IMPORT_SIM)
    assert not bad, "imports of vmlend.sim outside the composition root:\n" + _describe(edges, bad)
    assert not any(a.startswith(PRODUCTION_PLANES) for a, _ in bad)


def test_views_know_neither_cli_nor_demo(edges) -> None:
    bad = sorted((a, b) for a, b in edges if a == "vmlend.views" and b in VIEWS_MAY_NOT_IMPORT)
    assert not bad, "vmlend.views imports a front end:\n" + _describe(edges, bad)
