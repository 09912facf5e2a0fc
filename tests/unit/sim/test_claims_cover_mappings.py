"""Admission claims what the simulated fabric maps: DMA windows exactly, peer-to-peer segments
and LUT entries at most (issue 10, part 3 leftovers)."""

from __future__ import annotations

import pytest

from tests.support.simcluster import Cluster, domain_xml
from vmlend.errors import ResourceExhaustedError
from vmlend.ledger.admission import usage
from vmlend.sim.dmawin import RegistryWindowLedger
from vmlend.sim.invariants import check_hardware
from vmlend.sim.p2pmap import P2PMapper, registry_recorder
from vmlend.sim.simvm import SimVm
from vmlend.topology.model import GiB, Holder
from vmlend.wiring.fabric import default_topology_text

ALPHA_GPU, ALPHA_GPU2, BETA_GPU = 0x10, 0x11, 0x20


def _vm(c: Cluster, name: str, xml: bytes, node: str = "gamma") -> SimVm:
    ledger = RegistryWindowLedger(c.registry)
    p2p = P2PMapper(c.hw, node, name, recorder=registry_recorder(c.registry), promises=ledger)
    return SimVm(xml, hardware=c.hw, fabric=c.fabric(node), ledger=ledger, p2p=p2p, backing=GiB)


def _run(c: Cluster, name: str, fdids: tuple[int, ...], node: str = "gamma") -> SimVm:
    xml = domain_xml(name, 1 * GiB, fdids=fdids)
    c.prepare(xml, node)
    vm = _vm(c, name, xml, node)
    for fdid in fdids:
        vm.enable_device(fdid)
    return vm


def test_lut_entries_of_p2p_between_two_lenders_are_claimed(cluster):
    # the beta GPU reaches the alpha GPU's BARs through alpha's adapter, which must name it in
    # its LUT (and the other way round): admission claims those entries too
    _run(cluster, "web", (ALPHA_GPU, BETA_GPU))
    claims = cluster.claims()
    claimed = usage(cluster.hw.topology, claims)
    for adapter in cluster.hw.adapters():
        assert adapter.lut_used <= claimed[adapter.ref].lut_used, adapter.ref
    assert check_hardware(cluster.hw, holds=cluster.fabric().holds(), claims=claims) == []


ALPHA_NVME, BETA_NIC = 0x12, 0x21


def _small_alpha_window(state_path) -> Cluster:
    # alpha's adapter: 32 segments of 128 MiB, so a few GiB of guest RAM fill it
    text, _ = default_topology_text()
    head, alpha, rest = text.partition('name = "alpha"')
    rest = rest.replace('window = "128GiB"', 'window = "4GiB"', 1)
    return Cluster.create(state_path, head + alpha + rest)


def test_promised_p2p_segments_are_kept_from_other_vms_windows(state_path):
    c = _small_alpha_window(state_path)
    try:
        # VM a is admitted with its DMA windows (8 segments of alpha:0) and peer-to-peer from
        # the NVMe towards the NIC's two BARs (2 more), and has not enabled anything yet
        xml_a = domain_xml("a", 1 * GiB, fdids=(ALPHA_NVME, BETA_NIC))
        c.prepare(xml_a)
        # VM b was reserved without its RAM (no window claim): its windows may only take
        # what nobody was promised, 32 - 8 - 2 = 22 segments, and it needs 24
        c.fabric().reserve(0x11, Holder("gamma", "b"), guest_ram=0)
        xml_b = domain_xml("b", 3 * GiB, fdids=(0x11,))
        c.prepare(xml_b)
        b = _vm(c, "b", xml_b)
        with pytest.raises(ResourceExhaustedError, match="alpha:0"):
            b.enable_device(0x11)
        assert not c.hw.adapter("alpha:0").mapped_segments()
        # so a gets everything it was promised, peer-to-peer included
        a = _vm(c, "a", xml_a)
        for fdid in (ALPHA_NVME, BETA_NIC):
            a.enable_device(fdid)
        assert isinstance(a.p2p, P2PMapper)
        assert {(m.source, m.target) for m in a.p2p.maps()} >= {(ALPHA_NVME, BETA_NIC)}
        assert check_hardware(c.hw, holds=c.fabric().holds(), claims=c.claims()) == []
    finally:
        c.close()
