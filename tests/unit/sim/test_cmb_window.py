"""A share's CPU window onto its CMB extent takes segments of its node's adapter (mechanism
15, issue 40 points 1 and 2): mapped while the share is open, on the adapter of the drive's
crossing into the node, exactly what admission claimed with the share; a re-route moves the
window and its claim, the share's end returns both, and the guest's CMB writes go through it
(an untranslated window drops them)."""

from __future__ import annotations

import pytest

from tests.support.nvme_guest import share_xml
from tests.support.simcluster import Cluster
from vmlend.errors import DmaFault, ResourceExhaustedError
from vmlend.ledger import nvmeshares
from vmlend.ledger.nvmeadmit import CMB_SUFFIX
from vmlend.registry import ClaimKind
from vmlend.sim.hardware import SimHardware
from vmlend.sim.invariants import check_hardware, check_with_registry
from vmlend.sim.nvmedrive import drive_geometry
from vmlend.sim.nvmeshare import SharedNvmeDrive
from vmlend.sim.nvmetopology import SHARED_NVME, sharing_topology
from vmlend.sim.simvm import SimVm
from vmlend.topology.model import GuestRange, MiB
from vmlend.topology.parse import parse_topology

NVME = 0x12
BLOCKS = 1 << 20
CMB = 128 * 1024  # two 64 KiB extents
PRIMARY = "mxs824/gamma:0"


def cmb_claims(c: Cluster) -> dict[str, int]:
    return {
        cl.adapter: cl.segments
        for _f, cl in c.claims()
        if cl.kind is ClaimKind.BAR and cl.share.endswith(CMB_SUFFIX)
    }


@pytest.fixture
def shared(state_path, tmp_path):
    c = Cluster.create(state_path)
    geometry = drive_geometry(c.hw.device(NVME).spec, BLOCKS, CMB)
    nvmeshares.lend_shared(c.registry, NVME, geometry)
    drive = SharedNvmeDrive(c.hw, NVME, tmp_path, blocks=BLOCKS, cmb_bytes=CMB)
    yield c, drive
    drive.close()
    c.close()


def test_the_window_is_mapped_as_claimed_moved_by_a_reroute_and_returned(shared):
    c, drive = shared
    xml = share_xml("cmbvm", fdid=NVME)
    c.prepare(xml, "gamma")
    assert cmb_claims(c) == {"gamma:0": 1}  # claimed at reserve
    vm = SimVm(xml, hardware=c.hw, fabric=c.fabric("gamma"), nvme={NVME: drive})
    share = vm.nvme_share(NVME)
    share.set_master()
    assert share.cmb_window is not None and share.cmb_window[0] == "gamma:0"
    assert len(share.cmb_window[1]) == 1
    assert check_with_registry(c.hw, c.registry) == []
    assert share.cmb is not None
    share.cmb.write(0, b"sqe")
    assert share.cmb.read(0, 3) == b"sqe"
    access = share.cmb.resolve(0, 4)
    window = c.hw.adapter("gamma:0").segment_base(share.cmb_window[1][0])
    assert access.hops[1].address == window  # the guest's write leaves by its window
    # the cable goes: the drive's crossing, the window and its claim move to gamma:1
    c.fabric("gamma").set_link_up(PRIMARY, False)
    assert share.cmb_window[0] == "gamma:1" and cmb_claims(c) == {"gamma:1": 1}
    assert not c.hw.adapter("gamma:0").mapped_segments()
    assert check_with_registry(c.hw, c.registry) == []
    assert share.cmb.read(0, 3) == b"sqe"
    c.fabric("gamma").set_link_up(PRIMARY, True)
    assert check_with_registry(c.hw, c.registry) == []
    vm.stop()
    assert share.cmb_window is None
    assert not c.hw.adapter("gamma:0").mapped_segments()
    assert not c.hw.adapter("gamma:1").mapped_segments()
    c.release(xml, "gamma")
    assert cmb_claims(c) == {}
    assert check_with_registry(c.hw, c.registry) == []


def test_a_reroute_onto_an_adapter_without_room_for_the_window_keeps_the_route(shared):
    """A link event whose new route's adapter has no segment left for the share's CMB window
    moves nothing (as a full switch port): the crossing, the window and its claim stay on the
    dead cable, and the event completes (before, the move went half way and the error left
    the rest of the link event's re-routes and records undone)."""
    c, drive = shared
    xml = share_xml("cmbvm", fdid=NVME)
    c.prepare(xml, "gamma")
    vm = SimVm(xml, hardware=c.hw, fabric=c.fabric("gamma"), nvme={NVME: drive})
    share = vm.nvme_share(NVME)
    share.set_master()
    other = c.hw.adapter("gamma:1")
    filler = []
    while True:  # what other users' windows would take
        try:
            index = other.free_segments(1)
        except ResourceExhaustedError:
            break
        other.map_segment(index, "alpha", 0x1000_0000 + index * other.segment_size)
        filler.append(index)
    c.fabric("gamma").set_link_up(PRIMARY, False)  # completes: nothing raised
    assert share.cmb_window is not None and share.cmb_window[0] == "gamma:0"
    assert cmb_claims(c) == {"gamma:0": 1}
    crossing = c.hw.crossing(NVME, "gamma")
    assert crossing is not None and crossing.dst.ref == "gamma:0"
    assert drive.reroutes == []
    for index in filler:
        other.unmap_segment(index)
    assert check_with_registry(c.hw, c.registry) == []
    vm.stop()
    c.release(xml, "gamma")


