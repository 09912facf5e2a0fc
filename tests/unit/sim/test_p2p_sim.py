"""Peer-to-peer maps applied to the simulated hardware, proven with the DMA resolver: a DMA from
device A at B's guest-physical BAR address lands in B's BAR in all three cases, and faults once
B is gone or has moved."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from vmlend.cli import main
from vmlend.errors import (
    BarConflictError,
    DeviceHeldError,
    DmaFault,
    FabricError,
    NoPathError,
    P2PError,
    ResourceExhaustedError,
    StateError,
)
from vmlend.p2p import BORROWER_LOCAL, OTHER_LENDER, SAME_LENDER
from vmlend.sim.hardware import SimHardware
from vmlend.sim.p2pmap import P2PMapper, registry_recorder
from vmlend.sim.pci import regs
from vmlend.topology.model import GiB, GuestRange, Holder, MiB
from vmlend.topology.parse import load_topology, parse_topology
from vmlend.topology.pcie import device_to_device

GPU, GPU2, BETA_GPU, NIC = 0x10, 0x11, 0x20, 0x21
RAM = [GuestRange(0, 2 * GiB), GuestRange(4 * GiB, 6 * GiB)]
HI = 0x80_0000_0000  # the guest's 64-bit PCI hole


def gpu_bars(slot: int) -> dict[int, tuple[int, int]]:
    """BAR index -> (gpa, size) as a guest would place GPU number ``slot``."""
    base = HI + slot * 64 * GiB
    return {
        0: (0xC000_0000 + slot * 16 * MiB, 16 * MiB),
        1: (base, 32 * GiB),
        3: (base + 32 * GiB, 32 * MiB),
    }


PLACES = {
    GPU: gpu_bars(0),
    GPU2: gpu_bars(1),
    BETA_GPU: gpu_bars(2),
    NIC: {0: (0xC400_0000, 1 * MiB), 3: (0xC410_0000, 16 * 1024)},
}


def enable(hw: SimHardware, fdid: int) -> None:
    """Bus Master (to issue DMA) and memory decoding (to answer at its BARs)."""
    hw.device(fdid).config.write(regs.COMMAND, 2, regs.COMMAND_MEMORY | regs.COMMAND_MASTER)


def program(p2p: P2PMapper, fdid: int) -> None:
    for index, (gpa, size) in PLACES[fdid].items():
        p2p.program_bar(fdid, index, gpa, size)


def gpa(fdid: int, bar: int) -> int:
    return PLACES[fdid][bar][0]


@pytest.fixture(scope="module")
def topology():
    return load_topology()


@pytest.fixture
def hw(topology):
    hw = SimHardware.from_topology(topology)
    hw.create_guest("gamma", "web", RAM)
    for f in PLACES:
        hw.borrow(f, "gamma", "web")
        enable(hw, f)
    return hw


@pytest.fixture
def p2p(hw):
    mapper = P2PMapper(hw, "gamma", "web")
    for f in PLACES:
        program(mapper, f)
    return mapper


def lands(hw: SimHardware, src: int, dst: int, bar: int, offset: int, data: bytes = b"p2p!"):
    """DMA-write ``data`` from ``src`` at ``dst``'s guest BAR + offset; check where it went."""
    (target,) = hw.dma_write(src, gpa(dst, bar) + offset, data)
    assert (target.kind, target.owner, target.bar, target.offset) == ("bar", dst, bar, offset)
    assert target.node == hw.device(dst).lender
    assert hw.device(dst).bars.read_bytes(bar, offset, len(data)) == data
    assert hw.dma_read(src, gpa(dst, bar) + offset, len(data)) == data
    return target


def test_same_lender_lands_in_the_peer_bar_without_crossing(hw, p2p):
    t = lands(hw, GPU, GPU2, 1, 0x1234_5000, b"same lender")
    assert not t.crossed_ntb
    assert [h.stage for h in t.hops] == ["device", "lender-iommu", "bar"]
    assert t.address == hw.device(GPU2).bar_range(1)[0] + 0x1234_5000
    lands(hw, GPU2, GPU, 0, 0x10)
    lands(hw, GPU2, GPU, 3, 32 * MiB - 4)
    m = next(m for m in p2p.maps() if (m.source, m.target, m.bar) == (GPU, GPU2, 1))
    assert m.case == SAME_LENDER


