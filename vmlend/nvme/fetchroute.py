"""The route a shared drive's command fetch takes (pure): ``vmlend nvme path`` and the NVMe
share bench show it.

A fetch is the drive reading a 64-byte entry of a submission queue: a read, so it pays its
route twice (the request out, the data back). From a queue in guest RAM on another node that
is the drive's DMA path into the VM's RAM across the NTB (``vmlend path FDID NODE``: 11 hops
to gamma on the default fabric). From a queue in the drive's controller memory buffer (lender
memory, ``vmlend.nvme.cmb``) it is the path into the lender's own RAM: no NTB crossed. The
completion is a posted write into guest RAM either way (one way, same route), and with the
queue in the CMB the guest's command write becomes a posted write across the NTB that travels
ahead of its doorbell write on the same route.
"""

from __future__ import annotations

import msgspec

from vmlend.topology.model import Topology
from vmlend.topology.pcie import PciePath, device_to_ram

GUEST_RAM = "guest-ram"
CMB = "cmb"


class FetchRoute(msgspec.Struct, frozen=True):
    """Where a share's submission queues are (``sq``: ``GUEST_RAM`` or ``CMB``), the route of
    a command fetch and of its completion."""

    fdid: int
    node: str
    sq: str
    fetch: PciePath
    completion: PciePath

    @property
    def fetch_ns(self) -> int:
        """A fetch's cost on the way: its route there and back (a read)."""
        return 2 * self.fetch.latency_ns

    def to_json(self) -> dict[str, object]:
        return {
            "fdid": f"{self.fdid:#x}",
            "node": self.node,
            "sq": self.sq,
            "fetch": {**self.fetch.to_json(), "round_trip_ns": self.fetch_ns},
            "completion": self.completion.to_json(),
        }


def fetch_route(topology: Topology, fdid: int, node: str, in_cmb: bool) -> FetchRoute:
    """The fetch route of a share of drive ``fdid`` by a VM on ``node``, its submission
    queues in the drive's CMB (``in_cmb``) or in the VM's RAM."""
    lender = topology.device(fdid).lender
    fetch = device_to_ram(topology, fdid, lender if in_cmb else node)
    completion = device_to_ram(topology, fdid, node)
    return FetchRoute(fdid, node, CMB if in_cmb else GUEST_RAM, fetch, completion)
