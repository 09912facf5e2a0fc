"""PCI type-0 configuration space: header, write masks, BAR sizing, capabilities."""

from __future__ import annotations

import pytest

from vmlend.errors import ConfigError
from vmlend.sim.pci import regs
from vmlend.sim.pci.config import ConfigSpace, parse_bdf, write_hits
from vmlend.topology.model import BarKind, BarSpec, DeviceSpec, GiB, MiB, MsiSpec, MsixSpec


def spec(**kw) -> DeviceSpec:
    base = dict(
        fdid=0x10,
        lender="alpha",
        bdf="0000:41:00.0",
        kind="gpu",
        vendor_id=0x10DE,
        device_id=0x1DB4,
        class_code=0x030200,
        bars=(
            BarSpec(0, 16 * MiB, BarKind.MEM32),
            BarSpec(1, 32 * GiB, BarKind.MEM64, prefetch=True),
            BarSpec(3, 16 * 1024, BarKind.MEM64),
            BarSpec(5, 256, BarKind.IO),
        ),
        msi=MsiSpec(vectors=8, bits64=True, maskable=True),
        msix=MsixSpec(vectors=16, table_bar=0, table_offset=0x2000, pba_bar=0, pba_offset=0x3000),
    )
    base.update(kw)
    return DeviceSpec(**base)


@pytest.fixture
def cs() -> ConfigSpace:
    return ConfigSpace.from_spec(spec())


def test_header_identifies_the_function(cs):
    assert cs.read(regs.VENDOR_ID, 2) == 0x10DE
    assert cs.read(regs.DEVICE_ID, 2) == 0x1DB4
    assert cs.read(0, 4) == 0x1DB4_10DE  # little endian
    assert cs.read(regs.CLASS_PROG, 1) == 0x00
    assert cs.read(0x0A, 2) == 0x0302  # subclass, base class
    assert cs.read(regs.HEADER_TYPE, 1) == 0
    assert cs.read(regs.INTERRUPT_PIN, 1) == 1
    assert cs.status & regs.STATUS_CAP_LIST


def test_identity_and_pin_are_read_only(cs):
    cs.write(regs.VENDOR_ID, 4, 0xFFFF_FFFF)
    cs.write(regs.INTERRUPT_PIN, 1, 3)
    cs.write(regs.CLASS_PROG, 1, 0xFF)
    assert cs.read(0, 4) == 0x1DB4_10DE
    assert cs.read(regs.INTERRUPT_PIN, 1) == 1
    assert cs.read(regs.CLASS_PROG, 1) == 0


def test_interrupt_line_is_writable(cs):
    cs.write(regs.INTERRUPT_LINE, 1, 11)
    assert cs.read(regs.INTERRUPT_LINE, 1) == 11


def test_command_only_defined_bits_stick(cs):
    cs.write(regs.COMMAND, 2, 0xFFFF)
    want = (
        regs.COMMAND_IO
        | regs.COMMAND_MEMORY
        | regs.COMMAND_MASTER
        | regs.COMMAND_PARITY
        | regs.COMMAND_SERR
        | regs.COMMAND_INTX_DISABLE
    )
    assert cs.command == want
    assert cs.bus_master
    cs.write(regs.COMMAND, 2, regs.COMMAND_MEMORY)
    assert cs.command == regs.COMMAND_MEMORY
    assert not cs.bus_master


def test_io_enable_is_hardwired_zero_without_io_bar():
    cs = ConfigSpace.from_spec(spec(bars=(BarSpec(0, 4096, BarKind.MEM32),)))
    cs.write(regs.COMMAND, 2, regs.COMMAND_IO | regs.COMMAND_MASTER)
    assert cs.command == regs.COMMAND_MASTER


def test_status_error_bits_are_write_one_to_clear(cs):
    cs.set_status(regs.STATUS_REC_MASTER_ABORT | regs.STATUS_SIG_TARGET_ABORT)
    cs.write(regs.STATUS, 2, 0)  # writing 0 changes nothing
    assert cs.status & regs.STATUS_REC_MASTER_ABORT
    cs.write(regs.STATUS, 2, regs.STATUS_REC_MASTER_ABORT | regs.STATUS_CAP_LIST)
    assert not cs.status & regs.STATUS_REC_MASTER_ABORT
    assert cs.status & regs.STATUS_SIG_TARGET_ABORT
    assert cs.status & regs.STATUS_CAP_LIST  # read-only bit survives the write of 1


def size_of(cs: ConfigSpace, index: int) -> tuple[int, int]:
    """What an OS does: save, write all ones, read back, restore. Returns (size, flags)."""
    off = regs.BASE_ADDRESS_0 + 4 * index
    saved = cs.read(off, 4)
    cs.write(off, 4, 0xFFFF_FFFF)
    probe = cs.read(off, 4)
    cs.write(off, 4, saved)
    if probe & regs.BAR_SPACE_IO:
        return (~(probe & ~0x3) + 1) & 0xFFFF_FFFF, probe & 0x3
    flags = probe & 0xF
    mask = probe & ~0xF
    if flags & regs.BAR_MEM_TYPE_64:
        saved_hi = cs.read(off + 4, 4)
        cs.write(off + 4, 4, 0xFFFF_FFFF)
        mask |= cs.read(off + 4, 4) << 32
        cs.write(off + 4, 4, saved_hi)
        return (~mask + 1) & (1 << 64) - 1, flags
    return (~mask + 1) & 0xFFFF_FFFF, flags


