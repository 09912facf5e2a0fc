"""Peer-to-peer follows link events: a crossing between two lenders whose cable dies is made
again over another live route (segments, LUT entries, switch port entries), and comes back
to the cheapest route with the cable, as a borrowed device's own crossing does; the
registry's peer-to-peer claims follow (proven by the invariant checker and the DMA resolver)."""

from __future__ import annotations

from collections.abc import Callable

from tests.support.simcluster import Cluster, assert_matches_registry
from vmlend.registry.records import FenceRecord
from vmlend.sim.hardware import SimHardware
from vmlend.sim.invariants import check_hardware
from vmlend.sim.p2pmap import P2PMapper
from vmlend.sim.pci import regs
from vmlend.topology.model import GiB, GuestRange, Holder, MiB
from vmlend.topology.parse import parse_topology
from vmlend.wiring.fabric import default_topology_text

GPU, GPU2, BETA_GPU, BETA_NIC = 0x10, 0x11, 0x20, 0x21  # alpha's two GPUs, beta's GPU, NIC
RAM = [GuestRange(0, 2 * GiB)]
BARS = {
    GPU: {0: (0xC000_0000, 16 * MiB)},
    GPU2: {0: (0xC200_0000, 16 * MiB)},
    BETA_GPU: {0: (0xC100_0000, 16 * MiB)},
    BETA_NIC: {0: (0xC300_0000, 1 * MiB)},
}
BETA_CABLE = "mxs824/beta:0"
#: beta gets a second adapter on the cascaded switch: alpha reaches it over two routes
_BETA_1 = """  [[node.adapter]]
  index = 1
  model = "PXH830"
  window = "128GiB"
  segments = 32
  lut_entries = 32
  cpus = 1
  slot = "chassis1"

"""


def two_route_text() -> str:
    text, _source = default_topology_text()
    at = text.index('name = "beta"')
    device = text.index("  [[node.device]]", at)
    text = text[:device] + _BETA_1 + text[device:]
    text = text.replace('ports = ["gamma:1"]', 'ports = ["gamma:1", "beta:1"]')
    return text


def hardware(devices: tuple[int, ...] = (GPU, BETA_GPU)) -> SimHardware:
    hw = SimHardware.from_topology(parse_topology(two_route_text()))
    hw.create_guest("gamma", "web", RAM)
    for f in devices:
        hw.borrow(f, "gamma", "web")
        hw.device(f).config.write(regs.COMMAND, 2, regs.COMMAND_MEMORY | regs.COMMAND_MASTER)
    return hw


def program(p2p: P2PMapper, fdid: int) -> None:
    for index, (gpa, size) in BARS[fdid].items():
        p2p.program_bar(fdid, index, gpa, size)


def lands(hw: SimHardware, data: bytes) -> None:
    """alpha's GPU writes into beta's GPU's BAR 0 at its guest-physical address."""
    gpa, _size = BARS[BETA_GPU][0]
    (target,) = hw.dma_write(GPU, gpa + 0x40, data)
    assert target is not None, "dropped at a dead cable"
    assert (target.kind, target.owner, target.bar, target.node) == ("bar", BETA_GPU, 0, "beta")
    assert hw.dma_read(GPU, gpa + 0x40, len(data)) == data


def crossing(p2p: P2PMapper) -> str:
    (c,) = [c for c in p2p.crossings() if (c.source, c.target) == (GPU, BETA_GPU)]
    return c.path.describe()


def clean(hw: SimHardware) -> None:
    found = check_hardware(hw)
    assert not found, "\n".join(map(str, found))


def plug(c: Cluster, p2p: P2PMapper, fdid: int) -> None:
    """Reserve and borrow ``fdid`` for the mapper's VM, enable it, program its BARs."""
    holder = Holder(p2p.node, p2p.vm)
    fabric = c.fabric(p2p.node)
    fabric.reserve(fdid, holder, guest_ram=2 * GiB)
    fabric.borrow(fdid, holder)
    c.hw.device(fdid).config.write(regs.COMMAND, 2, regs.COMMAND_MEMORY | regs.COMMAND_MASTER)
    program(p2p, fdid)


