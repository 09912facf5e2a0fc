"""A small cluster for NVMe sharing tests, bench and docs: a drive whose BAR0 has doorbell
pages to spare (the default cluster's 0x12 has one, so its shares trap their doorbells), and
with ``paths=2`` two adapters on every node, one per cluster switch (``sw`` and ``sw2``), so a
two-path share's primary and backup paths share no adapter and no switch."""

from __future__ import annotations

#: fdid of the drive in ``sharing_topology``.
SHARED_NVME = 0x40


def sharing_topology(
    borrowers: int = 2, bar0: str = "64KiB", vectors: int = 64, paths: int = 1
) -> str:
    """A lender ``store`` with an NVMe drive (fdid 0x40) whose BAR0 has doorbell pages to spare
    (MSI-X in BAR 4) and ``borrowers`` nodes b1.. on one switch (``paths=2``: each node's
    second adapter on a second switch, ``sw2``)."""
    adapters = "".join(f"\n  [[node.adapter]]\n  index = {a}" for a in range(paths))
    nodes = "\n".join(
        f"""
[[node]]
name = "b{i}"
id = {i + 1}
ram = "8GiB"{adapters}
"""
        for i in range(1, borrowers + 1)
    )
    msix = (
        f"{{ vectors = {vectors}, table_bar = 4, table_offset = 0, pba_bar = 4, "
        "pba_offset = 0x2000 }"
    )
    switches = ""
    for a in range(paths):
        ports = ", ".join([f'"store:{a}"', *(f'"b{i}:{a}"' for i in range(1, borrowers + 1))])
        name = "sw" if a == 0 else f"sw{a + 1}"
        switches += f'\n[[switch]]\nname = "{name}"\nports = [{ports}]\n'
    return f"""
name = "nvme-share"
[[node]]
name = "store"
id = 1
ram = "16GiB"{adapters}
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
{nodes}{switches}"""
