"""The guest side of the NVMe tests: the guest's view of its controller's BAR0 and its RAM, for
``vmlend.nvme.driver.NvmeDriver`` acting as the guest's unmodified driver."""

from __future__ import annotations

from vmlend.fabric.model import MiB
from vmlend.fabric.sim.guest import SimGuest
from vmlend.fabric.sim.simvm import SimVm
from vmlend.nvme.driver import BumpAllocator, NvmeDriver


class VmBar0:
    """BAR0 of ``fdid`` as the guest CPU reaches it (its guest-physical BAR address)."""

    def __init__(self, vm: SimVm, fdid: int) -> None:
        self.vm = vm
        self.base = next(b.address for b in vm.bars(fdid) if b.index == 0)

    def read(self, offset: int, size: int) -> int:
        return self.vm.mmio_read(self.base + offset, size)

    def write(self, offset: int, size: int, value: int) -> None:
        self.vm.mmio_write(self.base + offset, size, value)


def guest_driver(mmio, guest: SimGuest, start: int = 16 * MiB, size: int = 16 * MiB) -> NvmeDriver:
    """A driver whose queues and buffers live in guest RAM [start, start + size)."""
    return NvmeDriver(mmio, guest, BumpAllocator(start, start + size))


SHARED_NVME = 0x40


def share_topology(borrowers: int = 2, bar0: str = "64KiB", vectors: int = 64) -> str:
    """A lender ``store`` with an NVMe drive (fdid 0x40) whose BAR0 has doorbell pages to spare
    (MSI-X in BAR 4) and ``borrowers`` nodes b1.. on one switch."""
    nodes = "\n".join(
        f"""
[[node]]
name = "b{i}"
id = {i + 1}
ram = "8GiB"
  [[node.adapter]]
  index = 0
"""
        for i in range(1, borrowers + 1)
    )
    msix = (
        f"{{ vectors = {vectors}, table_bar = 4, table_offset = 0, pba_bar = 4, "
        "pba_offset = 0x2000 }"
    )
    ports = ", ".join(['"store:0"', *(f'"b{i}:0"' for i in range(1, borrowers + 1))])
    return f"""
name = "nvme-share"
[[node]]
name = "store"
id = 1
ram = "16GiB"
  [[node.adapter]]
  index = 0
  [[node.device]]
  fdid = {SHARED_NVME}
  bdf = "0000:05:00.0"
  kind = "nvme"
  vendor = 0x144d
  device = 0xa80a
  class = 0x010802
  bars = [ {{ index = 0, size = "{bar0}", kind = "mem64" }},
           {{ index = 4, size = "16KiB", kind = "mem64" }} ]
  msix = {msix}
{nodes}
[[switch]]
name = "sw"
ports = [{ports}]
"""
