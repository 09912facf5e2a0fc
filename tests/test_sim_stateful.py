"""A seeded, randomised sequence of fabric operations, with the invariant checker after every
step (hypothesis' rule-based state machine).

Four VM slots on the default cluster (two on gamma, one on alpha, one on beta) start with a few
of alpha's and beta's devices (reserve + mdev through the hook's prepare), and the guests, the
fabric and the operator do, in any order: enable (the deferred borrow and the DMA windows),
Bus Master and memory decoding on and off, BAR moves (peer-to-peer re-plans), function level
resets, hot-remove, the fabric's give-back behind the VM's back (detach's return step), a
release after a crash, the lender reclaiming a device, VM stop, lender node down (its borrows
end on the hardware; its holds released, or left for later) and up again.

After each step: ``check_hardware`` (with the registry's holds and claims) finds nothing, and
every device (Bus Master forced on, as a misbehaving device would) reaches only RAM and BARs of
the VM that borrowed it. CI runs ``MAX_EXAMPLES`` sequences of up to ``STEPS`` steps each
(marked slow) plus a short smoke run in the fast suite, derandomized (the same sequences every
run); docs/simulator.md states the numbers.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.test_simvm import Cluster, domain_xml
from vmlend.errors import BorrowTeardownError, DmaFault, VmlendError
from vmlend.fabric.model import BarKind, GiB
from vmlend.fabric.sim.dmawin import RegistryWindowLedger
from vmlend.fabric.sim.invariants import check_hardware
from vmlend.fabric.sim.p2pmap import P2PMapper, registry_recorder
from vmlend.fabric.sim.simvm import SimVm
from vmlend.pci import regs
from vmlend.pci.config import EXP_OFFSET

MAX_EXAMPLES = 60
STEPS = 30
SMOKE_EXAMPLES = 5  # the fast suite's share (unmarked); the full run is marked slow
SMOKE_STEPS = 20

SLOTS = (("gamma", "a"), ("gamma", "b"), ("alpha", "c"), ("beta", "d"))
DEVICES = (0x10, 0x11, 0x12, 0x20, 0x21, 0x22)
LENDERS = ("alpha", "beta")

slots = st.sampled_from(range(len(SLOTS)))
picks = st.integers(min_value=0, max_value=len(DEVICES) - 1)
devices = st.sampled_from(DEVICES)


class FabricMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="vmlend-stateful-"))
        self.c = Cluster.create(self.tmp / "state.db")
        self.vms: dict[int, tuple[SimVm, P2PMapper, bytes]] = {}
        self.down: set[str] = set()

    def teardown(self) -> None:
        try:
            for slot in list(self.vms):
                self._stop(slot)
        finally:
            self.c.close()
            shutil.rmtree(self.tmp, ignore_errors=True)

    # --- helpers ---------------------------------------------------------------------------------
    def _vm(self, slot: int, pick: int) -> tuple[SimVm, int] | None:
        entry = self.vms.get(slot)
        if entry is None or not entry[0].devices():
            return None
        vm = entry[0]
        return vm, vm.devices()[pick % len(vm.devices())]

    def _stop(self, slot: int) -> None:
        vm, p2p, xml = self.vms.pop(slot)
        node = SLOTS[slot][0]
        vm.stop()
        p2p.close()
        self.c.release(xml, node)  # idempotent for devices released behind the VM's back

    def _holder_of(self, fdid: int):
        return self.c.fabric().device(fdid).holder

    def _release(self, fdid: int) -> None:
        """What the cleanup after a crash does: the hold goes, then the mdev."""
        holder = self._holder_of(fdid)
        if holder is None:
            return
        fabric = self.c.fabric(holder.node)
        assert fabric.release(fdid, holder)
        for m in fabric.mdevs():
            if m.fdid == fdid:
                fabric.remove_mdev(m.uuid)

    # --- rules ---------------------------------------------------------------------------------
    @precondition(lambda self: len(self.vms) < len(SLOTS))
    @rule(slot=slots, chosen=st.sets(devices, min_size=1, max_size=4))
    def start(self, slot: int, chosen: set[int]) -> None:
        """Start a VM (in the first free slot from ``slot`` on) with the chosen devices nobody
        holds; its guest enables them all."""
        slot = next(
            s % len(SLOTS) for s in range(slot, slot + len(SLOTS)) if s % len(SLOTS) not in self.vms
        )
        node, name = SLOTS[slot]
        free = tuple(sorted(f for f in chosen if self._holder_of(f) is None))
        if not free:
            return
        xml = domain_xml(name, 1 * GiB, fdids=free)
        try:
            self.c.prepare(xml, node)
        except VmlendError:
            return  # a lender down, admission: nothing was reserved
        ledger = RegistryWindowLedger(self.c.registry)
        p2p = P2PMapper(
            self.c.hw, node, name, recorder=registry_recorder(self.c.registry), promises=ledger
        )
        vm = SimVm(
            xml,
            hardware=self.c.hw,
            fabric=self.c.fabric(node),
            ledger=ledger,
            p2p=p2p,
            backing=GiB,
        )
        self.vms[slot] = (vm, p2p, xml)
        for fdid in vm.devices():
            self._enable(vm, fdid)

    def _enable(self, vm: SimVm, fdid: int) -> None:
        try:
            vm.enable_device(fdid)
        except BorrowTeardownError:
            raise
        except VmlendError:
            pass  # refused (not reserved, lender down, no room): the bit stays 0

    @precondition(lambda self: self.vms)
    @rule(slot=slots, pick=picks)
    def enable(self, slot: int, pick: int) -> None:
        got = self._vm(slot, pick)
        if got is not None:
            self._enable(*got)

    @rule(slot=slots, pick=picks, on=st.booleans())
    def bus_master(self, slot: int, pick: int, on: bool) -> None:
        got = self._vm(slot, pick)
        if got is not None:
            vm, fdid = got
            cmd = vm.config_read(fdid, regs.COMMAND, 2)
            cmd = cmd | regs.COMMAND_MASTER if on else cmd & ~regs.COMMAND_MASTER
            vm.config_write(fdid, regs.COMMAND, 2, cmd)

    @rule(slot=slots, pick=picks, on=st.booleans())
    def memory_decoding(self, slot: int, pick: int, on: bool) -> None:
        got = self._vm(slot, pick)
        if got is not None:
            vm, fdid = got
            cmd = vm.config_read(fdid, regs.COMMAND, 2)
            cmd = cmd | regs.COMMAND_MEMORY if on else cmd & ~regs.COMMAND_MEMORY
            vm.config_write(fdid, regs.COMMAND, 2, cmd)

    @rule(slot=slots, pick=picks, gib=st.sampled_from([0, 64, 128]))
    def move_bar(self, slot: int, pick: int, gib: int) -> None:
        got = self._vm(slot, pick)
        if got is None:
            return
        vm, fdid = got
        for bar in vm.bars(fdid):
            if bar.kind is BarKind.MEM64:
                address = bar.address + gib * GiB
                off = regs.BASE_ADDRESS_0 + 4 * bar.index
                vm.config_write(fdid, off, 4, address & 0xFFFFFFFF)
                vm.config_write(fdid, off + 4, 4, address >> 32)
                return

    @precondition(lambda self: self.vms)
    @rule(slot=slots, pick=picks)
    def flr(self, slot: int, pick: int) -> None:
        got = self._vm(slot, pick)
        if got is not None:
            got[0].config_write(got[1], EXP_OFFSET + regs.EXP_DEVCTL, 2, regs.EXP_DEVCTL_BCR_FLR)

    @precondition(lambda self: self.vms)
    @rule(slot=slots, pick=picks)
    def hot_remove(self, slot: int, pick: int) -> None:
        got = self._vm(slot, pick)
        if got is not None:
            vm, fdid = got
            vm.remove_device(fdid)
            self._release(fdid)

    @precondition(lambda self: self.vms)
    @rule(fdid=devices)
    def give_back_behind_the_vm(self, fdid: int) -> None:
        holder = self._holder_of(fdid)
        if holder is not None:
            self.c.fabric(holder.node).give_back(fdid, holder)

    @precondition(lambda self: self.vms)
    @rule(fdid=devices)
    def release_after_crash(self, fdid: int) -> None:
        self._release(fdid)

    @precondition(lambda self: self.vms)
    @rule(slot=slots)
    def stop(self, slot: int) -> None:
        if slot in self.vms:
            self._stop(slot)

    @precondition(lambda self: self.vms)
    @rule(fdid=devices)
    def lender_reclaim(self, fdid: int) -> None:
        """The lender takes the device back: borrow, hold and mdev end in one step."""
        self.c.fabric(self.c.hw.device(fdid).lender).reclaim(fdid)

    @rule(node=st.sampled_from(LENDERS), release=st.booleans())
    def lender_down(self, node: str, release: bool) -> None:
        """The lender's borrows end on the hardware; the holds stay until released."""
        self.c.fabric().set_node_up(node, False, "lost power")
        self.down.add(node)
        for fdid in DEVICES:
            if self.c.hw.device(fdid).lender == node:
                assert self.c.hw.borrowed(fdid) is None
                if release:
                    self._release(fdid)

    @precondition(lambda self: self.down)
    @rule(node=st.sampled_from(LENDERS))
    def lender_up(self, node: str) -> None:
        self.c.fabric().set_node_up(node, True)
        self.down.discard(node)

    # --- after every step ----------------------------------------------------------------------
    @invariant()
    def every_mapping_is_justified(self) -> None:
        with self.c.registry.read() as tx:
            holds, claims = tx.holds(), tx.claims()
        found = check_hardware(self.c.hw, holds=holds, claims=claims)
        assert found == [], "\n".join(map(str, found))

    @invariant()
    def every_device_reaches_only_its_vm(self) -> None:
        hw = self.c.hw
        targets = [
            (b.address, b.fdid)
            for vm, _p2p, _xml in self.vms.values()
            for f in vm.devices()
            for b in vm.bars(f)
            if b.kind is not BarKind.IO
        ] + [(gpa, None) for gpa in (0x1000, 512 << 20)]
        for dev in hw.devices():
            borrow = hw.borrowed(dev.fdid)
            owner = None if borrow is None else (borrow.node, borrow.vm)
            command = dev.config.command
            dev.config.write(regs.COMMAND, 2, command | regs.COMMAND_MASTER, notify=False)
            try:
                for gpa, _ in targets:
                    try:
                        t = hw.resolve_dma(dev.fdid, gpa, write=True)
                    except DmaFault:
                        continue
                    assert owner is not None, f"{dev.fdid:#x} is not borrowed yet reached {t}"
                    if t.kind == "ram":
                        assert (t.node, t.owner) == owner, f"{dev.fdid:#x} of {owner}: {t}"
                    else:
                        b = hw.borrowed(t.owner)  # type: ignore[arg-type]
                        assert b is not None and (b.node, b.vm) == owner, f"{dev.fdid:#x}: {t}"
            finally:
                dev.config.write(regs.COMMAND, 2, command, notify=False)


def _settings(examples: int, steps: int) -> settings:
    # derandomized: CI runs the same sequences every time; no example database on disk
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


class FabricSmoke(FabricMachine):
    """A few short sequences, for the fast suite."""


FabricMachine.TestCase.settings = _settings(MAX_EXAMPLES, STEPS)
FabricSmoke.TestCase.settings = _settings(SMOKE_EXAMPLES, SMOKE_STEPS)
test_fabric_state_machine = pytest.mark.slow(FabricMachine.TestCase)
test_fabric_state_machine_smoke = FabricSmoke.TestCase
