"""Named fault-injection points, for tests only.

``VMLEND_FAULT=attach:after-hotplug`` (several: comma-separated) makes the process kill itself
with SIGKILL when it reaches that point, as ``kill -9`` or a power cut would: no ``finally``,
no undo journal, no exit handler runs. Nothing but the tests sets it: they run an operation
with each point, then re-run it (or ``vmlend reconcile --fix``) and check the end state
(docs/testing.md). Unset, a point costs one environment lookup.

``=ONCE`` appended (``release:after-commit=ONCE``) kills only the first process that reaches the
point after the test *armed* it: the point fires while the file ``fault-<operation>-<point>``
exists under ``$VMLEND_ROOT``, and the process that removes it dies. So a test can set the
fault for every process of a host (an agent only serves hook calls whose fault setting is its
own), arm it once the agent is up, and have the agent die there while the hook that then
runs the rest of the call in its own process goes past it.
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
    "release": ("after-mdevs", "after-commit"),
    # the simulated backend, between the registry's commit and the event that records it
    # (``vmlend.sim.backend``; the nemesis's ``commit+kill``)
    "reserve": ("after-commit",),
}

#: Where ``=ONCE`` points look for the file that arms them.
ROOT_ENV = "VMLEND_ROOT"


def armed_path(root: str, name: str) -> str:
    """The file that arms the ``=ONCE`` point ``name`` (``operation:point``) under ``root``."""
    return os.path.join(root, "fault-" + name.replace(":", "-"))


def fault_point(name: str) -> None:
    """Die here if ``VMLEND_FAULT`` names this point (``operation:point``); with ``=INT``
    appended (``attach:after-hotplug=INT``) send SIGINT instead, as Ctrl-C would; with
    ``=STOP`` send SIGSTOP, so the process freezes there (as ``kill -STOP`` would) until
    somebody sends SIGCONT: the nemesis test freezes a hook mid-prepare this way.

    SIGINT goes to the process, and Python runs its handler on the main thread: reached on
    another thread (a hook call on the agent's worker), ``=INT`` does not interrupt the call
    there but asks the agent to stop, which finishes the call and the queued ones first.
    Tests of agent-served calls use the default SIGKILL. ``=ONCE``: SIGKILL, but only in the
    process that removes the point's armed file (``armed_path``); without it, nothing."""
    wanted = os.environ.get(FAULT_ENV)
    if not wanted:
        return
    for item in wanted.split(","):
        point, _, how = item.partition("=")
        if point == name:
            import signal  # only a test that asked for a fault pays for it

            if how == "ONCE":
                try:  # one process removes it: that one dies, any other goes on
                    os.unlink(armed_path(os.environ.get(ROOT_ENV, "/"), name))
                except FileNotFoundError:
                    continue
            sig = {"INT": signal.SIGINT, "STOP": signal.SIGSTOP}.get(how, signal.SIGKILL)
            os.kill(os.getpid(), sig)
