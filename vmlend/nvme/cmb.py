"""The controller memory buffer (CMB) of a shared drive (pure): register encoding and extents.

Each command fetch from a submission queue in guest RAM is a read across the NTB and back
(SmartIO §7.4.1). A CMB puts the queues near the drive instead: NVMe lets a controller
expose memory of its own (CAP.CMBS, CMBLOC at 0x38, CMBSZ at 0x3C) and lets a host place
submission queues in it when CMBSZ.SQS is set. As NVMePass's virtual CMB does, the manager
backs it with lender memory and gives each share an extent of its own: the guest's CPU writes
its commands through the borrower's adapter (posted writes), the drive fetches them from the
lender's memory without crossing the NTB, and completions still go to guest RAM.

The guest sees its extent as its own CMB at offset 0 of BAR 2 of its virtual controller (as
QEMU's emulated NVMe does), at guest address ``GUEST_CMB_BASE``: a queue it creates there is a
queue in its extent, the only part of the CMB its address space maps.
"""

from __future__ import annotations

from collections.abc import Sequence

from vmlend.errors import ConfigError
from vmlend.nvme import spec

REG_CMBLOC = 0x38
REG_CMBSZ = 0x3C
#: CAP.CMBS (NVMe 1.4): the controller supports a controller memory buffer.
CAP_CMBS = 1 << 57

CMBSZ_SQS = 1 << 0  # submission queues may live in the CMB
CMBSZ_CQS = 1 << 1
CMBSZ_LISTS = 1 << 2
CMBSZ_RDS = 1 << 3
CMBSZ_WDS = 1 << 4
CMBSZ_SZU_SHIFT = 8  # size units: 0 = 4 KiB, 1 = 64 KiB, ... (x16 each)
CMBSZ_SZ_SHIFT = 12  # size, in size units (20 bits)
CMBLOC_OFST_SHIFT = 12  # offset in the BAR, in CMBSZ size units

#: The BAR the guest finds its CMB in (CMBLOC.BIR).
CMB_BAR = 2
#: Where the guest's CMB sits in its address space (and in its share's, for the drive's
#: fetches): above any guest RAM, below the guard's 47-bit address limit.
GUEST_CMB_BASE = 0x7000_0000_0000
UNIT = spec.PAGE  # extents are whole 4 KiB pages (CMBSZ.SZU = 0)


def cmbsz(size: int) -> int:
    """CMBSZ of a CMB of ``size`` bytes holding submission queues only (4 KiB units)."""
    units = size // UNIT
    if size % UNIT or not 0 < units < 1 << 20:
        raise ConfigError(
            f"a controller memory buffer is 4 KiB .. 4 GiB in whole 4 KiB pages, not {size}"
            " bytes; give --cmb such a size (or 0 for none)"
        )
    return CMBSZ_SQS | 0 << CMBSZ_SZU_SHIFT | units << CMBSZ_SZ_SHIFT


def cmbloc(bar: int = CMB_BAR, offset: int = 0) -> int:
    """CMBLOC of a CMB at ``offset`` bytes (whole units) into BAR ``bar``."""
    if not 0 <= bar <= 5 or offset % UNIT:
        raise ValueError(f"CMB in BAR {bar} at {offset:#x} cannot be described")
    return bar | (offset // UNIT) << CMBLOC_OFST_SHIFT


def decode_cmbsz(value: int) -> tuple[int, bool]:
    """(size in bytes, submission queues supported) of a CMBSZ value."""
    unit = UNIT << 4 * (value >> CMBSZ_SZU_SHIFT & 0xF)
    return (value >> CMBSZ_SZ_SHIFT) * unit, bool(value & CMBSZ_SQS)


def decode_cmbloc(value: int, size_unit: int = UNIT) -> tuple[int, int]:
    """(BAR index, byte offset) of a CMBLOC value."""
    return value & 0x7, (value >> CMBLOC_OFST_SHIFT) * size_unit


def extent_bytes(queue_pairs: int, entries: int) -> int:
    """The extent a share's submission queues take: ``queue_pairs`` queues of the largest
    size the controller allows (its guest chooses sizes later), in whole pages."""
    need = queue_pairs * entries * spec.SQE_SIZE
    return -(-need // UNIT) * UNIT


def place_extent(taken: Sequence[tuple[int, int]], need: int, size: int) -> int | None:
    """First offset of ``need`` free bytes in a CMB of ``size`` between ``taken`` (offset,
    bytes) extents; None when no gap is large enough."""
    at = 0
    for start, length in sorted(taken):
        if start - at >= need:
            return at
        at = max(at, start + length)
    return at if size - at >= need else None


def largest_free(taken: Sequence[tuple[int, int]], size: int) -> int:
    """The largest free extent of a CMB of ``size`` between ``taken`` extents."""
    best, at = 0, 0
    for start, length in sorted(taken):
        best = max(best, start - at)
        at = max(at, start + length)
    return max(best, size - at)
