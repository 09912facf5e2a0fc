"""Helpers for tests of the simulated fabric: small topologies and opened fabrics."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

from vmlend.sim.backend import SimFabric
from vmlend.wiring.fabric import Location, default_topology_text, init_fabric, open_fabric


@functools.lru_cache(maxsize=32)
def _fresh_state(text: str, source: str, node: str | None) -> bytes:
    """The bytes of a new SQLite state holding ``text``, made by ``init_fabric`` once per
    process: parsing and compiling the topology and creating the schema took ~15 ms a state,
    and a few hundred tests start from the same one. (A closed state is one self-contained
    file; each test writes its own copy.)"""
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "state.db"
        init_fabric(path, text, source, node=node, hostname="test-host")
        return path.read_bytes()


def make_fabric(path: Location, text: str | None = None, node: str | None = "gamma") -> SimFabric:
    """Initialise the registry at ``path`` (a path or registry URL) with ``text`` (default
    cluster when None) and open it as ``node``. A new state file is a copy of one
    ``init_fabric`` made for the same topology and node; an existing state or a registry URL
    goes through ``init_fabric`` itself."""
    if text is None:
        text, source = default_topology_text()
    else:
        source = "test.toml"
    if isinstance(path, Path) and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_fresh_state(text, source, node))
    else:
        init_fabric(path, text, source, node=node, hostname="test-host")
    fabric = open_fabric(path, node)
    assert isinstance(fabric, SimFabric)
    return fabric


def small_topology(
    *,
    lut_entries: int = 32,
    borrower_lut_entries: int = 32,
    lender_window: str = "128GiB",
    lender_segments: int = 32,
    borrower_window: str = "128GiB",
    borrower_segments: int = 32,
    devices: int = 3,
    bars: str = '[ { index = 0, size = "16MiB" } ]',
    isolated: bool = False,
) -> str:
    """One lender ``l`` with ``devices`` devices (fdid 0x100...) and a borrower ``b``; with
    ``isolated`` a third node ``x`` that no cable reaches."""
    devs = "\n".join(
        f"""
  [[node.device]]
  fdid = {0x100 + i}
  bdf = "0000:0{i + 1}:00.0"
  kind = "nic"
  vendor = 0x8086
  device = 0x1521
  class = 0x020000
  bars = {bars}
"""
        for i in range(devices)
    )
    extra = (
        """
[[node]]
name = "x"
id = 3
  [[node.adapter]]
  index = 0
"""
        if isolated
        else ""
    )
    return f"""
name = "small"
[[node]]
name = "l"
id = 1
  [[node.adapter]]
  index = 0
  window = "{lender_window}"
  segments = {lender_segments}
  lut_entries = {lut_entries}
{devs}
[[node]]
name = "b"
id = 2
  [[node.adapter]]
  index = 0
  window = "{borrower_window}"
  segments = {borrower_segments}
  lut_entries = {borrower_lut_entries}
{extra}
[[link]]
ends = ["l:0", "b:0"]
"""


def star_topology(
    borrowers: int,
    devices: int,
    *,
    lut_entries: int = 32,
    lender_window: str = "128GiB",
    lender_segments: int = 32,
) -> str:
    """One lender ``l`` with ``devices`` devices (fdid 0x100...) and ``borrowers`` borrower
    nodes ``h0``, ``h1``, ... all on one switch: many hosts contending for one adapter."""
    devs = "".join(
        f"""
  [[node.device]]
  fdid = {0x100 + i}
  bdf = "0000:{i // 32 + 1:02x}:{i % 32:02x}.0"
  kind = "nic"
  vendor = 0x8086
  device = 0x1521
  class = 0x020000
  bars = [ {{ index = 0, size = "16MiB" }} ]
"""
        for i in range(devices)
    )
    hosts = "".join(
        f"""
[[node]]
name = "h{i}"
id = {10 + i}
  [[node.adapter]]
  index = 0
"""
        for i in range(borrowers)
    )
    ports = ", ".join(['"l:0"'] + [f'"h{i}:0"' for i in range(borrowers)])
    return f"""
