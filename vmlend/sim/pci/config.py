"""A PCI type-0 configuration space with the write semantics of real hardware.

The space is 4096 little-endian bytes. Every byte has a write mask (bits software may change)
and a write-1-to-clear mask (error bits the device sets and software acknowledges); all other
bits are read-only. BAR sizing falls out of the masks: the address bits below the BAR's size are
read-only zero, so writing all ones and reading back yields the size mask with the type bits.

Capabilities are laid out as a real endpoint would: PCI Express at 0x40, MSI at 0x80, MSI-X at
0xa0 (only those the ``DeviceSpec`` declares), chained from the pointer at 0x34. Extended
configuration space (0x100..) holds an empty capability header.

Listeners see every write *after* it took effect, with the value as written (not as stored):
that is what an mdev emulation or an interrupt relay needs to react to "the guest set Bus
Master" or "the guest enabled MSI-X".
"""

from __future__ import annotations

import re
from collections.abc import Callable

import msgspec

from vmlend.errors import ConfigError
from vmlend.sim.pci import regs
from vmlend.topology.model import BarKind, BarSpec, DeviceSpec

ConfigListener = Callable[[int, int, int], None]

_BDF_RE = re.compile(r"^(?:[0-9a-fA-F]{4}:)?([0-9a-fA-F]{2}):([0-1][0-9a-fA-F])\.([0-7])$")

# Where the capabilities sit (fixed, so tests and docs can name them).
EXP_OFFSET = 0x40
MSI_OFFSET = 0x80
MSIX_OFFSET = 0xA0


def parse_bdf(bdf: str) -> int:
    """The 16-bit requester id (bus << 8 | device << 3 | function) of ``[dddd:]bb:dd.f``."""
    m = _BDF_RE.match(bdf.strip())
    if not m:
        raise ConfigError(f"bad PCI address {bdf!r}: expected e.g. 0000:41:00.0")
    bus, dev, fn = (int(g, 16) for g in m.groups())
    return bus << 8 | dev << 3 | fn


def write_hits(offset: int, size: int, value: int, reg: int, reg_size: int) -> int | None:
    """The bits of a write (``offset``, ``size``, ``value``) that land in the register
    [``reg``, ``reg + reg_size``), shifted to the register's bit 0; None when it misses.

    Bits of the register the write did not cover read as 0 in the result.
    """
    lo = max(offset, reg)
    hi = min(offset + size, reg + reg_size)
    if lo >= hi:
        return None
    nbytes = hi - lo
    part = (value >> (8 * (lo - offset))) & ((1 << (8 * nbytes)) - 1)
    return part << (8 * (lo - reg))


class MsiState(msgspec.Struct, frozen=True):
    """The MSI capability as software programmed it."""

    enabled: bool
    vectors_supported: int
    vectors_enabled: int
    bits64: bool
    maskable: bool
    address: int
    data: int
    mask: int  # bit per vector; 0 when not maskable
    pending: int


class MsixState(msgspec.Struct, frozen=True):
    """The MSI-X capability's control fields (the table itself lives in BAR memory)."""

    enabled: bool
    masked_all: bool
    table_size: int
    table_bar: int
    table_offset: int
    pba_bar: int
    pba_offset: int


