"""A release counts the peer-to-peer claims of the VM's devices left anew; it never moves them
onto a route admission did not check. A discover may add a cheaper cable between two lenders
after admission: the pairs' maps stay on the route they were made on, so their claims stay
there too (P2P claims are an upper bound), until the VM's holds go."""

from __future__ import annotations

import pytest

from tests.support.daemon_marks import REGISTRIES
from tests.support.discovery import adapter, host
from tests.support.simfabric import make_fabric
from vmlend.registry import ClaimKind, open_registry
from vmlend.topology.model import GiB, Holder
from vmlend.wiring.discover import discover_fabric
from vmlend.wiring.fabric import open_fabric

GPU, BETA_GPU, NIC = 0x10, 0x20, 0x21  # alpha's GPU; beta's GPU and NIC
WEB = Holder("gamma", "web")


@pytest.fixture(params=REGISTRIES)
def location(request, tmp_path):
    if request.param == "etcd":
        return request.getfixturevalue("etcd_url")
    return tmp_path / "s.db"


def p2p(location, owners=(GPU, BETA_GPU, NIC)):
    reg = open_registry(location)
    try:
        with reg.read() as tx:
            return sorted(
                (f, c.adapter, c.share, c.segments, c.entries)
                for f, c in tx.claims()
                if c.kind is ClaimKind.P2P and f in owners
            )
    finally:
        reg.close()


def three_devices(location):
    with make_fabric(location) as fabric:
        for f in (GPU, BETA_GPU, NIC):
            fabric.reserve(f, WEB, guest_ram=2 * GiB)


def cable_alpha_to_beta(location):
    """alpha:1 and beta:1, cabled back to back: cheaper than the cluster switch."""
    for node, peer, name in ((4, 8, "alpha"), (8, 4, "beta")):
        found = host(node, (adapter(1, peer=(peer, 1)),), hostname=f"{name}.fabric.local")
        assert discover_fabric(location, found).action == "merged"


def release(location, fdid):
    with open_fabric(location, "gamma") as fabric:
        assert fabric.release(fdid, WEB)


def on(claims, *adapters):
    return [c for c in claims if c[1] in adapters]


def test_a_release_after_a_new_cable_keeps_the_pairs_claims_on_their_admitted_route(location):
    three_devices(location)
    before = p2p(location, (GPU, BETA_GPU))
    cable_alpha_to_beta(location)
    release(location, NIC)
    after = p2p(location)
    assert on(after, "alpha:1", "beta:1") == []  # never admitted there
    assert after == before  # an upper bound: the NIC's pairs' part goes with the VM's holds
    release(location, BETA_GPU)  # one device left: no pair, no claim, whatever the routes
    assert p2p(location) == []


def test_a_release_on_unchanged_routes_drops_exactly_the_pairs_of_the_device_gone(location):
    three_devices(location)
    before = p2p(location, (GPU, BETA_GPU))
    release(location, NIC)
    after = p2p(location)
    assert after and set(after) < set(before)
    assert not [c for c in after if "0x21" in c[2] or "0000:82:00" in c[2]]  # the NIC's
    with make_fabric(location) as fabric:  # the same two alone count the same claims
        fabric.release(GPU, WEB)
        fabric.release(BETA_GPU, WEB)
        for f in (GPU, BETA_GPU):
            fabric.reserve(f, WEB, guest_ram=2 * GiB)
    assert p2p(location) == after
