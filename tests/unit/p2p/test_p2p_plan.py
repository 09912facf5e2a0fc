"""Peer-to-peer planning (vmlend.p2p): pure, no hardware."""

from __future__ import annotations

import json

import pytest

from vmlend.errors import BarConflictError, NoPathError, P2PError, UnknownNodeError
from vmlend.p2p import (
    BORROWER_LOCAL,
    OTHER_LENDER,
    SAME_LENDER,
    GuestBar,
    PeerBar,
    PeerDevice,
    check_guest_bars,
    peer_device,
    plan_p2p,
)
from vmlend.topology.model import BarKind, GiB, GuestRange, MiB
from vmlend.topology.parse import load_topology, parse_topology
from vmlend.topology.pcie import device_to_device

RAM = [GuestRange(0, 2 * GiB), GuestRange(4 * GiB, 8 * GiB)]
HI = 0x80_0000_0000  # 512 GiB: where a guest with 4 GiB of high RAM puts 64-bit BARs


def gpu(fdid: int, lender: str, host: int = 0x100_0000_0000, slot: str | None = None) -> PeerDevice:
    return PeerDevice(
        fdid,
        lender,
        (
            PeerBar(0, 16 * MiB, BarKind.MEM32, 0x8000_0000 + fdid * 16 * MiB),
            PeerBar(1, 32 * GiB, BarKind.MEM64, host),
            PeerBar(3, 32 * MiB, BarKind.MEM64, host + 32 * GiB),
        ),
        dma_bits=40,
        slot=slot,
    )


def gpu_bars(fdid: int, slot: int) -> list[GuestBar]:
    """Where a guest would put a GPU's BARs: slot ``slot`` of the 32-bit and 64-bit holes."""
    return [
        GuestBar(fdid, 0, 0xC000_0000 + slot * 16 * MiB, 16 * MiB),
        GuestBar(fdid, 1, HI + slot * 64 * GiB, 32 * GiB),
        GuestBar(fdid, 3, HI + slot * 64 * GiB + 32 * GiB, 32 * MiB),
    ]


@pytest.fixture(scope="module")
def topo():
    return load_topology()


PLACES = ((0x10, "alpha"), (0x11, "alpha"), (0x20, "beta"))


def three_gpus():
    # in the default topology's expansion chassis, as peer_device takes them from it
    devices = [gpu(f, lender, slot="chassis1") for f, lender in PLACES]
    bars = gpu_bars(0x10, 0) + gpu_bars(0x11, 1) + gpu_bars(0x20, 2)
    return devices, bars


def test_every_ordered_pair_gets_every_memory_bar_of_the_other(topo):
    devices, bars = three_gpus()
    plan = plan_p2p(topo, "gamma", devices, bars, RAM)
    assert len(plan.maps) == 3 * 2 * 3  # sources x other devices x BARs
    assert not plan.skipped
    got = {(m.source, m.target, m.bar) for m in plan.maps}
    assert (0x10, 0x10, 1) not in got  # never to itself
    assert (0x20, 0x11, 3) in got
    m = next(m for m in plan.maps if (m.source, m.target, m.bar) == (0x10, 0x20, 1))
    assert (m.iova, m.size) == (HI + 2 * 64 * GiB, 32 * GiB)  # IOVA = the guest-physical BAR
    assert m.target_phys == devices[2].bar(1).host


def test_same_lender_turns_at_one_root(topo):
    devices, bars = three_gpus()
    m = next(m for m in plan_p2p(topo, "gamma", devices, bars).maps if m.target == 0x11)
    assert m.source == 0x10 and m.case == SAME_LENDER and m.path is None
    chassis = ("chassis1 switch", "chassis1 link adapter", "host link adapter to chassis1")
    assert m.route == (
        "device 0x10",
        *chassis,
        "alpha root complex via rp1",
        *chassis[::-1],
        f"device 0x11 BAR{m.bar}",
    )
    # the papers' local VM P2P (Table 2), the count `vmlend path 0x10 0x11` gives
    assert (m.hops, m.roots, m.ntb_crossings, m.added_ns) == (7, 1, 0, 0)
    assert m.hops == device_to_device(topo, 0x10, 0x11).hops


def test_other_lender_crosses_the_ntb_between_the_lenders(topo):
    devices, bars = three_gpus()
    plan = plan_p2p(topo, "gamma", devices, bars)
    m = next(m for m in plan.maps if (m.source, m.target) == (0x10, 0x20))
    assert m.case == OTHER_LENDER
    assert m.path is not None and m.path.describe() == "alpha:0 -> beta:0 via mxs824"
    assert "alpha root complex via rp1 -> " in m.describe()
    assert " -> alpha:0 -> mxs824 -> beta:0 -> " in m.describe()
    assert m.describe().endswith("chassis1 switch -> device 0x20 BAR" + str(m.bar))
    assert (m.hops, m.roots, m.ntb_crossings) == (17, 2, 1)
    assert (m.hops, m.roots) == (lambda p: (p.hops, p.roots))(device_to_device(topo, 0x10, 0x20))
    assert 350 <= m.added_ns <= 370
    back = next(m for m in plan.maps if (m.source, m.target) == (0x20, 0x10))
    assert back.case == OTHER_LENDER and back.path.src.ref == "beta:0"


