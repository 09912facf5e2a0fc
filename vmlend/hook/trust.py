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
from collections.abc import Iterable
from pathlib import Path

from vmlend.hook.actionlog import LOG_NAME
from vmlend.ownership import lstat_or_none, path_problems, problem_of, summary

__all__ = ["hook_problems", "path_problems", "summary", "tree_problems"]


@functools.lru_cache(maxsize=64)
def _tree_problems(root: str) -> tuple[str, ...]:
    # Cached per process: an import root is this interpreter's own code, walked once per
    # command (a venv holds tens of thousands of files).
    found: list[str] = []
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(top, name)
            st = lstat_or_none(p)
            if st is not None and (why := problem_of(p, st, above=False)) is not None:
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
    config_file: Path | None = None,
) -> list[str]:
    """Every path the hook at ``hook`` would run as root that non-root could change: the hook,
    the interpreter (and, for this interpreter, its standard library), the import roots, the
    configuration file it reads and the state directory with the state and log files in it."""
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
    if config_file is not None:
        add(path_problems(config_file))
    state_dir = state_path.parent
    add(path_problems(state_dir))
    for name in (state_path.name, f"{state_path.name}-wal", f"{state_path.name}-shm", LOG_NAME):
        add(path_problems(state_dir / name))
    return problems


def _this_interpreter() -> str:
    import sys

    return sys.executable
