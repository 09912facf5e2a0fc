"""Hot migration in the simulator (``vmlend.sim.hotmig``): a VM on gamma with alpha's GPU and
NVMe drive moves to beta while both keep working. Proof by data: what the devices write during
the pre-copy lands in the destination guest's memory, nothing reaches the source's RAM after
the switch, an interrupt raised across the switch is delivered once, on the destination; the
invariant checker holds after every phase; a device whose driver cannot quiesce, or a
destination without room, changes nothing."""

from __future__ import annotations

import pytest

from tests.support.simcluster import domain_xml
from vmlend.demo.interrupts import enable_guest_interrupts
from vmlend.errors import FabricError, QuiesceError, StaleTokenError
from vmlend.irq.eventfd import EventFd
from vmlend.sim.devqueue import DeviceQueue
from vmlend.sim.dmawin import RegistryWindowLedger
from vmlend.sim.hotmig import hot_migrate
from vmlend.sim.invariants import check_with_registry
from vmlend.sim.iommu import IommuDomain
from vmlend.sim.msitarget import MsiTargets
from vmlend.sim.ntbmsi import NtbMsiRoute
from vmlend.sim.p2pmap import P2PMapper, registry_recorder
from vmlend.sim.simvm import SimVm
from vmlend.topology.model import MiB

GPU, NVME, NIC = 0x10, 0x12, 0x21
CPU_PAGE = 0x0010_0000  # a page the vCPUs write during pre-copy
GPU_PAGE = 0x0200_0000  # the GPU's copy lands here during pre-copy
NVME_PAGE = 0x0300_0000  # the NVMe read in flight when the switch comes
LATE_PAGE = 0x0400_0000  # a command the guest queued that the device fetches on beta


def start(cluster, fdids=(GPU, NVME)) -> SimVm:
    xml = domain_xml("vm1", 512 * MiB, fdids=fdids)
    p2p = P2PMapper(
        cluster.hw,
        "gamma",
        "vm1",
        recorder=registry_recorder(cluster.registry),
        promises=RegistryWindowLedger(cluster.registry),
    )
    vm = cluster.start(xml, "gamma", p2p=p2p)
    for fdid in fdids:
        vm.enable_device(fdid)
    return vm


def checker(cluster, steps: list[str]):
    def check(step: str) -> None:
        found = check_with_registry(cluster.hw, cluster.registry)
        assert found == [], f"after {step}:\n" + "\n".join(map(str, found))
        steps.append(step)

    return check


def holds(cluster) -> dict[int, tuple[str, int]]:
    with cluster.registry.read() as tx:
        return {f: (str(h.holder), h.token) for f, h in tx.holds().items()}


@pytest.fixture
def efds():
    fds = [EventFd() for _ in range(4)]
    yield fds
    for f in fds:
        f.close()


