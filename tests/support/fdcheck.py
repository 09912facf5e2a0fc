"""Descriptor-leak checks that hold inside a long test session.

A test's own leaks are what count: garbage from earlier tests may be collected (and its
descriptors closed) while a test runs, so plain before/after sets of fd numbers are unstable.
We collect garbage first and compare what the descriptors point at, as a multiset: only net
new descriptors count as leaked.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections import Counter


def fd_snapshot(pid: int | str = "self") -> Counter[str]:
    if pid == "self":
        gc.collect()
    found: Counter[str] = Counter()
    base = f"/proc/{pid}/fd"
    for fd in os.listdir(base):
        with contextlib.suppress(FileNotFoundError):  # listdir's own descriptor, now closed
            found[os.readlink(f"{base}/{fd}")] += 1
    return found


def leaked(before: Counter[str], pid: int | str = "self") -> Counter[str]:
    """Descriptors open now that were not open at ``before`` (empty when nothing leaked)."""
    return fd_snapshot(pid) - before
