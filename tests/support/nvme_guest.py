"""The guest side of the NVMe tests: the guest's view of its controller's BAR0 and its RAM, for
``vmlend.sim.nvme.driver.NvmeDriver`` acting as the guest's unmodified driver, and the domain XML
of a VM that asks for a share."""

from __future__ import annotations

import uuid

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
