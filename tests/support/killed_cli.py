"""The CLI as a subprocess that may be killed at a named fault point (vmlend/faults.py), for
the fault matrices. No tests here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from vmlend.faults import FAULT_ENV

CLI = [sys.executable, "-c", "from vmlend.cli import main; main()"]


def run_cli(state: Path, *args: str, fault: str | None = None) -> subprocess.CompletedProcess[str]:
    """``vmlend --state STATE ARGS``; ``fault``: the point it kills itself at."""
    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, "VMLEND_STATE")}
    if fault:
        env[FAULT_ENV] = fault
    return subprocess.run(
        [*CLI, "--state", str(state), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        # Ctrl-C as a terminal delivers it, also when the suite itself runs as a background
        # job (the shell then ignores SIGINT for it, and the CLI would inherit that).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def assert_killed(res: subprocess.CompletedProcess[str]) -> None:
    assert res.returncode == -signal.SIGKILL, (res.returncode, res.stdout, res.stderr)
