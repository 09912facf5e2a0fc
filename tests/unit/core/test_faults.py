"""``vmlend.faults``: a named point kills the process that reaches it, when a test asks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO
from vmlend.faults import FAULT_ENV, POINTS, ROOT_ENV, armed_path

POINT = "release:after-commit"


def _reach(root: Path, fault: str) -> int:
    """The exit status of a process that reaches ``POINT`` with ``VMLEND_FAULT=fault``."""
    env = {**os.environ, FAULT_ENV: fault, ROOT_ENV: str(root), "PYTHONPATH": str(REPO)}
    code = f"from vmlend.faults import fault_point; fault_point({POINT!r})"
    return subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode


def test_the_points_the_simulated_backend_reaches_are_named() -> None:
    assert "after-commit" in POINTS["reserve"] and "after-commit" in POINTS["release"]


@pytest.mark.daemon  # its processes kill themselves
def test_a_point_kills_every_process_that_reaches_it(tmp_path: Path) -> None:
    assert _reach(tmp_path, POINT) == -signal.SIGKILL
    assert _reach(tmp_path, POINT) == -signal.SIGKILL
    assert _reach(tmp_path, "release:after-mdevs") == 0  # another point: nothing


@pytest.mark.daemon  # its processes kill themselves
def test_a_once_point_kills_only_the_first_process_after_it_was_armed(tmp_path: Path) -> None:
    once = f"{POINT}=ONCE"
    assert _reach(tmp_path, once) == 0  # not armed yet: goes past
    armed = Path(armed_path(str(tmp_path), POINT))
    armed.touch()
    assert _reach(tmp_path, once) == -signal.SIGKILL
    assert not armed.exists()
    assert _reach(tmp_path, once) == 0  # used up: the hook that runs on goes past
    assert _reach(tmp_path, f"prepare:after-device=ONCE,{once}") == 0


@pytest.mark.daemon  # its processes kill themselves
def test_an_armed_once_point_is_found_under_the_process_root_only(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    Path(armed_path(str(other), POINT)).touch()
    assert _reach(tmp_path, f"{POINT}=ONCE") == 0
    assert Path(armed_path(str(other), POINT)).exists()
