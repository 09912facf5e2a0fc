"""Run the story step by step and collect what each step showed.

``run_demo`` stops at the first step that fails (a ``VmlendError``, including ``DemoError`` for
a fact that did not hold) and always closes the cluster, so no guest, relay thread or open
registry outlives it. What a failed run leaves in the state (a domain, holds) is removed by the
first step of the next run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from vmlend.demo.context import DemoConfig, Story
from vmlend.demo.steps import STEPS, Step
from vmlend.errors import DemoError, VmlendError

log = logging.getLogger(__name__)


class StepResult(msgspec.Struct, frozen=True):
    n: int
    key: str
    title: str
    ok: bool
    seconds: float
    data: dict[str, Any]
    error: str | None = None

    def json(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "key": self.key,
            "title": self.title,
            "ok": self.ok,
            "seconds": round(self.seconds, 3),
            "error": self.error,
            "data": self.data,
        }


class DemoResult(msgspec.Struct):
    state: Path
    vm: str
    steps: list[StepResult] = msgspec.field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.steps) and all(s.ok for s in self.steps)

    @property
    def error(self) -> str | None:
        failed = next((s for s in self.steps if not s.ok), None)
        return None if failed is None else f"step {failed.n} ({failed.key}): {failed.error}"

    def json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "error": self.error,
            "state": str(self.state),
            "vm": self.vm,
            "seconds": round(self.seconds, 3),
            "steps": [s.json() for s in self.steps],
        }


def run_demo(
    state_path: Path,
    config: DemoConfig | None = None,
    *,
    on_step: Callable[[StepResult], None] | None = None,
    steps: Sequence[Step] = STEPS,
    clock: Callable[[], float] = time.monotonic,
) -> DemoResult:
    """Tell the story on the state at ``state_path``; ``on_step`` sees each result as it
    comes (the CLI prints it at once)."""
    story = Story(state_path, config or DemoConfig())
    result = DemoResult(state_path, story.config.vm)
    started = clock()
    try:
        for n, step in enumerate(steps, 1):
            t0 = clock()
            try:
                data = step.run(story)
                _check_invariants(story)
            except VmlendError as e:
                log.debug("step %s failed", step.key, exc_info=True)
                done = StepResult(n, step.key, step.title, False, clock() - t0, {}, str(e))
            else:
                done = StepResult(n, step.key, step.title, True, clock() - t0, data)
            result.steps.append(done)
            if on_step is not None:
                on_step(done)
            if not done.ok:
                break
    finally:
        if story.cluster is not None:
            story.cluster.close()
        result.seconds = clock() - started
    return result


def _check_invariants(story: Story) -> None:
    """Fail the step loudly when any mapping, LUT entry, context or interrupt route is not
    justified by a current borrow (``vmlend.sim.invariants``)."""
    if story.cluster is None:
        return
    found = story.cluster.violations()
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise DemoError(f"fabric invariant violated: {found[0]}{more}")