class ConfigSpace:
    """One function's configuration space. Build it with ``from_spec``."""

    def __init__(self) -> None:
        self._data = bytearray(regs.CONFIG_SIZE)
        self._wmask = bytearray(regs.CONFIG_SIZE)
        self._w1c = bytearray(regs.CONFIG_SIZE)
        self._listeners: list[ConfigListener] = []
        self._bars: dict[int, BarSpec] = {}
        self._msi_offset: int | None = None
        self._msix_offset: int | None = None
        self._power_on = bytes(self._data)

    # --- construction ------------------------------------------------------------------------
    @classmethod
    def from_spec(cls, spec: DeviceSpec) -> ConfigSpace:
        """The power-on configuration space of ``spec``: BARs unassigned, decoding off."""
        cs = cls()
        cs._put(regs.VENDOR_ID, 2, spec.vendor_id)
        cs._put(regs.DEVICE_ID, 2, spec.device_id)
        cs._put(regs.CLASS_PROG, 3, spec.class_code)
        cs._put(regs.HEADER_TYPE, 1, 0x00)  # type 0, single function
        cs._put(regs.SUBSYSTEM_VENDOR_ID, 2, spec.vendor_id)
        cs._put(regs.SUBSYSTEM_ID, 2, spec.device_id)
        cs._put(regs.INTERRUPT_PIN, 1, spec.intx_pin)

        has_io = any(b.kind is BarKind.IO for b in spec.bars)
        command_rw = (
            regs.COMMAND_MEMORY
            | regs.COMMAND_MASTER
            | regs.COMMAND_PARITY
            | regs.COMMAND_SERR
            | regs.COMMAND_INTX_DISABLE
            | (regs.COMMAND_IO if has_io else 0)  # hardwired 0 without an I/O BAR
        )
        cs._rw(regs.COMMAND, 2, command_rw)
        cs._put(regs.STATUS, 2, regs.STATUS_CAP_LIST)
        cs._w1c_bits(regs.STATUS, 2, regs.STATUS_RW1C)
        cs._rw(regs.CACHE_LINE_SIZE, 1, 0xFF)
        cs._rw(regs.INTERRUPT_LINE, 1, 0xFF)

        for bar in spec.bars:
            cs._add_bar(bar)

        caps: list[int] = [EXP_OFFSET]
        cs._add_exp(EXP_OFFSET)
        if spec.msi is not None:
            cs._add_msi(MSI_OFFSET, spec.msi.vectors, spec.msi.bits64, spec.msi.maskable)
            caps.append(MSI_OFFSET)
        if spec.msix is not None:
            m = spec.msix
            cs._add_msix(
                MSIX_OFFSET, m.vectors, m.table_bar, m.table_offset, m.pba_bar, m.pba_offset
            )
            caps.append(MSIX_OFFSET)
        cs._put(regs.CAPABILITY_LIST, 1, caps[0])
        for here, nxt in zip(caps, [*caps[1:], 0], strict=True):
            cs._put(here + regs.CAP_NEXT, 1, nxt)
        cs._power_on = bytes(cs._data)
        return cs

    def _put(self, offset: int, size: int, value: int) -> None:
        self._data[offset : offset + size] = value.to_bytes(size, "little")

    def _rw(self, offset: int, size: int, mask: int) -> None:
        self._wmask[offset : offset + size] = mask.to_bytes(size, "little")

    def _w1c_bits(self, offset: int, size: int, mask: int) -> None:
        self._w1c[offset : offset + size] = mask.to_bytes(size, "little")

    def _add_bar(self, bar: BarSpec) -> None:
        self._bars[bar.index] = bar
        off = regs.BASE_ADDRESS_0 + 4 * bar.index
        if bar.kind is BarKind.IO:
            self._put(off, 4, regs.BAR_SPACE_IO)
            self._rw(off, 4, ~(bar.size - 1) & 0xFFFFFFFC)
            return
        flags = regs.BAR_MEM_PREFETCH if bar.prefetch else 0
        if bar.kind is BarKind.MEM64:
            flags |= regs.BAR_MEM_TYPE_64
            self._rw(off, 4, ~(bar.size - 1) & 0xFFFFFFF0)
            self._rw(off + 4, 4, ~((bar.size - 1) >> 32) & 0xFFFFFFFF)
        else:
            self._rw(off, 4, ~(bar.size - 1) & 0xFFFFFFF0)
        self._put(off, 4, flags)

    def _add_exp(self, at: int) -> None:
        self._put(at + regs.CAP_ID, 1, regs.CAP_ID_EXP)
        self._put(at + regs.EXP_FLAGS, 2, regs.EXP_FLAGS_VERSION_2 | regs.EXP_TYPE_ENDPOINT << 4)
        # Max payload 256 B supported, FLR capable (SmartIO resets a device between borrowers).
        self._put(at + regs.EXP_DEVCAP, 4, regs.EXP_DEVCAP_FLR | 0x1)
        self._put(at + regs.EXP_DEVCTL, 2, 0x2810)  # relaxed ordering, MRRS 512, no-snoop
        self._rw(at + regs.EXP_DEVCTL, 2, regs.EXP_DEVCTL_RW)
        self._w1c_bits(at + regs.EXP_DEVSTA, 2, regs.EXP_DEVSTA_RW1C)
        self._put(at + regs.EXP_LNKCAP, 4, 0x3 | 16 << 4)  # 8 GT/s, x16
        self._put(at + regs.EXP_LNKSTA, 2, 0x3 | 16 << 4)

    def _add_msi(self, at: int, vectors: int, bits64: bool, maskable: bool) -> None:
        qmask = vectors.bit_length() - 1
        flags = qmask << 1 | (regs.MSI_FLAGS_64BIT if bits64 else 0)
        flags |= regs.MSI_FLAGS_MASKBIT if maskable else 0
        self._put(at + regs.CAP_ID, 1, regs.CAP_ID_MSI)
        self._put(at + regs.MSI_FLAGS, 2, flags)
        self._rw(at + regs.MSI_FLAGS, 2, regs.MSI_FLAGS_ENABLE | regs.MSI_FLAGS_QSIZE)
        self._rw(at + regs.MSI_ADDRESS_LO, 4, 0xFFFFFFFC)  # dword aligned
        if bits64:
            self._rw(at + regs.MSI_ADDRESS_HI, 4, 0xFFFFFFFF)
        data = regs.MSI_DATA_64 if bits64 else regs.MSI_DATA_32
        self._rw(at + data, 2, 0xFFFF)
        if maskable:
            mask = regs.MSI_MASK_64 if bits64 else regs.MSI_MASK_32
            self._rw(at + mask, 4, (1 << vectors) - 1)
        self._msi_offset = at

    def _add_msix(
        self, at: int, vectors: int, table_bar: int, table_off: int, pba_bar: int, pba_off: int
    ) -> None:
        self._put(at + regs.CAP_ID, 1, regs.CAP_ID_MSIX)
        self._put(at + regs.MSIX_FLAGS, 2, vectors - 1)
        self._rw(at + regs.MSIX_FLAGS, 2, regs.MSIX_FLAGS_MASKALL | regs.MSIX_FLAGS_ENABLE)
        self._put(at + regs.MSIX_TABLE, 4, table_off | table_bar)
        self._put(at + regs.MSIX_PBA, 4, pba_off | pba_bar)
        self._msix_offset = at

    # --- software access -----------------------------------------------------------------------
    @staticmethod
    def _check(offset: int, size: int) -> None:
        if size not in (1, 2, 4):
            raise ValueError(f"config access size must be 1, 2 or 4, got {size}")
        if offset < 0 or offset + size > regs.CONFIG_SIZE:
            raise ValueError(f"config offset {offset:#x}+{size} is outside 0..{regs.CONFIG_SIZE}")
        if offset % size:
            raise ValueError(f"config access at {offset:#x} is not {size}-byte aligned")

    def read(self, offset: int, size: int) -> int:
        """Read 1, 2 or 4 bytes at a naturally aligned ``offset``."""
        self._check(offset, size)
        return int.from_bytes(self._data[offset : offset + size], "little")

    def write(self, offset: int, size: int, value: int, *, notify: bool = True) -> None:
        """Write as hardware does: only writable bits change, 1s clear RW1C bits; then tell the
        listeners. ``notify=False`` is for the platform (firmware, the lender kernel restoring
        state after a reset), whose writes are not the software the listeners watch."""
        self._check(offset, size)
        value &= (1 << (8 * size)) - 1
        for i in range(size):
            at = offset + i
            v = (value >> (8 * i)) & 0xFF
            w = self._wmask[at]
            b = (self._data[at] & ~w) | (v & w)
            self._data[at] = b & ~(v & self._w1c[at]) & 0xFF
        self._clamp_msi_qsize()
        if not notify:
            return
        for fn in list(self._listeners):
            fn(offset, size, value)

    def _clamp_msi_qsize(self) -> None:
        # Software may not enable more vectors than the function supports; hardware that
        # gets a larger value behaves as if given the maximum (we model the defensive choice).
        if self._msi_offset is None:
            return
        at = self._msi_offset + regs.MSI_FLAGS
        flags = self.read(at, 2)
        qmask = (flags & regs.MSI_FLAGS_QMASK) >> 1
        qsize = (flags & regs.MSI_FLAGS_QSIZE) >> 4
        if qsize > qmask:
            self._put(at, 2, (flags & ~regs.MSI_FLAGS_QSIZE) | qmask << 4)

    def add_listener(self, fn: ConfigListener) -> Callable[[], None]:
        """Call ``fn(offset, size, value)`` after every write; returns a function removing it."""
        self._listeners.append(fn)

        def remove() -> None:
            if fn in self._listeners:
                self._listeners.remove(fn)

        return remove

    # --- device side ---------------------------------------------------------------------------
    def set_status(self, bits: int) -> None:
        """The device sets status bits (errors, INTx asserted); software clears RW1C ones."""
        self._put(regs.STATUS, 2, self.read(regs.STATUS, 2) | bits)

    def set_msi_pending(self, vector: int, pending: bool) -> None:
        """The device records (or drops) a pending MSI message of a masked vector."""
        st = self.msi()
        if st is None or not st.maskable:
            raise ValueError("this function has no maskable MSI capability")
        if not 0 <= vector < st.vectors_supported:
            raise ValueError(f"MSI vector {vector} out of range 0..{st.vectors_supported - 1}")
        assert self._msi_offset is not None
        at = self._msi_offset + (regs.MSI_PENDING_64 if st.bits64 else regs.MSI_PENDING_32)
        bits = st.pending | 1 << vector if pending else st.pending & ~(1 << vector)
        self._put(at, 4, bits)

    def reset(self) -> None:
        """Function level reset: back to power-on contents (listeners stay)."""
        self._data[:] = self._power_on

    # --- decoded views -------------------------------------------------------------------------
    @property
    def command(self) -> int:
        return self.read(regs.COMMAND, 2)

    @property
    def status(self) -> int:
        return self.read(regs.STATUS, 2)

    @property
    def bus_master(self) -> bool:
        return bool(self.command & regs.COMMAND_MASTER)

    @property
    def bars(self) -> dict[int, BarSpec]:
        """The implemented BARs by index (a 64-bit BAR under its lower index)."""
        return dict(self._bars)

    def snapshot(self) -> bytes:
        return bytes(self._data)

    def find_capability(self, cap_id: int) -> int | None:
        """Offset of the first capability ``cap_id`` in the list at 0x34, or None."""
        if not self.status & regs.STATUS_CAP_LIST:
            return None
        at = self.read(regs.CAPABILITY_LIST, 1) & ~0x3
        seen = 0
        while at and seen < 48:  # 48 = (256 - 64) / 4: a longer chain is a loop
            if self.read(at + regs.CAP_ID, 1) == cap_id:
                return at
            at = self.read(at + regs.CAP_NEXT, 1) & ~0x3
            seen += 1
        return None

    def bar_address(self, index: int) -> int | None:
        """The base software programmed into BAR ``index``; None when it is unassigned (zero),
        being sized (all address bits set) or not implemented (including the upper half of a
        64-bit BAR)."""
        bar = self._bars.get(index)
        if bar is None:
            return None
        off = regs.BASE_ADDRESS_0 + 4 * index
        low_mask = int.from_bytes(self._wmask[off : off + 4], "little")
        low = self.read(off, 4) & low_mask
        masks = [(low, low_mask)]
        addr = low
        if bar.kind is BarKind.MEM64:
            high_mask = int.from_bytes(self._wmask[off + 4 : off + 8], "little")
            high = self.read(off + 4, 4) & high_mask
            masks.append((high, high_mask))
            addr |= high << 32
        if addr == 0 or any(m and v == m for v, m in masks):
            return None
        return addr

    def msi(self) -> MsiState | None:
        """The MSI capability as programmed; None when the function has none."""
        at = self._msi_offset
        if at is None:
            return None
        flags = self.read(at + regs.MSI_FLAGS, 2)
        bits64 = bool(flags & regs.MSI_FLAGS_64BIT)
        maskable = bool(flags & regs.MSI_FLAGS_MASKBIT)
        address = self.read(at + regs.MSI_ADDRESS_LO, 4)
        if bits64:
            address |= self.read(at + regs.MSI_ADDRESS_HI, 4) << 32
        data = self.read(at + (regs.MSI_DATA_64 if bits64 else regs.MSI_DATA_32), 2)
        mask = pending = 0
        if maskable:
            mask = self.read(at + (regs.MSI_MASK_64 if bits64 else regs.MSI_MASK_32), 4)
            pending = self.read(at + (regs.MSI_PENDING_64 if bits64 else regs.MSI_PENDING_32), 4)
        return MsiState(
            enabled=bool(flags & regs.MSI_FLAGS_ENABLE),
            vectors_supported=1 << ((flags & regs.MSI_FLAGS_QMASK) >> 1),
            vectors_enabled=1 << ((flags & regs.MSI_FLAGS_QSIZE) >> 4),
            bits64=bits64,
            maskable=maskable,
            address=address,
            data=data,
            mask=mask,
            pending=pending,
        )

    def msix(self) -> MsixState | None:
        """The MSI-X capability's fields; None when the function has none."""
        at = self._msix_offset
        if at is None:
            return None
        flags = self.read(at + regs.MSIX_FLAGS, 2)
        table = self.read(at + regs.MSIX_TABLE, 4)
        pba = self.read(at + regs.MSIX_PBA, 4)
        return MsixState(
            enabled=bool(flags & regs.MSIX_FLAGS_ENABLE),
            masked_all=bool(flags & regs.MSIX_FLAGS_MASKALL),
            table_size=(flags & regs.MSIX_FLAGS_QSIZE) + 1,
            table_bar=table & regs.MSIX_BIR,
            table_offset=table & regs.MSIX_OFFSET_MASK,
            pba_bar=pba & regs.MSIX_BIR,
            pba_offset=pba & regs.MSIX_OFFSET_MASK,
        )
