"""Settings shared by the project's hypothesis state machines."""

from __future__ import annotations

from hypothesis import HealthCheck, settings


def derandomized(examples: int, steps: int) -> settings:
    """``examples`` sequences of up to ``steps`` steps, derandomized: CI runs the same sequences
    every time; no example database on disk, no deadline (the steps wait for threads or
    daemons)."""
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
