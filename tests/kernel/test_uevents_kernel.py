"""Uevents from the real kernel through pyudev: the SmartIO stand-in's (SMARTIO_AVAILABILITY)
and the mdev core's (MDEV_STATE) as a lender goes away and comes back, and the watcher
re-creating the mdev of a VM that was running. No udevd runs in the guest, so the live source
listens to the kernel's own netlink group."""

from __future__ import annotations

from tests.support.kernel_guest import LEND, REAL, STUB
from vmlend.kernel.mdev import MdevBus
from vmlend.kernel.udev import Outcome, ParentWatcher, PyudevSource, WantedMdev

U1 = "83b8f4f2-509f-382f-3c1e-e6bfe0fa4001"
PARENT = "smartio-12"


class Recording:
    """The live source, keeping (action, name, SMARTIO_AVAILABILITY or MDEV_STATE) of what
    it delivered."""

    def __init__(self, source):
        self.source, self.events = source, []

    def fileno(self):
        return self.source.fileno()

    def receive(self):
        ev = self.source.receive()
        if ev is not None:
            said = ev.properties.get("SMARTIO_AVAILABILITY") or ev.properties.get("MDEV_STATE")
            self.events.append((ev.action, ev.sys_name, said))
        return ev


def test_a_returning_lender_gets_the_running_vms_mdev_back(fabric_devices):
    source = PyudevSource.for_host(REAL)
    assert PyudevSource.netlink_source(REAL) == "kernel"
    STUB.command("borrow", "0x12")
    bus = MdevBus(REAL)
    bus.create(PARENT, LEND, U1)
    wanted = [WantedMdev(U1, PARENT, LEND, vm="web")]
    vanished, appeared = [], []
    watcher = ParentWatcher(bus, lambda: wanted, vanished.append, appeared.append)
    assert watcher.discover() == [PARENT]
    assert [r.outcome for r in watcher.reactions] == [Outcome.PRESENT]

    # The lender goes: the driver says so, and unregisters the parent with its child.
    gone = Recording(source)
    STUB.set_availability(0x12, "unreachable")
    assert watcher.run(gone, timeout=3) > 0
    assert ("change", PARENT, "unreachable") in gone.events, gone.events
    assert ("change", PARENT, "unregistered") in gone.events, gone.events
    assert vanished == [PARENT] and bus.parent_names() == [] and bus.devices() == []
    assert watcher.reactions[-1].outcome is Outcome.UNAVAILABLE

    # It comes back: the driver registers the parent again by itself, and the kernel's events
    # alone make the watcher re-create the VM's child.
    before = len(watcher.reactions)
    back = Recording(source)
    STUB.set_availability(0x12, "available")
    assert watcher.run(back, timeout=3) > 0
    assert ("change", PARENT, "available") in back.events, back.events
    # The mdev core's MDEV_STATE=registered is among them, and the watcher acts on every
    # "registered" (a parent may have come and gone unheard): one re-creation, then present.
    assert ("change", PARENT, "registered") in back.events, back.events
    assert appeared and set(appeared) == {PARENT}, back.events
    after = [(r.outcome, r.uuid, r.vm) for r in watcher.reactions[before:]]
    assert after[0] == (Outcome.RECREATED, U1, "web"), after
    assert set(after[1:]) <= {(Outcome.PRESENT, U1, "web")}, after
    dev = bus.device(U1)
    assert dev is not None and (dev.parent, dev.type_id) == (PARENT, LEND)
