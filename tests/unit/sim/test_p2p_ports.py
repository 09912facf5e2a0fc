"""Peer-to-peer between two lenders and the cluster switch ports' requester tables: the
crossing from the source's lender to the target's node holds the source's requester entry on
every port of its route, a full port refuses the map and changes nothing, the entries go with
the maps; admission claims them (a full port refuses the reserve in one line naming the switch
and the port), and the invariant checker counts them."""

from __future__ import annotations

import pytest

from tests.support.simcluster import Cluster
from vmlend.errors import SwitchPortFullError
from vmlend.registry import ClaimKind
from vmlend.sim.hardware import SimHardware
from vmlend.sim.invariants import check_hardware, check_with_registry
from vmlend.sim.p2pmap import P2PCrossing, P2PMapper
from vmlend.sim.pci import regs
from vmlend.topology.model import GiB, GuestRange, Holder, MiB
from vmlend.topology.parse import parse_topology
from vmlend.topology.requesters import SwitchPort, is_port
from vmlend.wiring.fabric import default_topology_text

GPU, BETA_GPU, NIC = 0x10, 0x20, 0x21  # alpha 0000:41:00.0; beta 0000:81:00.0, 0000:82:00.0
ALPHA_GPU_REQ, BETA_GPU_REQ = "alpha/0000:41:00", "beta/0000:81:00"
RAM = [GuestRange(0, 2 * GiB)]
BARS = {
    GPU: {0: (0xC000_0000, 16 * MiB), 1: (0x80_0000_0000, 32 * GiB)},
    BETA_GPU: {0: (0xC100_0000, 16 * MiB), 1: (0x90_0000_0000, 32 * GiB)},
    NIC: {0: (0xC400_0000, 1 * MiB)},
}
BETA_PORT, ALPHA_PORT = "mxs824/beta:0", "mxs824/alpha:0"


def topology_text(entries: int | None = None) -> str:
    text, _source = default_topology_text()
    if entries is None:
        return text
    return text.replace('name = "mxs824"\n', f'name = "mxs824"\nrequester_entries = {entries}\n')


def hardware(entries: int | None = None, devices=(GPU, BETA_GPU)) -> SimHardware:
    hw = SimHardware.from_topology(parse_topology(topology_text(entries)))
    hw.create_guest("gamma", "web", RAM)
    for f in devices:
        hw.borrow(f, "gamma", "web")
        hw.device(f).config.write(regs.COMMAND, 2, regs.COMMAND_MEMORY | regs.COMMAND_MASTER)
    return hw


def program(p2p: P2PMapper, fdid: int) -> None:
    for index, (gpa, size) in BARS[fdid].items():
        p2p.program_bar(fdid, index, gpa, size)


def clean(hw: SimHardware) -> None:
    found = check_hardware(hw)
    assert not found, "\n".join(map(str, found))


def tables(hw: SimHardware) -> dict[str, dict]:
    return {p: hw.switch_ports.entries(p) for p in hw.switch_ports.ports()}


def test_a_crossing_between_lenders_holds_the_sources_entry_until_its_maps_go():
    hw = hardware()
    p2p = P2PMapper(hw, "gamma", "web")
    program(p2p, GPU)
    program(p2p, BETA_GPU)
    # alpha's GPU reaches beta's BARs through beta's port, and beta's GPU alpha's
    from_alpha, from_beta = (GPU, "p2p gamma/web from 0x10"), (BETA_GPU, "p2p gamma/web from 0x20")
    assert hw.switch_ports.entries(BETA_PORT)[ALPHA_GPU_REQ] == {(BETA_GPU, from_alpha[1])}
    assert hw.switch_ports.entries(ALPHA_PORT)[BETA_GPU_REQ] == {(GPU, from_beta[1])}
    # the borrows' own entries are the same entries, used by the crossings too
    assert hw.switch_ports.entries(ALPHA_PORT)[ALPHA_GPU_REQ] == {GPU, (BETA_GPU, from_alpha[1])}
    assert [(c.source, c.target) for c in p2p.crossings()] == [(GPU, BETA_GPU), (BETA_GPU, GPU)]
    clean(hw)
    p2p.program_bar(BETA_GPU, 0, 0, 16 * MiB)  # one BAR unassigned: the other still crossed
    assert ALPHA_GPU_REQ in hw.switch_ports.entries(BETA_PORT)
    p2p.remove_device(BETA_GPU)
    assert ALPHA_GPU_REQ not in hw.switch_ports.entries(BETA_PORT)
    assert BETA_GPU_REQ not in hw.switch_ports.entries(ALPHA_PORT)
    assert p2p.crossings() == []
    clean(hw)
    p2p.close()


