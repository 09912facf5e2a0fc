"""Whether the files the root-run hook executes, imports or writes can be changed by non-root.

libvirtd runs the hook as root for every VM operation, so its interpreter, every import root,
its state directory and the hook file itself are root's code and data. The rule: each of them,
every file below an import root, and every directory above any of them is owned by root and not
writable by group or others. A sticky world-writable directory (``/tmp``) is accepted above a
path: its sticky bit keeps others from renaming what root owns there.

``vmlend hook install`` refuses a hook that breaks the rule (``--force`` installs it with a
loud warning) and ``vmlend doctor`` reports it.
"""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from vmlend.hook.actionlog import LOG_NAME

#: How many problems a one-line message names before "and N more".
SHOWN = 3


def _problem(path: str, st: os.stat_result, *, above: bool) -> str | None:
    """What is wrong with ``path`` (its ``lstat``) for root to trust it, or None."""
    if st.st_uid != 0:
        return f"{path} is owned by uid {st.st_uid}, not root"
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        return None  # a link's own bits mean nothing; its directory and target are checked
    writable = mode & (stat.S_IWGRP | stat.S_IWOTH)
    sticky_dir = stat.S_ISDIR(mode) and mode & stat.S_ISVTX and mode & stat.S_IWOTH
    if writable and not (above and sticky_dir):
        who = (
            "group and others"
            if writable == stat.S_IWGRP | stat.S_IWOTH
            else ("its group" if writable == stat.S_IWGRP else "others")
        )
        return f"{path} is writable by {who}"
    return None


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


def _chain(path: str) -> list[str]:
    """``path`` (absolute) and every directory above it, the path first."""
    out = [path]
    while True:
        parent = os.path.dirname(out[-1])
        if parent == out[-1]:
            return out
        out.append(parent)


def path_problems(path: str | os.PathLike[str]) -> list[str]:
    """Problems of one path and the directories above it, as given and once resolved (a link
    on the way leads root elsewhere). A missing path is no problem: it is checked when it
    exists (its directory is checked now)."""
    problems: list[str] = []
    given = os.path.abspath(path)
    for candidate in dict.fromkeys([given, os.path.realpath(given)]):
        for i, p in enumerate(_chain(candidate)):
            st = _lstat(p)
            if st is None:
                continue
            why = _problem(p, st, above=i > 0)
            if why is not None and why not in problems:
                problems.append(why)
    return problems


@functools.lru_cache(maxsize=64)
def _tree_problems(root: str) -> tuple[str, ...]:
    # Cached per process: an import root is this interpreter's own code, walked once per
    # command (a venv holds tens of thousands of files).
    found: list[str] = []
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(top, name)
            st = _lstat(p)
            if st is not None and (why := _problem(p, st, above=False)) is not None:
                found.append(why)
    return tuple(found)


def tree_problems(root: str | os.PathLike[str]) -> list[str]:
    """Problems of ``root``, the directories above it and everything below it."""
    root = os.path.abspath(root)
    problems = path_problems(root)
    if os.path.isdir(root):
        problems += [p for p in _tree_problems(os.path.realpath(root)) if p not in problems]
    return problems


def hook_problems(
    hook: Path,
    interpreter: str,
    roots: Iterable[str],
    state_path: Path,
) -> list[str]:
    """Every path the hook at ``hook`` would run as root that non-root could change: the hook,
    the interpreter (and, for this interpreter, its standard library), the import roots and
    the state directory with the state and log files in it."""
    problems: list[str] = []

    def add(found: list[str]) -> None:
        problems.extend(p for p in found if p not in problems)

    add(path_problems(hook))
    if interpreter:
        add(path_problems(interpreter))
    if interpreter and os.path.realpath(interpreter) == os.path.realpath(_this_interpreter()):
        add(tree_problems(Path(os.__file__).parent))  # the standard library the hook imports
    for root in roots:
        add(tree_problems(root))
    state_dir = state_path.parent
    add(path_problems(state_dir))
    for name in (state_path.name, f"{state_path.name}-wal", f"{state_path.name}-shm", LOG_NAME):
        add(path_problems(state_dir / name))
    return problems


def _this_interpreter() -> str:
    import sys

    return sys.executable


def summary(problems: list[str]) -> str:
    """The first problems in one line, with a count of the rest."""
    shown = "; ".join(problems[:SHOWN])
    more = len(problems) - SHOWN
    return f"{shown}; and {more} more" if more > 0 else shown