def test_other_lender_crosses_from_alpha_to_beta_through_a_domain_of_the_vm(hw, p2p):
    t = lands(hw, GPU, BETA_GPU, 1, 31 * GiB + 0x3000, b"to beta")
    assert [h.stage for h in t.hops] == [
        "device",
        "lender-iommu",
        "ntb-segment",
        "lut",
        "borrower-iommu",
        "bar",
    ]
    assert t.hops[2].node == "beta" and t.hops[4].detail == "beta:p2p:gamma/web"
    lands(hw, GPU2, NIC, 0, 0x800)  # a 32-bit BAR of the NIC, from the other alpha GPU
    lands(hw, NIC, GPU, 1, 0x40)  # and back: beta -> alpha
    t = lands(hw, BETA_GPU, GPU2, 3, 0)
    assert t.hops[4].detail == "alpha:p2p:gamma/web"
    cases = {(m.source, m.target): m.case for m in p2p.maps()}
    assert cases[(GPU, BETA_GPU)] == cases[(NIC, GPU)] == OTHER_LENDER


def test_every_pair_is_mapped_and_segments_are_shared(hw, p2p):
    bars = sum(len(PLACES[f]) for f in PLACES)
    assert len(p2p.maps()) == sum(bars - len(PLACES[f]) for f in PLACES)
    # alpha -> beta: BAR1 of the beta GPU spans 8 segments of 4 GiB; every other beta BAR sits
    # in one of two more chunks; both alpha GPUs share them
    assert len(hw.adapter("alpha:0").mapped_segments()) == 8 + 1 + 1
    assert {s.remote_node for s in hw.adapter("alpha:0").mapped_segments()} == {"beta"}


def test_a_removed_device_is_unreachable_and_reaches_nothing(hw, p2p):
    lands(hw, GPU, BETA_GPU, 0, 0)
    p2p.remove_device(BETA_GPU)
    for src, bar in ((GPU, 0), (GPU2, 1), (NIC, 3)):
        with pytest.raises(DmaFault) as e:
            hw.dma_write(src, gpa(BETA_GPU, bar), b"x")
        assert e.value.hop == "lender-iommu"
    with pytest.raises(DmaFault, match="lender-iommu"):
        hw.dma_read(BETA_GPU, gpa(GPU, 1), 4)
    assert not [m for m in p2p.maps() if BETA_GPU in (m.source, m.target)]
    lands(hw, GPU, NIC, 0, 0)  # the others still work
    lands(hw, GPU, GPU2, 1, 0)
    p2p.remove_device(NIC)
    p2p.remove_device(NIC)  # idempotent
    # nothing of alpha crosses to beta any more: segments and beta attachments are gone
    assert hw.adapter("alpha:0").mapped_segments() == []
    assert hw.adapter("beta:0").lut_lookup(hw.requester_key(GPU)) is None
    with pytest.raises(FabricError, match="no LUT entry on beta:0"):
        hw.ingress(GPU, "beta")
    assert [m.case for m in p2p.maps()] == [SAME_LENDER, SAME_LENDER] * 3


def test_a_moved_bar_maps_the_new_address_and_faults_the_old(hw, p2p):
    old = gpa(BETA_GPU, 1)
    new = HI + 4 * 64 * GiB
    p2p.program_bar(BETA_GPU, 1, new, 32 * GiB)
    (t,) = hw.dma_write(GPU, new + 0x5000, b"moved")
    assert (t.owner, t.bar, t.offset) == (BETA_GPU, 1, 0x5000)
    with pytest.raises(DmaFault) as e:
        hw.dma_write(GPU, old + 0x5000, b"stale")
    assert e.value.hop == "lender-iommu"
    assert {m.iova for m in p2p.maps() if (m.target, m.bar) == (BETA_GPU, 1)} == {new}
    # the old segments went back: 8 for the new place, none left for the old
    assert len(hw.adapter("alpha:0").mapped_segments()) == 10


