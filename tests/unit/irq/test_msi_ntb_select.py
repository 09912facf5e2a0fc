"""Choosing how a device's MSI/MSI-X reach the VM, end to end: the domain metadata
(``interrupts='ntb'|'relay'`` per device, with a per-VM default on ``<vmlend:vmlend>``), the real
hook (a subprocess of the simulated node ``sim:///gamma``) passing it to the reservation, the
guest's interrupts taking that path, and the fallback to the relay when the lender's window has
no segment left."""

from __future__ import annotations

import threading
import uuid

import pytest

from tests.support.simfabric import make_fabric
from vmlend.demo.cluster import DemoCluster
from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, new_domain, read_domain
from vmlend.errors import ConfigError
from vmlend.irq.records import RECORD_KIND
from vmlend.irq.vectors import IrqIndex
from vmlend.sim.msitarget import MSI_IOVA
from vmlend.topology.model import GiB, Holder, InterruptPath, MiB

NVME = 0x12  # on alpha, MSI and MSI-X: borrowed by gamma through alpha:0
GPU = 0x10  # on alpha too
VM_UUID = uuid.UUID("6f1c5a2e-0000-4000-8000-00000000000b")


def domain(
    *devices: DeviceRequest, interrupts: InterruptPath | None = None, memory: int = 512 * MiB
) -> bytes:
    spec = DomainSpec("web", memory, uuid=VM_UUID, devices=list(devices), interrupts=interrupts)
    return new_domain(spec, templates=TemplateSet()).to_bytes()


def lender_threads() -> list[str]:
    """Threads standing for lender-side software (the relay's lender reactor)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("irq-lender")]


@pytest.fixture
def cluster(state_path):
    make_fabric(state_path).close()
    cluster = DemoCluster(state_path)
    yield cluster
    cluster.close()


def start_and_load(cluster: DemoCluster, xml: bytes):
    hv = cluster.hypervisor("gamma")
    hv.define(xml)
    hv.start("web")  # runs the real hook: prepare reserves with the XML's interrupt path
    [wired] = cluster.guest("gamma").load_drivers("web")
    return hv, wired


def vector_paths(cluster: DemoCluster, fdid: int) -> set[str]:
    with cluster.registry.read() as tx:
        return {str(r.data["path"]) for r in tx.runtime(fdid, RECORD_KIND)}


def test_by_default_the_hook_maps_msix_over_the_ntb_with_no_lender_software(cluster):
    hv, wired = start_and_load(cluster, domain(DeviceRequest(NVME)))
    window = cluster.fabric("gamma").interrupt_window(NVME)
    assert window is not None and window.adapter == "alpha:0"
    assert wired.index is IrqIndex.MSIX and wired.path.startswith("ntb alpha->gamma")
    paths = vector_paths(cluster, NVME)
    assert paths and all(p.startswith("ntb") for p in paths)
    assert lender_threads() == []  # nothing on the lender handles the interrupts
    n = len(wired.eventfds)
    irqs = cluster.guest("gamma").guest("web").irqs
    assert irqs.fire(cluster.hw.device(NVME), 2 * n) == [2] * n
    assert lender_threads() == []
    hv.destroy("web")  # the release hook returns the device: the window goes with the hold
    assert cluster.fabric("gamma").interrupt_window(NVME) is None
    assert cluster.hw.lender_domain(NVME).lookup(MSI_IOVA) is None


def test_a_device_that_asks_for_the_relay_gets_the_relay(cluster):
    hv, wired = start_and_load(cluster, domain(DeviceRequest(NVME, interrupts=InterruptPath.RELAY)))
    assert cluster.fabric("gamma").interrupt_window(NVME) is None
    assert wired.path.startswith("relay alpha->gamma")
    assert lender_threads()  # the relay's lender side runs
    n = len(wired.eventfds)
    irqs = cluster.guest("gamma").guest("web").irqs
    assert irqs.fire(cluster.hw.device(NVME), n) == [1] * n
    hv.destroy("web")


def test_the_vms_default_applies_to_devices_that_do_not_say(cluster):
    xml = domain(
        DeviceRequest(NVME),
        DeviceRequest(GPU, interrupts=InterruptPath.NTB),
        interrupts=InterruptPath.RELAY,
    )
    info = read_domain(xml)
    assert [info.interrupts_of(d) for d in info.devices] == [
        InterruptPath.RELAY,
        InterruptPath.NTB,
    ]
    hv = cluster.hypervisor("gamma")
    hv.define(xml)
    hv.start("web")
    fabric = cluster.fabric("gamma")
    assert fabric.interrupt_window(NVME) is None
    assert fabric.interrupt_window(GPU) is not None
    hv.destroy("web")


def test_with_the_window_full_the_hook_falls_back_to_the_relay(cluster):
    fabric = cluster.fabric("gamma")
    usage = fabric.usage()["alpha:0"]
    seg, free = usage.adapter.segment_size, usage.segments_free
    # Another VM's DMA windows leave alpha's window exactly one segment: web's DMA window.
    other = Holder("gamma", "other", str(uuid.uuid4()))
    fabric.reserve(GPU, other, guest_ram=2 * GiB + (free - 2) * seg)
    assert fabric.usage()["alpha:0"].segments_free == 1
    hv, wired = start_and_load(cluster, domain(DeviceRequest(NVME)))
    assert fabric.usage()["alpha:0"].segments_free == 0
    assert fabric.interrupt_window(NVME) is None  # asked for the NTB, admitted on the relay
    assert wired.path.startswith("relay alpha->gamma")
    n = len(wired.eventfds)
    irqs = cluster.guest("gamma").guest("web").irqs
    assert irqs.fire(cluster.hw.device(NVME), n) == [1] * n
    hv.destroy("web")


def test_the_vms_default_needs_a_device_to_apply_to():
    with pytest.raises(ConfigError, match="give a --device"):
        domain(interrupts=InterruptPath.RELAY)


def test_a_bad_interrupt_path_is_refused():
    with pytest.raises(ConfigError, match="expected 'ntb' or 'relay'"):
        InterruptPath.parse("msi")