def test_device_writes_during_pre_copy_land_on_the_destination_and_nowhere_else(cluster, efds):
    hw = cluster.hw
    vm = start(cluster)
    targets = MsiTargets(hw)
    mode, _count = enable_guest_interrupts(vm, NVME)
    route = NtbMsiRoute(hw, targets, NVME)
    route.set_triggers(mode, [f.fileno() for f in efds])
    gpu, nvme = DeviceQueue(hw, GPU), DeviceQueue(hw, NVME)
    vm.guest.write(0x1000, b"before the move")

    def workload(n: int) -> None:
        if n == 1:  # both devices busy while the memory is copied
            gpu.submit(GPU_PAGE, b"G" * 4096)
            gpu.fetch()
            gpu.complete()  # lands in gamma's RAM mid-copy: only the IOMMU's log knows
            nvme.submit(NVME_PAGE, b"N" * 512, vector=0)
            nvme.fetch()  # in flight until the switch-over completes it
            vm.guest.write(CPU_PAGE, b"C" * 64)
            nvme.submit(LATE_PAGE, b"L" * 512)  # queued, not fetched: beta's device takes it

    steps: list[str] = []
    before = holds(cluster)
    dest_p2p = P2PMapper(
        hw,
        "beta",
        "vm1",
        recorder=registry_recorder(cluster.registry),
        promises=RegistryWindowLedger(cluster.registry),
    )
    done = hot_migrate(
        vm,
        cluster.fabric("beta"),
        cluster.registry,
        queues={GPU: gpu, NVME: nvme},
        msi={NVME: route},
        p2p=dest_p2p,
        workload=workload,
        check=checker(cluster, steps),
    )
    assert steps[:2] == ["claimed", "incoming"]
    assert steps[-3:] == ["switched", "source released", "resumed"]
    assert len(done.rounds) >= 2 and done.dma_pages >= 1
    # the VM and its devices are beta's now, under newer tokens; the old ones are refused
    assert vm.node == "beta" and vm.devices() == [GPU, NVME]
    after = holds(cluster)
    assert {f: h for f, (h, _t) in after.items()} == {GPU: "beta/vm1", NVME: "beta/vm1"}
    assert all(after[f][1] > before[f][1] for f in (GPU, NVME))
    with pytest.raises(StaleTokenError):
        hw.borrow(GPU, "gamma", "vm1", token=before[GPU][1])
    guest = hw.guest("beta", "vm1")
    assert guest.read(0x1000, 15) == b"before the move"
    assert guest.read(CPU_PAGE, 64) == b"C" * 64
    assert guest.read(GPU_PAGE, 4096) == b"G" * 4096  # DMA during pre-copy, copied
    assert guest.read(NVME_PAGE, 512) == b"N" * 512  # completed by the quiesce, copied
    # the interrupt of the command completed at the switch: once, on beta
    assert [f.drain() for f in efds] == [1, 0, 0, 0]
    assert targets.for_vm("beta", "vm1").delivered == 1
    assert targets.for_vm("gamma", "vm1").delivered == 0
    # after the switch: the queued command was fetched on beta and lands there; nothing
    # reaches gamma's RAM any more
    assert [a.node for a in nvme.accepted] == ["gamma", "beta"]
    gamma_pages = hw.node("gamma").memory.pages_stored
    nvme.complete()
    gpu.submit(GPU_PAGE + 4096, b"g" * 4096)
    gpu.fetch()
    gpu.complete()
    assert guest.read(LATE_PAGE, 512) == b"L" * 512
    landed = [t for done_ in (nvme.done, gpu.done) for ts in done_.values() for t in ts]
    late = [t for t in landed if t.address != 0 and t.node == "beta"]
    assert len(late) == 2
    assert hw.node("gamma").memory.pages_stored == gamma_pages
    for t in nvme.done[2] + gpu.done[2]:
        assert (t.node, t.owner) == ("beta", "vm1")
    assert vm.dma_read(GPU, GPU_PAGE, 4) == b"GGGG"  # the guest's driver goes on
    route.close()
    dest_p2p.close()
    vm.stop()


def test_without_the_iommu_dirty_log_a_device_write_is_lost(cluster, monkeypatch):
    """The log is what saves the DMA: a VM domain that logs nothing loses the GPU's write."""
    hw = cluster.hw
    vm = start(cluster, (GPU,))
    gpu = DeviceQueue(hw, GPU)
    monkeypatch.setattr(IommuDomain, "start_dirty_log", lambda self: None)

    def workload(n: int) -> None:
        if n == 1:
            gpu.submit(GPU_PAGE, b"G" * 4096)
            gpu.fetch()
            gpu.complete()

    hot_migrate(vm, cluster.fabric("beta"), cluster.registry, queues={GPU: gpu}, workload=workload)
    assert hw.guest("beta", "vm1").read(GPU_PAGE, 4) == bytes(4)
    vm.stop()


def test_a_device_whose_driver_cannot_quiesce_changes_nothing(cluster):
    hw = cluster.hw
    vm = start(cluster, (GPU, NIC))
    before = holds(cluster), cluster.claims()
    with pytest.raises(QuiesceError) as e:
        hot_migrate(vm, cluster.fabric("beta"), cluster.registry)
    assert str(e.value) == (
        "device 0x21 (nic) cannot be quiesced: its driver does not implement the migration states"
    )
    assert (holds(cluster), cluster.claims()) == before
    assert vm.node == "gamma" and hw.borrowed(GPU).node == "gamma"
    vm.stop()


def test_a_destination_that_cannot_reach_the_lender_changes_nothing(cluster):
    """beta's cable is down: the whole VM is refused there before anything moves."""
    hw = cluster.hw
    vm = start(cluster, (GPU,))
    cluster.fabric().set_link_up("mxs824/beta:0", False)
    before = holds(cluster), cluster.claims()
    with pytest.raises(FabricError) as e:
        hot_migrate(vm, cluster.fabric("beta"), cluster.registry)
    assert str(e.value).startswith("cannot hot-migrate to beta: device 0x10: ")
    assert str(e.value).endswith("nothing was changed")
    assert (holds(cluster), cluster.claims()) == before
    assert hw.borrowed(GPU).node == "gamma" and vm.node == "gamma"
    with pytest.raises(FabricError):
        hw.guest("beta", "vm1")
    vm.stop()
