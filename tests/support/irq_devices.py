"""The devices the irq tests run on, and the guest-side helpers they use.

``make_device`` builds a real simulated device (vmlend.sim.device.SimDevice). The
helpers only write config space and BAR memory, as a guest driver does. No tests here.
"""

from __future__ import annotations

from typing import Any

from vmlend.irq import vectors as r
from vmlend.sim.device import SimDevice
from vmlend.sim.pci import regs
from vmlend.topology.model import BarKind, BarSpec, DeviceSpec, MsiSpec, MsixSpec

MSI_AT = 0x50
MSIX_AT = 0x70
TABLE_BAR = 2
TABLE_OFFSET = 0x1000
PBA_OFFSET = 0x2000


def make_device(
    msi_vectors: int = 0,
    msi64: bool = True,
    msix_entries: int = 0,
    pin: int = 1,
    fdid: int = 0x42,
) -> Any:
    """A device with the given interrupt capabilities (MSI maskable, MSI-X table in BAR 2)."""
    spec = DeviceSpec(
        fdid=fdid,
        lender="alpha",
        bdf="0000:41:00.0",
        kind="nic",
        vendor_id=0x8086,
        device_id=0x10FB,
        class_code=0x020000,
        bars=(BarSpec(TABLE_BAR, 0x4000, BarKind.MEM32),),
        intx_pin=pin,
        msi=MsiSpec(msi_vectors, msi64, maskable=True) if msi_vectors else None,
        msix=(
            MsixSpec(msix_entries, TABLE_BAR, TABLE_OFFSET, TABLE_BAR, PBA_OFFSET)
            if msix_entries
            else None
        ),
    )
    dev = SimDevice(spec, {TABLE_BAR: 0xFE00_0000})
    # what the guest's driver does first (pci_set_master): MSI and MSI-X need Bus Master
    dev.config.write(regs.COMMAND, 2, dev.config.read(regs.COMMAND, 2) | regs.COMMAND_MASTER)
    return dev


def msi_enable(config, vectors: int, address: int = 0xFEE0_0000, data: int = 0x4020) -> None:
    cap = config.find_capability(r.CAP_ID_MSI)
    flags = config.read(cap + 2, 2)
    wide = flags & r.MSI_FLAGS_64BIT
    config.write(cap + r.MSI_ADDR_LO, 4, address & 0xFFFF_FFFF)
    if wide:
        config.write(cap + r.MSI_ADDR_HI, 4, address >> 32)
    config.write(cap + (r.MSI_DATA_64 if wide else r.MSI_DATA_32), 2, data)
    qsize = (vectors.bit_length() - 1) << 4
    config.write(cap + 2, 2, (flags & ~r.MSI_FLAGS_QSIZE) | qsize | r.MSI_FLAGS_ENABLE)


def msi_disable(config) -> None:
    cap = config.find_capability(r.CAP_ID_MSI)
    config.write(cap + 2, 2, config.read(cap + 2, 2) & ~r.MSI_FLAGS_ENABLE)


def msi_mask(config, bits: int) -> None:
    cap = config.find_capability(r.CAP_ID_MSI)
    wide = config.read(cap + 2, 2) & r.MSI_FLAGS_64BIT
    config.write(cap + (r.MSI_MASK_64 if wide else r.MSI_MASK_32), 4, bits)


def msix_flags(config, enable: bool = True, maskall: bool = False) -> None:
    cap = config.find_capability(r.CAP_ID_MSIX)
    flags = config.read(cap + 2, 2) & ~(r.MSIX_FLAGS_ENABLE | r.MSIX_FLAGS_MASKALL)
    flags |= (r.MSIX_FLAGS_ENABLE if enable else 0) | (r.MSIX_FLAGS_MASKALL if maskall else 0)
    config.write(cap + 2, 2, flags)


def msix_program(bars, vector: int, masked: bool = False) -> None:
    base = TABLE_OFFSET + vector * r.MSIX_ENTRY_SIZE
    bars.write(TABLE_BAR, base + r.MSIX_ENTRY_ADDR_LO, 4, 0xFEE0_0000)
    bars.write(TABLE_BAR, base + r.MSIX_ENTRY_ADDR_HI, 4, 0)
    bars.write(TABLE_BAR, base + r.MSIX_ENTRY_DATA, 4, 0x4000 + vector)
    msix_mask(bars, vector, masked)


def msix_mask(bars, vector: int, masked: bool) -> None:
    base = TABLE_OFFSET + vector * r.MSIX_ENTRY_SIZE
    bars.write(TABLE_BAR, base + r.MSIX_ENTRY_CTRL, 4, int(masked))


def intx_disable(config, disabled: bool) -> None:
    cmd = config.read(r.COMMAND, 2) & ~r.COMMAND_INTX_DISABLE
    config.write(r.COMMAND, 2, cmd | (r.COMMAND_INTX_DISABLE if disabled else 0))