def test_a_target_on_the_borrower_is_borrower_local_and_a_source_there_crosses(topo):
    local = gpu(0x30, "gamma")  # a device installed in the borrower, passed to the same VM
    devices = [gpu(0x10, "alpha"), local]
    plan = plan_p2p(topo, "gamma", devices, gpu_bars(0x10, 0) + gpu_bars(0x30, 1), RAM)
    to_local = plan.from_source(0x10)
    assert {m.case for m in to_local} == {BORROWER_LOCAL}
    assert all(m.target_node == "gamma" and m.path.dst.ref == "gamma:0" for m in to_local)
    from_local = plan.from_source(0x30)
    assert {m.case for m in from_local} == {OTHER_LENDER}
    assert all(m.path.src.ref == "gamma:0" for m in from_local)


def test_the_lenders_route_need_not_be_the_borrowers():
    # l1 and l2 share a cable the borrower is not on; the borrower reaches each separately
    text = """
[[node]]
name = "l1"
id = 1
  [[node.adapter]]
  index = 0
  [[node.adapter]]
  index = 1
[[node]]
name = "l2"
id = 2
  [[node.adapter]]
  index = 0
  [[node.adapter]]
  index = 1
[[node]]
name = "b"
id = 3
  [[node.adapter]]
  index = 0
  [[node.adapter]]
  index = 1
[[link]]
ends = ["l1:1", "l2:1"]
[[link]]
ends = ["l1:0", "b:0"]
[[link]]
ends = ["l2:0", "b:1"]
"""
    topo = parse_topology(text)
    devices = [gpu(0x10, "l1"), gpu(0x20, "l2")]
    plan = plan_p2p(topo, "b", devices, gpu_bars(0x10, 0) + gpu_bars(0x20, 1))
    m = next(m for m in plan.maps if m.source == 0x10)
    assert m.path.describe() == "l1:1 -> l2:1"
    assert m.route[2:4] == ("l1:1", "l2:1")


def test_lenders_no_ntb_joins_are_named(topo):
    text = """
[[node]]
name = "l1"
id = 1
  [[node.adapter]]
  index = 0
[[node]]
name = "x"
id = 2
  [[node.adapter]]
  index = 0
[[node]]
name = "b"
id = 3
  [[node.adapter]]
  index = 0
  [[node.adapter]]
  index = 1
[[link]]
ends = ["l1:0", "b:0"]
[[link]]
ends = ["x:0", "b:1"]
"""
    devices = [gpu(0x10, "l1"), gpu(0x40, "x")]
    with pytest.raises(NoPathError, match="from l1 to x") as e:
        plan_p2p(parse_topology(text), "b", devices, gpu_bars(0x10, 0) + gpu_bars(0x40, 1))
    assert (e.value.src, e.value.dst) == ("l1", "x")


def test_a_device_with_no_programmed_bars_is_still_a_source(topo):
    devices = [gpu(0x10, "alpha"), gpu(0x20, "beta")]
    plan = plan_p2p(topo, "gamma", devices, gpu_bars(0x20, 0))
    assert {(m.source, m.target) for m in plan.maps} == {(0x10, 0x20)}


def test_beyond_the_sources_dma_width_is_skipped_not_refused(topo):
    nvme = PeerDevice(0x12, "alpha", (PeerBar(0, 16 * 1024, BarKind.MEM64, 1 << 41),))
    far = 0x200_0000_0000  # 2 TiB: beyond a 40-bit GPU
    bars = [GuestBar(0x10, 1, far, 32 * GiB), GuestBar(0x12, 0, 0xFE00_0000, 16 * 1024)]
    plan = plan_p2p(topo, "gamma", [gpu(0x10, "alpha"), nvme], bars)
    assert [(m.source, m.target) for m in plan.maps] == [(0x10, 0x12), (0x12, 0x10)]
    assert plan.maps[1].iova == far  # the 64-bit NVMe reaches it
    assert len(plan.skipped) == 0
    gpu2 = gpu(0x11, "alpha")
    plan = plan_p2p(topo, "gamma", [gpu(0x10, "alpha"), gpu2, nvme], bars)
    (skip,) = plan.skipped
    assert (skip.source, skip.target, skip.bar) == (0x11, 0x10, 1)
    assert "40 bits" in skip.reason and "lower" in skip.reason


def test_a_bar_smaller_than_a_page_is_skipped(topo):
    tiny = PeerDevice(0x50, "beta", (PeerBar(0, 256, BarKind.MEM32, 0x9000_0000),))
    plan = plan_p2p(
        topo, "gamma", [gpu(0x10, "alpha"), tiny], [GuestBar(0x50, 0, 0xC000_0000, 256)]
    )
    assert not plan.maps
    assert "4096-byte IOMMU page" in plan.skipped[0].reason


