"""Named fault-injection points, for tests only.

``VMLEND_FAULT=attach:after-hotplug`` (several: comma-separated) makes the process kill itself
with SIGKILL when it reaches that point, as ``kill -9`` or a power cut would: no ``finally``,
no undo journal, no exit handler runs. Nothing but the tests sets it: they run an operation
with each point, then re-run it (or ``vmlend reconcile --fix``) and check the end state
(docs/testing.md). Unset, a point costs one environment lookup.
"""

from __future__ import annotations

import os

FAULT_ENV = "VMLEND_FAULT"

#: Every point, by operation, in the order the operation reaches them.
POINTS: dict[str, tuple[str, ...]] = {
    "attach": ("after-acquire", "after-hotplug", "after-metadata"),
    "detach": ("after-unplug", "after-metadata"),
    "migrate": ("after-stop", "after-return", "after-define", "after-undefine"),
    "live-migrate": ("after-unplug", "after-migrate", "after-replug"),
    "hot-migrate": ("after-claim", "after-hand-over", "after-migrate"),
    # an unplugged live migration's NVMe shares (vmlend.ledger.shareunplug)
    "share-move": ("after-claim", "after-hand-over"),
    "live-rollback": ("after-hand-back", "after-share-hand-back"),
    "prepare": ("after-device",),
    "release": ("after-mdevs",),
}


def fault_point(name: str) -> None:
    """Die here if ``VMLEND_FAULT`` names this point (``operation:point``); with ``=INT``
    appended (``attach:after-hotplug=INT``) send SIGINT instead, as Ctrl-C would; with
    ``=STOP`` send SIGSTOP, so the process freezes there (as ``kill -STOP`` would) until
    somebody sends SIGCONT: the nemesis test freezes a hook mid-prepare this way.

    SIGINT goes to the process, and Python runs its handler on the main thread: reached on
    another thread (a hook call on the agent's worker), ``=INT`` does not interrupt the call
    there but asks the agent to stop, which finishes the call and the queued ones first.
    Tests of agent-served calls use the default SIGKILL."""
    wanted = os.environ.get(FAULT_ENV)
    if not wanted:
        return
    for item in wanted.split(","):
        point, _, how = item.partition("=")
        if point == name:
            import signal  # only a test that asked for a fault pays for it

            sig = {"INT": signal.SIGINT, "STOP": signal.SIGSTOP}.get(how, signal.SIGKILL)
            os.kill(os.getpid(), sig)