def test_bar_sizing_32_bit(cs):
    assert size_of(cs, 0) == (16 * MiB, 0)


def test_bar_sizing_64_bit_prefetchable_larger_than_4g(cs):
    size, flags = size_of(cs, 1)
    assert size == 32 * GiB
    assert flags == regs.BAR_MEM_TYPE_64 | regs.BAR_MEM_PREFETCH
    # The low dword has no address bits at all for a BAR of 4 GiB or more.
    cs.write(0x14, 4, 0xFFFF_FFFF)
    assert cs.read(0x14, 4) == regs.BAR_MEM_TYPE_64 | regs.BAR_MEM_PREFETCH


def test_bar_sizing_small_64_bit_and_io(cs):
    assert size_of(cs, 3) == (16 * 1024, regs.BAR_MEM_TYPE_64)
    assert size_of(cs, 5) == (256, regs.BAR_SPACE_IO)


def test_unimplemented_bar_reads_zero_and_ignores_writes():
    cs = ConfigSpace.from_spec(spec(bars=(BarSpec(0, 4096, BarKind.MEM32),)))
    cs.write(regs.BASE_ADDRESS_0 + 4, 4, 0xFFFF_FFFF)
    assert cs.read(regs.BASE_ADDRESS_0 + 4, 4) == 0
    assert cs.bar_address(1) is None


def test_bar_address_programmed_unassigned_and_sizing(cs):
    assert cs.bar_address(0) is None  # power on: unassigned
    cs.write(0x10, 4, 0x8100_0000)
    assert cs.bar_address(0) == 0x8100_0000
    cs.write(0x10, 4, 0x8123_4567)  # address bits below the size are read-only zero
    assert cs.bar_address(0) == 0x8100_0000
    cs.write(0x14, 4, 0)
    cs.write(0x18, 4, 0x120)
    assert cs.bar_address(1) == 0x120_0000_0000
    assert cs.bar_address(2) is None  # upper half of the 64-bit BAR 1
    cs.write(0x18, 4, 0xFFFF_FFFF)
    assert cs.bar_address(1) is None  # being sized
    cs.write(0x10, 4, 0xFFFF_FFFF)
    assert cs.bar_address(0) is None


def test_capability_walk_finds_each_capability(cs):
    exp = cs.find_capability(regs.CAP_ID_EXP)
    msi = cs.find_capability(regs.CAP_ID_MSI)
    msix = cs.find_capability(regs.CAP_ID_MSIX)
    assert cs.read(regs.CAPABILITY_LIST, 1) == exp
    assert {cs.read(exp, 1), cs.read(msi, 1), cs.read(msix, 1)} == {0x10, 0x05, 0x11}
    assert cs.find_capability(regs.CAP_ID_PM) is None
    # the chain ends
    assert cs.read(msix + 1, 1) == 0
    # capabilities sit in the legacy space, dword aligned
    assert all(0x40 <= c < 0x100 and c % 4 == 0 for c in (exp, msi, msix))


def test_no_msi_capabilities_when_spec_has_none():
    cs = ConfigSpace.from_spec(spec(msi=None, msix=None))
    assert cs.find_capability(regs.CAP_ID_MSI) is None
    assert cs.find_capability(regs.CAP_ID_MSIX) is None
    assert cs.msi() is None and cs.msix() is None
    assert cs.find_capability(regs.CAP_ID_EXP) is not None


def test_msi_64_bit_maskable_fields(cs):
    at = cs.find_capability(regs.CAP_ID_MSI)
    flags = cs.read(at + regs.MSI_FLAGS, 2)
    assert flags & regs.MSI_FLAGS_64BIT
    assert flags & regs.MSI_FLAGS_MASKBIT
    assert (flags & regs.MSI_FLAGS_QMASK) >> 1 == 3  # 8 vectors
    cs.write(at + regs.MSI_ADDRESS_LO, 4, 0xFEE0_1003)  # low two bits are read-only zero
    cs.write(at + regs.MSI_ADDRESS_HI, 4, 0x1)
    cs.write(at + regs.MSI_DATA_64, 2, 0x4041)
    cs.write(at + regs.MSI_MASK_64, 4, 0xFFFF_FFFF)
    cs.write(at + regs.MSI_FLAGS, 2, regs.MSI_FLAGS_ENABLE | 2 << 4)
    st = cs.msi()
    assert st.enabled and st.bits64 and st.maskable
    assert st.address == 0x1_FEE0_1000
    assert st.data == 0x4041
    assert st.mask == 0xFF  # only one bit per supported vector
    assert st.vectors_supported == 8 and st.vectors_enabled == 4
    # the read-only capability bits survived the flags write
    assert cs.read(at + regs.MSI_FLAGS, 2) & (regs.MSI_FLAGS_64BIT | regs.MSI_FLAGS_QMASK)


