"""Which interrupt vectors the guest enabled, read from config space and the MSI-X table.

``decode_setup`` is pure over two read functions; ``ConfigIrqWatcher`` re-decodes whenever the
guest writes config space or the MSI-X table and tells its subscribers when the outcome changed.
Register layout: pci_regs.h (see docs/interrupts.md).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from enum import IntEnum
from typing import Protocol

import msgspec

log = logging.getLogger(__name__)

# --- pci_regs.h ---------------------------------------------------------------------------
COMMAND = 0x04
COMMAND_INTX_DISABLE = 0x400
INTERRUPT_PIN = 0x3D

CAP_ID_MSI = 0x05
MSI_FLAGS = 2
MSI_FLAGS_ENABLE = 0x1
MSI_FLAGS_QSIZE = 0x70
MSI_FLAGS_64BIT = 0x80
MSI_FLAGS_MASKBIT = 0x100
MSI_ADDR_LO = 4
MSI_ADDR_HI = 8
MSI_DATA_32 = 8
MSI_DATA_64 = 12
MSI_MASK_32 = 12
MSI_MASK_64 = 16

CAP_ID_MSIX = 0x11
MSIX_FLAGS = 2
MSIX_FLAGS_QSIZE = 0x7FF
MSIX_FLAGS_MASKALL = 0x4000
MSIX_FLAGS_ENABLE = 0x8000
MSIX_TABLE = 4
MSIX_PBA = 8
MSIX_BIR = 0x7
MSIX_ENTRY_SIZE = 16
MSIX_ENTRY_ADDR_LO = 0
MSIX_ENTRY_ADDR_HI = 4
MSIX_ENTRY_DATA = 8
MSIX_ENTRY_CTRL = 12
MSIX_ENTRY_CTRL_MASKED = 0x1


class IrqIndex(IntEnum):
    """VFIO_PCI_*_IRQ_INDEX."""

    INTX = 0
    MSI = 1
    MSIX = 2


# --- what the relay needs from the device ---------------------------------------------------


class ConfigSpaceLike(Protocol):
    def read(self, offset: int, size: int) -> int: ...
    def add_listener(self, fn: Callable[[int, int, int], None]) -> Callable[[], None]: ...
    def find_capability(self, cap_id: int) -> int | None: ...
    def set_msi_pending(self, vector: int, pending: bool) -> None: ...


class BarMemoryLike(Protocol):
    def read(self, bar: int, offset: int, size: int) -> int: ...
    def write(self, bar: int, offset: int, size: int, value: int) -> None: ...
    def add_listener(self, fn: Callable[[int, int, int, int], None]) -> Callable[[], None]: ...
    def set_msix_pending(self, vector: int, pending: bool) -> None: ...


# --- the decoded state ----------------------------------------------------------------------


class MsixLocation(msgspec.Struct, frozen=True):
    """Where the MSI-X table and pending-bit array live (BAR index and offset)."""

    table_bar: int
    table_offset: int
    pba_bar: int
    pba_offset: int
    entries: int

    def entry_of(self, bar: int, offset: int) -> int | None:
        """The table entry a BAR access at ``offset`` touches, or None outside the table."""
        rel = offset - self.table_offset
        if bar != self.table_bar or rel < 0 or rel >= self.entries * MSIX_ENTRY_SIZE:
            return None
        return rel // MSIX_ENTRY_SIZE


class Message(msgspec.Struct, frozen=True):
    """An MSI/MSI-X message (address and data) as the guest programmed it."""

    address: int
    data: int


class IrqSetup(msgspec.Struct, frozen=True):
    """The vectors the guest enabled and which of them are masked.

    ``index`` None means no interrupt is enabled. ``masked`` already folds in the MSI-X function
    mask. ``messages`` are informational (the VMM routes them; the relay routes by vector).
    """

    index: IrqIndex | None = None
    count: int = 0
    masked: frozenset[int] = frozenset()
    function_masked: bool = False
    msix: MsixLocation | None = None
    maskable: bool = False
    messages: tuple[Message, ...] = ()  # not compared (see __eq__)

    # The watcher tells subscribers only when the setup changes (``new == old``): a guest
    # reprogramming a message alone is not a change for the relay, so equality and the hash
    # (equal objects hash equal) leave ``messages`` out.
    def _compared(self) -> tuple[object, ...]:
        return tuple(getattr(self, f) for f in self.__struct_fields__ if f != "messages")

    def __eq__(self, other: object) -> bool:
        if type(other) is not IrqSetup:
            return NotImplemented
        return self._compared() == other._compared()

    def __hash__(self) -> int:
        return hash(self._compared())

    @property
    def shape(self) -> tuple[IrqIndex | None, int]:
        """What decides which eventfds exist; a mask change keeps the shape."""
        return (self.index, self.count)


DISABLED = IrqSetup()

ReadConfig = Callable[[int, int], int]
ReadBar = Callable[[int, int, int], int]


def decode_msix(read: ReadConfig, read_bar: ReadBar, cap: int) -> IrqSetup | None:
    flags = read(cap + MSIX_FLAGS, 2)
    if not flags & MSIX_FLAGS_ENABLE:
        return None
    table = read(cap + MSIX_TABLE, 4)
    pba = read(cap + MSIX_PBA, 4)
    loc = MsixLocation(
        table_bar=table & MSIX_BIR,
        table_offset=table & ~MSIX_BIR,
        pba_bar=pba & MSIX_BIR,
        pba_offset=pba & ~MSIX_BIR,
        entries=(flags & MSIX_FLAGS_QSIZE) + 1,
    )
    function_masked = bool(flags & MSIX_FLAGS_MASKALL)
    masked: set[int] = set()
    messages = []
    for v in range(loc.entries):
        base = loc.table_offset + v * MSIX_ENTRY_SIZE
        ctrl = read_bar(loc.table_bar, base + MSIX_ENTRY_CTRL, 4)
        if function_masked or ctrl & MSIX_ENTRY_CTRL_MASKED:
            masked.add(v)
        addr = read_bar(loc.table_bar, base + MSIX_ENTRY_ADDR_LO, 4) | (
            read_bar(loc.table_bar, base + MSIX_ENTRY_ADDR_HI, 4) << 32
        )
        messages.append(Message(addr, read_bar(loc.table_bar, base + MSIX_ENTRY_DATA, 4)))
    return IrqSetup(
        IrqIndex.MSIX,
        loc.entries,
        frozenset(masked),
        function_masked,
        loc,
        maskable=True,
        messages=tuple(messages),
    )


def decode_msi(read: ReadConfig, cap: int) -> IrqSetup | None:
    flags = read(cap + MSI_FLAGS, 2)
    if not flags & MSI_FLAGS_ENABLE:
        return None
    count = 1 << ((flags & MSI_FLAGS_QSIZE) >> 4)
    wide = bool(flags & MSI_FLAGS_64BIT)
    address = read(cap + MSI_ADDR_LO, 4)
    if wide:
        address |= read(cap + MSI_ADDR_HI, 4) << 32
    data = read(cap + (MSI_DATA_64 if wide else MSI_DATA_32), 2)
    masked: frozenset[int] = frozenset()
    maskable = bool(flags & MSI_FLAGS_MASKBIT)
    if maskable:
        bits = read(cap + (MSI_MASK_64 if wide else MSI_MASK_32), 4)
        masked = frozenset(v for v in range(count) if bits >> v & 1)
    # Multiple-message MSI: vector v is sent with data | v (the low bits the device varies).
    messages = tuple(Message(address, data | v) for v in range(count))
    return IrqSetup(IrqIndex.MSI, count, masked, maskable=maskable, messages=messages)


def decode_setup(
    read: ReadConfig,
    read_bar: ReadBar,
    msi_cap: int | None,
    msix_cap: int | None,
) -> IrqSetup:
    """The enabled vectors. MSI-X wins over MSI, either over INTx (as a device behaves)."""
    if msix_cap is not None and (setup := decode_msix(read, read_bar, msix_cap)):
        return setup
    if msi_cap is not None and (setup := decode_msi(read, msi_cap)):
        return setup
    pin = read(INTERRUPT_PIN, 1)
    if pin and not read(COMMAND, 2) & COMMAND_INTX_DISABLE:
        return IrqSetup(IrqIndex.INTX, 1)
    return DISABLED


# --- watching the guest's writes ------------------------------------------------------------


class IrqSetupSource(Protocol):
    """Where a lender device learns its enabled vectors (config space, or fixed in a bench)."""

    def current(self) -> IrqSetup: ...
    def subscribe(self, fn: Callable[[IrqSetup], None]) -> Callable[[], None]: ...
    def set_pending(self, vector: int, pending: bool) -> None: ...
    def close(self) -> None: ...


class SimDeviceLike(Protocol):
    @property
    def config(self) -> ConfigSpaceLike: ...
    @property
    def bars(self) -> BarMemoryLike: ...
    def on_reset(self, fn: Callable[[], None]) -> Callable[[], None]: ...


OnReset = Callable[[Callable[[], None]], Callable[[], None]]


class ConfigIrqWatcher:
    """Decodes the setup after every guest write to config space or the MSI-X table.

    A function-level reset rewrites config space without guest writes; pass ``on_reset`` (a
    subscription, like ``SimDevice.on_reset``) so the watcher re-reads after one.
    """

    def __init__(
        self, config: ConfigSpaceLike, bars: BarMemoryLike, on_reset: OnReset | None = None
    ) -> None:
        self._config = config
        self._bars = bars
        self._msi_cap = config.find_capability(CAP_ID_MSI)
        self._msix_cap = config.find_capability(CAP_ID_MSIX)
        self._lock = threading.Lock()
        self._subscribers: list[Callable[[IrqSetup], None]] = []
        self._undelivered: deque[IrqSetup] = deque()  # decoded, in order, not yet delivered
        self._delivering = False  # a thread is delivering _undelivered now
        self._setup = self._decode()
        self._removers = [
            config.add_listener(self._on_config_write),
            bars.add_listener(self._on_bar_write),
        ]
        if on_reset is not None:
            self._removers.append(on_reset(self.refresh))

    @classmethod
    def for_device(cls, device: SimDeviceLike) -> ConfigIrqWatcher:
        return cls(device.config, device.bars, device.on_reset)

    def _decode(self) -> IrqSetup:
        return decode_setup(self._config.read, self._bars.read, self._msi_cap, self._msix_cap)

    def current(self) -> IrqSetup:
        return self._setup

    def subscribe(self, fn: Callable[[IrqSetup], None]) -> Callable[[], None]:
        self._subscribers.append(fn)
        return lambda: self._subscribers.remove(fn)

    def _on_config_write(self, offset: int, size: int, value: int) -> None:
        self.refresh()

    def _on_bar_write(self, bar: int, offset: int, size: int, value: int) -> None:
        loc = self._setup.msix
        if loc is not None and loc.entry_of(bar, offset) is not None:
            self.refresh()

    def refresh(self) -> None:
        """Re-read the device; tell subscribers if the setup changed.

        Subscribers see the setups in the order they were decoded, the last one last: two
        threads writing at once must not leave a stale setup (say, an old mask set) at the
        lender. Decoding queues the new setup under the lock; one thread at a time delivers
        the queue in order, outside the lock (a subscriber may write the device again). A
        thread that finds another delivering leaves its setup to it and returns."""
        with self._lock:
            new = self._decode()
            if new == self._setup:
                return
            log.debug("irq setup %s -> %s", self._setup, new)
            self._setup = new
            self._undelivered.append(new)
            if self._delivering:
                return
            self._delivering = True
        try:
            while True:
                with self._lock:
                    if not self._undelivered:
                        return
                    setup = self._undelivered.popleft()
                    subscribers = list(self._subscribers)
                for fn in subscribers:
                    fn(setup)
        finally:
            with self._lock:
                self._delivering = False

    def set_pending(self, vector: int, pending: bool) -> None:
        """Mirror a masked vector's pending state into the device (MSI-X PBA, MSI pending bits),
        where the guest reads it; a device-side update, not a guest write."""
        setup = self._setup
        if setup.index == IrqIndex.MSIX:
            self._bars.set_msix_pending(vector, pending)
        elif setup.index == IrqIndex.MSI and setup.maskable:
            self._config.set_msi_pending(vector, pending)

    def close(self) -> None:
        for remove in self._removers:
            remove()
        self._removers = []
        self._subscribers.clear()


class FixedIrqSetup:
    """A setup that never changes (benchmarks, devices configured out of band)."""

    def __init__(self, setup: IrqSetup) -> None:
        self._setup = setup

    def current(self) -> IrqSetup:
        return self._setup

    def subscribe(self, fn: Callable[[IrqSetup], None]) -> Callable[[], None]:
        return lambda: None

    def set_pending(self, vector: int, pending: bool) -> None:
        pass

    def close(self) -> None:
        pass
