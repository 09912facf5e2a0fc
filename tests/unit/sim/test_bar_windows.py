"""A borrower's windows onto a device's BARs take NTB segments, mapped = claimed (issue 40,
points 1 and 2): the hardware borrow maps each memory BAR on whole segments of the borrower
adapter of the device's crossing, exactly what admission claims as ``window-bars``; the end
of the borrow removes them, a re-route moves them with the claim, and the guest's MMIO goes
through them."""

from __future__ import annotations

import pytest

from tests.support.simcluster import Cluster, domain_xml
from vmlend.errors import DmaFault, ResourceExhaustedError
from vmlend.ledger.admission import bar_segments
from vmlend.registry import ClaimKind
from vmlend.sim.hardware import SimHardware
from vmlend.sim.invariants import check_hardware, check_with_registry
from vmlend.sim.pci import regs
from vmlend.topology.model import GiB
from vmlend.topology.parse import load_topology, parse_topology
from vmlend.wiring.fabric import default_topology_text

GPU, NVME, BETA_GPU, NIC = 0x10, 0x12, 0x20, 0x21
PRIMARY = "mxs824/gamma:0"


def mapped(hw: SimHardware, fdid: int) -> dict[str, int]:
    """BAR-window segments of ``fdid`` per adapter, as the adapters translate them."""
    out: dict[str, int] = {}
    for w in hw.bar_windows(fdid):
        adapter = hw.adapter(w.adapter)
        n = sum(adapter.segment(i) is not None for i in w.segments())
        out[w.adapter] = out.get(w.adapter, 0) + n
    return out


def claimed(c: Cluster, fdid: int) -> dict[str, int]:
    return {
        cl.adapter: cl.segments for f, cl in c.claims() if f == fdid and cl.kind is ClaimKind.BAR
    }


@pytest.fixture
def cluster(state_path):
    c = Cluster.create(state_path)
    yield c
    c.close()


def _run(c: Cluster, fdids: tuple[int, ...]):
    xml = domain_xml("web", 1 * GiB, fdids=fdids)
    vm = c.start(xml)
    for fdid in fdids:
        vm.enable_device(fdid)
    return xml, vm


def test_a_borrow_maps_what_admission_claimed_and_the_release_returns_it(cluster):
    xml, vm = _run(cluster, (GPU, NIC))
    # a GPU: 16 MiB + 32 GiB + 32 MiB BARs in 4 GiB segments = 1 + 8 + 1
    assert mapped(cluster.hw, GPU) == claimed(cluster, GPU) == {"gamma:0": 10}
    assert mapped(cluster.hw, NIC) == claimed(cluster, NIC) == {"gamma:0": 2}
    assert check_with_registry(cluster.hw, cluster.registry) == []
    vm.remove_device(NIC)  # the hardware borrow ends; the reservation keeps its claims
    assert mapped(cluster.hw, NIC) == {} and claimed(cluster, NIC) == {"gamma:0": 2}
    assert check_with_registry(cluster.hw, cluster.registry) == []
    vm.stop()
    cluster.release(xml)
    assert cluster.hw.bar_windows() == [] and claimed(cluster, GPU) == {}
    assert not cluster.hw.adapter("gamma:0").mapped_segments()


def test_the_lender_taking_a_device_back_returns_its_segments(cluster):
    _run(cluster, (GPU,))
    assert cluster.fabric("alpha").reclaim(GPU) is not None
    assert mapped(cluster.hw, GPU) == claimed(cluster, GPU) == {}
    assert not cluster.hw.adapter("gamma:0").mapped_segments()
    assert check_with_registry(cluster.hw, cluster.registry) == []


def test_a_reroute_moves_the_windows_and_their_claim(cluster):
    _, vm = _run(cluster, (NVME,))
    fab = cluster.fabric()
    fab.set_link_up(PRIMARY, False)
    assert mapped(cluster.hw, NVME) == claimed(cluster, NVME) == {"gamma:1": 1}
    assert not cluster.hw.adapter("gamma:0").mapped_segments()
    assert check_with_registry(cluster.hw, cluster.registry) == []
    target = vm.hw.mmio.resolve("gamma", NVME, 0, 0x100, 4)
    assert target.adapter == "gamma:1"
    window = cluster.hw.adapter("gamma:1").segment_base(cluster.hw.bar_windows(NVME)[0].first)
    assert target.hops[1].address == window + 0x100  # the borrower-side address in its window
    fab.set_link_up(PRIMARY, True)
    assert check_with_registry(cluster.hw, cluster.registry) == []


