"""A shared NVMe drive's crossings and the cluster switch ports' requester tables: each
crossing of the drive into a VM's node holds the drive's requester entry on every port of its
route (as a borrow's does), a full port refuses the share's mapping and changes nothing, a
re-route moves the entries (or is refused onto a full port), and the invariant checker counts
the shares' entries: one no crossing explains is reported, and so is one not claimed."""

from __future__ import annotations

import pytest

from tests.support.nvme_guest import guest_driver
from tests.support.simcluster import Cluster
from vmlend.errors import SwitchPortFullError
from vmlend.ledger import nvmeshares as shares
from vmlend.registry import ClaimKind
from vmlend.sim.hardware import SimHardware
from vmlend.sim.invariants import check_hardware, check_with_registry
from vmlend.sim.nvmedrive import drive_geometry
from vmlend.sim.nvmeshare import SharedNvmeDrive
from vmlend.topology.model import GuestRange, Holder, MiB
from vmlend.topology.parse import parse_topology
from vmlend.topology.requesters import SwitchPort, is_port
from vmlend.wiring.fabric import default_topology_text

DRIVE = 0x12  # alpha's NVMe drive, 0000:43:00.0
GPU = 0x20  # beta's GPU
DRIVE_REQ = "alpha/0000:43:00"
PRIMARY = "mxs824/gamma:0"


def topology_text(entries: int | None = None) -> str:
    text, _source = default_topology_text()
    if entries is None:
        return text
    out = text.replace('name = "mxs824"\n', f'name = "mxs824"\nrequester_entries = {entries}\n')
    out = out.replace('name = "mxs824b"\n', f'name = "mxs824b"\nrequester_entries = {entries}\n')
    assert out.count(f"requester_entries = {entries}") == 2
    return out


def hardware(entries: int | None = None) -> SimHardware:
    return SimHardware.from_topology(parse_topology(topology_text(entries)), seed=5)


@pytest.fixture
def hw():
    return hardware()


def clean(hw, drive) -> None:
    found = check_hardware(hw, shares=drive.grants() if drive is not None else ())
    assert not found, "\n".join(map(str, found))


def boot(hw, drive, node: str, vm: str):
    hw.create_guest(node, vm, [GuestRange(0, 64 * MiB)])
    share = drive.open_share(node, vm, 1, 1024)
    share.set_master()
    return share


def users(hw, port: str):
    return hw.switch_ports.entries(port).get(DRIVE_REQ, frozenset())


def test_a_shares_crossing_holds_the_drives_entry_on_each_port_until_it_ends(hw, tmp_path):
    drive = SharedNvmeDrive(hw, DRIVE, tmp_path, blocks=1 << 16)
    assert hw.switch_ports.ports() == []  # the manager drives it on its lender: no crossing
    one = boot(hw, drive, "gamma", "one")
    two = boot(hw, drive, "gamma", "two")  # the same crossing into gamma: the same entries
    assert hw.switch_ports.ports() == ["mxs824/alpha:0", PRIMARY]
    assert users(hw, PRIMARY) == {(DRIVE, "nvme>gamma")}
    clean(hw, drive)
    other = boot(hw, drive, "beta", "other")
    assert users(hw, "mxs824/alpha:0") == {(DRIVE, "nvme>gamma"), (DRIVE, "nvme>beta")}
    assert users(hw, "mxs824/beta:0") == {(DRIVE, "nvme>beta")}
    clean(hw, drive)
    one.close()
    assert users(hw, PRIMARY) == {(DRIVE, "nvme>gamma")}  # two still crosses
    two.close()
    assert hw.switch_ports.ports() == ["mxs824/alpha:0", "mxs824/beta:0"]
    clean(hw, drive)
    other.set_master(False)  # the guest stops bus mastering: its crossing goes
    assert hw.switch_ports.ports() == []
    clean(hw, drive)
    drive.close()


def test_a_full_port_refuses_the_shares_mapping_and_changes_nothing(tmp_path):
    hw = hardware(entries=1)
    drive = SharedNvmeDrive(hw, DRIVE, tmp_path, blocks=1 << 16)
    hw.borrow(GPU, "gamma", "gpu-vm")  # beta's GPU fills gamma's port
    luts = {a.ref: a.lut() for a in hw.adapters()}
    ports = {p: hw.switch_ports.entries(p) for p in hw.switch_ports.ports()}
    hw.create_guest("gamma", "web", [GuestRange(0, 64 * MiB)])
    share = drive.open_share("gamma", "web", 1, 1024)
    with pytest.raises(SwitchPortFullError) as e:
        share.set_master()
    assert str(e.value).startswith(
        f"switch mxs824 port {PRIMARY}: its requester table is full (1 of 1 entries used),"
        f" no room for requester {DRIVE_REQ}"
    )
    assert "\n" not in str(e.value)
    assert {a.ref: a.lut() for a in hw.adapters()} == luts
    assert {p: hw.switch_ports.entries(p) for p in hw.switch_ports.ports()} == ports
    clean(hw, drive)
    hw.give_back(GPU)
    share.set_master()  # room now
    assert users(hw, PRIMARY) == {(DRIVE, "nvme>gamma")}
    drv = guest_driver(share.bar0, hw.guest("gamma", "web"))
    (queue,) = drv.start(queues=1, entries=8)
    assert drv.write(queue, 0, b"\x07" * 512).ok
    clean(hw, drive)
    drive.close()