def test_a_bar_moved_beyond_a_sources_dma_width_is_skipped_for_it_only(hw, p2p):
    far = 0x100_0000_0000  # 1 TiB: out of the 40-bit GPUs' reach, not the NIC's
    p2p.program_bar(BETA_GPU, 1, far, 32 * GiB)
    sources = {m.source for m in p2p.maps() if (m.target, m.bar) == (BETA_GPU, 1)}
    assert sources == {NIC}
    assert {(s.source, s.target, s.bar) for s in p2p.skipped()} == {
        (GPU, BETA_GPU, 1),
        (GPU2, BETA_GPU, 1),
    }
    (t,) = hw.dma_write(NIC, far + 0x100, b"wide")
    assert (t.owner, t.bar, t.offset) == (BETA_GPU, 1, 0x100)


def test_an_unassigned_bar_loses_its_maps(hw, p2p):
    p2p.program_bar(GPU2, 1, 0, 32 * GiB)
    with pytest.raises(DmaFault, match="lender-iommu"):
        hw.dma_write(GPU, gpa(GPU2, 1), b"x")
    lands(hw, GPU, GPU2, 3, 0)


def test_overlapping_bars_are_refused_and_nothing_changes(hw, p2p):
    before = p2p.maps()
    with pytest.raises(BarConflictError, match="over BAR 0 of device 0x11"):
        p2p.program_bar(NIC, 0, gpa(GPU2, 0), 1 * MiB)
    with pytest.raises(BarConflictError, match="over guest RAM"):
        p2p.program_bar(NIC, 0, 0x4000_0000, 1 * MiB)
    assert p2p.maps() == before
    lands(hw, GPU, NIC, 0, 0x10)  # still at its old place


def test_a_peer_with_memory_decoding_off_does_not_answer(hw, p2p):
    hw.device(GPU2).config.write(regs.COMMAND, 2, regs.COMMAND_MASTER)
    with pytest.raises(DmaFault, match="memory decoding is off") as e:
        hw.dma_write(GPU, gpa(GPU2, 1), b"x")
    assert e.value.hop == "no-target"


def test_a_failure_midway_undoes_everything(hw):
    p2p = P2PMapper(hw, "gamma", "web")
    program(p2p, GPU)
    program(p2p, GPU2)
    beta = hw.adapter("beta:0")
    for i in range(beta.segments):  # someone else took beta's whole window
        beta.map_segment(i, "gamma", i * beta.segment_size)
    before = (p2p.maps(), hw.lender_domain(GPU).mappings(), hw.node("beta").iommu.attached())
    # the alpha GPUs' maps to the beta GPU go in first; its own maps to alpha then fail
    with pytest.raises(ResourceExhaustedError, match="beta:0"):
        p2p.program_bar(BETA_GPU, 0, gpa(BETA_GPU, 0), 16 * MiB)
    after = (p2p.maps(), hw.lender_domain(GPU).mappings(), hw.node("beta").iommu.attached())
    assert after == before
    assert hw.adapter("alpha:0").mapped_segments() == []
    assert hw.lender_domain(BETA_GPU).mappings() == []
    with pytest.raises(DmaFault, match="lender-iommu"):
        hw.dma_write(GPU, gpa(BETA_GPU, 0), b"x")
    lands(hw, GPU, GPU2, 1, 0)


def test_detach_ingress_only_undoes_attach_ingress(hw):
    domain = hw.vm_domain("beta", "probe")
    requester = hw.attach_ingress(GPU, "beta", domain)
    assert hw.node("beta").iommu.domain_for(requester) is domain
    assert hw.detach_ingress(GPU, "beta") is True
    assert hw.node("beta").iommu.domain_for(requester) is None
    assert hw.detach_ingress(GPU, "beta") is False


