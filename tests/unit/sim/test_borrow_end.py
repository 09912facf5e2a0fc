"""No mapping outlives the borrow that justified it.

A device given back by any path other than the VM's own removal (a release after a crash, the
fabric's give-back) loses, in the same step, every mapping sourced from or targeting it: DMA
windows, peer-to-peer maps in both directions, LUT entries, ingress attachments. A teardown that
fails is never swallowed: the device stays fenced under its old borrow, unreachable.
"""

from __future__ import annotations

import pytest

from tests.support.simcluster import Cluster, domain_xml
from vmlend.errors import BorrowTeardownError, DeviceHeldError, DmaFault, VmlendError
from vmlend.sim.hardware import Borrow
from vmlend.sim.invariants import check_hardware
from vmlend.sim.p2pmap import P2PMapper
from vmlend.sim.pci import regs
from vmlend.sim.simvm import SimVm
from vmlend.topology.model import GiB

GPU, GPU2 = 0x10, 0x11  # both lent by alpha: only alpha's IOMMU is on a peer write's path


def start_with_p2p(cluster: Cluster, name: str, fdids: tuple[int, ...]) -> tuple[SimVm, P2PMapper]:
    p2p = P2PMapper(cluster.hw, "gamma", name)
    vm = cluster.start(domain_xml(name, 1 * GiB, fdids=fdids), p2p=p2p)
    for f in fdids:
        vm.enable_device(f)
    return vm, p2p


def bar1(vm: SimVm, fdid: int) -> int:
    (bar,) = [b for b in vm.bars(fdid) if b.index == 1]
    return bar.address


def hand_over_gpu2(cluster: Cluster, a: SimVm) -> SimVm:
    """VM a's GPU2 is released behind its back (a release after a crash), then VM b on the
    same node takes it and enables it."""
    assert cluster.fabric().release(GPU2, a.holder)
    for m in cluster.fabric().mdevs():
        if m.fdid == GPU2:
            cluster.fabric().remove_mdev(m.uuid)
    b = cluster.start(domain_xml("b", 1 * GiB, fdids=(GPU2,)))
    b.enable_device(GPU2)
    return b


def test_a_released_peer_is_unreachable_from_the_old_vm(cluster):
    a, p2p = start_with_p2p(cluster, "a", (GPU, GPU2))
    (t,) = cluster.hw.dma_write(GPU, bar1(a, GPU2), b"peer")
    assert (t.kind, t.owner) == ("bar", GPU2)
    b = hand_over_gpu2(cluster, a)
    assert cluster.hw.borrowed(GPU2).vm == "b"
    with pytest.raises(DmaFault) as e:
        cluster.hw.dma_write(GPU, bar1(a, GPU2), b"from VM A")
    assert e.value.hop == "lender-iommu"
    assert cluster.hw.device(GPU2).bars.read_bytes(1, 0, 9) == bytes(9)
    assert p2p.maps() == []
    assert check_hardware(cluster.hw) == []
    b.stop()
    a.stop()


def test_a_released_device_reaches_nothing_of_the_old_vm(cluster):
    a, _ = start_with_p2p(cluster, "a", (GPU, GPU2))
    b = hand_over_gpu2(cluster, a)
    with pytest.raises(DmaFault):
        cluster.hw.dma_write(GPU2, bar1(a, GPU), b"from VM B")
    assert cluster.hw.device(GPU).bars.read_bytes(1, 0, 9) == bytes(9)
    b.stop()
    a.stop()


def test_give_back_removes_windows_and_maps_in_the_same_step(cluster):
    a, p2p = start_with_p2p(cluster, "a", (GPU, GPU2))
    seen: list[tuple[int, int]] = []

    def observe(borrow: Borrow) -> None:
        # runs after every earlier subscriber: the mapper and the windows are done already
        seen.append((borrow.fdid, len(p2p.maps())))

    cluster.hw.on_borrow_end(observe)
    cluster.fabric().give_back(GPU2, a.holder)
    assert seen == [(GPU2, 0)]
    assert not a.session(GPU2).dma_active and a.session(GPU).dma_active
    assert cluster.hw.lender_domain(GPU2).mappings() == []
    assert check_hardware(cluster.hw) == []
    a.stop()


def test_a_failing_teardown_is_raised_and_fences_the_device(cluster):
    a, _ = start_with_p2p(cluster, "a", (GPU, GPU2))

    def broken(borrow: Borrow) -> None:
        raise RuntimeError("mapper lost its tables")

    remove = cluster.hw.on_borrow_end(broken)
    with pytest.raises(BorrowTeardownError, match="fenced"):
        cluster.fabric().release(GPU2, a.holder)
    # still the old VM's (nobody else can take it), but it neither masters nor decodes
    assert cluster.hw.borrowed(GPU2).vm == "a"
    assert cluster.hw.fenced(GPU2) is not None
    cmd = cluster.hw.device(GPU2).config.command
    assert not cmd & (regs.COMMAND_MASTER | regs.COMMAND_MEMORY)
    with pytest.raises(DmaFault):
        cluster.hw.dma_write(GPU, bar1(a, GPU2), b"x")
    with pytest.raises(DeviceHeldError):
        cluster.hw.borrow(GPU2, "gamma", "b")
    assert cluster.fabric().device(GPU2).holder == a.holder  # the hold was not dropped
    remove()
    assert cluster.fabric().release(GPU2, a.holder)  # a retry finishes the job
    assert cluster.hw.fenced(GPU2) is None and cluster.hw.borrowed(GPU2) is None
    assert check_hardware(cluster.hw) == []
    a.stop()


