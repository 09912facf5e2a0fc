"""The machine's own vmlend and libvirt files are not the suite's: no test reads, writes or
deletes ``/etc/vmlend``, ``/var/lib/vmlend`` or libvirt's hooks directory; every process a test
starts gets a private root and configuration (``tests/conftest.py`` gives each test its own
``VMLEND_CONFIG`` and ``VMLEND_STATE``).

Two checks, neither of which ever touches those files:
- In the test's own process an audit hook sees every open, listing, removal or rename of a path
  there: the test that did it fails, naming the path.
- A file there that appears or changes while a test runs may be the work of a process the test
  started, or of anybody else on the machine (an operator's ``vmlend hook install``): it is
  reported as a warning naming the file, never removed, and no test is failed for it.

Register with ``pytest_plugins = ["tests.support.machine_files"]``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

#: The machine's files no test may touch (``$VMLEND_TEST_MACHINE_DIRS``, colon-separated: other
#: directories, for the test of this guard itself).
PROTECTED = tuple(
    Path(p)
    for p in os.environ.get(
        "VMLEND_TEST_MACHINE_DIRS", "/etc/vmlend:/var/lib/vmlend:/etc/libvirt/hooks"
    ).split(":")
)

#: Audit events that name a path as their first argument.
_PATH_EVENTS = frozenset(
    {
        "open",
        "os.listdir",
        "os.scandir",
        "os.remove",
        "os.rmdir",
        "os.mkdir",
        "os.rename",
        "os.chmod",
        "os.chown",
        "os.truncate",
        "os.utime",
        "os.symlink",
        "os.link",
        "shutil.rmtree",
        "shutil.copyfile",
        "shutil.move",
    }
)

#: What the current test touched (None outside a test).
_touched: list[str] | None = None


def protected(path: Any) -> bool:
    """Whether ``path`` (as an audit event gives it) lies under a protected directory."""
    if isinstance(path, int) or path is None:
        return False  # a file descriptor: its path was checked when it was opened
    try:
        absolute = Path(os.path.abspath(os.fsdecode(path)))
    except (TypeError, ValueError):
        return False
    return any(absolute == p or p in absolute.parents for p in PROTECTED)


def _audit(event: str, args: tuple[Any, ...]) -> None:
    touched = _touched
    if touched is None or event not in _PATH_EVENTS or not args:
        return
    try:
        paths = args[:2] if event in ("os.rename", "os.link", "shutil.move") else args[:1]
        for path in paths:
            if protected(path):
                touched.append(f"{event} {os.fsdecode(path)}")
    except Exception:  # an audit hook's exception would fail the call it audits
        return


sys.addaudithook(_audit)


def snapshot() -> dict[str, tuple[int, int, int]]:
    """Every file under the protected directories: (inode, size, mtime). Looked at without
    counting as the running test's touch: this is the guard's own look."""
    global _touched
    touched, _touched = _touched, None
    try:
        return _walk()
    finally:
        _touched = touched


def _walk() -> dict[str, tuple[int, int, int]]:
    out = {}
    for top in PROTECTED:
        for dirpath, _dirs, files in os.walk(top):
            for name in files:
                path = os.path.join(dirpath, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                out[path] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


_KEY = pytest.StashKey[list[str]]()
#: What appeared or changed there during the run, and while which test: the session's report.
_changes: list[str] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    global _touched
    before = snapshot()
    _touched = item.stash[_KEY] = []
    try:
        yield
    finally:
        _touched = None
    after = snapshot()
    changed = sorted(p for p in after.keys() | before.keys() if after.get(p) != before.get(p))
    if changed:
        _changes.append(f"{', '.join(changed[:5])} (while {item.nodeid} ran)")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Reported, never undone: whoever wrote there, the file is somebody's."""
    if not _changes:
        return
    terminalreporter.section("the machine's vmlend and libvirt files changed")
    terminalreporter.line(
        "a process a test started without its private root, or another program on this"
        " machine, changed these (left as they are):"
    )
    for line in _changes:
        terminalreporter.line(f"  {line}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    touched = item.stash.get(_KEY, [])
    if report.when == "call" and touched and report.passed:
        report.outcome = "failed"
        report.longrepr = (
            "this test touched the machine's own files ("
            + "; ".join(sorted(set(touched))[:5])
            + "): give what it runs a private root and config"
        )
