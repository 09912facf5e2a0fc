"""Settings shared by the project's hypothesis state machines."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine

from tests.support.hypothesis_tiers import examples as tier_examples


def derandomized(examples: int, steps: int) -> settings:
    """``examples`` sequences of up to ``steps`` steps, derandomized: CI runs the same sequences
    every time; no example database on disk, no deadline (the steps wait for threads or
    daemons). ``make test-fast`` runs its share of the sequences, each as deep
    (tests/support/hypothesis_tiers.py)."""
    return settings(
        max_examples=tier_examples(examples),
        stateful_step_count=steps,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


def replay(
    machine: RuleBasedStateMachine,
    invariants: Iterable[Callable[[Any], None]],
    steps: Iterable[tuple[str, Mapping[str, object]]],
) -> None:
    """``steps`` (rule, arguments: a sequence the machine ran, so each rule's precondition
    holds) on ``machine``, every one of ``invariants`` looked at after each, as hypothesis
    does; the machine is torn down at the end."""
    checks = list(invariants)
    try:
        for name, arguments in steps:
            getattr(machine, name)(**arguments)
            for check in checks:
                check(machine)
    finally:
        machine.teardown()