name = "star"
[[node]]
name = "l"
id = 1
  [[node.adapter]]
  index = 0
  window = "{lender_window}"
  segments = {lender_segments}
  lut_entries = {lut_entries}
{devs}
{hosts}
[[switch]]
name = "sw"
ports = [{ports}]
"""


def fabric_topology(nodes: int, devices_per_node: int) -> str:
    """A generated fabric of ``nodes`` nodes ``n0``, ``n1``, ... each lending
    ``devices_per_node`` devices (fdid ``node * 0x100 + i``), all on one switch: the shape of
    the 60-node, ~1,000-device cluster of the scaling benchmark. Adapters have 64 LUT entries
    and 64 segments so that each node may lend and borrow ~17 devices through one adapter."""
    parts = ['name = "generated"']
    for n in range(nodes):
        parts.append(
            f'[[node]]\nname = "n{n}"\nid = {n + 1}\n  [[node.adapter]]\n  index = 0\n'
            "  lut_entries = 64\n  segments = 64\n"
        )
        for i in range(devices_per_node):
            parts.append(
                f"  [[node.device]]\n  fdid = {(n + 1) * 0x100 + i}\n"
                f'  bdf = "0000:{i // 32 + 1:02x}:{i % 32:02x}.0"\n  kind = "nic"\n'
                "  vendor = 0x8086\n  device = 0x1521\n  class = 0x020000\n"
                '  bars = [ { index = 0, size = "16MiB" } ]\n'
            )
    ports = ", ".join(f'"n{n}:0"' for n in range(nodes))
    parts.append(f'[[switch]]\nname = "sw"\nports = [{ports}]\n')
    return "\n".join(parts)


def two_cable_topology() -> str:
    """Lender ``l`` with an NVMe drive (fdid 0x12, as in the default cluster) and two adapters,
    each cabled back to back to one of borrower ``b``'s two: ``l:0-b:0`` and ``l:1-b:1`` are
    two paths that share no adapter, so a dead cable leaves its path no detour."""
    return """
name = "two-cables"
[[node]]
name = "l"
id = 1
  [[node.adapter]]
  index = 0
  [[node.adapter]]
  index = 1
  [[node.device]]
  fdid = 0x12
  bdf = "0000:43:00.0"
  kind = "nvme"
  vendor = 0x8086
  device = 0x0a54
  class = 0x010802
  bars = [ { index = 0, size = "16KiB", kind = "mem64" } ]
  msi = { vectors = 32, bits64 = true, maskable = true }
  msix = { vectors = 32, table_bar = 0, table_offset = 0x2000, pba_bar = 0, pba_offset = 0x3000 }
[[node]]
name = "b"
id = 2
  [[node.adapter]]
  index = 0
  [[node.adapter]]
  index = 1
[[link]]
ends = ["l:0", "b:0"]
[[link]]
ends = ["l:1", "b:1"]
"""


def ports_topology(*, requester_entries: int | None = None, borrower_lut_entries: int = 32) -> str:
    """Two lenders and two borrowers on cluster switch ``sw`` (with ``requester_entries`` per
    port when given), the borrower ``b`` also on ``sw2``, cascaded to ``sw``: a second route.

    ``l1`` lends NIC 0x100 at 0000:41:00.0 with 9 VFs 0x101..0x109 (functions 1..9 of it,
    ARI-style: 0x101..0x107 are 41:00.1..41:00.7, 0x108 and 0x109 are 41:01.0 and 41:01.1)
    and GPU 0x110 at 0000:42:00.0; ``l2`` lends GPU 0x200 at 0000:41:00.0 (alpha's BDF on
    another host: another requester). ``b`` has adapters b:0 (on ``sw``, with
    ``borrower_lut_entries``) and b:1 (on ``sw2``); ``c`` has c:0 on ``sw``."""
    entries = "" if requester_entries is None else f"requester_entries = {requester_entries}\n"
    gpu = """
  kind = "gpu"
  vendor = 0x10de
  device = 0x1db4
  class = 0x030200
  bars = [ { index = 0, size = "16MiB" } ]
"""
    return f"""
name = "ports"
[[node]]
name = "l1"
id = 1
  [[node.adapter]]
  index = 0
  [[node.device]]
  fdid = 0x100
  bdf = "0000:41:00.0"
  kind = "nic"
  vendor = 0x8086
  device = 0x1521
  class = 0x020000
  bars = [ {{ index = 0, size = "1MiB" }} ]
    [node.device.sriov]
    vfs = 9
    first_fdid = 0x101
    device = 0x1520
    bars = [ {{ index = 0, size = "16KiB", kind = "mem64" }} ]
  [[node.device]]
  fdid = 0x110
  bdf = "0000:42:00.0"
{gpu}
[[node]]
name = "l2"
id = 2
  [[node.adapter]]
  index = 0
  [[node.device]]
  fdid = 0x200
  bdf = "0000:41:00.0"
{gpu}
[[node]]
name = "b"
id = 3
  [[node.adapter]]
  index = 0
  lut_entries = {borrower_lut_entries}
  [[node.adapter]]
  index = 1
[[node]]
name = "c"
id = 4
  [[node.adapter]]
  index = 0

[[switch]]
name = "sw"
{entries}ports = ["l1:0", "l2:0", "b:0", "c:0"]

[[switch]]
name = "sw2"
ports = ["b:1"]

[[switch_link]]
ends = ["sw", "sw2"]
"""
