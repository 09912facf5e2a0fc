"""What a host's SmartIO driver says about the host itself (docs/smartio-contract.md, section 1,
"This host's NTB adapters", and section 2 for its devices), as plain data.

``vmlend.kernel.discover`` reads it from sysfs; ``vmlend.topology.merge`` merges it into a
topology. No I/O here.
"""

from __future__ import annotations

import msgspec

from vmlend.topology.model import BarSpec


class FoundAdapter(msgspec.Struct, frozen=True):
    """One NTB adapter of this host, and what its cable leads to."""

    index: int
    model: str
    window_size: int  # bytes
    segments: int
    lut_entries: int
    link_up: bool
    #: The adapter at the other end of a back-to-back cable: (node id, adapter index).
    peer: tuple[int, int] | None = None
    #: The port of the cluster switch the cable leads to (the switch's wiring is not seen).
    switch_port: int | None = None


class FoundDevice(msgspec.Struct, frozen=True):
    """One device installed in this host, as the driver lists it."""

    fdid: int
    adapter: int  # the lender adapter it is reached through (``lender_adapter``)
    bdf: str
    kind: str  # from the class code ("nvme", "gpu", ...), "vf" for an SR-IOV VF
    vendor_id: int
    device_id: int
    class_code: int
    dma_bits: int
    bars: tuple[BarSpec, ...]
    physfn: int | None
    lent: bool  # ``available`` (lent) rather than ``unlent``


class FoundHost(msgspec.Struct, frozen=True):
    """This host as its driver describes it."""

    node_id: int
    hostname: str
    adapters: tuple[FoundAdapter, ...] = ()
    devices: tuple[FoundDevice, ...] = ()
    ram: int | None = None  # bytes (``MemTotal``); None: not known
    #: Devices of other nodes the driver lists: each host describes its own.
    remote_devices: int = 0
    #: One line per device directory the driver describes unsoundly (left out).
    damaged: tuple[str, ...] = ()
