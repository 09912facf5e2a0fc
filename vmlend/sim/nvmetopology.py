"""A small cluster for NVMe sharing tests, bench and docs: a drive whose BAR0 has doorbell
pages to spare (the default cluster's 0x12 has one, so its shares trap their doorbells)."""

from __future__ import annotations

#: fdid of the drive in ``sharing_topology``.
SHARED_NVME = 0x40


def sharing_topology(borrowers: int = 2, bar0: str = "64KiB", vectors: int = 64) -> str:
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
