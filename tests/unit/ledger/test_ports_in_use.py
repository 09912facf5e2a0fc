"""``ports_in_use`` (what ``vmlend status`` shows per switch port): one requester entry per
requester on a port however many holds, and whichever kind (a crossing's LUT claim,
peer-to-peer's P2P claim), claim it; adapters are not ports."""

from __future__ import annotations

from vmlend.ledger.admission import PortUsage, ports_in_use
from vmlend.registry import Claim, ClaimKind
from vmlend.topology.parse import parse_topology
from vmlend.wiring.fabric import default_topology_text


def test_a_requester_counts_once_per_port_whoever_claims_it():
    text, _source = default_topology_text()
    eight = 'name = "mxs824b"\nrequester_entries = 8\n'
    topo = parse_topology(text.replace('name = "mxs824b"\n', eight))
    gpu, beta = "req:alpha/0000:41:00", "req:beta/0000:81:00"
    claims = [
        (0x10, Claim("mxs824/alpha:0", ClaimKind.LUT, gpu, entries=1)),
        (0x11, Claim("mxs824/alpha:0", ClaimKind.LUT, gpu, entries=1)),  # another function
        (0x20, Claim("mxs824/alpha:0", ClaimKind.P2P, gpu, entries=1)),  # P2P, as the target
        (0x10, Claim("mxs824/alpha:0", ClaimKind.P2P, beta, entries=1)),
        (0x20, Claim("mxs824b/gamma:1", ClaimKind.LUT, beta, entries=1)),
        (0x10, Claim("alpha:0", ClaimKind.LUT, gpu, entries=1)),  # an adapter: not a port
        (0x10, Claim("mxs824/gamma:0", ClaimKind.DMA, "vm:gamma/web", segments=1)),
    ]
    assert ports_in_use(topo, claims) == [
        PortUsage("mxs824", "mxs824/alpha:0", 2, 256),
        PortUsage("mxs824b", "mxs824b/gamma:1", 1, 8),
    ]