def fill_the_other_route(hw: SimHardware) -> Callable[[], None]:
    """Fill beta:1's switch port requester table (what other devices' crossings would hold
    there), so a re-route off beta's cable finds no room; returns what empties it again."""
    from vmlend.topology.requesters import route_ports

    ports = hw.switch_ports
    other = next(p for p in hw.routes("alpha", "beta") if p.dst.ref == "beta:1")
    full = [p for p in route_ports(other) if "beta:1" in p.name]
    fillers: list[str] = []
    while True:
        who = f"zeta/0000:{len(fillers):02x}:00"
        try:
            ports.add(full, who, (0x999, who))
        except Exception:
            break
        fillers.append(who)

    def empty() -> None:
        for who in fillers:
            ports.remove(full, who, (0x999, who))

    return empty


def test_a_crossing_between_lenders_leaves_a_dead_cable_and_comes_back_with_it():
    hw = hardware()
    p2p = P2PMapper(hw, "gamma", "web")
    program(p2p, GPU)
    program(p2p, BETA_GPU)
    assert crossing(p2p) == "alpha:0 -> beta:0 via mxs824"
    lands(hw, b"before")
    hw.link_down(BETA_CABLE)
    assert crossing(p2p) == "alpha:0 -> beta:1 via mxs824, mxs824b"
    lands(hw, b"rerouted")  # through beta's other adapter
    assert "alpha/0000:41:00" not in hw.switch_ports.entries(BETA_CABLE)  # left the dead port
    clean(hw)
    hw.link_up(BETA_CABLE)
    assert crossing(p2p) == "alpha:0 -> beta:0 via mxs824"
    lands(hw, b"back")
    clean(hw)
    p2p.close()
    clean(hw)


def test_with_no_live_route_left_the_maps_stay_cut_and_follow_the_cable_back():
    hw = hardware()
    p2p = P2PMapper(hw, "gamma", "web")
    program(p2p, GPU)
    program(p2p, BETA_GPU)
    hw.link_down("mxs824/alpha:0")  # alpha's only cable: no route from alpha at all
    assert crossing(p2p) == "alpha:0 -> beta:0 via mxs824"
    gpa, _size = BARS[BETA_GPU][0]
    assert not any(hw.dma_write(GPU, gpa, b"cut"))  # dropped at the dead cable
    assert hw.dma_read(GPU, gpa, 4) == b"\xff" * 4
    clean(hw)
    program(p2p, BETA_GPU)  # a BAR programmed meanwhile maps on the cut route, as before
    hw.link_up("mxs824/alpha:0")
    lands(hw, b"back")
    clean(hw)
    p2p.close()


def test_a_give_back_while_every_route_is_cut_leaves_the_other_maps_alone():
    """Found by the state machine: with the maps of alpha and beta on a route that died and
    no other one up, giving one of alpha's GPUs back re-planned the other GPU's maps onto
    another route and failed to make them there, inside the give-back (the device fenced).
    Only a link event moves maps between routes."""
    hw = hardware((GPU, GPU2, BETA_GPU))
    p2p = P2PMapper(hw, "gamma", "web")
    for f in (GPU, GPU2, BETA_GPU):
        program(p2p, f)
    hw.link_down(BETA_CABLE)  # onto beta:1
    hw.link_down("mxs824-mxs824b")  # and that one dies too: no route from alpha to beta
    before = [m for m in p2p.maps() if GPU not in (m.source, m.target)]
    hw.give_back(GPU)
    assert hw.fenced(GPU) is None
    assert p2p.maps() == before
    clean(hw)
    p2p.close()


