"""Peer-to-peer on a real kernel (docs/smartio-contract.md section 8): two children of one VM,
the guest side programming a memory BAR of each and turning memory decoding on through VFIO
(as a VMM passes a guest's config writes on), the stand-in (kernel-tier/smartio_mdev.patch)
listing it in ``guest_bars`` and sending ``SMARTIO_BARS``, and ``vmlend mdev watch`` writing
each source's ``p2p`` as ``plan_p2p`` computes it, with the hold's token. The stand-in maps
nothing: it records and checks the write, and simulates ``p2p_state``.

The stand-in offers a child one memory BAR: its device's first 32-bit memory BAR among BARs 2
to 5. The default topology's GPUs have none there, so this test's topology gives 0x10 and
0x20 a 1 MiB BAR 5."""

from __future__ import annotations

import errno
import os
import select
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.kernel_guest import REAL, STUB, private_root, write
from tests.support.vfio_user import VfioDevice
from vmlend.kernel.backend import SmartioFabric
from vmlend.kernel.p2pfiles import lines_for, parse_guest_bars, parse_p2p, parse_p2p_state
from vmlend.lending.devices import UndoJournal, acquire_device
from vmlend.memory.layout import MemoryConfig, compute_layout
from vmlend.p2p import RECORD_KIND, GuestBar, peer_device, plan_p2p
from vmlend.registry import SqliteRegistry
from vmlend.topology.model import GiB, GuestRam, Holder
from vmlend.topology.parse import parse_topology
from vmlend.wiring.fabric import default_topology_text, init_fabric

#: VFIO's config-space region, the command register, BAR 5's register.
CONFIG, COMMAND, BAR5 = 7, 0x04, 0x24
MEMORY = 0x02
WEB = Holder("gamma", "web", "11111111-1111-1111-1111-111111111111")
GPUS = {0x10: "83b8f4f2-509f-382f-3c1e-e6bfe0fa9101", 0x20: "83b8f4f2-509f-382f-3c1e-e6bfe0fa9102"}
#: Where the guest puts each GPU's BAR 5 (below 4 GiB, above its 2 GiB of low RAM).
GPA = {0x10: 0xFE00_0000, 0x20: 0xFE10_0000}
MIB = 1 << 20


def _topology_text() -> str:
    """The default topology, 0x10 and 0x20 with a 1 MiB 32-bit BAR 5 each."""
    text, _source = default_topology_text()
    for fdid in GPUS:
        head = text.index(f"fdid = {fdid:#x}\n")
        end = text.index("\n  ]\n", head)
        text = text[:end] + '\n    { index = 5, size = "1MiB", kind = "mem32" },' + text[end:]
    return text


def group(uuid: str):
    return REAL.mdev_devices / uuid / "smartio"


@pytest.fixture
def vm(tmp_path):
    """VM web with both GPUs' children, their DMA windows written, borrowed by this host."""
    text = _topology_text()
    topology = parse_topology(text)
    STUB.populate(topology)
    state = tmp_path / "state.db"
    init_fabric(state, text, "test topology", node="gamma")
    ram = GuestRam(tuple(compute_layout(MemoryConfig("q35", 6 * GiB)).ranges()))
    env = private_root(tmp_path / "root")
    with SmartioFabric(SqliteRegistry.open(state), env, local_node="gamma") as fab:
        for fdid, uuid in GPUS.items():
            acquire_device(fab, WEB, fdid, uuid, UndoJournal(), guest_ram=ram)
            STUB.set_borrower(fdid, 12)  # the guest enabled it: the hardware borrow
        yield fab, state, topology


