"""The data path's windows on a real kernel (docs/smartio-contract.md section 8): vmlend's
hook writes each child's ``smartio/dma_windows`` when libvirtd starts a VM, the stand-in
(kernel-tier/smartio_mdev.patch) records and checks them, and what it recorded is the guest's
RAM as QEMU itself lays it out (``info mtree``). The stand-in pins and maps nothing: its
``dma_state`` says ``mapped`` with the written ranges when Bus Master is set through the
child's config space, here written through VFIO as a VMM writes it (SeaBIOS, the only guest
code that runs, sets no Bus Master on a serial card)."""

from __future__ import annotations

import errno
import re
import struct

import libvirt
import libvirt_qemu
import pytest

from tests.support.kernel_guest import REAL, STUB, private_root, write
from tests.support.kernel_host import operator_host
from tests.support.vfio_user import VfioDevice
from vmlend.kernel.backend import SmartioFabric
from vmlend.kernel.dmafiles import DmaWord, format_windows, parse_state, parse_windows
from vmlend.kernel.udev import Outcome, PyudevSource
from vmlend.lending.devices import UndoJournal, acquire_device, return_device
from vmlend.memory.dmarecords import DMA_WINDOW
from vmlend.memory.layout import MemoryConfig, compute_layout
from vmlend.registry import SqliteRegistry
from vmlend.topology.model import GiB, GuestRam, GuestRange, Holder
from vmlend.wiring.fabric import default_topology_text, init_fabric

#: VFIO's config-space region, the command register and its Bus Master bit.
CONFIG, COMMAND, MASTER = 7, 0x04, 0x04
#: QEMU's aliases of the guest's RAM in the system address space (hw/i386/pc.c).
RAM_ALIAS = re.compile(
    r"^\s*([0-9a-f]+)-([0-9a-f]+) \(prio -?\d+, ram\): alias (ram-below-4g|ram-above-4g) @"
)


def group(uuid: str):
    return REAL.mdev_devices / uuid / "smartio"


def qemu_ram(dom) -> list[GuestRange]:
    """The guest's RAM as QEMU maps it: the RAM aliases of ``address-space: memory`` (HMP
    answers with CRLF line ends and heads one tree with every address space sharing it)."""
    text = libvirt_qemu.qemuMonitorCommand(
        dom, "info mtree", libvirt_qemu.VIR_DOMAIN_QEMU_MONITOR_COMMAND_HMP
    )
    found: set[GuestRange] = set()
    names: list[str] = []
    heading = False
    for line in text.replace("\r", "").splitlines():
        if line.startswith("address-space:"):
            name = line.partition(":")[2].strip()
            names = [*names, name] if heading else [name]
            heading = True
            continue
        heading = False
        m = RAM_ALIAS.match(line)
        if m and "memory" in names:
            found.add(GuestRange(int(m[1], 16), int(m[2], 16) + 1))
    assert found, text
    return sorted(found, key=lambda r: r.start)


@pytest.fixture
def host(libvirtd, tmp_path, fabric_devices):
    with operator_host(libvirtd, tmp_path) as h:
        yield h


@pytest.mark.libvirtd
def test_a_started_vms_child_has_the_guests_ram_as_windows_until_it_is_destroyed(
    host, libvirt_conn
):
    u1 = host.new_vm("web", "0x12")
    host.vmlend("vm", "start", "web")
    dom = libvirt_conn.lookupByName("web")
    windows_file = group(u1) / "dma_windows"
    written = parse_windows(windows_file.read_text(), windows_file)
    assert written is not None
    with SqliteRegistry.open(host.state) as reg, reg.read() as tx:
        hold = tx.hold(0x12)
    assert hold is not None
    token = hold.token
    assert written.token == token > 0
    ranges = [r for w in written.windows for r in w.ranges]
    assert ranges == qemu_ram(dom)  # the 64 MiB pc guest: one range from 0
    assert [w.name for w in written.windows] == ["low"]
    assert any("DMA windows of 0x12 (low) written" in ln for ln in host.hook_log("web", "prepare"))
    state_file = group(u1) / "dma_state"
    assert parse_state(state_file.read_text(), state_file).word is DmaWord.NONE

    # a holder with an older token (its hold ended while it was cut off) is refused
    before = windows_file.read_text()
    with pytest.raises(OSError) as e:
        write(windows_file, f"token {token - 1}\nlow 0x0 0x1000\n")
    assert e.value.errno == errno.ESTALE
    assert windows_file.read_text() == before

    host.vmlend("vm", "destroy", "web")
    assert not (REAL.mdev_devices / u1).exists()  # the child, and its windows with it
    with pytest.raises(libvirt.libvirtError):
        qemu_ram(dom)


@pytest.fixture
def fabric(tmp_path, fabric_devices):
    state = tmp_path / "state.db"
    text, source = default_topology_text()
    init_fabric(state, text, source, node="gamma")
    env = private_root(tmp_path / "root")
    with SmartioFabric(SqliteRegistry.open(state), env, local_node="gamma") as fab:
        yield fab


WEB = Holder("gamma", "web", "11111111-1111-1111-1111-111111111111")
U = "83b8f4f2-509f-382f-3c1e-e6bfe0fa9001"


def command(dev: VfioDevice) -> int:
    return struct.unpack("<H", dev.read(CONFIG, COMMAND, 2))[0]


