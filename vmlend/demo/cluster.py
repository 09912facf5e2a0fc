"""The demo's simulated cluster in this process: one ``SimHardware``, one ``SimFabric`` per node
driving it, and a simulated hypervisor per node whose guests are ``DemoGuest``.

The hypervisors are the ones ``vmlend --connect sim:///<node>`` opens (same data directory
beside the state, same hook command), so ``vmlend status -c sim:///gamma`` sees the demo's VM.
The hook is the real one, run as a subprocess the way libvirtd runs it; ``HookTrace`` keeps a
record of each call for the report.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec

from vmlend.demo.guest import DemoGuest
from vmlend.errors import UnknownDomainError
from vmlend.irq.records import VectorRecorder, registry_vector_recorder
from vmlend.registry import open_registry
from vmlend.sim.backend import SimFabric
from vmlend.sim.dmawin import RegistryWindowLedger
from vmlend.sim.hardware import SimHardware
from vmlend.sim.hypervisor.node import HookRun, HookRunner, SimHypervisor
from vmlend.sim.invariants import Violation, check_hardware, registry_grants
from vmlend.sim.msitarget import MsiTargets
from vmlend.sim.p2pmap import Recorder, registry_recorder
from vmlend.topology.compiled import stored_topology
from vmlend.topology.model import GiB
from vmlend.wiring.hypervisor import hook_command, open_hypervisor

log = logging.getLogger(__name__)


class HookCall(msgspec.Struct, frozen=True):
    node: str
    args: tuple[str, ...]  # libvirt's argv: domain, operation, sub-operation, extra
    returncode: int
    seconds: float


class HookTrace(HookRunner):
    """Runs the hook exactly as ``HookRunner`` does and remembers each call."""

    def __init__(
        self, node: str, command: Sequence[str] | None, timeout: float, calls: list[HookCall]
    ) -> None:
        super().__init__(command, timeout)
        self.node = node
        self.calls = calls  # shared by every node's trace: one record, in call order

    def run(self, name: str, op: str, subop: str, extra: str, xml: bytes) -> HookRun:
        started = time.monotonic()
        result = super().run(name, op, subop, extra, xml)
        args = (name, op, subop, extra or "-")
        self.calls.append(HookCall(self.node, args, result.returncode, time.monotonic() - started))
        return result


class DemoCluster:
    """The simulated cluster of the state at ``state_path`` (already initialised)."""

    def __init__(self, state_path: Path, *, backing: int = GiB, seed: int = 0) -> None:
        self.state_path = state_path
        self.backing = backing
        self.registry = open_registry(state_path)
        self.ledger = RegistryWindowLedger(self.registry)
        try:
            with self.registry.read() as tx:
                rec = tx.topology()
        except BaseException:
            self.registry.close()
            raise
        self.hw = SimHardware.from_topology(stored_topology(rec), seed=seed)
        self.msi_targets = MsiTargets(self.hw)  # one per hardware: a page per VM
        self._fabrics: dict[str, SimFabric] = {}
        self.guests: dict[str, DemoGuest] = {}
        self._hypervisors: dict[str, SimHypervisor] = {}
        self.hook_calls: list[HookCall] = []

    # --- collaborators ------------------------------------------------------------------------
    def fabric(self, node: str | None = None) -> SimFabric:
        """The fabric seen from ``node`` (default: the state's local node), driving the
        hardware of this process."""
        key = node or ""
        if key not in self._fabrics:
            registry = open_registry(self.state_path)
            self._fabrics[key] = SimFabric(registry, node, hardware=self.hw)
        return self._fabrics[key]

    def p2p_recorder(self) -> Recorder:
        return registry_recorder(self.registry)

    def vector_recorder(self) -> VectorRecorder:
        return registry_vector_recorder(self.registry)

    def guest(self, node: str) -> DemoGuest:
        if node not in self.guests:
            self.guests[node] = DemoGuest(self, node)
        return self.guests[node]

    def hypervisor(self, node: str) -> SimHypervisor:
        """The simulated hypervisor ``sim:///<node>`` with the real hook and our guests."""
        if node not in self._hypervisors:
            self.hw.node(node)  # UnknownNodeError before anything is created
            hv = open_hypervisor(
                f"sim:///{node}",
                state_dir=self.state_path.parent,
                hook_command=hook_command(self.state_path, node),
                guest_driver=self.guest(node),
            )
            assert isinstance(hv, SimHypervisor), "a sim:/// URI opens a simulated node"
            hv.hooks = HookTrace(node, hv.hooks.command, hv.hooks.timeout, self.hook_calls)
            self._hypervisors[node] = hv
        return self._hypervisors[node]

    def violations(self) -> list[Violation]:
        """The fabric's invariants over this process's hardware and the shared holds/claims;
        the registry's NVMe shares justify what shared drives map for them."""
        with self.registry.read() as tx:
            holds, claims, grants = tx.holds(), tx.claims(), registry_grants(tx)
        return check_hardware(self.hw, holds=holds, claims=claims, shares=grants)

    # --- idempotence --------------------------------------------------------------------------
    def remove_vm(self, name: str) -> list[str]:
        """Remove every trace of a VM called ``name`` a previous run left: its domain on every
        node (stopped first, so the hook returns its devices), then any hold or mdev still
        naming it. Returns what was done."""
        done: list[str] = []
        for node in sorted(self.hw.nodes):
            hv = self.hypervisor(node)
            try:
                info = hv.lookup(name)
            except UnknownDomainError:
                continue
            if info.active:
                hv.destroy(name)
                done.append(f"destroyed {name} on {node}")
            if info.persistent:
                hv.undefine(name)
                done.append(f"undefined {name} on {node}")
        for st in self.fabric().devices():
            h = st.holder
            if h is not None and h.vm == name:
                self.fabric(h.node).release(st.fdid, h)
                done.append(f"returned {st.fdid:#x} from {h}")
        for node in sorted(self.hw.nodes):
            for m in self.fabric(node).mdevs():
                if m.vm == name and self.fabric(node).remove_mdev(m.uuid):
                    done.append(f"removed mdev {m.uuid} on {node}")
        return done

    def close(self) -> None:
        for guest in self.guests.values():
            for name in list(guest.running):
                guest.on_stopped(name)
        for hv in self._hypervisors.values():
            hv.close()
        for f in self._fabrics.values():
            f.close()
        self._fabrics.clear()
        self.registry.close()
