"""Uevents from the real kernel through pyudev: the mdev parent leaving and coming back (its
driver unloaded and loaded again, as a SmartIO parent does when its lender reboots), and the
watcher re-creating the mdev of a VM that was running. No udevd runs in the guest, so the
live source listens to the kernel's own netlink group."""

from __future__ import annotations

import subprocess

from tests.support.kernel_guest import MTTY, MTTY2, REAL
from vmlend.kernel.mdev import MdevBus
from vmlend.kernel.udev import Outcome, ParentWatcher, PyudevSource, WantedMdev

U1 = "83b8f4f2-509f-382f-3c1e-e6bfe0fa4001"


class Recording:
    """The live source, keeping (action, name, MDEV_STATE) of what it delivered."""

    def __init__(self, source):
        self.source, self.events = source, []

    def fileno(self):
        return self.source.fileno()

    def receive(self):
        ev = self.source.receive()
        if ev is not None:
            self.events.append((ev.action, ev.sys_name, ev.properties.get("MDEV_STATE")))
        return ev


def test_a_returning_parent_gets_the_running_vms_mdev_back():
    source = PyudevSource.for_host(REAL)
    assert PyudevSource.netlink_source(REAL) == "kernel"
    bus = MdevBus(REAL)
    bus.create(MTTY, MTTY2, U1)
    wanted = [WantedMdev(U1, MTTY, MTTY2, vm="web")]
    vanished, appeared = [], []
    watcher = ParentWatcher(bus, lambda: wanted, vanished.append, appeared.append)
    assert watcher.discover() == [MTTY]
    assert [r.outcome for r in watcher.reactions] == [Outcome.PRESENT]

    # The parent goes: its child must go first (the module is in use while it has one).
    bus.remove(U1)
    subprocess.run(["rmmod", "mtty"], check=True)
    assert watcher.run(source, timeout=3) > 0
    assert vanished == [MTTY] and bus.parent_names() == []
    assert watcher.reactions[-1].outcome is Outcome.UNAVAILABLE

    # It comes back: the kernel's events alone make the watcher re-create the VM's child.
    subprocess.run(["insmod", "/lib/modules/vmlend/mtty.ko"], check=True)
    before = len(watcher.reactions)
    seen = Recording(source)
    assert watcher.run(seen, timeout=3) > 0
    # The mdev core's MDEV_STATE=registered is among them, and the watcher acts on every
    # "registered" (a parent may have come and gone unheard): one re-creation, then present.
    assert ("change", MTTY, "registered") in seen.events, seen.events
    assert appeared and set(appeared) == {MTTY}, seen.events
    after = [(r.outcome, r.uuid, r.vm) for r in watcher.reactions[before:]]
    assert after[0] == (Outcome.RECREATED, U1, "web"), after
    assert set(after[1:]) <= {(Outcome.PRESENT, U1, "web")}, after
    dev = bus.device(U1)
    assert dev is not None and (dev.parent, dev.type_id) == (MTTY, MTTY2)
