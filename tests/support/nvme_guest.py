"""The guest side of the NVMe tests: the guest's view of its controller's BAR0 and its RAM, for
``vmlend.sim.nvme.driver.NvmeDriver`` acting as the guest's unmodified driver, and the domain XML
of a VM that asks for a share."""

from __future__ import annotations

import uuid
from contextlib import contextmanager
from pathlib import Path

from vmlend.domain import DeviceRequest, DomainSpec, NvmeShareRequest, TemplateSet, new_domain
from vmlend.sim.guest import SimGuest
from vmlend.sim.nvme.driver import BumpAllocator, NvmeDriver
from vmlend.sim.simvm import SimVm
from vmlend.topology.model import MiB


class VmBar0:
    """BAR0 of ``fdid`` as the guest CPU reaches it (its guest-physical BAR address)."""

    def __init__(self, vm: SimVm, fdid: int) -> None:
        self.vm = vm
        self.base = next(b.address for b in vm.bars(fdid) if b.index == 0)

    def read(self, offset: int, size: int) -> int:
        return self.vm.mmio_read(self.base + offset, size)

    def write(self, offset: int, size: int, value: int) -> None:
        self.vm.mmio_write(self.base + offset, size, value)


def guest_driver(
    mmio, guest: SimGuest, start: int = 16 * MiB, size: int = 16 * MiB, **timer
) -> NvmeDriver:
    """A driver whose queues and buffers live in guest RAM [start, start + size); ``timer``:
    its ``clock`` and command ``timeout``, and ``shadow_doorbells`` (False: a guest that
    never configures them)."""
    return NvmeDriver(mmio, guest, BumpAllocator(start, start + size), **timer)


def share_xml(
    name: str,
    queues: int = 1,
    size: int = 32 * MiB,
    *,
    fdid: int = 0x12,
    also: tuple[int, ...] = (),
    virt_type: str = "kvm",
    paths: int = 1,
) -> bytes:
    """A 256 MiB domain asking for a share (``queues`` pairs, ``size`` bytes, on ``paths``
    paths) of drive ``fdid`` and, whole, the devices ``also``; its UUID derived from
    ``name``."""
    spec = DomainSpec(
        name=name,
        memory_bytes=256 * MiB,
        uuid=uuid.uuid5(uuid.NAMESPACE_DNS, name),
        devices=[
            DeviceRequest(fdid, share=NvmeShareRequest(queues, size, paths)),
            *(DeviceRequest(f) for f in also),
        ],
        virt_type=virt_type,
    )
    return new_domain(spec, templates=TemplateSet()).to_bytes()


@contextmanager
def shared_drive(state_path: Path, directory: Path, *, fdid: int = 0x12, blocks: int = 1 << 20):
    """The default simulated cluster with drive ``fdid`` lent for queue-level sharing
    (``blocks`` blocks) and its manager running: ``(cluster, drive)``, both closed after."""
    from tests.support.simcluster import Cluster
    from vmlend.ledger import nvmeshares
    from vmlend.sim.nvmedrive import drive_geometry
    from vmlend.sim.nvmeshare import SharedNvmeDrive

    c = Cluster.create(state_path)
    nvmeshares.lend_shared(c.registry, fdid, drive_geometry(c.hw.device(fdid).spec, blocks))
    drive = SharedNvmeDrive(c.hw, fdid, directory, blocks=blocks)
    try:
        yield c, drive
    finally:
        drive.close()
        c.close()


def start_sharing_vm(c, drive, name: str, node: str):  # type: ignore[no-untyped-def]
    """VM ``name`` started by the hook on ``node`` with a one-pair share of ``drive``, its
    guest's driver up: ``(vm, driver, its first I/O queue pair)``."""
    xml = share_xml(name, fdid=drive.fdid)
    c.prepare(xml, node)
    vm = SimVm(xml, hardware=c.hw, fabric=c.fabric(node), nvme={drive.fdid: drive})
    vm.nvme_share(drive.fdid).set_master()
    driver = guest_driver(vm.nvme_share(drive.fdid).bar0, vm.guest)
    return vm, driver, driver.start(queues=1)[0]