def _watch(state) -> subprocess.Popen[str]:
    """``vmlend mdev watch`` on the guest's real root, once it listens (it logs the parents
    it found after its uevent monitor started)."""
    env = {k: v for k, v in os.environ.items() if k != "VMLEND_ROOT"}
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "vmlend"), "-v", "--root", "/", "--state", str(state),
         "--node", "gamma", "mdev", "watch", "--timeout", "4"],
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert proc.stderr is not None
    seen = 0
    deadline = time.monotonic() + 60
    while seen < len(GPUS):
        ready, _, _ = select.select([proc.stderr], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, "vmlend mdev watch did not start"
        line = proc.stderr.readline()
        assert line, f"vmlend mdev watch ended: {proc.wait()}"
        seen += "appeared" in line
    return proc


def _decode(uuid: str, gpa: int) -> None:
    """The guest programs BAR 5 and turns memory decoding on, through the child's config."""
    with VfioDevice(uuid) as dev:
        dev.write(CONFIG, BAR5, struct.pack("<I", gpa))
        dev.write(CONFIG, COMMAND, struct.pack("<H", 0x0001 | MEMORY))


@pytest.mark.daemon  # vmlend mdev watch, a subprocess: killed by its PID if it hangs
def test_the_watcher_writes_each_sources_p2p_as_the_planner_computes_it(vm):
    fab, state, topology = vm
    for uuid in GPUS.values():
        assert (group(uuid) / "guest_bars").read_text() == ""  # decoding off
    proc = _watch(state)
    try:
        for fdid, uuid in GPUS.items():
            _decode(uuid, GPA[fdid])
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err

    bars = []
    for fdid, uuid in GPUS.items():
        f = group(uuid) / "guest_bars"
        decoded = parse_guest_bars(f.read_text(), fdid, f)
        assert decoded == (GuestBar(fdid, 5, GPA[fdid], MIB),)
        bars += decoded
    devices = [peer_device(topology.device(f), {b.index: 0 for b in topology.device(f).bars})
               for f in GPUS]  # fmt: skip
    plan = plan_p2p(topology, "gamma", devices, bars)
    holds = fab._state.holds()
    for fdid, uuid in GPUS.items():
        f = group(uuid) / "p2p"
        written = parse_p2p(f.read_text(), f)
        assert written is not None, err
        assert written.token == holds[fdid].token
        assert written.lines == lines_for(plan.from_source(fdid))
        s = group(uuid) / "p2p_state"
        state_lines = parse_p2p_state(s.read_text(), s)
        assert [x.line for x in state_lines] == list(written.lines)
        assert {x.case for x in state_lines} == {"other-lender"}  # alpha and beta
        with fab.registry.read() as tx:
            keys = [r.key for r in tx.runtime(fdid, RECORD_KIND)]
        assert keys == [m.key for m in plan.from_source(fdid)]

    # a holder with an older token (its hold ended while it was cut off) is refused
    f = group(GPUS[0x10]) / "p2p"
    before = f.read_text()
    token = holds[0x10].token
    with pytest.raises(OSError) as e:
        write(f, f"token {token - 1}\n0x20 5 {GPA[0x20]:#x} {MIB:#x}\n")
    assert e.value.errno == errno.ESTALE
    with pytest.raises(OSError) as e:  # its own BAR
        write(f, f"token {token}\n0x10 5 {GPA[0x10]:#x} {MIB:#x}\n")
    assert e.value.errno == errno.EINVAL
    with pytest.raises(OSError) as e:  # a size the target's BAR does not have
        write(f, f"token {token}\n0x20 5 {GPA[0x20]:#x} 0x2000\n")
    assert e.value.errno == errno.EINVAL
    assert f.read_text() == before


@pytest.mark.usefixtures("vm")
def test_the_bar_is_listed_only_while_decoded_at_an_address():
    uuid = GPUS[0x10]
    with VfioDevice(uuid) as dev:
        dev.write(CONFIG, BAR5, struct.pack("<I", GPA[0x10]))  # memory decoding still off
        assert (group(uuid) / "guest_bars").read_text() == ""
        dev.write(CONFIG, BAR5, struct.pack("<I", 0xFFFF_FFFF))  # sizing
        assert struct.unpack("<I", dev.read(CONFIG, BAR5, 4))[0] == (~(MIB - 1)) & 0xFFFF_FFFF
        dev.write(CONFIG, COMMAND, struct.pack("<H", 0x0001 | MEMORY))
        assert (group(uuid) / "guest_bars").read_text() == ""  # the sizing pattern
        dev.write(CONFIG, BAR5, struct.pack("<I", GPA[0x10] + 0x1234))  # aligned down
        f = group(uuid) / "guest_bars"
        assert parse_guest_bars(f.read_text(), 0x10, f) == (GuestBar(0x10, 5, GPA[0x10], MIB),)
