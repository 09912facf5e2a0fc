"""The test tree's own rules: unit tests mirror vmlend's packages (``tests/unit/<package>``,
``core`` for vmlend's top-level modules) or a tool directory (``kernel-tier`` as
``tests/unit/kernel_tier``), whole-system scenarios sit in ``tests/scenarios``,
helpers live in ``tests/support``, and no test module imports another (what two of them share
moves to the support package)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest
from hypothesis import settings
from lxml import etree

from tests.support.hypothesis_tiers import DEFAULT_EXAMPLES, FAST, examples
from tests.support.paths import REPO, TESTS

#: What may sit at the top of the tree: the package marker, the shared fixtures, and the
#: tests of the trees' own rules.
TOP = {
    "__init__.py",
    "conftest.py",
    "test_suite_layout.py",
    "test_package_layers.py",
    "test_docs_paths.py",
}


def _imports(path) -> list[str]:
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


def test_the_top_of_the_tree_holds_only_the_rules_and_the_fixtures():
    top = {p.name for p in TESTS.glob("*.py")}
    assert top <= TOP, sorted(top - TOP)


def _mirrored() -> set[str]:
    """What a directory of tests/unit may be named after: a package of vmlend, a one-module
    plane (p2p.py), ``core`` for vmlend's top-level modules, or a top-level tool directory of
    the repository that holds Python modules of its own (kernel-tier/resolve.py), its hyphens
    read as underscores (a package's name cannot have them)."""
    src = REPO / "vmlend"
    names = {p.name for p in src.iterdir() if (p / "__init__.py").exists()}
    names |= {p.stem for p in src.glob("*.py")}
    tools = {
        p.name.replace("-", "_")
        for p in REPO.iterdir()
        if p.is_dir() and p not in (src, TESTS) and any(p.glob("*.py"))
    }
    return names | tools | {"core"}


def test_unit_tests_sit_under_a_package_of_vmlend():
    dirs = {p.name for p in (TESTS / "unit").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert dirs <= _mirrored(), sorted(dirs - _mirrored())
    stray = [p.name for p in (TESTS / "unit").glob("*.py") if p.name != "__init__.py"]
    assert stray == []


def test_every_test_directory_is_a_package_and_holds_tests_only():
    """A package marker in each: two test files of one name in two directories stay apart."""
    problems = []
    for tree in ("unit", "scenarios", "kernel"):
        for d in [TESTS / tree, *(p for p in (TESTS / tree).rglob("*") if p.is_dir())]:
            if d.name == "__pycache__":
                continue
            if not (d / "__init__.py").exists():
                problems.append(f"{d.relative_to(TESTS)} has no __init__.py")
            for f in d.glob("*.py"):
                if f.name not in ("__init__.py", "conftest.py") and not f.name.startswith("test_"):
                    problems.append(f"{f.relative_to(TESTS)} is a helper: move it to tests/support")
    assert problems == []


_INNER_HEADER = """
import os, signal, subprocess, sys
import pytest
"""

_INNER_TEST = """
{mark}
def {name}():
    {body}
"""

#: What a test may not do unmarked: start a daemon (a stand-in named etcd), signal a process,
#: run a process that kills itself at a fault point.
_DAEMON_BODIES = {
    "starts etcd": "subprocess.run([{etcd!r}])",
    "signals": "p = subprocess.Popen(['sleep', '30']); p.terminate(); p.wait()",
    "fault point": (
        "subprocess.run(['true'], env={{**os.environ, 'VMLEND_FAULT': 'attach:after-hotplug'}})"
    ),
}


def _inner_name(body: str, marked: bool) -> str:
    return f"test_{'marked' if marked else 'unmarked'}_{list(_DAEMON_BODIES).index(body)}"


@pytest.fixture(scope="module")
def daemon_rule_run(tmp_path_factory) -> dict[str, str | None]:
    """Every body, marked and unmarked, as the tests of one inner pytest run (one interpreter
    and collection for all six, not six): inner test name -> why it did not pass (failed,
    errored or skipped), or None when it passed."""
    tmp = tmp_path_factory.mktemp("daemon-rule")
    fake = tmp / "etcd"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    tests = [
        _INNER_TEST.format(
            mark="@pytest.mark.daemon" if marked else "",
            name=_inner_name(body, marked),
            body=_DAEMON_BODIES[body].format(etcd=str(fake)),
        )
        for body in _DAEMON_BODIES
        for marked in (False, True)
    ]
    (tmp / "test_inner.py").write_text(_INNER_HEADER + "".join(tests))
    report = tmp / "report.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-p", "tests.support.daemon_marks", f"--junitxml={report}", "test_inner.py"],
        cwd=tmp,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    outcomes: dict[str, str | None] = {}
    for case in etree.parse(str(report)).iter("testcase"):
        bad = [e for e in case if e.tag in ("failure", "error", "skipped")]
        outcomes[case.get("name")] = f"{bad[0].tag}: {bad[0].get('message')}" if bad else None
    return outcomes


@pytest.mark.parametrize("body", list(_DAEMON_BODIES), ids=list(_DAEMON_BODIES))
@pytest.mark.parametrize("marked", [False, True], ids=["unmarked", "marked"])
def test_a_test_that_starts_a_daemon_fails_unless_marked_daemon(daemon_rule_run, body, marked):
    """``make test-fast`` runs the tests not marked ``daemon``: one that starts a daemon or
    signals a process unmarked fails (tests/support/daemon_marks.py), wherever it runs."""
    name = _inner_name(body, marked)
    assert name in daemon_rule_run, daemon_rule_run  # it ran
    failure = daemon_rule_run[name]
    if marked:
        assert failure is None
    else:
        assert failure is not None and "not marked 'daemon'" in failure, failure


_MACHINE_FILES = '''
import subprocess, sys
from pathlib import Path

def test_reads_the_machines_file():
    Path({etc!r}, "vmlend.toml").read_text()

def test_a_process_it_started_writes_there():
    subprocess.run([sys.executable, "-c", "open({new!r}, 'w').write('x')"], check=True)
'''


def test_the_machines_files_are_never_touched_and_never_removed(tmp_path):
    """A test that opens the machine's /etc/vmlend fails; a file that appears there while a
    test runs (its subprocess, or an operator) is reported and left where it is."""
    etc = tmp_path / "etc-vmlend"
    etc.mkdir()
    (etc / "vmlend.toml").write_text("# the operator's\n")
    test = tmp_path / "test_inner.py"
    test.write_text(_MACHINE_FILES.format(etc=str(etc), new=str(etc / "new.toml")))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-p", "tests.support.machine_files", str(test)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "VMLEND_TEST_MACHINE_DIRS": str(etc)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "1 failed, 1 passed" in run.stdout, run.stdout
    assert "touched the machine's own files (open " in run.stdout
    assert f"{etc / 'new.toml'} (while test_inner.py::test_a_process_it_started_writes_there" in (
        run.stdout
    )
    assert (etc / "new.toml").read_text() == "x"  # never removed
    assert (etc / "vmlend.toml").read_text() == "# the operator's\n"


def _recipe(makefile: str, target: str) -> str:
    """The command lines of ``target`` in the Makefile."""
    lines = makefile.splitlines()
    start = lines.index(next(x for x in lines if x.startswith(f"{target}:")))
    body = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        body.append(line)
    return "\n".join(body)


def test_the_fast_tier_explores_a_share_of_each_property_and_make_test_all_of_it():
    """``make test-fast`` loads the fast hypothesis profile: fewer examples, no deadline, and
    every count a test writes scaled alike; ``make test`` loads none, and runs the counts as
    written (tests/support/hypothesis_tiers.py)."""
    fast = settings.get_profile(FAST)
    assert fast.deadline is None
    assert fast.max_examples < DEFAULT_EXAMPLES
    full = settings.get_profile("default")
    assert [examples(n, profile=full) for n in (3, 60, 300)] == [3, 60, 300]
    share = fast.max_examples / DEFAULT_EXAMPLES
    assert examples(300, profile=fast) == round(300 * share) < 300
    assert examples(10, profile=fast) == 5 and examples(3, profile=fast) == 3  # a floor
    makefile = (REPO / "Makefile").read_text()
    assert f"--hypothesis-profile={FAST}" in _recipe(makefile, "test-fast")
    assert "--hypothesis-profile" not in _recipe(makefile, "test")


def test_make_test_runs_every_test_once_in_its_two_passes():
    """``make test`` runs the tests that start no daemon on two workers and the rest in one
    process: its two marker expressions are each other's complement, so no test is left out
    and none runs twice, and only the first pass is spread over workers."""
    recipe = _recipe((REPO / "Makefile").read_text(), "test")
    passes = [line for line in recipe.splitlines() if " -m pytest " in line]
    assert len(passes) == 2, recipe
    marks = [re.search(r"-m '([^']+)'", line) for line in passes]
    assert [m.group(1) if m else None for m in marks] == [
        "not daemon and not slow",
        "daemon or slow",
    ]
    assert " -n 2 " in passes[0] and " -n " not in passes[1]