def test_only_the_vms_borrowed_devices_take_part(hw, topology):
    p2p = P2PMapper(hw, "gamma", "web")
    with pytest.raises(P2PError, match="0x12 is not borrowed by gamma/web"):
        p2p.program_bar(0x12, 0, 0xC800_0000, 16 * 1024)
    hw.give_back(NIC)  # the four devices' BAR windows fill gamma:0's 32 segments
    hw.borrow(0x12, "gamma", "db")
    with pytest.raises(DeviceHeldError, match="gamma/db"):
        p2p.program_bar(0x12, 0, 0xC800_0000, 16 * 1024)
    with pytest.raises(P2PError, match="no BAR 2"):
        p2p.program_bar(GPU, 2, 0xC800_0000, 16 * MiB)
    assert p2p.maps() == []


def test_a_device_given_back_without_remove_is_dropped_at_the_next_change(hw, p2p):
    hw.give_back(BETA_GPU)
    p2p.program_bar(NIC, 3, 0xC420_0000, 16 * 1024)
    assert not [m for m in p2p.maps() if BETA_GPU in (m.source, m.target)]
    assert hw.lender_domain(BETA_GPU).mappings() == []
    (t,) = hw.dma_write(GPU, 0xC420_0000, b"nic")
    assert (t.owner, t.bar) == (NIC, 3)


# --- the borrower's own device ---------------------------------------------------------------

LOCAL_TOPOLOGY = """
name = "p2p-local"
[[node]]
name = "lender"
id = 1
ram = "16GiB"
  [[node.adapter]]
  index = 0
  [[node.device]]
  fdid = 0x100
  bdf = "0000:41:00.0"
  kind = "gpu"
  vendor = 0x10de
  device = 0x1db4
  class = 0x030200
  bars = [ { index = 0, size = "16MiB" }, { index = 1, size = "64MiB", kind = "mem64" } ]
[[node]]
name = "host"
id = 2
ram = "32GiB"
  [[node.adapter]]
  index = 0
  [[node.adapter]]
  index = 1
  [[node.device]]
  fdid = 0x300
  bdf = "0000:05:00.0"
  kind = "nvme"
  vendor = 0x8086
  device = 0x0a54
  class = 0x010802
  bars = [ { index = 0, size = "16KiB", kind = "mem64" }, { index = 2, size = "32", kind = "io" } ]
[[node]]
name = "island"
id = 3
  [[node.adapter]]
  index = 0
  [[node.device]]
  fdid = 0x400
  bdf = "0000:07:00.0"
  kind = "nic"
  vendor = 0x8086
  device = 0x1521
  class = 0x020000
  bars = [ { index = 0, size = "1MiB" } ]
[[switch]]
name = "sw"
ports = ["lender:0", "host:0"]
[[link]]
ends = ["host:1", "island:0"]
"""


@pytest.fixture
def local():
    hw = SimHardware.from_topology(parse_topology(LOCAL_TOPOLOGY))
    hw.create_guest("host", "web", [GuestRange(0, 1 * GiB)])
    for f in (0x100, 0x300):
        hw.borrow(f, "host", "web")
        enable(hw, f)
    p2p = P2PMapper(hw, "host", "web")
    p2p.program_bar(0x100, 0, 0xC000_0000, 16 * MiB)
    p2p.program_bar(0x100, 1, 0x10_0000_0000, 64 * MiB)
    p2p.program_bar(0x300, 0, 0xC100_0000, 16 * 1024)
    p2p.program_bar(0x300, 2, 0xC040, 32)  # an I/O BAR: ignored
    return hw, p2p


def test_borrower_local_target_is_reached_through_the_vms_own_domain(local):
    hw, p2p = local
    (t,) = hw.dma_write(0x100, 0xC100_0000 + 0x200, b"to the host")
    assert (t.node, t.owner, t.bar, t.offset) == ("host", 0x300, 0, 0x200)
    assert t.hops[4].detail == "host:vm:web"  # the VM's own domain on the borrower
    assert hw.device(0x300).bars.read_bytes(0, 0x200, 11) == b"to the host"
    m = next(m for m in p2p.maps() if m.source == 0x100)
    assert m.case == BORROWER_LOCAL and (m.target, m.bar) == (0x300, 0)


