"""A test's system requirement (a daemon, a tool, root): missing on a developer's machine, the
test is skipped with what to install; in CI (``.ci/run`` sets ``$CI``, and ``make sysdeps``
installed everything) it is a failure, so CI never skips."""

from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    return bool(os.environ.get("CI"))


def need(present: bool, what: str) -> None:
    """Skip the test, or fail it in CI, unless ``present``; ``what`` says what is missing."""
    if present:
        return
    if in_ci():
        pytest.fail(f"{what} (CI installs everything a test needs: make sysdeps)")
    pytest.skip(what)
