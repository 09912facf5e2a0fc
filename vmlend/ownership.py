"""Whether non-root can change a path root relies on: the rule the installed hook, its
configuration file and everything the hook runs are held to (``vmlend.hook.trust``,
docs/security.md). Each path and every directory above it is owned by root and not writable by
group or others; a sticky world-writable directory (``/tmp``) is accepted above a path.
"""

from __future__ import annotations

import os
import stat

#: How many problems a one-line message names before "and N more".
SHOWN = 3


def problem_of(path: str, st: os.stat_result, *, above: bool) -> str | None:
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


def lstat_or_none(path: str) -> os.stat_result | None:
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
            st = lstat_or_none(p)
            if st is None:
                continue
            why = problem_of(p, st, above=i > 0)
            if why is not None and why not in problems:
                problems.append(why)
    return problems


def summary(problems: list[str]) -> str:
    """The first problems in one line, with a count of the rest."""
    shown = "; ".join(problems[:SHOWN])
    more = len(problems) - SHOWN
    return f"{shown}; and {more} more" if more > 0 else shown