def test_a_source_on_the_borrower_crosses_with_a_lut_entry_of_its_own(local):
    hw, p2p = local
    rid = hw.device(0x300).requester_id
    assert hw.adapter("host:0").lut_lookup(rid) is not None
    (t,) = hw.dma_write(0x300, 0x10_0000_0000 + 0x1000, b"from the host")
    assert (t.node, t.owner, t.bar, t.offset) == ("lender", 0x100, 1, 0x1000)
    assert t.hops[4].detail == "lender:p2p:host/web"
    p2p.remove_device(0x300)
    assert hw.adapter("host:0").lut_lookup(rid) is None
    with pytest.raises(DmaFault, match="lender-iommu"):
        hw.dma_write(0x300, 0x10_0000_0000, b"x")
    with pytest.raises(DmaFault, match="lender-iommu"):
        hw.dma_write(0x100, 0xC100_0000, b"x")
    # the borrow's own crossing into the VM's domain (its DMA windows) is untouched
    vm = hw.vm_domain("host", "web")
    assert hw.node("host").iommu.domain_for(hw.ingress(0x100, "host")) is vm
    assert hw.adapter("lender:0").mapped_segments() == []


def test_lenders_without_a_path_are_named(local):
    hw, p2p = local
    hw.borrow(0x400, "host", "web")
    with pytest.raises(NoPathError, match="from lender to island"):
        p2p.program_bar(0x400, 0, 0xC200_0000, 1 * MiB)
    assert {m.target for m in p2p.maps()} == {0x100, 0x300}


# --- persisting the maps ----------------------------------------------------------------------


def test_the_recorder_sees_every_put_and_removal(hw):
    log: list[tuple[int, str, object]] = []
    p2p = P2PMapper(hw, "gamma", "web", recorder=lambda f, k, d: log.append((f, k, d)))
    program(p2p, GPU)
    program(p2p, BETA_GPU)
    assert sorted((f, k) for f, k, d in log) == sorted(
        [(BETA_GPU, f"0x10/bar{i}") for i in (0, 1, 3)] + [(GPU, f"0x20/bar{i}") for i in (0, 1, 3)]
    )
    assert all(d["case"] == OTHER_LENDER for _, _, d in log)
    log.clear()
    p2p.remove_device(BETA_GPU)
    assert sorted(log) == sorted(
        [(BETA_GPU, f"0x10/bar{i}", None) for i in (0, 1, 3)]
        + [(GPU, f"0x20/bar{i}", None) for i in (0, 1, 3)]
    )


def test_maps_are_registry_runtime_records_of_the_source(tmp_path, hw):
    from tests.support.simfabric import make_fabric
    from vmlend.registry import SqliteRegistry

    fabric = make_fabric(tmp_path / "s.db")
    holder = Holder("gamma", "web", "u1")
    for f in (GPU, GPU2, BETA_GPU):  # the NIC is not reserved in the registry
        fabric.reserve(f, holder)
    reg = SqliteRegistry.open(tmp_path / "s.db")
    p2p = P2PMapper(hw, "gamma", "web", recorder=registry_recorder(reg))
    program(p2p, GPU)
    program(p2p, GPU2)
    program(p2p, BETA_GPU)
    with reg.read() as tx:
        recs = tx.runtime(kind="p2p-map")
    assert len(recs) == 3 * 2 * 3
    rec = next(r for r in recs if (r.fdid, r.key) == (GPU, "0x20/bar1"))
    assert rec.data["iova"] == gpa(BETA_GPU, 1) and rec.data["target_node"] == "beta"
    # one count: each record's hops and roots are what `vmlend path` and status show
    for r in recs:
        want = device_to_device(hw.topology, r.fdid, int(r.data["target"]))
        assert (r.data["hops"], r.data["roots"]) == (want.hops, want.roots)
    assert (rec.data["hops"], rec.data["roots"]) == (17, 2)
    state = ["--state", str(tmp_path / "s.db")]
    path = json.loads(CliRunner().invoke(main, [*state, "path", "0x10", "0x20", "--json"]).output)
    status = CliRunner().invoke(main, [*state, "status", "--json", "-c", "sim:///gamma"])
    assert status.exit_code == 0, status.output
    (web,) = [v for v in json.loads(status.output)["vms"] if v["name"] == "web"]
    (gpu,) = [d for d in web["devices"] if d["fdid"] == "0x10"]
    shown = next(m for m in gpu["p2p_maps"] if m["key"] == "0x20/bar1")
    assert (shown["hops"], shown["roots"]) == (path["hops"], path["roots"]) == (17, 2)
    # a record that cannot be written (the NIC is not held) undoes the whole change
    before = p2p.maps()
    with pytest.raises(StateError, match="not held"):
        program(p2p, NIC)
    assert p2p.maps() == before
    with reg.read() as tx:
        assert len(tx.runtime(kind="p2p-map")) == 3 * 2 * 3
    p2p.remove_device(BETA_GPU)
    with reg.read() as tx:
        left = tx.runtime(kind="p2p-map")
    assert {(r.fdid, r.key.split("/")[0]) for r in left} == {(GPU, "0x11"), (GPU2, "0x10")}


