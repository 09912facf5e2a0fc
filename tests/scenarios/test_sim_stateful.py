"""A seeded, randomised sequence of fabric operations and hand-overs, with the invariant checker
and an isolation probe after every step (hypothesis' rule-based state machine).

The cluster (``TOPOLOGY``) has two lenders whose devices sit at the same BDFs (alpha's GPU and
beta's GPU at 0000:41:00.0, alpha's NVMe drive and beta's NIC at 0000:43:00.0), two borrowers,
and alpha's NVMe drive lent for queue-level sharing. Five VM slots run on four nodes; the VM
"a" runs on gamma and on delta with the same name and UUID. The guests, the fabric, the
operator and an attacker do, in any order:

- start a VM with free devices and, sometimes, a share of the drive (the hook's prepare; the
  guest enables everything and its NVMe driver starts, its submission queue in the share's
  extent of the drive's controller memory buffer when it has one; the CMB holds two, so a
  third one-path share is refused until a release returns one), share I/O (its completion
  interrupts over the NTB when its interrupt window was admitted, each write reaching its
  VM's target, else relayed), a guest's register write to one of its devices (MMIO through
  the adapters);
- enable, Bus Master and memory decoding on and off, BAR moves (peer-to-peer re-plans),
  function level resets, hot-remove (the VM's own hold released);
- hand-overs: the fabric's give-back behind the VM's back, a release after a crash, a share
  released behind its VM, the lender reclaiming a device or the shared drive, lender down and
  up, VM stop, the drive shared again once it is free;
- hot migration: a running VM moves to another node with its devices plugged (a NIC, whose
  driver cannot quiesce, and a destination without room are refused with nothing changed),
  the checker run after each of its phases; or, a VM with a share (always for a share of two
  paths), unplugged: its devices hot-removed and re-plugged there, its share controller
  unplugged and plugged back, the share kept (its blocks the VM's at every step, another VM
  asking meanwhile is given other blocks, the guest reads its disk back there);
- attacks: a VM hot-adding another VM's mdev, a failed start of a domain whose metadata names
  another VM's mdevs followed by its release (with a consistent and an inconsistent copy).

After each step: ``check_hardware`` (with the registry's holds, claims and shares) finds
nothing; every device (Bus Master forced on, as a misbehaving device would) reaches only RAM
and BARs of the VM that borrowed it; the shared drive reaches, in each address space, only the
RAM of the VM whose registry share it is, and at its CMB address only the extent of the CMB
that share claimed (the checker: every mapped extent equals the claimed one); every session
whose device moved on reads all ones, and its config writes (Command, MSI, a function level
reset) change nothing on the device; a share taken from its VM reads all ones; a guest's MMIO
to a device it holds, and each doorbell its share of the drive rings (primary and backup pair),
is cut at a dead cable exactly when the device's DMA into that VM's RAM (in the share's address
space) is, as the DMA resolver judges.

CI runs ``MAX_EXAMPLES`` sequences of up to ``STEPS`` steps (marked slow) plus a short smoke
run in the fast suite, derandomized (the same sequences every run). ``VMLEND_STATEFUL_EXAMPLES``
and ``VMLEND_STATEFUL_STEPS`` explore more (docs/simulator.md states the numbers).
"""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tests.support.discovery import device as found_device
from tests.support.etcd_daemon import EtcdServer, host_lease
from tests.support.etcd_units import ledgers_agree_with_blocks
from tests.support.nvme_guest import guest_driver
from tests.support.simcluster import Cluster
from tests.support.stateful import derandomized
from vmlend.domain import (
    DeviceRequest,
    DomainSpec,
    NvmeShareRequest,
    TemplateSet,
    mdev_uuid,
    new_domain,
    read_domain,
)
from vmlend.errors import (
    BorrowTeardownError,
    DmaFault,
    StaleTokenError,
    StateError,
    VmlendError,
)
from vmlend.hook.actionlog import NullLog
from vmlend.hook.ops import HookOps
from vmlend.ledger import handover
from vmlend.ledger import nvmeshares as ledger
from vmlend.lending.devices import UndoJournal, acquire_device
from vmlend.lending.quiesce import how_to_quiesce
from vmlend.nvme import spec as nvme_spec
from vmlend.nvme.cmb import GUEST_CMB_BASE
from vmlend.nvme.guard import asid_base
from vmlend.nvme.shares import Share
from vmlend.registry import FenceRecord, SqliteRegistry, same_holder
from vmlend.sim.dmawin import RegistryWindowLedger
from vmlend.sim.hostmem import FRAME
from vmlend.sim.hotmig import hot_migrate
from vmlend.sim.invariants import check_hardware, registry_grants
from vmlend.sim.nvme.cmb import GuestWithCmb
from vmlend.sim.nvme.driver import NvmeDriver, QueuePair
from vmlend.sim.nvme.relay import BACKUP
from vmlend.sim.nvmedrive import drive_geometry
from vmlend.sim.nvmeshare import SharedNvmeDrive
from vmlend.sim.p2pmap import P2PMapper, registry_recorder
from vmlend.sim.pci import regs
from vmlend.sim.pci.config import EXP_OFFSET, MSI_OFFSET
from vmlend.sim.simvm import SimVm
from vmlend.sim.unplugmig import unplug_migrate
from vmlend.topology.discovered import FoundHost
from vmlend.topology.model import BarKind, GiB, Holder, MiB
from vmlend.topology.paths import NtbPath
from vmlend.topology.requesters import ports_between
from vmlend.wiring.discover import discover_fabric

MAX_EXAMPLES = int(os.environ.get("VMLEND_STATEFUL_EXAMPLES", "300"))
STEPS = int(os.environ.get("VMLEND_STATEFUL_STEPS", "40"))
#: What a guest writes to its share's disk before an unplugged move (read back after it).
MARK = b"\x5a" * 512
SMOKE_EXAMPLES = 5  # the fast suite's share (unmarked); the full run is marked slow
SMOKE_STEPS = 20
#: On etcd (marked slow): every registry call is a request to a real etcd.
#: 100 of up to 40 steps (about 4 min): 40 of them do not reach a VM of three devices whose
#: peer-to-peer claims need all its holds (a holds_of that lost one went unseen).
ETCD_EXAMPLES = int(os.environ.get("VMLEND_STATEFUL_ETCD_EXAMPLES", "100"))
ETCD_STEPS = int(os.environ.get("VMLEND_STATEFUL_ETCD_STEPS", "40"))
#: On ``TIGHT_TOPOLOGY`` (marked slow), of up to ``STEPS`` steps.
TIGHT_EXAMPLES = int(os.environ.get("VMLEND_STATEFUL_TIGHT_EXAMPLES", "100"))
#: On ``SHARED_ENTRY_TOPOLOGY`` on etcd (marked slow), of up to ``ETCD_STEPS`` steps.
SHARED_ETCD_EXAMPLES = int(os.environ.get("VMLEND_STATEFUL_SHARED_ETCD_EXAMPLES", "100"))

_GPU = """
  kind = "gpu"
  vendor = 0x10de
  device = 0x1db4
  class = 0x030200
  dma_bits = 40
  intx = "A"
  bars = [ {{ index = 0, size = "16MiB", kind = "mem32" }},
           {{ index = 1, size = "1GiB", kind = "mem64", prefetch = true }} ]
  msi = {{ vectors = 1, bits64 = true }}
"""
_ADAPTER = """
  [[node.adapter]]
  index = 0
  model = "PXH830"
  window = "64GiB"
  segments = 32
  lut_entries = 32
  cpus = 1
"""