def test_records_are_json_and_keyed_by_target_bar(topo):
    devices, bars = three_gpus()
    m = next(m for m in plan_p2p(topo, "gamma", devices, bars).maps if m.target == 0x20)
    rec = json.loads(json.dumps(m.record()))
    assert m.key == f"0x20/bar{m.bar}"
    assert rec["case"] == OTHER_LENDER and rec["ntb"] == "alpha:0 -> beta:0 via mxs824"
    assert rec["iova"] == m.iova and rec["hops"] == 17 and rec["roots"] == 2


def test_peer_device_from_a_spec(topo):
    spec = topo.device(0x21)
    dev = peer_device(spec, {0: 0x8000_0000, 3: 0x8010_0000})
    assert dev.lender == "beta" and dev.bar(3).host == 0x8010_0000
    with pytest.raises(P2PError, match=r"no BAR 1 .*0, 3"):
        dev.bar(1)


# --- what the guest programmed: conflicts and bad input --------------------------------------


def test_a_bar_over_guest_ram_is_refused(topo):
    devices, bars = three_gpus()
    bad = [*bars[:-1], GuestBar(0x20, 3, 6 * GiB, 32 * MiB)]
    with pytest.raises(BarConflictError, match=r"over guest RAM 0x100000000-0x200000000") as e:
        plan_p2p(topo, "gamma", devices, bad, RAM)
    assert (e.value.fdid, e.value.bar) == (0x20, 3)
    low = [*bars[:-3], GuestBar(0x20, 0, 2 * GiB - 16 * MiB, 16 * MiB)]
    with pytest.raises(BarConflictError, match="guest RAM 0x0-0x80000000"):
        check_guest_bars({d.fdid: d for d in devices}, low, RAM)


def test_a_bar_over_another_bar_is_refused_naming_both(topo):
    devices, bars = three_gpus()
    same = [b for b in bars if (b.fdid, b.index) != (0x11, 1)]
    same.append(GuestBar(0x11, 1, HI, 32 * GiB))  # exactly where 0x10's BAR1 is
    with pytest.raises(BarConflictError, match="over BAR 1 of device 0x10") as e:
        plan_p2p(topo, "gamma", devices, same)
    assert (e.value.fdid, e.value.bar, e.value.gpa) == (0x11, 1, HI)
    nested = [b for b in bars if (b.fdid, b.index) != (0x11, 3)]
    nested.append(GuestBar(0x11, 3, HI + 4 * GiB, 32 * MiB))  # well inside 0x10's BAR1
    with pytest.raises(BarConflictError, match="over BAR 1 of device 0x10"):
        plan_p2p(topo, "gamma", devices, nested)


def test_adjacent_bars_and_bars_touching_ram_are_fine(topo):
    devices = [gpu(0x10, "alpha"), gpu(0x11, "alpha")]
    bars = [GuestBar(0x10, 0, 2 * GiB, 16 * MiB), GuestBar(0x11, 0, 2 * GiB + 16 * MiB, 16 * MiB)]
    assert len(plan_p2p(topo, "gamma", devices, bars, RAM).maps) == 2


@pytest.mark.parametrize(
    ("bar", "match"),
    [
        (GuestBar(0x99, 0, 0xC000_0000, 16 * MiB), "0x99 is not passed through"),
        (GuestBar(0x10, 2, 0xC000_0000, 16 * MiB), "no BAR 2"),
        (GuestBar(0x10, 0, 0xC000_0000, 32 * MiB), "is 0x1000000 bytes, not 0x2000000"),
        (GuestBar(0x10, 0, 0xC080_0000, 16 * MiB), "not aligned to its size"),
        (GuestBar(0x10, 0, 0x1_0000_0000, 16 * MiB), "32-bit BAR and must end below 4 GiB"),
    ],
)
def test_bad_guest_bars_are_refused(topo, bar, match):
    with pytest.raises(P2PError, match=match):
        plan_p2p(topo, "gamma", [gpu(0x10, "alpha"), gpu(0x11, "alpha")], [bar])


def test_io_bars_duplicates_and_unknown_nodes_are_refused(topo):
    nic = PeerDevice(0x60, "beta", (PeerBar(2, 32, BarKind.IO, 0x1000),))
    with pytest.raises(P2PError, match="I/O BAR"):
        plan_p2p(topo, "gamma", [nic], [GuestBar(0x60, 2, 0x1000, 32)])
    one = GuestBar(0x10, 0, 0xC000_0000, 16 * MiB)
    with pytest.raises(P2PError, match="given twice"):
        plan_p2p(topo, "gamma", [gpu(0x10, "alpha")], [one, one])
    with pytest.raises(P2PError, match="listed twice"):
        plan_p2p(topo, "gamma", [gpu(0x10, "alpha"), gpu(0x10, "alpha")], [])
    with pytest.raises(UnknownNodeError):
        plan_p2p(topo, "nowhere", [gpu(0x10, "alpha")], [])