def test_p2p_segments_come_from_the_top_of_the_window(hw, p2p):
    alpha = hw.adapter("alpha:0")
    used = sorted(s.index for s in alpha.mapped_segments())
    assert used == list(range(alpha.segments - 10, alpha.segments))
    assert alpha.free_segments(alpha.segments - 10) == 0  # DMA windows still get one long run


def test_a_peer_write_into_the_msix_table_reaches_the_relay_like_a_cpu_write(hw, p2p):
    from vmlend.irq.vectors import MSIX_ENTRY_CTRL, MSIX_ENTRY_SIZE, ConfigIrqWatcher

    nic = hw.device(NIC)  # MSI-X table at BAR 3 offset 0
    cap = nic.config.find_capability(regs.CAP_ID_MSIX)
    flags = nic.config.read(cap + 2, 2)
    nic.config.write(cap + 2, 2, flags | regs.MSIX_FLAGS_ENABLE)
    for v in range(3):  # entries start masked: the guest unmasked three of them
        nic.bars.write(3, v * MSIX_ENTRY_SIZE + MSIX_ENTRY_CTRL, 4, 0)
    watcher = ConfigIrqWatcher.for_device(nic)
    seen: list[frozenset[int]] = []
    watcher.subscribe(lambda setup: seen.append(setup.masked))
    assert 1 not in watcher.current().masked
    # the GPU (a peer of the same VM) masks vector 1 by DMA, as a device driver may arrange
    (t,) = hw.dma_write(GPU, gpa(NIC, 3) + MSIX_ENTRY_SIZE + MSIX_ENTRY_CTRL, b"\x01\0\0\0")
    assert (t.owner, t.bar) == (NIC, 3)
    assert nic.bars.msix_entry(1).masked
    assert seen and 1 in seen[-1] and 1 in watcher.current().masked
    watcher.close()


class _Promised:
    """Other VMs were promised ``n`` segments of alpha:0 (and have mapped none)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.asked: list[tuple[str, str]] = []

    def promised_segments(self, adapter: str, share: str) -> int:
        self.asked.append((adapter, share))
        return self.n if adapter == "alpha:0" else 0


def test_segments_promised_to_other_vms_are_left_free(hw):
    # alpha -> beta needs 10 segments of alpha:0 (32): with 23 promised elsewhere only 9 may go
    promised = _Promised(23)
    mapper = P2PMapper(hw, "gamma", "web", promises=promised)
    for f in (GPU, NIC):
        program(mapper, f)  # alpha -> beta: 1 segment of alpha:0 for the NIC's BARs
    assert len(hw.adapter("alpha:0").mapped_segments()) == 1
    with pytest.raises(ResourceExhaustedError, match="alpha:0"):
        program(mapper, BETA_GPU)  # 9 more, BAR by BAR: the last is one beyond the promises
    assert len(hw.adapter("alpha:0").mapped_segments()) == 32 - 23  # none of the promised
    assert ("alpha:0", "vm:gamma/web") in promised.asked
    promised.n = 22
    program(mapper, BETA_GPU)
    assert len(hw.adapter("alpha:0").mapped_segments()) == 10
    mapper.close()
