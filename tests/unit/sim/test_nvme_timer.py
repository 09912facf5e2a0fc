"""Command deadlines on an injected clock (issue 40, point 1): a command times out when the
clock the test moves says so, not when something is called."""

from __future__ import annotations

import pytest

from tests.support.clocks import FakeClock
from vmlend.errors import ConfigError
from vmlend.sim.nvme.timer import COMMAND_TIMEOUT, CommandTimer


def test_a_deadline_passes_only_on_the_clock():
    clock = FakeClock()
    timer = CommandTimer(10.0, clock)
    timer.start("a")
    clock.advance(4)
    timer.start("b")
    assert timer.expired() == []
    clock.advance(6)
    assert timer.expired() == ["a"]
    clock.advance(4)
    assert timer.expired() == ["a", "b"]  # earliest first
    assert timer.stop("a") is True and timer.stop("a") is False
    assert timer.expired() == ["b"] and len(timer) == 1


def test_a_command_sent_again_starts_over():
    clock = FakeClock()
    timer = CommandTimer(5.0, clock)
    timer.start(1)
    clock.advance(4)
    timer.start(1)
    clock.advance(4)
    assert timer.expired() == []
    clock.advance(1)
    assert timer.expired() == [1]
    timer.clear()
    assert timer.expired() == [] and len(timer) == 0


def test_linuxs_timeout_is_the_default():
    assert CommandTimer().timeout == COMMAND_TIMEOUT == 30.0


@pytest.mark.parametrize("bad", [0, -1.0, float("nan")])
def test_a_timeout_must_be_positive(bad):
    with pytest.raises(ConfigError, match="must be positive seconds"):
        CommandTimer(bad)