def test_the_registry_claims_follow_the_rerouted_crossing(tmp_path):
    c = Cluster.create(tmp_path / "state.db", two_route_text())
    try:
        holder = Holder("gamma", "web")
        fabric = c.fabric()
        for f in (GPU, BETA_GPU):
            fabric.reserve(f, holder, guest_ram=2 * GiB)
        c.hw.create_guest("gamma", "web", RAM)
        for f in (GPU, BETA_GPU):
            fabric.borrow(f, holder)
        p2p = P2PMapper(c.hw, "gamma", "web")
        program(p2p, GPU)
        program(p2p, BETA_GPU)
        assert_matches_registry(c)
        fabric.set_link_up(BETA_CABLE, False)
        assert crossing(p2p) == "alpha:0 -> beta:1 via mxs824, mxs824b"
        assert_matches_registry(c)
        fabric.set_link_up(BETA_CABLE, True)
        assert_matches_registry(c)
        p2p.close()
    finally:
        c.close()


def test_a_take_back_after_a_reroute_keeps_the_entry_a_source_left_on_the_new_route(tmp_path):
    """Found by the SQLite state machine (CI's derandomized run): a VM on alpha with alpha's
    GPU and beta's GPU and NIC; beta's cable dies; the borrows of beta's devices have no
    other route from their adapter and stay on it, while peer-to-peer from them to alpha's
    GPU moves onto beta's other adapter, where each source gets a LUT entry of its own. The
    GPU's hold then ends and the lender takes it back: the release counted the claims of the
    pairs left anew on the cheapest live route, taking the NIC's crossing to leave by that
    adapter too, and dropped the claim of its entry there (the checker: beta:1 with an entry
    in use that nothing claims). The pair left still works, and its claims cover it."""
    c = Cluster.create(tmp_path / "state.db", two_route_text())
    try:
        holder = Holder("alpha", "c")
        fabric = c.fabric("alpha")
        devices = (GPU, BETA_GPU, BETA_NIC)
        for f in devices:
            fabric.reserve(f, holder, guest_ram=2 * GiB)
        c.hw.create_guest("alpha", "c", RAM)
        for f in devices:
            fabric.borrow(f, holder)
            c.hw.device(f).config.write(regs.COMMAND, 2, regs.COMMAND_MEMORY | regs.COMMAND_MASTER)
        p2p = P2PMapper(c.hw, "alpha", "c")
        for f in devices:
            program(p2p, f)
        fabric.set_link_up(BETA_CABLE, False)
        (nic,) = [x for x in p2p.crossings() if (x.source, x.target) == (BETA_NIC, GPU)]
        assert nic.path.describe() == "beta:1 -> alpha:0 via mxs824b, mxs824"
        borrow = c.hw.borrowed(BETA_NIC)
        assert borrow is not None and borrow.path is not None
        assert borrow.path.src.ref == "beta:0"  # its own crossing stayed on the dead cable
        assert_matches_registry(c)
        with c.registry.read() as tx:
            hold = tx.hold(BETA_GPU)
        assert hold is not None
        fabric.release(BETA_GPU, holder)
        c.fabric("beta").take_back(FenceRecord(BETA_GPU, holder, hold.token))
        gpa, _size = BARS[GPU][0]
        (target,) = c.hw.dma_write(BETA_NIC, gpa + 0x40, b"left")
        assert target is not None and (target.owner, target.node) == (GPU, "alpha")
        assert_matches_registry(c)
        p2p.close()
    finally:
        c.close()