def test_msi_qsize_cannot_exceed_qmask(cs):
    at = cs.find_capability(regs.CAP_ID_MSI)
    cs.write(at + regs.MSI_FLAGS, 2, 5 << 4)  # ask for 32 vectors of 8
    assert cs.msi().vectors_enabled == 8


def test_msi_32_bit_layout_puts_data_at_8():
    cs = ConfigSpace.from_spec(spec(msi=MsiSpec(vectors=1, bits64=False, maskable=True)))
    at = cs.find_capability(regs.CAP_ID_MSI)
    cs.write(at + regs.MSI_DATA_32, 2, 0x1234)
    cs.write(at + regs.MSI_MASK_32, 4, 0xFFFF_FFFF)
    st = cs.msi()
    assert not st.bits64
    assert st.data == 0x1234 and st.mask == 0x1
    assert st.vectors_supported == 1
    cs.write(at + regs.MSI_FLAGS, 2, 0x70)
    assert cs.msi().vectors_enabled == 1


def test_msi_pending_is_read_only_to_software(cs):
    at = cs.find_capability(regs.CAP_ID_MSI)
    cs.write(at + regs.MSI_PENDING_64, 4, 0xFF)
    assert cs.msi().pending == 0
    cs.set_msi_pending(2, True)
    assert cs.msi().pending == 0b100
    cs.set_msi_pending(2, False)
    assert cs.msi().pending == 0
    with pytest.raises(ValueError):
        cs.set_msi_pending(8, True)


def test_msix_fields(cs):
    at = cs.find_capability(regs.CAP_ID_MSIX)
    st = cs.msix()
    assert st.table_size == 16
    assert (st.table_bar, st.table_offset, st.pba_bar, st.pba_offset) == (0, 0x2000, 0, 0x3000)
    assert not st.enabled and not st.masked_all
    cs.write(at + regs.MSIX_FLAGS, 2, 0xFFFF)
    st = cs.msix()
    assert st.enabled and st.masked_all and st.table_size == 16
    cs.write(at + regs.MSIX_TABLE, 4, 0xFFFF_FFFF)  # table location is read-only
    assert cs.msix().table_offset == 0x2000


def test_listeners_see_every_write_and_can_be_removed(cs):
    seen = []
    remove = cs.add_listener(lambda o, s, v: seen.append((o, s, v)))
    cs.write(regs.COMMAND, 2, regs.COMMAND_MASTER)
    cs.write(regs.VENDOR_ID, 2, 0x1234)  # read-only, still a write software made
    remove()
    cs.write(regs.COMMAND, 2, 0)
    assert seen == [(regs.COMMAND, 2, regs.COMMAND_MASTER), (regs.VENDOR_ID, 2, 0x1234)]


def test_listener_sees_state_after_the_write(cs):
    states = []
    cs.add_listener(lambda o, s, v: states.append(cs.bus_master))
    cs.write(regs.COMMAND, 2, regs.COMMAND_MASTER)
    assert states == [True]


def test_platform_writes_do_not_notify(cs):
    seen = []
    cs.add_listener(lambda *a: seen.append(a))
    cs.write(0x10, 4, 0x8000_0000, notify=False)
    assert seen == [] and cs.bar_address(0) == 0x8000_0000


def test_reset_restores_power_on(cs):
    cs.write(regs.COMMAND, 2, regs.COMMAND_MASTER)
    cs.write(0x10, 4, 0x8000_0000)
    cs.reset()
    assert cs.command == 0 and cs.bar_address(0) is None


@pytest.mark.parametrize(
    ("offset", "size"), [(0x04, 3), (0x05, 2), (0x02, 4), (4095, 2), (-1, 1), (4096, 1)]
)
def test_bad_accesses_are_refused(cs, offset, size):
    with pytest.raises(ValueError):
        cs.read(offset, size)
    with pytest.raises(ValueError):
        cs.write(offset, size, 0)


def test_config_space_is_4096_bytes(cs):
    assert len(cs.snapshot()) == 4096
    assert cs.read(0xFFC, 4) == 0


def test_pcie_flr_capable(cs):
    exp = cs.find_capability(regs.CAP_ID_EXP)
    assert cs.read(exp + regs.EXP_DEVCAP, 4) & regs.EXP_DEVCAP_FLR
    cs.write(exp + regs.EXP_DEVCTL, 2, regs.EXP_DEVCTL_BCR_FLR)
    assert not cs.read(exp + regs.EXP_DEVCTL, 2) & regs.EXP_DEVCTL_BCR_FLR  # reads 0


def test_parse_bdf():
    assert parse_bdf("0000:41:00.0") == 0x4100
    assert parse_bdf("82:00.3") == 0x8203
    assert parse_bdf("0000:00:1f.7") == 0x00FF
    with pytest.raises(ConfigError):
        parse_bdf("41:00")


def test_write_hits():
    assert write_hits(0x04, 4, 0x0010_0006, 0x06, 2) == 0x0010
    assert write_hits(0x04, 2, 0x6, 0x06, 2) is None
    assert write_hits(0x07, 1, 0x80, 0x06, 2) == 0x8000
