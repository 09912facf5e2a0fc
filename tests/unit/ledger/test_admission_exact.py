"""Admission claims what bus-master enable and peer-to-peer will map (issue 10, part 3):
the planner's own DMA window segment count from the guest's real layout, room for P2P maps
and the LUT entries they need, the device's DMA reach, and a migration admitted as a whole."""

from __future__ import annotations

import pytest
from lxml import etree

from tests.support.simcluster import Cluster, domain_xml
from tests.support.simfabric import make_fabric
from vmlend.domain import read_domain
from vmlend.errors import DmaLimitError, ResourceExhaustedError
from vmlend.memory.domain_memory import domain_layout
from vmlend.memory.windows import window_segments
from vmlend.registry import ClaimKind
from vmlend.sim.p2pmap import P2PMapper
from vmlend.topology.model import DeviceState, GiB, GuestRam, GuestRange, Holder

SEGMENT = 4 * GiB  # the default topology: 128 GiB windows in 32 segments


@pytest.fixture
def cluster(state_path):
    c = Cluster.create(state_path)
    yield c
    c.close()


def with_dimms(xml: bytes, maxmem: int, slots: int, dimms: list[tuple[int, int | None]]) -> bytes:
    """The domain XML with hot-plug memory: ``dimms`` as (size, fixed base or None)."""
    root = etree.fromstring(xml)
    memory = root.find("memory")
    total = int(memory.text) * 1024 if memory.get("unit", "KiB") == "KiB" else None
    assert total is not None
    memory.text = str((total + sum(s for s, _b in dimms)) // 1024)
    mx = etree.Element("maxMemory", slots=str(slots), unit="KiB")
    mx.text = str(maxmem // 1024)
    memory.addprevious(mx)
    devices = root.find("devices")
    for size, base in dimms:
        dev = etree.SubElement(devices, "memory", model="dimm")
        target = etree.SubElement(dev, "target")
        etree.SubElement(target, "size", unit="KiB").text = str(size // 1024)
        etree.SubElement(target, "node").text = "0"
        if base is not None:
            etree.SubElement(dev, "address", type="dimm", base=hex(base))
    return etree.tostring(root)


def dma_claim(cluster: Cluster, adapter: str) -> int:
    return max(
        (
            c.segments
            for _f, c in cluster.claims()
            if c.adapter == adapter and c.kind is ClaimKind.DMA
        ),
        default=0,
    )


def test_a_8_gib_q35_guest_claims_the_3_segments_its_windows_map(cluster):
    # low RAM 0-2 GiB takes 1 segment, high RAM 4-10 GiB rounded out to 4-12 GiB takes 2:
    # ceil(8 GiB / 4 GiB) = 2 would under-claim by one.
    xml = domain_xml("web", 8 * GiB, fdids=(0x12,))
    vm = cluster.start(xml)
    assert dma_claim(cluster, "alpha:0") == 3
    vm.enable_device(0x12)
    assert len(cluster.hw.adapter("alpha:0").mapped_segments()) == 3
    vm.stop()


def test_hot_plug_dimms_claim_the_segments_their_gaps_take(cluster):
    # 8 GiB initial RAM and one 8 GiB DIMM placed at 40 GiB: the high window spans 4-48 GiB
    # (11 segments) and low RAM takes 1; the size alone (16 GiB) would say 4.
    xml = with_dimms(domain_xml("web", 8 * GiB, fdids=(0x12,)), 64 * GiB, 2, [(8 * GiB, 40 * GiB)])
    ranges = domain_layout(xml).ranges()
    assert window_segments(ranges, SEGMENT) == 12
    vm = cluster.start(xml)
    assert dma_claim(cluster, "alpha:0") == 12
    vm.enable_device(0x12)
    assert len(cluster.hw.adapter("alpha:0").mapped_segments()) == 12
    vm.stop()


@pytest.mark.parametrize(
    ("machine", "memory"),
    [("q35", 1 * GiB), ("q35", 3 * GiB), ("q35", 8 * GiB), ("pc", 8 * GiB), ("q35", 61 * GiB)],
)
def test_claimed_equals_mapped_for_each_layout(cluster, machine, memory):
    vm = cluster.start(domain_xml("web", memory, machine=machine, fdids=(0x12,)))
    claimed = dma_claim(cluster, "alpha:0")
    vm.enable_device(0x12)
    assert len(cluster.hw.adapter("alpha:0").mapped_segments()) == claimed
    vm.stop()


def test_p2p_maps_fit_in_what_was_claimed(cluster):
    # GPUs from alpha and beta: each reaches the other's BARs (16M + 32G + 32M: up to 1 + 8 + 1
    # segments) through its own lender's adapter, besides the VM's DMA windows there and its
    # interrupt window (MSI over the NTB, one segment).
    mapper = P2PMapper(cluster.hw, "gamma", "web")
    vm = cluster.start(domain_xml("web", 8 * GiB, fdids=(0x10, 0x20)), p2p=mapper)
    usage = cluster.fabric().usage()
    assert usage["alpha:0"].segments_used == 3 + 10 + 1
    assert usage["beta:0"].segments_used == 3 + 10 + 1
    vm.enable_device(0x10)
    vm.enable_device(0x20)
    assert mapper.maps(), "the guest placed the BARs, so peer-to-peer is mapped"
    for ref in ("alpha:0", "beta:0"):
        mapped = len(cluster.hw.adapter(ref).mapped_segments())
        assert 3 < mapped <= usage[ref].segments_used
    vm.stop()


def test_a_p2p_shortfall_is_refused_at_reserve_with_the_numbers(tmp_path):
    f = make_fabric(tmp_path / "s.db")
    vm = Holder("gamma", "vm1")
    f.reserve(0x10, vm, guest_ram=64 * GiB)  # alpha:0: 17 segments of DMA windows
    f.reserve(0x20, vm, guest_ram=64 * GiB)  # beta:0: 17 + 10 to reach 0x10's BARs
    before = f.usage()
    # 0x20 would reach the BARs of 0x10 and 0x11 through beta:0: 20 segments, where 15 are
    # free besides the VM's DMA windows
    with pytest.raises(ResourceExhaustedError) as e:
        f.reserve(0x11, vm, guest_ram=64 * GiB)
    assert str(e.value) == (
        "NTB window segments for peer-to-peer on beta:0 is short by 5 segments"
        " (need 20 segments, have 15 segments)"
    )
    assert f.usage() == before and f.device(0x11).state is DeviceState.AVAILABLE
    f.close()


def test_a_borrower_local_source_claims_a_lut_entry_for_p2p(tmp_path):
    # A VM on alpha with alpha's own GPU and beta's: the local GPU was never let across by a
    # borrow, so reaching beta's BARs takes a LUT entry on alpha:0.
    f = make_fabric(tmp_path / "s.db", node="alpha")
    vm = Holder("alpha", "vm1")
    f.reserve(0x10, vm, guest_ram=8 * GiB)
    assert f.usage()["alpha:0"].lut_used == 0
    f.reserve(0x20, vm, guest_ram=8 * GiB)
    # one entry for 0x20's crossing (as any borrow), one for 0x10's peer-to-peer
    assert f.usage()["alpha:0"].lut_used == 2
    # 0x20's BARs for the CPU (10 segments) and room for 0x10 to reach them (10 more)
    assert f.usage()["alpha:0"].segments_used == 20
    f.release(0x20, vm)
    assert f.usage()["alpha:0"].lut_used == 0 and f.usage()["alpha:0"].segments_used == 0
    f.close()


def test_dma_reach_is_checked_at_reserve(tmp_path):
    f = make_fabric(tmp_path / "s.db", node="alpha")
    vm = Holder("alpha", "vm1")
    past_1tib = GuestRam((GuestRange(0, 2 * GiB), GuestRange(4 * GiB, 1100 * GiB)))
    with pytest.raises(DmaLimitError, match="addresses only 40 bits"):
        f.reserve(0x10, vm, guest_ram=past_1tib)  # a 40-bit GPU, local: no window to run out
    assert f.device(0x10).state is DeviceState.AVAILABLE
    assert f.reserve(0x12, vm, guest_ram=past_1tib).state is DeviceState.RESERVED  # 64-bit NVMe
    f.close()


def test_guest_ram_ending_exactly_at_the_dma_limit_is_admitted(tmp_path):
    # q35 with 1022 GiB on an Intel vCPU: 2 GiB low, high RAM from 4 GiB up to exactly 1 TiB,
    # the first address a 40-bit device cannot reach: its last byte is reachable
    f = make_fabric(tmp_path / "s.db", node="alpha")
    vm = Holder("alpha", "vm1")
    to_1tib = GuestRam((GuestRange(0, 2 * GiB), GuestRange(4 * GiB, 1024 * GiB)))
    assert f.reserve(0x10, vm, guest_ram=to_1tib).state is DeviceState.RESERVED
    f.release(0x10, vm)
    one_page_more = GuestRam((GuestRange(0, 2 * GiB), GuestRange(4 * GiB, 1024 * GiB + 4096)))
    with pytest.raises(DmaLimitError, match="short by 4096 bytes"):
        f.reserve(0x10, vm, guest_ram=one_page_more)
    f.close()


def test_the_hook_admits_the_domain_layout_not_its_size(cluster):
    xml = domain_xml("big", 1100 * GiB, fdids=(0x10,))
    root = etree.fromstring(xml)
    cpu = etree.SubElement(root, "cpu")  # an Intel vCPU: no AMD 1 TiB hole question
    etree.SubElement(cpu, "model", vendor_id="GenuineIntel").text = "Skylake-Client"
    xml = etree.tostring(root)
    assert read_domain(xml).ram is not None
    with pytest.raises(Exception, match="addresses only 40 bits"):
        cluster.prepare(xml, node="alpha")
    assert cluster.fabric("alpha").device(0x10).holder is None