def test_a_device_hot_plugged_after_a_reroute_leaves_the_vms_entries_claimed(tmp_path):
    """The same hand-over through a reserve: a VM on alpha with alpha's GPU and beta's GPU,
    beta's cable cut (beta's GPU's own crossing stays on it, its peer-to-peer leaves by
    beta's other adapter, with an entry of its own there), then beta's NIC hot-plugged.
    The reserve's admission counted the VM's peer-to-peer claims anew on the cheapest live
    route and dropped the GPU's entry there; the NIC's borrow took one more entry on that
    adapter than was claimed. It counts them on the routes the maps take now."""
    c = Cluster.create(tmp_path / "state.db", two_route_text())
    try:
        holder = Holder("alpha", "c")
        fabric = c.fabric("alpha")
        c.hw.create_guest("alpha", "c", RAM)
        p2p = P2PMapper(c.hw, "alpha", "c")

        def plug(fdid: int) -> None:
            fabric.reserve(fdid, holder, guest_ram=2 * GiB)
            fabric.borrow(fdid, holder)
            command = regs.COMMAND_MEMORY | regs.COMMAND_MASTER
            c.hw.device(fdid).config.write(regs.COMMAND, 2, command)
            program(p2p, fdid)
            assert_matches_registry(c, after=f"plugging {fdid:#x}")

        plug(GPU)
        plug(BETA_GPU)
        fabric.set_link_up(BETA_CABLE, False)
        assert_matches_registry(c)
        plug(BETA_NIC)
        gpa, _size = BARS[GPU][0]
        (target,) = c.hw.dma_write(BETA_NIC, gpa + 0x40, b"plugged")
        assert target is not None and (target.owner, target.node) == (GPU, "alpha")
        p2p.close()
    finally:
        c.close()


def test_a_pair_plugged_while_the_maps_stay_cut_is_claimed_on_their_route(tmp_path):
    """The mapper gives a new pair the route the VM's maps between the same two lenders hold.
    Beta's cable cut with no room on the other route (its port's requester table full): the
    maps stay on the cut route. Alpha's second GPU plugged then is mapped there too, and its
    claims must be counted there, not on the cheapest live route (before: "beta:0: 3 LUT
    entries in use, 2 claimed", and entries on the cut route's ports unclaimed)."""
    c = Cluster.create(tmp_path / "state.db", two_route_text())
    try:
        c.hw.create_guest("gamma", "web", RAM)
        p2p = P2PMapper(c.hw, "gamma", "web")
        plug(c, p2p, GPU)
        plug(c, p2p, BETA_GPU)
        empty = fill_the_other_route(c.hw)
        c.fabric().set_link_up(BETA_CABLE, False)
        assert "beta:0" in crossing(p2p)  # no room on the other route: the maps stay cut
        plug(c, p2p, GPU2)
        assert all("beta:0" in x.path.describe() for x in p2p.crossings())
        empty()
        assert_matches_registry(c)
        p2p.close()
    finally:
        c.close()


def test_maps_made_again_after_they_all_went_keep_the_route_the_claims_count(tmp_path):
    """The tight-ports state machine's case: beta's cable cut with no room on the other route,
    so the maps stay cut and the link event counts the claims there; room comes back; then the
    guest unassigns and re-programs its BARs. The pair's maps all went, and the mapper made
    them anew on the cheapest live route while the claims stayed on the cut one ("beta:0: 2
    peer-to-peer segment(s) mapped, at most 0 claimed"). The pair keeps its route until a link
    event moves it, and the count reads it."""
    c = Cluster.create(tmp_path / "state.db", two_route_text())
    try:
        fabric = c.fabric()
        c.hw.create_guest("gamma", "web", RAM)
        p2p = P2PMapper(c.hw, "gamma", "web")
        plug(c, p2p, GPU)
        plug(c, p2p, BETA_GPU)
        empty = fill_the_other_route(c.hw)
        fabric.set_link_up(BETA_CABLE, False)
        assert "beta:0" in crossing(p2p)  # no room on the other route: the maps stay cut
        empty()
        assert_matches_registry(c)
        for fdid in (GPU, BETA_GPU):  # the guest unassigns every BAR, then programs them again
            for index in BARS[fdid]:
                p2p.program_bar(fdid, index, 0, 0)
        assert p2p.crossings() == []
        for fdid in (GPU, BETA_GPU):
            program(p2p, fdid)
        assert "beta:0" in crossing(p2p)
        assert_matches_registry(c)
        # the cable back: the link event moves the pair and the claims follow
        fabric.set_link_up(BETA_CABLE, True)
        assert_matches_registry(c)
        p2p.close()
    finally:
        c.close()
