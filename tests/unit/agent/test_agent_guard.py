"""The borrower's guard: which VMs it pauses when the lease is in doubt, and that a pause does
not wait for the hypervisor's slowest domain."""

from __future__ import annotations

import threading
import time

from tests.support.simcluster import domain_of as _domain
from tests.support.simfabric import make_fabric
from vmlend.agent.guard import RemoteVmGuard
from vmlend.hypervisor.base import DomainInfo, DomainState
from vmlend.sim.hypervisor.node import SimHypervisor

GPU = 0x10  # lent by alpha: remote for gamma
APP = "33333333-3333-3333-3333-333333333333"
DB = "44444444-4444-4444-4444-444444444444"


class ListingHangs(SimHypervisor):
    """Listing waits (as libvirt's does while one domain's hook runs) until ``go`` is set."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.hang = False
        self.listing = threading.Event()
        self.go = threading.Event()

    def list_domains(self) -> list[DomainInfo]:
        if self.hang:
            self.listing.set()
            self.go.wait()
        return super().list_domains()


def test_the_guard_pauses_only_running_vms_with_remote_devices(tmp_path):
    fabric = make_fabric(tmp_path / "state.db")  # opened as gamma
    hv = SimHypervisor("gamma", tmp_path / "hv", None)
    hv.define(_domain("app", APP, (GPU,)))
    hv.define(_domain("db", DB, ()))  # nothing remote
    hv.define(_domain("idle", "55555555-5555-5555-5555-555555555555", (GPU,)))  # not running
    hv.start("app")
    hv.start("db")
    guard = RemoteVmGuard(hv, fabric, "gamma")
    assert guard.pause() == ["app"]
    assert hv.lookup("app").state is DomainState.PAUSED
    assert hv.lookup("db").state is DomainState.RUNNING
    assert guard.known == {"app"}


def test_a_pause_does_not_wait_for_a_listing_the_hypervisor_holds_up(tmp_path):
    """Found by the nemesis test: with etcd out of quorum, a VM's start hung in its prepare
    hook; the agent's pause listed the domains first, which waited for that start, and a
    running VM with a remote device ran on 8.5 s, past its lease, while the lender gave the
    device to another host. The census remembers who to pause; the pause does those first."""
    fabric = make_fabric(tmp_path / "state.db")
    hv = ListingHangs("gamma", tmp_path / "hv", None)
    hv.define(_domain("app", APP, (GPU,)))
    hv.start("app")
    guard = RemoteVmGuard(hv, fabric, "gamma")
    assert guard.census() == ["app"]
    hv.hang = True
    pausing = threading.Thread(target=lambda: guard.pause())
    pausing.start()
    try:
        deadline = time.monotonic() + 20
        while hv.lookup("app").state is not DomainState.PAUSED:
            assert time.monotonic() < deadline, "app was not paused while the listing hung"
            time.sleep(0.01)
        assert not hv.go.is_set()  # paused while the listing still waits
    finally:
        hv.go.set()
        pausing.join()


def test_a_pause_names_the_vms_in_order_whichever_the_census_knew(tmp_path):
    """The log line operators (and tests) read: 'paused app, web', not in the order found."""
    fabric = make_fabric(tmp_path / "state.db")
    hv = SimHypervisor("gamma", tmp_path / "hv", None)
    hv.define(_domain("web", APP, (GPU,)))
    hv.start("web")
    guard = RemoteVmGuard(hv, fabric, "gamma")
    guard.census()  # knows web only
    hv.define(_domain("app", DB, (0x11,)))
    hv.start("app")
    assert guard.pause() == ["app", "web"]
