"""The test tree's own rules: helpers live in ``tests/support``, and no test module imports
another (what two of them share moves to the support package)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            out.append(base)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return out


def test_no_test_module_imports_another():
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        for name in _imports(path):
            last = name.lstrip(".").split(".")[-1] if name.lstrip(".") else ""
            if last.startswith("test_") or ".test_" in name:
                offenders.append(f"{path.relative_to(TESTS)} imports {name}")
    assert offenders == []


def test_only_test_modules_and_the_conftest_sit_at_the_top_of_the_tree():
    top = {p.name for p in TESTS.glob("*.py")}
    helpers = sorted(n for n in top if not n.startswith("test_"))
    assert helpers == ["__init__.py", "conftest.py"]
