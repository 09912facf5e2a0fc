"""Put the NVMe controller model behind a simulated device's BAR0.

The controller's bus-master traffic goes through the simulator's resolver (``hw.dma_read`` /
``hw.dma_write``), so queues, PRP lists and data honour every window and fault like any DMA;
its completion interrupts are the device's (``raise_interrupt``), relayed by whoever listens.
A function level reset of the device resets the controller too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec

from vmlend.errors import FabricError, SharingUnsupportedError
from vmlend.nvme import spec
from vmlend.nvme.cmb import cmbsz
from vmlend.nvme.shares import Geometry
from vmlend.sim.device import SimDevice
from vmlend.sim.hardware import SimHardware
from vmlend.sim.hostmem import FRAME, FramedRange, HostMemory
from vmlend.sim.iommu import IommuDomain
from vmlend.sim.nvme.controller import ControllerConfig, NvmeController
from vmlend.sim.nvme.driver import BumpAllocator
from vmlend.sim.nvme.namespace import Namespace
from vmlend.topology.model import DeviceSpec


class ResolverDma:
    """The controller's DMA port: device ``fdid``'s requests resolved hop by hop."""

    def __init__(self, hardware: SimHardware, fdid: int) -> None:
        self.hw = hardware
        self.fdid = fdid

    def read(self, iova: int, length: int) -> bytes:
        return self.hw.dma_read(self.fdid, iova, length)

    def write(self, iova: int, data: bytes) -> None:
        self.hw.dma_write(self.fdid, iova, data)


def doorbell_room(device: DeviceSpec) -> int:
    """Bytes of BAR0 from the first doorbell to the next thing in the BAR (MSI-X table or PBA
    when they sit in BAR0, else the end of the BAR)."""
    bar0 = next((b for b in device.bars if b.index == 0), None)
    if bar0 is None or bar0.size <= spec.DOORBELL_BASE:
        raise SharingUnsupportedError(device.fdid, "BAR0 is too small for NVMe registers")
    end = bar0.size
    m = device.msix
    if m is not None:
        for bar, offset in ((m.table_bar, m.table_offset), (m.pba_bar, m.pba_offset)):
            if bar == 0 and offset >= spec.DOORBELL_BASE:
                end = min(end, offset)
    return end - spec.DOORBELL_BASE


def drive_config(device: DeviceSpec, dstrd: int = 0, entries: int = 1024) -> ControllerConfig:
    """What the device's BAR layout allows: as many queue pairs as doorbells fit."""
    slots = doorbell_room(device) // (4 << dstrd)
    pairs = min(slots // 2 - 1, 0xFFFE)
    if pairs < 1:
        raise SharingUnsupportedError(device.fdid, "BAR0 has no room for an I/O queue doorbell")
    vectors = device.msix.vectors if device.msix else 1
    return ControllerConfig(
        queue_pairs=pairs,
        entries=entries,
        dstrd=dstrd,
        vectors=vectors,
        serial=f"VMLEND{device.fdid:08X}",
        vendor_id=device.vendor_id,
    )


class SimNvmeDrive(msgspec.Struct):
    """A controller attached to a device, with its namespace."""

    device: SimDevice
    controller: NvmeController
    namespace: Namespace
    remove_reset: Callable[[], None]

    def close(self) -> None:
        self.remove_reset()
        self.controller.close()
        self.namespace.close()


def drive_geometry(device: DeviceSpec, blocks: int, cmb_bytes: int = 0) -> Geometry:
    """What the manager of ``device`` can share (``SharingUnsupportedError`` when nothing):
    the queue pairs its doorbells allow, its MSI-X vectors (one per queue pair), ``blocks``,
    and ``cmb_bytes`` of controller memory buffer for its shares' submission queues."""
    if device.kind != "nvme" or device.class_code >> 8 != 0x0108:
        raise SharingUnsupportedError(device.fdid, f"it is a {device.kind}, not an NVMe controller")
    if device.msix is None or device.msix.vectors < 2:
        raise SharingUnsupportedError(device.fdid, "it has no MSI-X vectors to give each VM")
    cfg = drive_config(device)
    if cmb_bytes:
        cmbsz(cmb_bytes)  # a size the registers can describe, or ConfigError
    return Geometry(
        cfg.queue_pairs,
        cfg.dstrd,
        cfg.vectors,
        blocks,
        f"nvme {device.fdid:#x}",
        cmb_bytes,
        cfg.entries,
    )


def attach_nvme(
    hardware: SimHardware,
    fdid: int,
    directory: Path,
    *,
    blocks: int = 1 << 21,
    block_size: int = 512,
    config: ControllerConfig | None = None,
) -> SimNvmeDrive:
    """Make device ``fdid`` an NVMe drive whose namespace 1 (``blocks`` blocks) lives in a
    sparse file under ``directory``."""
    device = hardware.device(fdid)
    cfg = config or drive_config(device.spec)
    if cfg.doorbell_end() > spec.DOORBELL_BASE + doorbell_room(device.spec):
        raise FabricError(
            f"device {fdid:#x}: {cfg.queue_pairs} queue pairs' doorbells do not fit in BAR0"
        )
    ns = Namespace(1, Path(directory) / f"nvme-{fdid:x}-ns1.img", blocks, block_size)

    def msix_on() -> bool:
        state = device.config.msix()
        return bool(state and state.enabled)

    controller = NvmeController(
        device.bars,
        ResolverDma(hardware, fdid),
        device.raise_interrupt,
        [ns],
        cfg,
        msix_enabled=msix_on,
    )
    return SimNvmeDrive(device, controller, ns, device.on_reset(controller.function_reset))


class HostDmaMemory(FramedRange):
    """Lender memory of the drive's host driver (the manager), mapped for the drive at ``iova``
    (frames need not be contiguous: each is mapped on its own)."""

    def __init__(
        self, memory: HostMemory, domain: IommuDomain, iova: int, size: int, owner: str
    ) -> None:
        super().__init__(memory, "the manager's memory", base=iova)
        self.domain = domain
        self.iova = iova
        try:
            for i in range(size // FRAME):
                frame = memory.alloc(FRAME, owner=owner)
                self.frames.append(frame)
                domain.map(iova + i * FRAME, frame, FRAME)
        except Exception:
            self.close()
            raise
        self.alloc = BumpAllocator(iova, iova + size)

    def close(self) -> None:
        for i, frame in enumerate(self.frames):
            if self.domain.lookup(self.iova + i * FRAME) is not None:
                self.domain.unmap(self.iova + i * FRAME, FRAME)
            self.memory.free(frame)
        self.frames = []


class DeviceBar0:
    """BAR0 as the lender's CPU reaches it (the manager's driver)."""

    def __init__(self, device: SimDevice) -> None:
        self.bars = device.bars

    def read(self, offset: int, size: int) -> int:
        return self.bars.read(0, offset, size)

    def write(self, offset: int, size: int, value: int) -> None:
        self.bars.write(0, offset, size, value)
