"""A bench for one host's VM workers (``vmlend.agent.guest``): an SQLite fabric opened as
gamma, a simulated hypervisor without hooks (the test decides the holds), a lease clock on a
fake clock, pause marks in a run directory, and workers driven turn by turn (``step``)."""

from __future__ import annotations

from pathlib import Path

from tests.support.clocks import FakeClock
from tests.support.simcluster import domain_of
from tests.support.simfabric import make_fabric
from vmlend.agent.clock import LeaseClock
from vmlend.agent.guest import Guest, GuestSettings, VmState
from vmlend.agent.pause_marks import PauseMarks
from vmlend.agent.recover import VmRecovery
from vmlend.domain import mdev_uuid
from vmlend.fabric.base import Fabric
from vmlend.lending.devices import UndoJournal, acquire_device, holder_for
from vmlend.sim.hypervisor.node import SimHypervisor
from vmlend.wiring.fabric import open_fabric

TTL = 10.0
GPU, NIC = 0x10, 0x20  # lent by alpha and by beta: remote for gamma


class Bench:
    def __init__(
        self, tmp_path: Path, hv: SimHypervisor | None = None, node: str = "gamma"
    ) -> None:
        self.node = node
        self.state = tmp_path / "state.db"
        self.fabric = make_fabric(self.state, node=node)
        self.hv = hv or SimHypervisor(node, tmp_path / "hv", None)
        self.now = FakeClock()
        self.clock = LeaseClock(self.now)
        self.lease = 1
        self.clock.start(self.lease, TTL, self.now(), followed=True)
        self.marks = PauseMarks(tmp_path / "run" / "paused")
        self.changes: list[tuple[str, str, str]] = []
        self.recovered: list[VmRecovery] = []

    # --- the VMs ------------------------------------------------------------------------------
    def vm(self, name: str, uuid: str, fdids: tuple[int, ...], *, held: bool = True) -> None:
        """Define and start ``name`` with ``fdids``, held for it (``held``) as its prepare
        hook would have."""
        self.hv.define(domain_of(name, uuid, fdids))
        self.hv.start(name)
        if held:
            holder = holder_for(self.fabric, name, uuid)
            for fdid in fdids:
                mdev = str(mdev_uuid(uuid, fdid))
                acquire_device(self.fabric, holder, fdid, mdev, UndoJournal())

    def guest(self, name: str, state: VmState = VmState.RUNNING) -> Guest:
        """``name``'s worker, not started: the test takes its turns (``step``)."""

        def changed(vm: str, before: VmState, after: VmState, why: str) -> None:
            self.changes.append((vm, after.value, why))

        return Guest(
            name,
            state,
            hv=self.hv,
            clock=self.clock,
            open_fabric=self.open_fabric,
            marks=self.marks,
            settings=GuestSettings(period=1.0, fence_wait=0.0, interval=0.01),
            changed=changed,
            recovered=self.recovered.append,
            now=self.now,
        )

    def open_fabric(self) -> Fabric:
        return open_fabric(self.state, self.node)

    # --- the lease ----------------------------------------------------------------------------
    def turn(self, guest: Guest) -> None:
        guest.step()

    def doubt(self) -> None:
        """No renewal for more than half the TTL."""
        self.now.advance(TTL / 2 + 0.1)

    def renew(self) -> None:
        self.clock.renewed(self.lease, self.now(), TTL)

    def lose(self) -> None:
        """etcd says the lease is gone; a new one is taken (not followed yet)."""
        self.clock.gone(self.lease)
        self.lease += 1
        self.clock.start(self.lease, TTL, self.now(), followed=False)

    def follow(self) -> None:
        self.clock.followed(self.lease)
