"""The ``daemon`` marker, kept honest: a test that starts a daemon (etcd, libvirtd, virtlogd,
QEMU) or signals another process (kill -9, SIGSTOP, a SIGTERM to stop a child) must be marked
``daemon``, so ``make test-fast`` (``-m 'not daemon and not slow'``) stays the tests that run
in one process and the developer's loop stays fast.

How: one audit hook (``sys.addaudithook``; it cannot be removed, so it only records into the
current test's list) watches process starts and signals; a test not marked ``daemon`` that did
either fails at teardown, naming what it started. A test that uses a fixture which starts a
daemon (``DAEMON_FIXTURES``), or is marked ``qemu`` or ``libvirtd``, is a daemon test by that
alone: the fixture, not each test, is where the daemon starts, and a session-scoped one starts
in whichever test asks first.

Register with ``pytest_plugins = ["tests.support.daemon_marks"]``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import PurePath
from typing import Any

import pytest

from vmlend.faults import FAULT_ENV

#: Executables that are daemons for this rule (by base name; QEMU by prefix).
DAEMONS = frozenset({"etcd", "libvirtd", "virtlogd", "virtqemud"})
QEMU_PREFIX = "qemu-system-"

#: Fixtures that start a daemon (or reach one another test started): a test using one is a
#: daemon test whatever its marks.
DAEMON_FIXTURES = frozenset(
    {
        "etcd",
        "etcd_url",
        "private_etcd",
        "libvirtd",
        "libvirt_conn",
        "libvirt_guests",
        "hook_recorder",
    }
)

#: The registries a test runs on, as a parameter list: the etcd case is a daemon test.
REGISTRIES = ["sqlite", pytest.param("etcd", marks=pytest.mark.daemon)]

#: Marks that imply ``daemon``.
IMPLYING = ("qemu", "libvirtd")

#: What the current test started or signalled (None between tests: nothing is recorded).
_events: list[str] | None = None


def _program(argv: Any) -> str:
    if isinstance(argv, (str, bytes, os.PathLike)):
        first = os.fsdecode(argv).split()[0] if os.fsdecode(argv).strip() else ""
    else:
        try:
            first = os.fsdecode(next(iter(argv)))
        except (StopIteration, TypeError):
            return ""
    return PurePath(first).name


def is_daemon(program: str) -> bool:
    return program in DAEMONS or program.startswith(QEMU_PREFIX)


def _is_agent(argv: Any) -> bool:
    """``vmlend agent ...`` or ``python -m vmlend agent ...`` (the agent is a daemon too)."""
    if isinstance(argv, (str, bytes, os.PathLike)):
        words = os.fsdecode(argv).split()
    else:
        try:
            words = [os.fsdecode(a) for a in argv]
        except TypeError:
            return False
    names = [PurePath(w).name for w in words[:4]]
    return "agent" in words[1:4] and any(n in ("vmlend", "vmlend.cli") for n in names)


def _audit(event: str, args: tuple[Any, ...]) -> None:
    events = _events
    if events is None:
        return
    try:
        _record(events, event, args)
    except Exception as e:  # an audit hook's exception would fail the call it audits
        events.append(f"(daemon_marks could not read a {event} event: {e!r})")


def _record(events: list[str], event: str, args: tuple[Any, ...]) -> None:
    if event == "subprocess.Popen":
        # (executable, args, cwd, env): a shell command names its program in args
        program = _program(args[0]) if args[0] else _program(args[1])
        if is_daemon(program) or is_daemon(_program(args[1])):
            events.append(f"started {program or _program(args[1])}")
        elif _is_agent(args[1]):
            events.append("started a vmlend agent")
        env = args[3] if args[3] is not None else os.environ
        if any(os.fsdecode(k) == FAULT_ENV and v for k, v in env.items()):
            events.append(f"ran a process that kills itself at a fault point ({FAULT_ENV})")
    elif event in ("os.posix_spawn", "os.exec"):
        if is_daemon(_program(args[0])) or is_daemon(_program(args[1])):
            events.append(f"started {_program(args[1]) or _program(args[0])}")
    elif event in ("os.kill", "os.killpg"):
        pid, sig = args[0], args[1]
        if sig != 0 and pid not in (0, os.getpid()):
            events.append(
                f"sent signal {int(sig)} to {'group ' if event == 'os.killpg' else ''}{pid}"
            )


sys.addaudithook(_audit)


def is_daemon_test(item: pytest.Item) -> bool:
    return item.get_closest_marker("daemon") is not None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        implied = any(item.get_closest_marker(m) is not None for m in IMPLYING)
        if implied or fixtures & DAEMON_FIXTURES:
            item.add_marker(pytest.mark.daemon)


_KEY = pytest.StashKey[list[str]]()


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any]) -> Iterator[None]:
    """A daemon fixture asked for by name (``request.getfixturevalue``) counts as a start:
    the session's etcd started once, in some earlier test, serves this one all the same."""
    if _events is not None and fixturedef.argname in DAEMON_FIXTURES:
        _events.append(f"uses the {fixturedef.argname} fixture")
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    """Record from the test's set-up to the end of its call. Not its teardown: stopping what
    it started is not what the rule is about, and a session's fixtures stop in whichever test
    comes last."""
    global _events
    _events = item.stash[_KEY] = []
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    global _events
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.when == "setup" and not report.passed:
        _events = None
    if report.when != "call":
        return
    _events = None
    events = item.stash.get(_KEY, [])
    if events and not is_daemon_test(item) and report.passed:
        shown = sorted(set(events))
        report.outcome = "failed"
        report.longrepr = (
            "this test is not marked 'daemon' but it "
            + "; ".join(shown[:5])
            + ": mark it @pytest.mark.daemon (make test-fast runs only the tests that start no"
            " daemon and signal no process)"
        )