@pytest.fixture
def hw():
    hw = SimHardware.from_topology(load_topology(), seed=3)
    hw.create_guest("gamma", "web", [])
    hw.borrow(NVME, "gamma", "web")
    dev = hw.device(NVME)
    dev.config.write(regs.COMMAND, 2, dev.config.read(regs.COMMAND, 2) | regs.COMMAND_MEMORY)
    return hw


def test_mmio_through_a_window_a_reset_lost_faults_until_it_is_programmed_again(hw):
    assert hw.mmio_write("gamma", NVME, 0, 0x100, 4, 1) is not None
    hw.link_down(PRIMARY)
    hw.link_up(PRIMARY, keep_mappings=False)  # gamma:0 lost its segments
    with pytest.raises(DmaFault) as fault:
        hw.mmio.resolve("gamma", NVME, 0, 0x100, 4)
    assert fault.value.hop == "ntb-segment" and "gamma:0" in fault.value.why
    assert hw.mmio_write("gamma", NVME, 0, 0x100, 4, 2) is None
    assert hw.mmio_read("gamma", NVME, 0, 0x100, 4) == 0xFFFF_FFFF
    assert hw.device(NVME).bars.read(0, 0x100, 4) == 1  # the write never arrived
    hw.reprogram(PRIMARY)
    assert hw.mmio_write("gamma", NVME, 0, 0x100, 4, 3) is not None
    assert hw.device(NVME).bars.read(0, 0x100, 4) == 3


def test_a_window_segment_translating_elsewhere_is_caught(hw):
    (w,) = hw.bar_windows(NVME)
    adapter = hw.adapter(w.adapter)
    adapter.unmap_segment(w.first)
    adapter.map_segment(w.first, "alpha", 0x1000)  # low RAM of alpha, not the drive's BAR
    with pytest.raises(DmaFault) as fault:
        hw.mmio.resolve("gamma", NVME, 0, 0x100, 4)
    assert fault.value.hop == "ntb-segment"
    assert [v.kind for v in check_hardware(hw)] == ["ntb-segment"]


def test_the_checker_finds_a_window_kept_after_the_borrow(hw):
    (w,) = hw.bar_windows(NVME)
    hw.give_back(NVME)
    assert hw.bar_windows() == [] and hw.adapter("gamma:0").segment(w.first) is None
    hw.adapter("gamma:0").map_segment(w.first, "alpha", w.remote)  # a leak, by hand
    assert [v.kind for v in check_hardware(hw)] == ["ntb-segment"]


def _small_gamma_window() -> SimHardware:
    # gamma's adapters: 4 segments of 4 GiB, so one GPU's BARs (10 segments) do not fit
    text, _ = default_topology_text()
    head, gamma, rest = text.partition('name = "gamma"')
    rest = rest.replace('window = "128GiB"\n  segments = 32', 'window = "16GiB"\n  segments = 4', 2)
    return SimHardware.from_topology(parse_topology(head + gamma + rest), seed=1)


def test_a_full_borrower_window_refuses_the_borrow_in_one_line_changing_nothing():
    hw = _small_gamma_window()
    hw.create_guest("gamma", "web", [])
    assert bar_segments(hw.device(GPU).spec, hw.adapter("gamma:0").segment_size) == 10
    with pytest.raises(ResourceExhaustedError) as e:
        hw.borrow(GPU, "gamma", "web")
    assert "gamma:0" in str(e.value) and "\n" not in str(e.value)
    assert hw.borrowed(GPU) is None and hw.bar_windows() == []
    assert hw.adapter("gamma:0").lut_used == 0 and hw.adapter("alpha:0").lut_used == 0
    assert not hw.adapter("gamma:0").mapped_segments()
    assert check_hardware(hw) == []
    hw.borrow(NVME, "gamma", "web")  # one segment: fits
    assert [w.adapter for w in hw.bar_windows(NVME)] == ["gamma:0"]


def test_a_hold_ended_behind_its_vm_and_the_take_back_leave_no_window(cluster):
    from vmlend.registry import FenceRecord

    _, vm = _run(cluster, (GPU,))
    token = cluster.fabric().holds()[GPU].token
    assert mapped(cluster.hw, GPU) == {"gamma:0": 10}
    # its host's lease ran out: the hold ends behind the VM, the borrow with it
    assert cluster.fabric().release(GPU, vm.holder)
    assert cluster.hw.bar_windows() == [] and claimed(cluster, GPU) == {}
    cluster.fabric("alpha").take_back(FenceRecord(GPU, vm.holder, token))
    assert cluster.hw.bar_windows() == [] and not cluster.hw.adapter("gamma:0").mapped_segments()
    assert cluster.hw.mmio_read("gamma", GPU, 0, 0x100, 4) == 0xFFFF_FFFF  # nothing decodes it
    assert check_with_registry(cluster.hw, cluster.registry) == []