TOPOLOGY = f"""
name = "handover"
[[node]]
name = "alpha"
id = 4
ram = "64GiB"
{_ADAPTER}
{_ADAPTER.replace("index = 0", "index = 1")}
  [[node.device]]
  fdid = 0x10
  bdf = "0000:41:00.0"
{_GPU.format()}
  [[node.device]]
  fdid = 0x12
  bdf = "0000:43:00.0"
  kind = "nvme"
  vendor = 0x144d
  device = 0xa80a
  class = 0x010802
  bars = [ {{ index = 0, size = "64KiB", kind = "mem64" }},
           {{ index = 4, size = "16KiB", kind = "mem64" }} ]
  msix = {{ vectors = 64, table_bar = 4, table_offset = 0, pba_bar = 4, pba_offset = 0x2000 }}

[[node]]
name = "beta"
id = 8
ram = "64GiB"
{_ADAPTER}
{_ADAPTER.replace("index = 0", "index = 1")}
  [[node.device]]
  fdid = 0x20
  bdf = "0000:41:00.0"
{_GPU.format()}
  [[node.device]]
  fdid = 0x21
  bdf = "0000:43:00.0"
  kind = "nic"
  vendor = 0x8086
  device = 0x1572
  class = 0x020000
  bars = [ {{ index = 0, size = "1MiB", kind = "mem32" }} ]
  msi = {{ vectors = 4, bits64 = true }}

[[node]]
name = "gamma"
id = 12
ram = "64GiB"
{_ADAPTER}
{_ADAPTER.replace("index = 0", "index = 1")}

[[node]]
name = "delta"
id = 16
ram = "64GiB"
{_ADAPTER}

[[switch]]
name = "sw"
ports = ["alpha:0", "beta:0", "gamma:0", "delta:0"]

[[switch]]
name = "sw2"
ports = ["gamma:1"]

[[switch_link]]
ends = ["sw", "sw2"]

[[link]]
ends = ["alpha:1", "beta:1"]
"""

#: The same cluster on switches whose ports hold two requesters each: gamma's and delta's
#: ports (and the cable to ``sw2``) fill up before the VMs have every device, so starts (a
#: share of the drive too: its crossing needs the drive's requester on each port), hot
#: migrations and re-routes (the drive's crossings' too) meet full requester tables and are
#: refused, and the checker proves after every step that the claims on each port equal the
#: entries in use, the shares' crossings' included.
TIGHT_TOPOLOGY = TOPOLOGY.replace(
    'name = "sw"\nports', 'name = "sw"\nrequester_entries = 2\nports'
).replace('name = "sw2"\nports', 'name = "sw2"\nrequester_entries = 2\nports')
assert TIGHT_TOPOLOGY.count("requester_entries = 2") == 2

SHARED = 0x12
SHARED_REQUESTER = "alpha/0000:43:00"  # its requester device, as the switch ports count it
#: A full switch port's refusal (``SwitchPortFullError``, wrapped by the hook): port, lender.
FULL_PORT = re.compile(r"port (\S+): its requester table is full .*? requester ([^/\s]+)/")
BLOCKS = 1 << 16
#: The drive's controller memory buffer: room for two one-path shares' extents (64 KiB per
#: queue pair), so a third is refused and a release makes room again.
CMB_BYTES = 128 * 1024
SLOTS = (("gamma", "a"), ("gamma", "b"), ("delta", "a"), ("alpha", "c"), ("beta", "d"))
NODES = ("gamma", "delta", "alpha", "beta")
DEVICES = (0x10, 0x12, 0x20, 0x21)
LENDERS = ("alpha", "beta")
PROBE_GPAS = (0x1000, 512 * MiB)
#: A BAR0 offset no device here decodes as anything but plain memory (NVMe's registers end
#: below it, no MSI-X table sits in BAR0 at 0).
MMIO_REG = 0x100
#: Cables a link fault can cut: gamma's primary and backup, a lender's, the switches' cable,
#: and the lenders' own cable (alpha:1 to beta:1, the cheapest route between them, so
#: peer-to-peer between alpha and beta crosses it and moves onto the switch when it dies).
LENDERS_CABLE = "alpha:1-beta:1"
LINKS = ("sw/gamma:0", "sw2/gamma:1", "sw/alpha:0", "sw-sw2", LENDERS_CABLE)

slots = st.sampled_from(range(len(SLOTS)))
picks = st.integers(min_value=0, max_value=len(DEVICES) - 1)
devices = st.sampled_from(DEVICES)


def _caused_by(e: BaseException | None, kind: type[BaseException]) -> bool:
    """Whether ``e`` or an error it was raised from (the hook wraps its causes) is a ``kind``."""
    while e is not None:
        if isinstance(e, kind):
            return True
        e = e.__cause__
    return False


def vm_xml(name: str, fdids: tuple[int, ...], share: bool, paths: int = 1) -> bytes:
    requests = [DeviceRequest(f) for f in fdids]
    if share:
        requests.append(DeviceRequest(SHARED, share=NvmeShareRequest(1, 8 * MiB, paths)))
    return new_domain(
        DomainSpec(
            name=name,
            memory_bytes=1 * GiB,
            uuid=uuid.uuid5(uuid.NAMESPACE_DNS, f"{name}.vmlend.test"),
            devices=requests,
        ),
        templates=TemplateSet(),
    ).to_bytes()


class Running(msgspec.Struct):
    vm: SimVm
    p2p: P2PMapper
    xml: bytes
    driver: NvmeDriver | None = None
    queue: QueuePair | None = None