def test_a_full_port_refuses_the_map_and_changes_nothing():
    hw = hardware(entries=2)
    hw.borrow(NIC, "alpha", "x")  # beta's NIC to a VM on alpha: beta's and alpha's ports full
    p2p = P2PMapper(hw, "gamma", "web")
    program(p2p, BETA_GPU)
    before, maps = tables(hw), p2p.maps()
    with pytest.raises(SwitchPortFullError) as e:
        program(p2p, GPU)  # each GPU must reach the other's BARs: no port has room
    assert str(e.value).startswith(
        f"switch mxs824 port {BETA_PORT}: its requester table is full (2 of 2 entries used),"
        f" no room for requester {ALPHA_GPU_REQ}"
    ) or str(e.value).startswith(
        f"switch mxs824 port {ALPHA_PORT}: its requester table is full (2 of 2 entries used),"
        f" no room for requester {BETA_GPU_REQ}"
    )
    assert tables(hw) == before and p2p.maps() == maps
    clean(hw)
    hw.give_back(NIC)  # room now
    program(p2p, GPU)
    assert ALPHA_GPU_REQ in hw.switch_ports.entries(BETA_PORT)
    assert BETA_GPU_REQ in hw.switch_ports.entries(ALPHA_PORT)
    clean(hw)
    p2p.close()
    assert tables(hw) == {
        ALPHA_PORT: {ALPHA_GPU_REQ: {GPU}},
        "mxs824/gamma:0": {ALPHA_GPU_REQ: {GPU}, BETA_GPU_REQ: {BETA_GPU}},
        BETA_PORT: {BETA_GPU_REQ: {BETA_GPU}},
    }


def test_the_checker_reports_a_crossing_of_devices_the_vm_does_not_both_borrow():
    hw = hardware(devices=(GPU,))
    path = hw.route("alpha", "beta")
    assert path is not None
    forged = P2PCrossing(GPU, BETA_GPU, "gamma", "web", path)
    hw.add_p2p_crossings(lambda: [forged])
    for port in (SwitchPort("mxs824", "alpha:0"), SwitchPort("mxs824", "beta:0")):
        hw.switch_ports.add([port], ALPHA_GPU_REQ, forged.user)
    found = [str(v) for v in check_hardware(hw) if v.kind == "port"]
    assert found == [
        "port peer-to-peer 0x10 -> 0x20: its crossing over alpha:0 -> beta:0 via mxs824 holds"
        " requester entries while gamma/web does not borrow both"
    ]


def test_the_entries_in_use_are_claimed_by_the_targets_hold(state_path):
    c = Cluster.create(state_path)
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
        assert check_with_registry(c.hw, c.registry) == []
        with c.registry.write() as tx:  # the P2P claims without the port entries
            mine = [(f, cl) for f, cl in tx.claims() if cl.kind is ClaimKind.P2P]
            ports = sorted((f, cl.adapter, cl.share) for f, cl in mine if is_port(cl.adapter))
            assert ports == [
                (GPU, ALPHA_PORT, f"req:{BETA_GPU_REQ}"),
                (GPU, BETA_PORT, f"req:{BETA_GPU_REQ}"),
                (BETA_GPU, ALPHA_PORT, f"req:{ALPHA_GPU_REQ}"),
                (BETA_GPU, BETA_PORT, f"req:{ALPHA_GPU_REQ}"),
            ]
            kept = [(f, cl) for f, cl in mine if not is_port(cl.adapter)]
            tx.replace_claims(ClaimKind.P2P, [GPU, BETA_GPU], kept)
        found = sorted(str(v) for v in check_with_registry(c.hw, c.registry) if v.kind == "claims")
        assert found == [
            f"claims {port}: requester entry req:{req} of {target:#x} in use, not claimed by"
            " its hold"
            for port, req, target in (
                (ALPHA_PORT, ALPHA_GPU_REQ, BETA_GPU),
                (ALPHA_PORT, BETA_GPU_REQ, GPU),
                (BETA_PORT, ALPHA_GPU_REQ, BETA_GPU),
                (BETA_PORT, BETA_GPU_REQ, GPU),
            )
        ]
        p2p.close()
    finally:
        c.close()


def test_admission_refuses_peer_to_peer_through_a_full_port_in_one_line(state_path):
    c = Cluster.create(state_path, topology_text(entries=2))
    try:
        c.fabric("alpha").reserve(NIC, Holder("alpha", "x"))  # beta's NIC: beta's, alpha's ports
        web = Holder("gamma", "web")
        c.fabric().reserve(BETA_GPU, web)  # beta's port full: beta's GPU and NIC
        with c.registry.read() as tx:
            before = tx.claims()
        with pytest.raises(SwitchPortFullError) as e:
            c.fabric().reserve(GPU, web)  # its own route has room; peer-to-peer has not
        message = str(e.value)
        assert "\n" not in message
        assert message.startswith(
            f"switch mxs824 port {ALPHA_PORT}: its requester table is full (2 of 2 entries"
            f" used), no room for requester {BETA_GPU_REQ}"
        )
        with c.registry.read() as tx:
            assert tx.claims() == before
        c.fabric("alpha").release(NIC, Holder("alpha", "x"))
        c.fabric().reserve(GPU, web)
    finally:
        c.close()
