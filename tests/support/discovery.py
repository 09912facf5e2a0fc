"""Hosts as a SmartIO driver describes them, for the tests of ``vmlend fabric discover``: small
builders of ``FoundHost`` and a two-node topology with a back-to-back cable and a switch."""

from __future__ import annotations

from vmlend.topology.discovered import FoundAdapter, FoundDevice, FoundHost
from vmlend.topology.model import BarKind, BarSpec

GiB = 1 << 30

#: Two hosts: ``a`` (node 1) lends an NVMe drive, ``b`` (node 2) lends nothing; ``a:0`` and
#: ``b:0`` are cabled back to back, ``b:1`` sits on switch ``sw`` alone.
TWO_HOSTS = """
name = "two"
[[node]]
name = "a"
id = 1
hostname = "a.example"
  [[node.adapter]]
  index = 0
  [[node.device]]
  fdid = 0x10
  bdf = "0000:41:00.0"
  kind = "nvme"
  vendor = 0x8086
  device = 0x0a54
  class = 0x010802
  bars = [ { index = 0, size = "16KiB", kind = "mem64" } ]
  msix = { vectors = 32, table_bar = 0, table_offset = 0x2000, pba_bar = 0, pba_offset = 0x3000 }
[[node]]
name = "b"
id = 2
  [[node.adapter]]
  index = 0
  [[node.adapter]]
  index = 1
[[link]]
ends = ["a:0", "b:0"]
[[switch]]
name = "sw"
ports = ["b:1"]
"""

NVME_BARS = (BarSpec(0, 16 << 10, BarKind.MEM64),)


def adapter(
    index: int = 0,
    *,
    model: str = "PXH830",
    window_size: int = 128 * GiB,
    segments: int = 32,
    lut_entries: int = 32,
    link_up: bool = True,
    peer: tuple[int, int] | None = None,
    switch_port: int | None = None,
) -> FoundAdapter:
    return FoundAdapter(
        index, model, window_size, segments, lut_entries, link_up, peer, switch_port
    )


def device(
    fdid: int,
    bdf: str = "0000:41:00.0",
    *,
    kind: str = "nvme",
    vendor: int = 0x8086,
    device_id: int = 0x0A54,
    class_code: int = 0x010802,
    dma_bits: int = 64,
    bars: tuple[BarSpec, ...] = NVME_BARS,
    physfn: int | None = None,
    lent: bool = True,
    adapter_index: int = 0,
) -> FoundDevice:
    return FoundDevice(
        fdid, adapter_index, bdf, kind, vendor, device_id, class_code, dma_bits, bars, physfn,
        lent,
    )  # fmt: skip


def host(
    node_id: int,
    adapters: tuple[FoundAdapter, ...] = (),
    devices: tuple[FoundDevice, ...] = (),
    *,
    hostname: str = "newhost.example",
    ram: int | None = 256 * GiB,
) -> FoundHost:
    return FoundHost(node_id, hostname, adapters, devices, ram)


#: Host ``a`` exactly as TWO_HOSTS has it: merging it changes nothing.
HOST_A = host(
    1,
    (adapter(0, peer=(2, 0)),),
    (device(0x10),),
    hostname="a.example",
)