class FabricMachine(RuleBasedStateMachine):
    #: The cluster the sequences run on.
    topology = TOPOLOGY

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="vmlend-stateful-"))
        self.c = Cluster.create(self._location(), self.topology)
        self.vms: dict[int, Running] = {}
        self.down: set[str] = set()
        self.links_down: set[str] = set()
        self.drive: SharedNvmeDrive | None = None
        self.drives: list[SharedNvmeDrive] = []
        self.discovered = 0  # devices ``discover_a_new_device`` merged
        self.claimed_on: set[str] = set()  # adapters and ports a claim has ever been on
        self._share_drive()

    def _location(self) -> Path | str:
        """Where the registry lives: an SQLite file (``FabricOnEtcd``: an etcd cluster)."""
        return self.tmp / "state.db"

    def teardown(self) -> None:
        try:
            for slot in list(self.vms):
                self._stop(slot)
            for d in self.drives:
                d.close()
        finally:
            self.c.close()
            shutil.rmtree(self.tmp, ignore_errors=True)

    # --- helpers ---------------------------------------------------------------------------------
    def _share_drive(self) -> None:
        geometry = drive_geometry(self.c.hw.device(SHARED).spec, BLOCKS, CMB_BYTES)
        ledger.lend_shared(self.c.registry, SHARED, geometry)
        self.drive = SharedNvmeDrive(
            self.c.hw, SHARED, self.tmp, blocks=BLOCKS, cmb_bytes=CMB_BYTES
        )
        self.drives.append(self.drive)

    def _vm(self, slot: int, pick: int) -> tuple[SimVm, int] | None:
        entry = self.vms.get(slot)
        if entry is None or not entry.vm.devices():
            return None
        vm = entry.vm
        return vm, vm.devices()[pick % len(vm.devices())]

    def _stop(self, slot: int) -> None:
        entry = self.vms.pop(slot)
        node = entry.vm.node  # a hot migration may have moved it from its slot's node
        entry.vm.stop()
        entry.p2p.close()
        self.c.release(entry.xml, node)  # idempotent for devices released behind the VM's back

    def _holder_of(self, fdid: int):
        return self.c.fabric().device(fdid).holder

    def _release(self, fdid: int) -> None:
        """What the cleanup after a crash does: the hold goes, then the mdev."""
        holder = self._holder_of(fdid)
        if holder is None or holder.vm == ledger.MANAGER_VM:
            return
        self._release_own(fdid, holder)

    def _release_own(self, fdid: int, holder) -> None:
        fabric = self.c.fabric(holder.node)
        fabric.release(fdid, holder)
        for m in fabric.mdevs():
            if m.fdid == fdid and m.vm == holder.vm:
                fabric.remove_mdev(m.uuid)

    def _records_of(self, holder) -> tuple[list, dict, list]:
        """The mdevs, holds and shares the registry has for ``holder``'s VM."""
        with self.c.registry.read() as tx:
            mdevs = sorted(
                (m for m in tx.mdevs() if (m.node, m.vm) == (holder.node, holder.vm)),
                key=lambda m: m.uuid,
            )
            holds = {f: h for f, h in tx.holds().items() if same_holder(h.holder, holder)}
        shares = [e for e in self._registry_shares() if same_holder(e.holder, holder)]
        return mdevs, holds, shares

    def _registry_shares(self) -> list[ledger.ShareEntry]:
        with self.c.registry.read() as tx:
            return [ledger.share_entry(r) for r in tx.runtime(None, ledger.SHARE_RECORD)]

    # --- rules: VMs and their guests -----------------------------------------------------------
    @initialize(
        first=st.sets(devices, min_size=1, max_size=2),
        second=st.sets(devices, min_size=1, max_size=2),
        share=st.booleans(),
    )
    def two_vms_named_a(self, first: set[int], second: set[int], share: bool) -> None:
        """Every sequence starts with VM "a" on gamma and on delta (one name, one UUID), so
        hand-overs and attacks have victims from the first step."""
        self.start(0, first, share)
        self.start(2, second, not share)

    @precondition(lambda self: len(self.vms) < len(SLOTS))
    @rule(
        slot=slots,
        chosen=st.sets(devices, min_size=0, max_size=3),
        share=st.booleans(),
    )
    def start(self, slot: int, chosen: set[int], share: bool) -> None:
        """Start a VM (in the first free slot from ``slot`` on) with the chosen devices nobody
        holds and, if the drive is shared now, a share of it; its guest enables them all."""
        slot = next(
            s % len(SLOTS) for s in range(slot, slot + len(SLOTS)) if s % len(SLOTS) not in self.vms
        )
        node, name = SLOTS[slot]
        if any((e.vm.node, e.vm.name) == (node, name) for e in self.vms.values()):
            return  # a VM of that name moved there hot

        free = tuple(sorted(f for f in chosen if self._holder_of(f) is None))
        # a share even of a drive whose manager lost it (it must be refused), never of a drive
        # the VM takes whole
        share = share and self.drive is not None and SHARED not in free
        if not free and not share:
            return
        # gamma's "a" asks for a backup path (gamma has two adapters): a two-path share
        xml = vm_xml(name, free, share, 2 if (node, name) == ("gamma", "a") else 1)
        try:
            self.c.prepare(xml, node)
        except VmlendError as e:
            # refused by admission or a held device, never by the state itself (a take of
            # units that left a claim without its block, say)
            assert not _caused_by(e, StateError), f"start refused by the state: {e}"
            self.c.release(xml, node)  # what libvirt runs after a failed prepare
            full = "requester table is full" in str(e)
            event("start: refused, a switch port full" if full else "start: refused")
            if full and share and f"no room for requester {SHARED_REQUESTER};" in str(e):
                event("start: a share refused, a switch port full")
            if full and self._p2p_port(str(e), node):
                event("start: peer-to-peer refused, a switch port full")
            if "controller memory buffer has no room" in str(e):
                event("start: a share refused, the drive's CMB full")
            return
        ledger_ = RegistryWindowLedger(self.c.registry)
        p2p = P2PMapper(
            self.c.hw, node, name, recorder=registry_recorder(self.c.registry), promises=ledger_
        )
        try:
            vm = SimVm(
                xml,
                hardware=self.c.hw,
                fabric=self.c.fabric(node),
                ledger=ledger_,
                p2p=p2p,
                backing=GiB,
                nvme={SHARED: self.drive} if share and self.drive is not None else None,
            )
        except VmlendError:
            # only a share of a drive whose manager lost it may fail the start
            assert share and self.drive is not None and self.drive.ended is not None
            p2p.close()
            self.c.release(xml, node)
            event("start: refused a share of a drive whose manager lost it")
            return
        entry = self.vms[slot] = Running(vm, p2p, xml)
        event(f"start: a VM with {len(vm.devices())} device(s)" + (" and a share" if share else ""))
        for fdid in vm.devices():
            self._enable(vm, fdid)
        if p2p.crossings():
            event("start: peer-to-peer between lenders holds switch port entries")
        if vm.shares():
            self._start_share_driver(entry)

    def _start_share_driver(self, entry: Running) -> None:
        """The guest enables its share controller and its NVMe driver starts it."""
        vm = entry.vm
        s = vm.nvme_share(SHARED)
        s.set_master()
        entry.driver = guest_driver(s.bar0, vm.guest)
        if s.cmb is None:
            (entry.queue,) = entry.driver.start(queues=1, entries=8)
            return
        # its submission queue in its extent of the drive's CMB, as Linux's driver puts it
        # when the controller offers one; the completion queue in its RAM
        drv = entry.driver
        drv.memory = GuestWithCmb(vm.guest, s.cmb)
        drv.reset()
        drv.enable()
        drv.identify_namespace(1)
        drv.set_queue_count(1)
        cq = drv.alloc(8 * nvme_spec.CQE_SIZE)
        entry.queue = drv.create_queue_pair_at(1, GUEST_CMB_BASE, cq, 8, vector=1)
        event("start: a share with its submission queue in the CMB")

    def _p2p_port(self, message: str, node: str) -> bool:
        """The full port the refusal names is on no route from the requester's lender to
        ``node``: only the VM's peer-to-peer between two lenders crosses it."""
        found = FULL_PORT.search(message)
        if found is None:
            return False
        port, lender = found.group(1), found.group(2)
        return port not in ports_between(self.c.hw.topology, lender, node)

    def _enable(self, vm: SimVm, fdid: int) -> None:
        try:
            vm.enable_device(fdid)
        except BorrowTeardownError:
            raise
        except VmlendError:
            pass  # refused (not reserved, lender down, no room, taken): the bit stays 0

    @precondition(lambda self: self.vms)
    @rule(slot=slots, lba=st.integers(min_value=0, max_value=15))
    def share_io(self, slot: int, lba: int) -> None:
        """The guest writes and reads back a block of its share: it works while the share is
        the VM's; once taken, the controller is gone (the driver times out)."""
        entry = self.vms.get(slot)
        if entry is None or entry.driver is None or entry.queue is None:
            return
        share = entry.vm.nvme_share(SHARED)
        data = bytes([lba + 1]) * 512
        try:
            path = self.c.hw.crossing(SHARED, entry.vm.node)
            if share.relay is not None and share.relay.active == BACKUP:
                path = share.backup  # a two-path share on its backup pair
            dead = path is not None and bool(self.c.hw.dead_links(path))
        except VmlendError:  # no crossing set up and no live route to set one up over
            dead = True
        active = BACKUP if share.relay is not None and share.relay.active == BACKUP else 0
        msi = msgspec.structs.replace(share.msi)  # what the share's interrupts did so far
        try:
            done = entry.driver.write(entry.queue, lba, data)
            back = entry.driver.read(entry.queue, lba, 1)[1]
        except VmlendError:
            if dead and not share.revoked:
                # its route is dead and no other is up (the drive moves its crossing when one
                # is): the commands are lost and the guest gives the queue up
                entry.queue = None
                event("share_io: lost on a dead link")
                return
            assert share.revoked, "I/O failed on a share that is still the VM's"
            return
        assert not share.revoked, "I/O completed on a share taken from the VM"
        assert not dead, "I/O completed across a dead link"
        # the default drive has one doorbell page: a two-path share here is relayed (page
        # mode is explored by tests/unit/sim/test_nvme_two_path_stateful.py)
        mode = f" (two paths, {share.relay.mode} mode)" if share.relay is not None else ""
        event("share_io: done" + mode)
        assert done.ok and back == data
        # its completions interrupted the VM the way it was admitted: over the NTB with its
        # interrupt window (each a posted write that reached its target), else relayed
        if share.interrupt_path(active) == "ntb":
            event("share_io: interrupts over the NTB")
            assert share.msi.delivered > msi.delivered and share.msi.lost == msi.lost
        else:
            event("share_io: interrupts relayed")
            assert share.msi.relayed > msi.relayed and share.msi.delivered == msi.delivered

    def _ours(self, vm: SimVm, fdid: int) -> bool:
        """The device is under ``vm``'s borrow and its session is live."""
        borrow = self.c.hw.borrowed(fdid)
        owned = borrow is not None and (borrow.node, borrow.vm) == (vm.node, vm.name)
        return owned and not vm.session(fdid).cut_off

    @precondition(lambda self: self.vms)
    @rule(
        slot=slots,
        pick=picks,
        value=st.integers(min_value=1, max_value=0xFFFF_FFFF),
        pull=st.booleans(),
    )
    def guest_mmio(self, slot: int, pick: int, value: int, pull: bool) -> None:
        """The guest writes a register of one of its devices (``pull``: just after a cable of
        the device's crossing went down, the fabric re-routing it if it can): it reaches the
        device exactly when the device is the VM's, decodes memory and the route of its
        crossing has no dead cable (a dead cable drops it, as it drops the device's DMA)."""
        got = self._vm(slot, pick)
        if got is None:
            return
        vm, fdid = got
        base = vm.session(fdid).decoded_bars().get(0)
        if base is None:
            return  # the guest does not decode BAR0: its driver cannot write it
        hw = self.c.hw
        dev = hw.device(fdid)
        borrow = hw.borrowed(fdid)
        if pull and borrow is not None and borrow.path is not None:
            cut = [c for c in borrow.path.links if c in LINKS and c not in self.links_down]
            if cut:
                self.link_down(cut[-1])  # the borrower's end first: gamma's own adapter
                borrow = hw.borrowed(fdid)
        ours = self._ours(vm, fdid)
        path = borrow.path if borrow is not None else None
        dead = ours and path is not None and bool(hw.dead_links(path))
        decodes = hw.fenced(fdid) is None and bool(dev.config.command & regs.COMMAND_MEMORY)
        before = dev.bars.read(0, MMIO_REG, 4)
        value = value if value != before else value ^ 1
        vm.mmio_write(base + MMIO_REG, 4, value)
        after = dev.bars.read(0, MMIO_REG, 4)
        if ours and decodes and not dead:
            assert after == value, f"{vm.name}'s write to {fdid:#x} did not arrive"
            event("guest_mmio: delivered")
            return
        assert after == before, f"{vm.name}'s write reached {fdid:#x} (ours={ours}, dead={dead})"
        event("guest_mmio: " + ("dropped at a dead cable" if dead else "not delivered"))

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
        """The guest's device leaves (detach); the VM's own hold and mdev go, nobody else's."""
        got = self._vm(slot, pick)
        if got is not None:
            vm, fdid = got
            vm.remove_device(fdid)
            self._release_own(fdid, vm.holder)

    @precondition(lambda self: self.vms)
    @rule(slot=slots)
    def stop(self, slot: int) -> None:
        if slot in self.vms:
            self._stop(slot)

    # --- rules: hand-overs -----------------------------------------------------------------------
    @precondition(lambda self: self.vms)
    @rule(fdid=devices)
    def give_back_behind_the_vm(self, fdid: int) -> None:
        holder = self._holder_of(fdid)
        if holder is not None and holder.vm != ledger.MANAGER_VM:
            self.c.fabric(holder.node).give_back(fdid, holder)

    @precondition(lambda self: self.vms)
    @rule(fdid=devices)
    def release_after_crash(self, fdid: int) -> None:
        self._release(fdid)

    def _end_hold(self, fdid: int) -> tuple[Holder, int] | None:
        """End the hold of ``fdid`` in the ordinary way (not a manager's): its holder and
        token, for a late step of it; None when there is none."""
        with self.c.registry.read() as tx:
            hold = tx.hold(fdid)
        if hold is None or hold.holder.vm == ledger.MANAGER_VM:
            return None
        self._release_own(fdid, hold.holder)
        return hold.holder, hold.token

    def _late_borrow_is_refused(self, fdid: int, holder: Holder, token: int, after: str) -> None:
        """The ended hold's holder borrows again with its old token: the device refuses it."""
        try:
            self.c.hw.borrow(fdid, holder.node, holder.vm, token=token)
        except StaleTokenError:
            event(f"hand-over: a late borrow after {after} refused")
        else:
            raise AssertionError(f"{fdid:#x} served {holder} again under its spent token {token}")
        assert self.c.hw.borrowed(fdid) is None

    @precondition(lambda self: self.vms)
    @rule(fdid=devices)
    def late_borrow_after_a_take_back(self, fdid: int) -> None:
        """The holder's hold ends behind its VM (its lease ran out), the lender takes the
        device back for it, and the holder, cut off, borrows again with its old token before
        anyone else holds the device: the device refuses it (the token is spent)."""
        if (ended := self._end_hold(fdid)) is None:
            return
        holder, token = ended
        self.c.fabric(self.c.hw.device(fdid).lender).take_back(FenceRecord(fdid, holder, token))
        self._late_borrow_is_refused(fdid, holder, token, "a take-back")

    @precondition(lambda self: self.vms)
    @rule(fdid=devices)
    def late_borrow_after_a_release(self, fdid: int) -> None:
        """The holder's hold is released in the ordinary way (a CLI call, the release hook)
        while a step made for it is still in flight elsewhere (the nemesis's seed 4: a
        win-back's mdev creation): that step, coming after, is refused (the token is spent)."""
        if (ended := self._end_hold(fdid)) is not None:
            self._late_borrow_is_refused(fdid, *ended, "a release")

    @precondition(lambda self: self.vms)
    @rule(slot=slots)
    def release_share_behind_the_vm(self, slot: int) -> None:
        """A crash cleanup returns the VM's share while the VM still runs."""
        entry = self.vms.get(slot)
        if entry is None or not entry.vm.shares():
            return
        holder = entry.vm.holder
        fabric = self.c.fabric(holder.node)
        fabric.release_share(SHARED, holder)
        event("hand-over: a share released behind its VM")
        for m in fabric.mdevs():
            if m.fdid == SHARED and m.vm == holder.vm:
                fabric.remove_mdev(m.uuid)
        assert entry.vm.nvme_share(SHARED).revoked

    @precondition(lambda self: self.vms or self.drive is not None)
    @rule(fdid=devices)
    def lender_reclaim(self, fdid: int) -> None:
        """The lender takes the device (or the shared drive) back: borrow, hold, shares and
        mdevs end in one step."""
        taken = self.c.fabric(self.c.hw.device(fdid).lender).reclaim(fdid)
        if taken is not None:
            whom = "the manager" if taken.vm == ledger.MANAGER_VM else "a VM"
            event(f"hand-over: reclaimed from {whom}")

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

    def _fabric_records(self) -> tuple:
        with self.c.registry.read() as tx:
            return (
                tx.holds(),
                sorted(tx.claims(), key=repr),
                sorted(tx.fences(), key=repr),
                sorted(tx.mdevs(), key=repr),
            )

    @precondition(lambda self: self.discovered < 8)
    @rule(node=st.sampled_from(LENDERS))
    def discover_a_new_device(self, node: str) -> None:
        """The lender's driver lists one device more: ``fabric discover`` amends the topology
        (a new generation) beside every hold, claim, fence and mdev, which stay as they were,
        whatever the VMs, links and lenders are doing."""
        spec = self.c.fabric().topology().node(node)
        fdid = 0x700 + self.discovered
        found = found_device(
            fdid, f"0000:{0x90 + self.discovered:02x}:00.0", kind="nic", class_code=0x020000
        )
        before = self._fabric_records()
        result = discover_fabric(
            self.c.path, FoundHost(spec.node_id, spec.hostname, devices=(found,)), node=node
        )
        assert result.action == "merged", result
        self.discovered += 1
        assert self._fabric_records() == before
        new = self.c.fabric().topology().device(fdid)
        assert new.lender == node and new.lent
        assert self._holder_of(fdid) is None
        event("discover: a device merged beside the holds")

    @rule(link=st.sampled_from(LINKS), via=st.sampled_from(NODES))
    def link_down(self, link: str, via: str = "gamma") -> None:
        """A cable fails: the devices across it are re-routed where another route is up, and
        so is peer-to-peer between two lenders. Recorded by ``via``'s process: on etcd each
        has its own registry and what its earlier commits knew (``etcd_warm``), so the
        recount runs from memories of different ages."""
        before = self._p2p_routes()
        change = self.c.fabric(via).set_link_up(link, False)
        assert change.changed == (link not in self.links_down)
        self.links_down.add(link)
        for f in change.faults:
            event(f"link down: {f.state}")
        if self._p2p_routes() != before:
            event("link down: peer-to-peer re-routed")

    @precondition(lambda self: LENDERS_CABLE not in self.links_down and self._p2p_routes())
    @rule()
    def cut_the_lenders_cable_under_peer_to_peer(self) -> None:
        """The cable peer-to-peer between alpha and beta takes dies while a VM's devices use
        it: the crossing moves onto the switch (``link_down`` picks it only now and then)."""
        self.link_down(LENDERS_CABLE)

    def _p2p_routes(self) -> set[tuple[int, int, int, str]]:
        """Each running VM's peer-to-peer maps that cross an NTB, with their routes (the
        lenders' own cable holds no switch port, so ``p2p_crossings`` does not list them)."""
        return {(slot, m.source, m.target, m.path.describe())
                for slot, entry in self.vms.items()
                if isinstance(entry.vm.p2p, P2PMapper)
                for m in entry.vm.p2p.maps() if m.path is not None}  # fmt: skip

    @precondition(lambda self: self.links_down)
    @rule(link=st.sampled_from(LINKS), keep=st.booleans(), via=st.sampled_from(NODES))
    def link_up(self, link: str, keep: bool, via: str) -> None:
        """A cable comes back, with its mappings or without (its adapters reset), recorded by
        ``via``'s process (see ``link_down``)."""
        before = self._p2p_routes()
        change = self.c.fabric(via).set_link_up(link, True, keep_mappings=keep)
        assert change.changed == (link in self.links_down)
        self.links_down.discard(link)
        for f in change.faults:
            event(f"link up ({'kept' if keep else 'lost'}): {f.state}")
        if self._p2p_routes() != before:
            event("link up: peer-to-peer re-routed")

    @precondition(lambda self: self.drive is None or self.drive.ended is not None)
    @rule()
    def share_again(self) -> None:
        """The lender shares the drive again once its old manager lost it and nobody else
        holds it: a new manager, a reset controller."""
        holder = self._holder_of(SHARED)
        if "alpha" in self.down or self.c.hw.borrowed(SHARED) is not None:
            return
        if holder is not None and holder.vm != ledger.MANAGER_VM:
            return
        if self.drive is not None:
            self.drives.remove(self.drive)
            self.drive.close()
            self.drive = None
        self._share_drive()
        event("hand-over: the drive shared again")

    def _replug(self, vm: SimVm, fdids: list[int]) -> list[int]:
        """Reserve ``fdids`` for ``vm`` where it runs now, make their mdevs and hot-add them
        (a mixed move's re-plug); the ones refused (no room, lender down, taken)."""
        refused = []
        for fdid in fdids:
            fabric = self.c.fabric(vm.node)
            mdev = mdev_uuid(uuid.UUID(vm.holder.vm_uuid), fdid)
            try:
                acquire_device(fabric, vm.holder, fdid, mdev, UndoJournal(),
                               guest_ram=vm.guest_ram)
                vm.add_device(fdid)
            except VmlendError:
                refused.append(fdid)
                continue
            self._enable(vm, fdid)
        return refused

    @precondition(lambda self: self.vms)
    @rule(
        slot=slots,
        pick=st.integers(min_value=0, max_value=len(NODES) - 1),
        mixed=st.booleans(),
        unplug=st.booleans(),
    )
    def hot_migrate(self, slot: int, pick: int, mixed: bool, unplug: bool) -> None:
        """The VM moves to another node while it runs, its devices plugged; the checker runs
        after every phase. Refused (a NIC, a device not enabled, no room there): nothing
        changed. ``mixed``: its devices that cannot quiesce (a NIC) are hot-removed and
        returned first and re-plugged where the VM runs after (refused: the VM runs without
        them, as the CLI's mixed move says). ``unplug`` (a VM with a share), or a share of two
        paths: the VM moves unplugged (``_unplugged_move``)."""
        entry = self.vms.get(slot)
        if entry is None:
            return
        vm = entry.vm
        taken = {(e.vm.node, e.vm.name) for e in self.vms.values()}
        choices = [n for n in NODES if n != vm.node and (n, vm.name) not in taken]
        if not choices:
            return
        to = choices[pick % len(choices)]
        source = vm.node
        relayed = any(vm.nvme_share(f).relay is not None for f in vm.shares())
        if vm.shares() and (unplug or relayed):
            self._unplugged_move(entry, to)
            return
        stuck = [
            f for f in vm.devices() if how_to_quiesce(self.c.hw.device(f).spec.kind) is None
        ]
        if not mixed or len(stuck) == len(vm.devices()) + len(vm.shares()):
            # all or nothing hot: a VM of NICs only moves unplugged
            stuck = []
        for fdid in stuck:
            vm.remove_device(fdid)
            self._release_own(fdid, vm.holder)
        if stuck:
            self._check_justified("after a mixed move's unplug")
            for fdid in vm.devices():  # the guest has enabled what stays (hot needs it)
                self._enable(vm, fdid)
        steps: list[str] = []

        def check(step: str) -> None:
            self._check_justified(f"after hot-migration phase {step!r}")
            steps.append(step)

        p2p = P2PMapper(
            self.c.hw,
            to,
            vm.name,
            recorder=registry_recorder(self.c.registry),
            promises=RegistryWindowLedger(self.c.registry),
        )
        before = self._records_of(vm.holder)
        try:
            hot_migrate(vm, self.c.fabric(to), self.c.registry, p2p=p2p, check=check)
        except VmlendError as e:
            p2p.close()
            assert vm.node == source and steps in ([], ["claimed", "abandoned"]), steps
            assert self._records_of(vm.holder) == before
            event(f"hot migration refused: {type(e).__name__}")
            if stuck:
                back = self._replug(vm, stuck)
                event("mixed move refused: unplugged devices back on the source"
                      + (" (some refused)" if back else ""))
            return
        entry.p2p = p2p
        assert vm.node == to and steps[-1] == "resumed"
        for fdid in vm.devices():
            b = self.c.hw.borrowed(fdid)
            assert b is not None and (b.node, b.vm) == (to, vm.name)
        for fdid in vm.shares():
            # the share followed: the registry's and the drive's, under the destination's name
            share = vm.nvme_share(fdid)
            assert share.node == to and share.name == f"vm:{to}/{vm.name}"
            _m, _h, recorded = self._records_of(vm.holder)
            assert [e.share.name for e in recorded] == [share.name]
            if entry.driver is not None:  # the guest's driver runs on its copied RAM, and
                # reaches its CMB extent (if it has one) from the destination now
                cmb = share.cmb
                entry.driver.memory = vm.guest if cmb is None else GuestWithCmb(vm.guest, cmb)
                if cmb is not None:
                    assert cmb.node == to
            event("hot migration: a share moved with the VM")
        if stuck:
            refused = self._replug(vm, stuck)
            for fdid in stuck:
                if fdid not in refused:
                    b = self.c.hw.borrowed(fdid)
                    assert b is None or (b.node, b.vm) == (to, vm.name)
            event("mixed move: unplugged devices plugged back on the destination"
                  + (" (some refused)" if refused else ""))
        event(f"hot migration: {len(vm.devices())} device(s) moved with the VM")

    def _unplugged_move(self, entry: Running, to: str) -> None:
        """The VM moves unplugged (``vmlend.sim.unplugmig``): its borrowed devices hot-removed
        and returned, its share controllers unplugged with the shares kept (their blocks are
        the VM's at every step, and a share another VM asks for meanwhile gets other blocks);
        then the devices are re-plugged where it runs (refused: it runs without them) and the
        guest restarts its share's controller and reads its disk as it left it. Refused (no
        room there, no backup path for a share of two paths): nothing of the share changed,
        the devices are plugged back on the source."""
        vm = entry.vm
        source, shares = vm.node, vm.shares()
        if any(vm.nvme_share(f).revoked or not vm.nvme_share(f).open for f in shares):
            return  # taken from it: the move refuses it before anything
        mark = None
        if entry.driver is not None and entry.queue is not None:
            try:
                if entry.driver.write(entry.queue, 15, MARK).ok:
                    mark = MARK
            except VmlendError:  # a dead link: share_io covers it
                entry.queue = None
        out = vm.devices()
        for fdid in out:
            vm.remove_device(fdid)
            self._release_own(fdid, vm.holder)
        if out:
            self._check_justified("after an unplugged move's device unplugs")
        before = {f: vm.nvme_share(f).share for f in shares}
        steps: list[str] = []

        def extent(share: Share) -> set[int]:
            return set(range(share.lba_offset, share.lba_offset + share.blocks))

        def check(step: str) -> None:
            self._check_justified(f"after unplugged-migration step {step!r}")
            steps.append(step)
            mine = [e.share for e in self._registry_shares() if e.holder.vm == vm.name
                    and e.holder.vm_uuid == vm.holder.vm_uuid]
            assert sorted(s.lba_offset for s in mine) == sorted(
                s.lba_offset for s in before.values()), step
            if step == "handed over":  # another VM asks for a share of the drive meanwhile
                other = Holder("beta", "intruder", str(uuid.uuid4()))
                try:
                    got = ledger.reserve_share(self.c.registry, SHARED, other, 1, 1024)
                except VmlendError:
                    return  # the drive is full: nothing to give anyway
                assert not any(extent(got) & extent(b) for b in before.values())
                ledger.release_share(self.c.registry, SHARED, other)
                event("unplugged move: a share asked for meanwhile got other blocks")

        try:
            unplug_migrate(vm, self.c.fabric(to), self.c.registry, check=check)
        except VmlendError as e:
            assert vm.node == source and steps == [], steps
            assert {f: vm.nvme_share(f).share for f in shares} == before
            event(f"unplugged move refused: {type(e).__name__}")
            self._replug(vm, out)
            return
        assert vm.node == to and steps[-1] == "plugged back"
        for fdid in shares:
            s, was = vm.nvme_share(fdid), before[fdid]
            assert s.name == f"vm:{to}/{vm.name}"
            assert (s.share.qid_base, s.share.lba_offset, s.share.asid, s.share.paths) == (
                was.qid_base, was.lba_offset, was.asid, was.paths
            )
            assert s.share.cmb_extent == was.cmb_extent
        refused = self._replug(vm, out)
        entry.queue = None
        try:
            self._start_share_driver(entry)
        except VmlendError:  # its route is dead: share_io covers it
            event("unplugged move: the share's controller did not start (a dead link)")
            return
        if mark is not None and entry.queue is not None:
            try:
                assert entry.driver is not None
                assert entry.driver.read(entry.queue, 15, 1)[1] == mark
                event("unplugged move: the guest read its disk back on the destination")
            except VmlendError:
                entry.queue = None
        two = any(vm.nvme_share(f).relay is not None for f in shares)
        event("unplugged move: a share moved with the VM" + (" (two paths)" if two else "")
              + (", devices re-plugged" if out and not refused else ""))

    @precondition(lambda self: self.vms)
    @rule(
        slot=slots,
        pick=st.integers(min_value=0, max_value=len(NODES) - 1),
        handed=st.booleans(),
    )
    def hot_migrate_rolled_back(self, slot: int, pick: int, handed: bool) -> None:
        """A hot migration killed after its claim (``handed``: after its hand-over, the VM
        still on the source, the hardware never re-pointed), then rolled back as
        ``vmlend migrate --live --rollback`` does: the claims go, or the hand-over is undone
        and the devices serve the source's newer tokens. After it the VM's holds, shares and
        mdevs are the source's, nothing is claimed for the destination, and the checker finds
        everything justified."""
        entry = self.vms.get(slot)
        if entry is None:
            return
        vm = entry.vm
        taken = {(e.vm.node, e.vm.name) for e in self.vms.values()}
        choices = [n for n in NODES if n != vm.node and (n, vm.name) not in taken]
        sessions = vm.sessions()
        shares = [
            f
            for f in vm.shares()
            if not vm.nvme_share(f).revoked and vm.nvme_share(f).relay is None
        ]
        if not choices or not (sessions or shares):
            return
        if any(self.c.hw.borrowed(f) is None for f in sessions):
            return  # a device not enabled: the hot move itself refuses it
        to = choices[pick % len(choices)]
        src, dst = vm.holder, Holder(to, vm.name, vm.holder.vm_uuid)
        with self.c.registry.read() as tx:
            before = {f: h.token for f, h in tx.holds().items() if f in sessions}
        try:
            claimed = handover.claim_destination(
                self.c.registry, sorted(sessions), src, dst, vm.guest_ram, shares=shares
            )
        except VmlendError as e:
            event(f"rollback: the claim refused ({type(e).__name__})")
            return
        self._check_justified("after an interrupted hot move's claim")
        if not handed:
            handover.abandon(self.c.registry, claimed)
            event("rollback: after the claim")
        else:
            mdevs = {f: s.mdev for f, s in sessions.items() if s.mdev}
            mdevs |= {f: vm.nvme_share(f).mdev or "" for f in shares if vm.nvme_share(f).mdev}
            handover.hand_over(self.c.registry, claimed, mdevs, 0.0)
            back = handover.hand_back(self.c.registry, claimed, mdevs, 0.0)
            for fdid in sessions:  # the devices serve the source's newer holds
                self.c.hw.move_borrow(fdid, vm.node, vm.name, token=back[fdid])
            assert all(back[f] > before[f] for f in sessions)
            event("rollback: after the hand-over")
        self._check_justified("after the rollback")
        with self.c.registry.read() as tx:
            holds = tx.holds()
            assert all(same_holder(holds[f].holder, src) for f in sessions)
            assert not [c for _f, c in tx.claims() if f"{to}/{vm.name}" in c.share]
            assert not tx.runtime(kind="hand-over")
            assert not [m for m in tx.mdevs() if (m.node, m.vm) == (to, vm.name)]
        _m, _h, recorded = self._records_of(src)
        assert sorted(e.fdid for e in recorded) == sorted(vm.shares()) or not shares

    # --- rules: attacks ------------------------------------------------------------------------
    @precondition(lambda self: len(self.vms) >= 2)
    @rule(slot=slots, victim=slots)
    def hot_add_anothers_mdev(self, slot: int, victim: int) -> None:
        """A VM hot-adds a device whose mdev another VM on its node has: refused, and the
        device does not notice."""
        attacker, target = self.vms.get(slot), self.vms.get(victim)
        if attacker is None or target is None or slot == victim:
            return
        for fdid in target.vm.devices():
            if fdid in attacker.vm.devices():
                continue
            dev = self.c.hw.device(fdid)
            before = [dev.config.read(o, 4) for o in range(0, 0x100, 4)]
            with pytest.raises(VmlendError):
                attacker.vm.add_device(fdid)
            event("attack: hot-add of another VM's mdev refused")
            assert fdid not in attacker.vm.devices()
            assert [dev.config.read(o, 4) for o in range(0, 0x100, 4)] == before

    @precondition(lambda self: self.vms)
    @rule(victim=slots, elsewhere=st.booleans())
    def forged_start_then_release(self, victim: int, elsewhere: bool) -> None:
        """A copy of a running VM's domain fails to start, then libvirt runs its release: the
        victim's holds and mdevs stay as they were. The copy runs on another node unchanged
        (``elsewhere``), or on the victim's node under another name and domain UUID, its
        metadata still naming the victim's mdevs (libvirt refuses a second domain with the
        same UUID on one host, so that is the copy a user can define there)."""
        target = self.vms.get(victim)
        if target is None:
            return
        node, name = target.vm.node, target.vm.name
        forged = target.xml
        if elsewhere:
            node = "delta" if node == "gamma" else "gamma"
        else:
            own = str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{name}.vmlend.test")).encode()
            forged = forged.replace(f"<name>{name}</name>".encode(), b"<name>forged</name>")
            forged = forged.replace(own, str(uuid.uuid5(uuid.NAMESPACE_DNS, "forged")).encode())
        if any((e.vm.node, e.vm.name) == (node, "a") for e in self.vms.values()) and elsewhere:
            return  # that node runs its own "a": the copy is that VM's business
        victim_holder = target.vm.holder
        before = self._records_of(victim_holder)
        ops = HookOps(self.c.fabric(node), NullLog())
        try:
            ops.prepare(read_domain(forged))
            started = "started (the victim held nothing it names)"
        except VmlendError:
            started = "refused"
        ops.release(read_domain(forged, strict=False))
        event(f"attack: a copied domain {started} {'elsewhere' if elsewhere else 'here'}")
        assert self._records_of(victim_holder) == before

    # --- after every step ----------------------------------------------------------------------
    def _check_justified(self, when: str = "") -> None:
        with self.c.registry.read() as tx:
            holds, claims, grants = tx.holds(), tx.claims(), registry_grants(tx)
        found = check_hardware(self.c.hw, holds=holds, claims=claims, shares=grants)
        assert found == [], when + "\n" + "\n".join(map(str, found))

    @invariant()
    def every_mapping_is_justified(self) -> None:
        self._check_justified()

    @invariant()
    def every_device_reaches_only_its_vm(self) -> None:
        hw = self.c.hw
        targets = [
            (b.address, b.fdid)
            for entry in self.vms.values()
            for f in entry.vm.devices()
            for b in entry.vm.bars(f)
            if b.kind is not BarKind.IO
        ] + [(gpa, None) for gpa in PROBE_GPAS]
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

    def _dma_dies(self, fdid: int, iova: int, owner: tuple[str, str]) -> bool | None:
        """Whether ``fdid``'s DMA write to ``iova`` dies at a dead cable (True) or reaches
        ``owner``'s RAM (False); None when it is refused for another reason (nothing mapped
        there) or lands elsewhere (another invariant's business)."""
        hw = self.c.hw
        dev = hw.device(fdid)
        command = dev.config.command
        dev.config.write(regs.COMMAND, 2, command | regs.COMMAND_MASTER, notify=False)
        try:
            t = hw.resolve_dma(fdid, iova, write=True)
        except DmaFault as fault:
            return True if fault.hop == "link-down" else None
        finally:
            dev.config.write(regs.COMMAND, 2, command, notify=False)
        return False if t.kind == "ram" and (t.node, t.owner) == owner else None

    def _mmio_dies(self, node: str, fdid: int, offset: int, path: NtbPath | None) -> bool:
        try:
            self.c.hw.mmio.resolve(node, fdid, 0, offset, 4, path=path)
        except DmaFault as fault:
            assert fault.hop == "link-down", f"{node} -> {fdid:#x}+{offset:#x}: {fault}"
            return True
        return False

    @invariant()
    def a_guests_mmio_dies_exactly_when_its_devices_dma_into_it_does(self) -> None:
        """Judged by the DMA resolver, not by the route ``hw.crossing`` names: a register
        write of a VM to its borrowed device, and each doorbell its share of the drive rings
        (the primary pair's and a backup pair's), crosses a dead cable exactly when the
        device's DMA into that VM's RAM (in the share's address space) does."""
        hw = self.c.hw
        for entry in self.vms.values():
            vm = entry.vm
            for fdid in vm.devices():
                if not self._ours(vm, fdid) or hw.fenced(fdid) is not None:
                    continue
                if not hw.device(fdid).config.command & regs.COMMAND_MEMORY:
                    continue
                dead = self._dma_dies(fdid, PROBE_GPAS[0], (vm.node, vm.name))
                if dead is not None:
                    mmio = self._mmio_dies(vm.node, fdid, MMIO_REG, None)
                    assert mmio == dead, f"{vm.name} -> {fdid:#x}: MMIO dead {mmio}, DMA {dead}"
        drive = self.drive
        if drive is None or drive.ended is not None or hw.fenced(SHARED) is not None:
            return
        dstrd = drive.controller.config.dstrd
        for vms in list(drive.shares.values()):
            if not vms.open or vms.revoked:
                continue
            s = vms.share
            pairs = [(s.asid, s.real_qid(1), vms.doorbell_route())]
            if vms.relay is not None and vms.backup is not None:
                pairs.append((s.backup_asid, s.backup_qid(1), vms.doorbell_route(backup=True)))
            for asid, qid, path in pairs:
                dead = self._dma_dies(SHARED, asid_base(asid) + PROBE_GPAS[0], (vms.node, vms.vm))
                if dead is None:
                    continue
                offset = nvme_spec.doorbell_offset(qid, False, dstrd)
                mmio = self._mmio_dies(vms.node, SHARED, offset, path)
                event("mmio: share doorbell" + (" (dead)" if dead else ""))
                assert mmio == dead, f"{vms.name} doorbell {qid}: MMIO dead {mmio}, DMA {dead}"

    @invariant()
    def the_shared_drive_reaches_only_each_shares_vm(self) -> None:
        hw = self.c.hw
        shares = self._registry_shares()
        owners = {asid: (e.holder.node, e.holder.vm) for e in shares for asid in e.share.asids}
        extents = {e.share.asid: e.share.cmb_extent for e in shares}
        frames = self.drive.cmb_frames() if self.drive is not None else []
        dev = hw.device(SHARED)
        command = dev.config.command
        dev.config.write(regs.COMMAND, 2, command | regs.COMMAND_MASTER, notify=False)
        try:
            for asid in sorted(set(owners) | {1, 2, 3, 4}):
                for gpa in PROBE_GPAS:
                    try:
                        t = hw.resolve_dma(SHARED, asid_base(asid) + gpa, write=True)
                    except DmaFault:
                        continue
                    assert t.kind == "ram" and (t.node, t.owner) == owners.get(asid), (
                        f"address space {asid} of the drive reached {t}"
                    )
                # its CMB address: its own extent of the CMB (claimed in the registry), the
                # start of the next one past its end, or nothing
                for offset in (0, CMB_BYTES // 2):
                    iova = asid_base(asid) + GUEST_CMB_BASE + offset
                    try:
                        t = hw.resolve_dma(SHARED, iova, write=True)
                    except DmaFault:
                        continue
                    extent = extents.get(asid)
                    page = t.address - t.address % FRAME
                    assert extent is not None and offset < extent[1], f"{asid}: CMB {t}"
                    assert page in frames and frames.index(page) * FRAME == extent[0] + offset, (
                        f"address space {asid} reached CMB {t}, not its extent {extent}"
                    )
                    event("probe: a share's CMB extent reached")
        finally:
            dev.config.write(regs.COMMAND, 2, command, notify=False)

    @invariant()
    def a_session_whose_device_moved_on_changes_nothing(self) -> None:
        for entry in self.vms.values():
            vm = entry.vm
            for fdid in vm.devices():
                s = vm.session(fdid)
                if not s.cut_off:
                    continue
                dev = self.c.hw.device(fdid)
                before = [dev.config.read(o, 4) for o in range(0, 0x100, 4)]
                borrow = self.c.hw.borrowed(fdid)
                assert vm.config_read(fdid, regs.COMMAND, 2) == 0xFFFF
                with pytest.raises(VmlendError):
                    vm.dma_write(fdid, 0x1000, b"stale")
                vm.config_write(fdid, regs.COMMAND, 2, 0)
                vm.config_write(fdid, MSI_OFFSET + regs.MSI_FLAGS, 2, 0)
                vm.config_write(fdid, EXP_OFFSET + regs.EXP_DEVCTL, 2, regs.EXP_DEVCTL_BCR_FLR)
                assert [dev.config.read(o, 4) for o in range(0, 0x100, 4)] == before
                assert self.c.hw.borrowed(fdid) == borrow
                event("probe: a cut-off session poked")
            for fdid in vm.shares():
                share = vm.nvme_share(fdid)
                if share.revoked:
                    assert share.bar0.read(0x1C, 4) == 0xFFFF_FFFF
                    assert share.config.read(regs.COMMAND, 2) == 0xFFFF
                    share.bar0.write(0x1000, 4, 1)  # dropped
                    event("probe: a revoked share poked")

    @invariant()
    def each_registry_reads_the_claims_the_state_holds(self) -> None:
        """An open SQLite state keeps claims per adapter between its transactions
        (``vmlend.registry.keptclaims``): after every step, every registry of the machine (the
        cluster's and each node's, connections of their own) reads what the file holds, on
        every adapter that has ever had a claim."""
        if not isinstance(self.c.registry, SqliteRegistry):
            return
        with sqlite3.connect(self.c.path) as db:
            rows = db.execute(
                "SELECT fdid, adapter, kind, share, entries, segments, bytes FROM claims"
            ).fetchall()
        self.claimed_on |= {r[1] for r in rows}
        refs = sorted(self.claimed_on)
        held = sorted(r for r in rows if r[1] in self.claimed_on)
        for reg in [self.c.registry, *(f.registry for f in self.c.fabrics.values())]:
            with reg.read() as tx:
                got = sorted(
                    (f, c.adapter, c.kind.value, c.share, c.entries, c.segments, c.bytes)
                    for f, c in tx.claims_on(refs)
                )
            assert got == held


class FabricSmoke(FabricMachine):
    """A few short sequences, for the fast suite."""


class FabricTightPorts(FabricMachine):
    """The machine on ``TIGHT_TOPOLOGY``: full switch port requester tables refuse starts,
    hot migrations and re-routes (in one line naming the switch and the port)."""

    topology = TIGHT_TOPOLOGY


class FabricTightPortsSmoke(FabricTightPorts):
    """A few short sequences of it, for the fast suite."""


#: The etcd server ``FabricOnEtcd`` runs on (``etcd_for_the_machine`` starts it).
_ETCD: list[EtcdServer] = []


class FabricOnEtcd(FabricMachine):
    """The same machine on the etcd registry (a cluster of its own per sequence): its
    optimistic transactions, the reads it leaves uncompared, the unit blocks and the VMs'
    markers, under the same checks after every step. Its hot moves of a VM of three
    devices across the two lenders fit etcd's 128 operations per transaction
    (tests/unit/ledger/test_handover_etcd.py)."""

    def _location(self) -> str:
        self.url = _ETCD[0].url(f"stateful-{uuid.uuid4().hex[:12]}")
        return self.url

    @invariant()
    def the_units_carry_what_the_ledgers_say(self) -> None:
        """Layout 6 keeps each VM's claims in its marker's ledger, and where hosts contend
        also on its head unit block of each adapter (what admission reads): after every step
        they agree, every VM has exactly the units its claims there use, and on its node's
        own places (no VM block there) its node's claims fit the node's extents."""
        ledgers_agree_with_blocks(self.url)


#: The cluster with beta's NIC (0x21) a second function of its GPU's device (0x20), and one
#: requester entry per port of ``sw``: VMs that borrow one function each share the device's
#: entry on every port on the way, which admission counts once and each VM's units count for
#: itself, so the units on such a port run beyond its capacity.
SHARED_ENTRY_TOPOLOGY = TOPOLOGY.replace(
    'fdid = 0x21\n  bdf = "0000:43:00.0"', 'fdid = 0x21\n  bdf = "0000:41:00.1"'
).replace('name = "sw"\nports', 'name = "sw"\nrequester_entries = 1\nports')
assert SHARED_ENTRY_TOPOLOGY.count("0000:41:00.1") == 1
assert SHARED_ENTRY_TOPOLOGY.count("requester_entries = 1") == 1


class FabricSharedEntryOnEtcd(FabricOnEtcd):
    """The etcd machine on ``SHARED_ENTRY_TOPOLOGY``: with 0x20 and 0x21 in two VMs, beta's
    port holds two units for its one entry, one beyond its capacity, and every take on that
    port is then decided on the port as a whole (``EtcdTxn._take_units``, ``_beyond``),
    under the same checks after every step."""

    topology = SHARED_ENTRY_TOPOLOGY


@pytest.fixture
def etcd_for_the_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A private etcd and a host root with a published agent lease, for ``FabricOnEtcd`` (one
    test: after the autouse fixture that gives every test a host root of its own)."""
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    root = tmp_path / "host"
    try:
        host_lease(server, root, ttl=3600)
        monkeypatch.setenv("VMLEND_ROOT", str(root))
        _ETCD.append(server)
        yield
    finally:
        _ETCD.clear()
        server.stop()


FabricMachine.TestCase.settings = derandomized(MAX_EXAMPLES, STEPS)
FabricSmoke.TestCase.settings = derandomized(SMOKE_EXAMPLES, SMOKE_STEPS)
FabricOnEtcd.TestCase.settings = derandomized(ETCD_EXAMPLES, ETCD_STEPS)
FabricTightPorts.TestCase.settings = derandomized(TIGHT_EXAMPLES, STEPS)
FabricSharedEntryOnEtcd.TestCase.settings = derandomized(SHARED_ETCD_EXAMPLES, ETCD_STEPS)
FabricTightPortsSmoke.TestCase.settings = derandomized(SMOKE_EXAMPLES, SMOKE_STEPS)
test_fabric_state_machine = pytest.mark.slow(FabricMachine.TestCase)
test_fabric_state_machine_smoke = FabricSmoke.TestCase
test_fabric_state_machine_tight_ports = pytest.mark.slow(FabricTightPorts.TestCase)
test_fabric_state_machine_tight_ports_smoke = FabricTightPortsSmoke.TestCase
test_fabric_state_machine_on_etcd = pytest.mark.slow(
    pytest.mark.daemon(pytest.mark.usefixtures("etcd_for_the_machine")(FabricOnEtcd.TestCase))
)
test_fabric_state_machine_shared_entry_on_etcd = pytest.mark.slow(
    pytest.mark.daemon(
        pytest.mark.usefixtures("etcd_for_the_machine")(FabricSharedEntryOnEtcd.TestCase)
    )
)