def test_a_fenced_device_with_bus_master_set_again_faults_at_the_fence(cluster):
    """The fence, not only the cleared Bus Master bit, stops a fenced device: a platform
    write (firmware, a lender-side tool) that turns Bus Master on again must not let its DMA
    through."""
    a, _ = start_with_p2p(cluster, "a", (GPU, GPU2))

    def broken(borrow: Borrow) -> None:
        raise RuntimeError("mapper lost its tables")

    remove = cluster.hw.on_borrow_end(broken)
    with pytest.raises(BorrowTeardownError):
        cluster.fabric().release(GPU2, a.holder)
    remove()
    config = cluster.hw.device(GPU2).config
    config.write(regs.COMMAND, 2, config.command | regs.COMMAND_MASTER, notify=False)
    assert config.bus_master and cluster.hw.fenced(GPU2) is not None
    for target in (0x10_0000, bar1(a, GPU)):  # the old VM's RAM, its peer's BAR
        with pytest.raises(DmaFault) as e:
            cluster.hw.dma_write(GPU2, target, b"after the fence")
        assert e.value.hop == "fenced"
    assert cluster.hw.device(GPU).bars.read_bytes(1, 0, 15) == bytes(15)
    assert cluster.fabric().release(GPU2, a.holder)  # a retry lifts the fence
    assert cluster.hw.fenced(GPU2) is None
    a.stop()


def _claims_and_holds(cluster: Cluster):
    with cluster.registry.read() as tx:
        return {"holds": tx.holds(), "claims": tx.claims()}


def test_lender_reclaim_ends_the_borrow_the_hold_and_the_mdev_in_one_step(cluster):
    a, p2p = start_with_p2p(cluster, "a", (GPU, GPU2))
    fabric = cluster.fabric()
    assert fabric.reclaim(GPU2) == a.holder
    # hardware: no borrow, no windows, no peer maps to or from it
    assert cluster.hw.borrowed(GPU2) is None
    assert not a.windows.active(GPU2)
    assert {(m.source, m.target) for m in p2p.maps()} == set()
    with pytest.raises(DmaFault):
        cluster.hw.dma_write(GPU, bar1(a, GPU2), b"peer")
    with pytest.raises(DmaFault):
        cluster.hw.dma_write(GPU2, 0x1000, b"ram")
    # registry: the hold, its claims and its mdev are gone; the device is still lent
    assert GPU2 not in fabric.holds()
    assert not [m for m in fabric.mdevs() if m.fdid == GPU2]
    assert fabric.device(GPU2).state.value == "available"
    assert check_hardware(cluster.hw, **_claims_and_holds(cluster)) == []
    # the guest cannot take the device back; its other device still works
    with pytest.raises(VmlendError):
        a.enable_device(GPU2)
    assert cluster.hw.borrowed(GPU2) is None
    (t,) = cluster.hw.dma_write(GPU, 0x1000, b"still mine")
    assert (t.kind, t.owner) == ("ram", "a")
    assert fabric.reclaim(GPU2) is None  # nobody holds it: nothing to take back
    a.stop()


def test_a_lender_going_down_ends_the_hardware_borrows_of_its_devices(cluster):
    a, p2p = start_with_p2p(cluster, "a", (GPU, GPU2))
    cluster.fabric().set_node_up("alpha", False, "lost power")
    for fdid in (GPU, GPU2):
        assert cluster.hw.borrowed(fdid) is None
        with pytest.raises(DmaFault):
            cluster.hw.dma_write(fdid, 0x1000, b"ram")
    assert p2p.maps() == [] and not a.windows.devices()
    # the holds stay, no longer borrowed, for their holder (or reconcile) to release
    holds = cluster.fabric().holds()
    assert {f: h.phase.value for f, h in holds.items()} == {GPU: "reserved", GPU2: "reserved"}
    assert check_hardware(cluster.hw, **_claims_and_holds(cluster)) == []
    a.stop()


def test_same_name_and_uuid_on_two_nodes_are_two_vms(cluster):
    """VM "web" with one UUID runs on gamma and on alpha (a domain defined on both hosts):
    holder identity includes the node, so give-back, reclaim and release of one never touch
    the other's device."""
    beta_gpu = 0x20
    xml_g = domain_xml("web", 1 * GiB, fdids=(GPU,))
    xml_a = domain_xml("web", 1 * GiB, fdids=(beta_gpu,))
    g = cluster.start(xml_g)
    a = cluster.start(xml_a, node="alpha")
    g.enable_device(GPU)
    a.enable_device(beta_gpu)
    assert (g.holder.vm, g.holder.vm_uuid) == (a.holder.vm, a.holder.vm_uuid)
    alpha, gamma = cluster.fabric("alpha"), cluster.fabric("gamma")

    def gamma_web_keeps_its_gpu() -> None:
        assert gamma.device(GPU).holder == g.holder
        assert cluster.hw.borrowed(GPU).node == "gamma"
        g.dma_write(GPU, 0x10_0000, b"gamma")
        assert g.guest.read(0x10_0000, 5) == b"gamma"

    # alpha's web cannot give back, or release, what gamma's web holds
    with pytest.raises(DeviceHeldError):
        alpha.give_back(GPU, a.holder)
    assert not alpha.release(GPU, a.holder)
    gamma_web_keeps_its_gpu()
    # the lender takes alpha's web's device back: gamma's web keeps its own
    assert cluster.fabric("beta").reclaim(beta_gpu) == a.holder
    gamma_web_keeps_its_gpu()
    # alpha's web stops and its release hook runs
    a.stop()
    cluster.release(xml_a, node="alpha")
    gamma_web_keeps_its_gpu()
    assert check_hardware(cluster.hw) == []
    g.stop()
    cluster.release(xml_g)
    assert gamma.device(GPU).holder is None