def test_a_reroute_moves_the_entries_and_back(hw, tmp_path):
    drive = SharedNvmeDrive(hw, DRIVE, tmp_path, blocks=1 << 16)
    boot(hw, drive, "gamma", "web")
    hw.link_down(PRIMARY)
    assert hw.crossing(DRIVE, "gamma").dst.ref == "gamma:1"
    assert hw.switch_ports.ports() == [
        "mxs824/alpha:0",
        "mxs824/mxs824b",
        "mxs824b/gamma:1",
        "mxs824b/mxs824",
    ]
    clean(hw, drive)
    hw.link_up(PRIMARY)
    assert hw.switch_ports.ports() == ["mxs824/alpha:0", PRIMARY]
    clean(hw, drive)
    drive.close()
    assert hw.switch_ports.ports() == []


def test_a_reroute_onto_a_full_port_is_refused_and_the_crossing_stays(tmp_path):
    hw = hardware(entries=1)
    drive = SharedNvmeDrive(hw, DRIVE, tmp_path, blocks=1 << 16)
    boot(hw, drive, "gamma", "web")
    # another requester holds the one entry of gamma's port on the second switch
    hw.switch_ports.add([SwitchPort("mxs824b", "gamma:1")], "beta/0000:81:00", GPU)
    hw.link_down(PRIMARY)
    assert drive.reroutes == []
    assert hw.crossing(DRIVE, "gamma").dst.ref == "gamma:0"
    assert users(hw, PRIMARY) == {(DRIVE, "nvme>gamma")}
    assert hw.switch_ports.entries("mxs824/mxs824b") == {}
    drive.close()


def test_the_checker_reports_a_shares_entry_no_crossing_explains(hw, tmp_path):
    drive = SharedNvmeDrive(hw, DRIVE, tmp_path, blocks=1 << 16)
    share = boot(hw, drive, "gamma", "web")
    share.close()
    clean(hw, drive)
    hw.switch_ports.add([SwitchPort("mxs824", "gamma:0")], DRIVE_REQ, (DRIVE, "nvme>gamma"))
    found = [v for v in check_hardware(hw, shares=drive.grants()) if v.kind == "port"]
    assert [str(v) for v in found] == [
        f"port {PRIMARY} entry {DRIVE_REQ}: held for 0x12 (nvme>gamma), whose crossing does"
        " not pass it"
    ]
    drive.close()


def test_the_checker_reports_a_crossing_into_a_node_without_a_share(hw, tmp_path):
    drive = SharedNvmeDrive(hw, DRIVE, tmp_path, blocks=1 << 16)
    boot(hw, drive, "gamma", "web")
    found = [str(v) for v in check_hardware(hw, shares=()) if v.kind == "port"]
    assert found == [
        "port NVMe drive 0x12 into gamma: its crossing over alpha:0 -> gamma:0 via mxs824 holds"
        " requester entries for no current share on gamma"
    ]
    drive.close()


def test_a_shares_entries_in_use_are_claimed_by_the_managers_hold(state_path):
    c = Cluster.create(state_path)
    try:
        shares.lend_shared(c.registry, DRIVE, drive_geometry(c.hw.device(DRIVE).spec, 1 << 16))
        drive = SharedNvmeDrive(c.hw, DRIVE, state_path.parent, blocks=1 << 16)
        ram = 64 * MiB
        share = shares.reserve_share(
            c.registry, DRIVE, Holder("gamma", "web"), 1, 4096, guest_ram=ram
        )
        c.hw.create_guest("gamma", "web", [GuestRange(0, ram)])
        drive.open_share("gamma", "web", share=share).set_master()
        assert check_with_registry(c.hw, c.registry) == []
        with c.registry.write() as tx:  # the claims without the port entries
            lut = [(f, cl) for f, cl in tx.claims() if f == DRIVE and cl.kind is ClaimKind.LUT]
            assert {cl.adapter for _f, cl in lut if is_port(cl.adapter)} == {
                "mxs824/alpha:0",
                PRIMARY,
            }
            tx.replace_claims(
                ClaimKind.LUT, [DRIVE], [(f, cl) for f, cl in lut if not is_port(cl.adapter)]
            )
        found = [str(v) for v in check_with_registry(c.hw, c.registry) if v.kind == "claims"]
        assert found == [
            f"claims {p}: requester entry req:{DRIVE_REQ} of 0x12 in use, not claimed by its hold"
            for p in ("mxs824/alpha:0", PRIMARY)
        ]
        drive.close()
    finally:
        c.close()