def test_bus_master_through_the_child_maps_the_written_windows_and_a_reset_unmaps(fabric):
    ram = GuestRam(tuple(compute_layout(MemoryConfig("q35", 6 * GiB)).ranges()))
    acquire_device(fabric, WEB, 0x12, U, UndoJournal(), guest_ram=ram)
    state_file = group(U) / "dma_state"
    try:
        with VfioDevice(U) as dev:
            dev.write(CONFIG, COMMAND, struct.pack("<H", 0x0007))  # I/O, memory, Bus Master
            state = parse_state(state_file.read_text(), state_file)
            assert state.word is DmaWord.MAPPED
            assert [(w.name, w.adapter, w.ranges) for w in state.windows] == [
                (w.name, None, w.ranges) for w in fabric.expected_windows(0x12, ram)
            ]
            assert command(dev) & MASTER
            report = fabric.dma_report(U)
            assert report is not None and report.written is not None
            # the same windows again while mapped: taken; others: EBUSY
            acquire_device(fabric, WEB, 0x12, U, UndoJournal(), guest_ram=ram)
            with pytest.raises(OSError) as e:
                write(group(U) / "dma_windows", f"token {report.written.token}\n")
            assert e.value.errno == errno.EBUSY
            dev.write(CONFIG, COMMAND, struct.pack("<H", 0x0003))
            assert state_file.read_text() == "none\n"

            # no windows: the enable is refused and Bus Master reads back 0
            write(group(U) / "dma_windows", f"token {report.written.token}\n")
            dev.write(CONFIG, COMMAND, struct.pack("<H", 0x0007))
            state = parse_state(state_file.read_text(), state_file)
            assert (state.word, state.error) == (DmaWord.REFUSED, "ENODATA")
            assert not command(dev) & MASTER
    finally:
        return_device(fabric, WEB, 0x12, U)
    assert not (REAL.mdev_devices / U).exists()


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ("low 0x1 0x1000\n", errno.EINVAL),  # unaligned
        ("low 0x0 0x2000 0x1000 0x1000\n", errno.EINVAL),  # overlapping
        ("high 0x0 0x1000\n", errno.EINVAL),  # a high range below 4 GiB
        ("low " + " ".join(f"{i * 0x2000:#x} 0x1000" for i in range(65)) + "\n", errno.E2BIG),
    ],
)
def test_the_stand_in_refuses_what_section_8_refuses(fabric, body, code):
    ram = GuestRam(tuple(compute_layout(MemoryConfig("q35", 1 * GiB)).ranges()))
    acquire_device(fabric, WEB, 0x12, U, UndoJournal(), guest_ram=ram)
    try:
        token = fabric._state.holds()[0x12].token
        with pytest.raises(OSError) as e:
            write(group(U) / "dma_windows", f"token {token}\n{body}")
        assert e.value.errno == code
        assert (group(U) / "dma_windows").read_text() == f"token {token}\nlow 0x0 0x40000000\n"
    finally:
        return_device(fabric, WEB, 0x12, U)


W = "83b8f4f2-509f-382f-3c1e-e6bfe0fa9002"


def test_the_watcher_writes_a_recreated_childs_windows_and_records_bus_master(fabric):
    """``vmlend mdev watch``'s watcher over the real kernel's uevents: the lender goes and
    comes back, the watcher re-creates the VM's child and writes its windows from the RAM this
    host noted; a Bus Master enable through the child sends SMARTIO_DMA, and the watcher keeps
    dma_state as the device's dma-window records, removed again when it is cleared."""
    ram = GuestRam(tuple(compute_layout(MemoryConfig("q35", 6 * GiB)).ranges()))
    acquire_device(fabric, WEB, 0x12, W, UndoJournal(), guest_ram=ram)
    source = PyudevSource(source=PyudevSource.netlink_source(REAL))
    watcher = fabric.watcher()
    try:
        assert watcher.discover() == ["smartio-12"]
        token = fabric._state.holds()[0x12].token
        want = format_windows(token, fabric.expected_windows(0x12, ram))
        assert (group(W) / "dma_windows").read_text() == want

        STUB.set_availability(0x12, "unreachable")  # the parent goes, and the child with it
        watcher.run(source, timeout=2)
        assert not (REAL.mdev_devices / W).exists()
        STUB.set_availability(0x12, "available")  # the stand-in registers the parent again
        watcher.run(source, timeout=2)
        outcomes = [(r.outcome, r.uuid) for r in watcher.reactions]
        assert (Outcome.RECREATED, W) in outcomes, outcomes
        assert (group(W) / "dma_windows").read_text() == want  # a new child: the watcher's write

        def records():
            with fabric.registry.read() as tx:
                return {r.key: r.data for r in tx.runtime(0x12, DMA_WINDOW)}

        assert records() == {}
        before = len(watcher.reactions)
        with VfioDevice(W) as dev:
            dev.write(CONFIG, COMMAND, struct.pack("<H", 0x0007))  # Bus Master on: mapped
            watcher.run(source, timeout=2)
            kept = records()
            assert sorted(kept) == ["high", "low"], watcher.reactions[before:]
            assert {name: data["ranges"] for name, data in kept.items()} == {
                w.name: [[r.start, r.end] for r in w.ranges]
                for w in fabric.expected_windows(0x12, ram)
            }
            assert kept["low"]["adapter"] is None and kept["low"]["state"] == "mapped"
            assert (Outcome.DMA_RECORDED, W) in [
                (r.outcome, r.uuid) for r in watcher.reactions[before:]
            ]
            dev.write(CONFIG, COMMAND, struct.pack("<H", 0x0003))  # off: none
            watcher.run(source, timeout=2)
            assert records() == {}
    finally:
        return_device(fabric, WEB, 0x12, W)
    assert not (REAL.mdev_devices / W).exists()