@pytest.fixture
def hw():
    return SimHardware.from_topology(parse_topology(sharing_topology(2)), seed=3)


def test_a_cmb_write_through_a_window_a_reset_lost_is_dropped(hw, tmp_path):
    drive = SharedNvmeDrive(hw, SHARED_NVME, tmp_path, blocks=BLOCKS, cmb_bytes=CMB)
    try:
        hw.create_guest("b1", "vm", [GuestRange(0, 64 * MiB)])
        share = drive.open_share("b1", "vm", 1, 4096)
        assert share.cmb is not None and share.cmb_window is not None
        share.cmb.write(0, b"one")
        hw.link_down("sw/b1:0")
        hw.link_up("sw/b1:0", keep_mappings=False)  # b1:0 lost the window's segment
        with pytest.raises(DmaFault) as fault:
            share.cmb.resolve(0, 4)
        assert fault.value.hop == "ntb-segment" and "b1:0" in fault.value.why
        share.cmb.write(0, b"two")
        assert share.cmb.dropped == 1 and share.cmb.read(0, 3) == b"\xff" * 3
        hw.reprogram("sw/b1:0")
        assert share.cmb.read(0, 3) == b"one"  # the dropped write never arrived
        assert check_hardware(hw, shares=drive.grants()) == []
        share.close()
        assert not hw.adapter("b1:0").mapped_segments()
    finally:
        drive.close()


def test_a_full_adapter_refuses_the_share_in_one_line_leaving_nothing(hw, tmp_path):
    drive = SharedNvmeDrive(hw, SHARED_NVME, tmp_path, blocks=BLOCKS, cmb_bytes=CMB)
    try:
        hw.create_guest("b1", "vm", [GuestRange(0, 64 * MiB)])
        adapter = hw.adapter("b1:0")
        for i in range(adapter.segments):  # every segment taken (by hand)
            adapter.map_segment(i, "b2", i * 4096)
        with pytest.raises(ResourceExhaustedError) as e:
            drive.open_share("b1", "vm", 1, 4096)
        assert "b1:0" in str(e.value) and "\n" not in str(e.value)
        assert drive.shares == {} and drive.cmb_windows() == []
        for i in range(adapter.segments):
            adapter.unmap_segment(i)
        assert drive.open_share("b1", "vm", 1, 4096).cmb_window is not None
    finally:
        drive.close()


def test_a_page_mode_doorbell_goes_through_its_window_onto_its_own_page(hw, tmp_path):
    from vmlend.nvme import spec

    drive = SharedNvmeDrive(hw, SHARED_NVME, tmp_path, blocks=BLOCKS)
    try:
        for node in ("b1", "b2"):
            hw.create_guest(node, "vm", [GuestRange(0, 64 * MiB)])
        a = drive.open_share("b1", "vm", 1, 4096)
        b = drive.open_share("b2", "vm", 1, 4096)
        assert a.bar0.mapped and a.doorbell_window is not None and a.cmb_window is None
        ref, (index,) = a.doorbell_window
        seg = hw.adapter(ref).segment(index)
        assert seg is not None and a.bar0.page is not None
        assert (ref, seg.remote_node, seg.remote_addr) == (
            "b1:0",
            "store",
            hw.device(SHARED_NVME).bar_phys[0] + a.bar0.page,
        )
        assert check_hardware(hw, shares=drive.grants()) == []
        sq1 = spec.DOORBELL_BASE + 8  # the guest's SQ 1 tail doorbell
        a.bar0.write(sq1, 4, 1)
        assert hw.mmio.stats.delivered["b1:0"] == 1
        hw.link_down("sw/b1:0")
        hw.link_up("sw/b1:0", keep_mappings=False)  # b1:0 lost the window
        a.bar0.write(sq1, 4, 2)
        assert hw.mmio.stats.aborted["b1:0"] == 1 and hw.mmio.stats.delivered["b1:0"] == 1
        hw.reprogram("sw/b1:0")
        a.bar0.write(sq1, 4, 3)
        assert hw.mmio.stats.delivered["b1:0"] == 2
        # a window onto another VM's page is caught
        bref, (bindex,) = b.doorbell_window  # type: ignore[misc]
        badapter = hw.adapter(bref)
        badapter.unmap_segment(bindex)
        badapter.map_segment(bindex, "store", seg.remote_addr)
        assert [v.kind for v in check_hardware(hw, shares=drive.grants())] == ["ntb-segment"]
        badapter.unmap_segment(bindex)
        badapter.map_segment(bindex, "store", hw.device(SHARED_NVME).bar_phys[0] + b.bar0.page)
        a.close()
        b.close()
        assert not hw.adapter("b1:0").mapped_segments()
        assert not hw.adapter("b2:0").mapped_segments()
        assert check_hardware(hw, shares=drive.grants()) == []
    finally:
        drive.close()
