"""Admission claims what the simulated fabric maps: DMA windows exactly, peer-to-peer segments
and LUT entries at most (issue 10, part 3 leftovers)."""

from __future__ import annotations

import pytest

from tests.test_simvm import Cluster, domain_xml
from vmlend.fabric.admission import usage
from vmlend.fabric.model import GiB
from vmlend.fabric.sim.dmawin import RegistryWindowLedger
from vmlend.fabric.sim.invariants import check_hardware
from vmlend.fabric.sim.p2pmap import P2PMapper, registry_recorder
from vmlend.fabric.sim.simvm import SimVm

ALPHA_GPU, ALPHA_GPU2, BETA_GPU = 0x10, 0x11, 0x20


@pytest.fixture
def cluster(state_path):
    c = Cluster.create(state_path)
    yield c
    c.close()


def _run(c: Cluster, name: str, fdids: tuple[int, ...], node: str = "gamma") -> SimVm:
    xml = domain_xml(name, 1 * GiB, fdids=fdids)
    c.prepare(xml, node)
    p2p = P2PMapper(c.hw, node, name, recorder=registry_recorder(c.registry))
    vm = SimVm(
        xml,
        hardware=c.hw,
        fabric=c.fabric(node),
        ledger=RegistryWindowLedger(c.registry),
        p2p=p2p,
        backing=GiB,
    )
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
        assert len(adapter.lut()) <= claimed[adapter.ref].lut_used, adapter.ref
    assert check_hardware(cluster.hw, holds=cluster.fabric().holds(), claims=claims) == []
