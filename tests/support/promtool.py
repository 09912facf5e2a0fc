"""promtool, Prometheus's rule checker, for the monitoring tests: ``make promtool`` takes the
binary out of Debian's ``prometheus`` package into build/promtool (cached there; no server is
installed or started). Where it cannot be fetched the test is skipped, and fails in CI
(``tests/support/needs.py``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.support.needs import need
from tests.support.paths import REPO

PROMTOOL = REPO / "build" / "promtool" / "usr" / "bin" / "promtool"


def promtool() -> Path:
    """The binary, fetched by ``make promtool`` on first use."""
    if not PROMTOOL.exists():
        r = subprocess.run(
            ["make", "-s", "promtool"], cwd=REPO, capture_output=True, text=True, check=False
        )
        why = (r.stderr.strip().splitlines() or ["no output"])[-1]
        need(r.returncode == 0 and PROMTOOL.exists(), f"promtool: 'make promtool' failed: {why}")
    return PROMTOOL


def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """``promtool ARGS``, its output kept."""
    return subprocess.run(
        [str(promtool()), *map(str, args)], capture_output=True, text=True, check=False
    )
