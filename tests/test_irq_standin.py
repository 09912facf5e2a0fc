"""The devices the irq tests run on, and the guest-side helpers they use.

``make_device`` builds the real simulated device (vmlend.fabric.sim.device.SimDevice) when it
exists, else a minimal stand-in with the same API (the two were written in parallel). The
helpers only write config space and BAR memory, as a guest driver does. No tests here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vmlend.irq import vectors as r

try:
    from vmlend.fabric.sim.device import SimDevice

    from vmlend.fabric.model import BarKind, BarSpec, DeviceSpec, MsiSpec, MsixSpec
except ImportError:  # the simulated hardware is not merged yet
    SimDevice = None

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
    if SimDevice is None:
        return StandinDevice(msi_vectors, msi64, msix_entries, pin, fdid)
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
    return SimDevice(spec, {TABLE_BAR: 0xFE00_0000})


class StandinConfig:
    def __init__(self, pin: int = 1) -> None:
        self._data = bytearray(256)
        self._listeners: list[Callable[[int, int, int], None]] = []
        self._data[r.INTERRUPT_PIN] = pin
        self._last_cap = 0x34

    def add_cap(self, cap_id: int, at: int) -> None:
        self._data[self._last_cap] = at
        self._data[at] = cap_id
        self._data[at + 1] = 0
        self._last_cap = at + 1

    def read(self, offset: int, size: int) -> int:
        return int.from_bytes(self._data[offset : offset + size], "little")

    def poke(self, offset: int, size: int, value: int) -> None:
        self._data[offset : offset + size] = value.to_bytes(size, "little")

    def write(self, offset: int, size: int, value: int) -> None:
        self.poke(offset, size, value)
        for fn in list(self._listeners):
            fn(offset, size, value)

    def add_listener(self, fn: Callable[[int, int, int], None]) -> Callable[[], None]:
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn) if fn in self._listeners else None

    def find_capability(self, cap_id: int) -> int | None:
        at = self._data[0x34]
        while at:
            if self._data[at] == cap_id:
                return at
            at = self._data[at + 1]
        return None

    @property
    def command(self) -> int:
        return self.read(r.COMMAND, 2)

    def set_msi_pending(self, vector: int, pending: bool) -> None:
        at = MSI_AT + (r.MSI_MASK_64 if self.read(MSI_AT + 2, 2) & r.MSI_FLAGS_64BIT else 12) + 4
        bits = self.read(at, 4)
        self.poke(at, 4, bits | 1 << vector if pending else bits & ~(1 << vector))


class StandinBars:
    def __init__(self, entries: int) -> None:
        self._mem = {TABLE_BAR: bytearray(0x4000)}
        self._listeners: list[Callable[[int, int, int, int], None]] = []
        self.entries = entries

    def read(self, bar: int, offset: int, size: int) -> int:
        return int.from_bytes(self._mem[bar][offset : offset + size], "little")

    def write(self, bar: int, offset: int, size: int, value: int) -> None:
        self._mem[bar][offset : offset + size] = value.to_bytes(size, "little")
        for fn in list(self._listeners):
            fn(bar, offset, size, value)

    def add_listener(self, fn: Callable[[int, int, int, int], None]) -> Callable[[], None]:
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn) if fn in self._listeners else None

    def set_msix_pending(self, vector: int, pending: bool) -> None:
        at = PBA_OFFSET + vector // 8
        byte = self._mem[TABLE_BAR][at]
        bit = 1 << (vector % 8)
        self._mem[TABLE_BAR][at] = byte | bit if pending else byte & ~bit

    def msix_pending(self, vector: int) -> bool:
        return bool(self._mem[TABLE_BAR][PBA_OFFSET + vector // 8] >> (vector % 8) & 1)


class StandinDevice:
    def __init__(
        self,
        msi_vectors: int = 0,
        msi64: bool = True,
        msix_entries: int = 0,
        pin: int = 1,
        fdid: int = 0x42,
    ) -> None:
        self.fdid = fdid
        self.config = StandinConfig(pin)
        self.bars = StandinBars(msix_entries)
        self._sinks: list[Callable[[int], None]] = []
        self._reset_listeners: list[Callable[[], None]] = []
        if msi_vectors:
            self.config.add_cap(r.CAP_ID_MSI, MSI_AT)
            qmask = (msi_vectors.bit_length() - 1) << 1
            flags = qmask | r.MSI_FLAGS_MASKBIT | (r.MSI_FLAGS_64BIT if msi64 else 0)
            self.config.poke(MSI_AT + 2, 2, flags)
        if msix_entries:
            self.config.add_cap(r.CAP_ID_MSIX, MSIX_AT)
            self.config.poke(MSIX_AT + 2, 2, msix_entries - 1)
            self.config.poke(MSIX_AT + 4, 4, TABLE_OFFSET | TABLE_BAR)
            self.config.poke(MSIX_AT + 8, 4, PBA_OFFSET | TABLE_BAR)

    def reset(self) -> None:
        """Function level reset, as far as interrupts go: MSI and MSI-X off, INTx on."""
        for cap, enable in ((MSI_AT, r.MSI_FLAGS_ENABLE), (MSIX_AT, r.MSIX_FLAGS_ENABLE)):
            self.config.poke(cap + 2, 2, self.config.read(cap + 2, 2) & ~enable)
        self.config.poke(r.COMMAND, 2, 0)
        for fn in list(self._reset_listeners):
            fn()

    def on_reset(self, fn: Callable[[], None]) -> Callable[[], None]:
        self._reset_listeners.append(fn)
        return lambda: self._reset_listeners.remove(fn) if fn in self._reset_listeners else None

    def on_interrupt(self, fn: Callable[[int], None]) -> Callable[[], None]:
        self._sinks.append(fn)
        return lambda: self._sinks.remove(fn) if fn in self._sinks else None

    def raise_interrupt(self, vector: int) -> None:
        for fn in list(self._sinks):
            fn(vector)


# --- what a guest driver writes ---------------------------------------------------------------


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
