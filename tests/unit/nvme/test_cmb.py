"""The controller memory buffer, pure: CMBLOC/CMBSZ as the NVMe spec lays them out, and each
share's extent of it in the share book (disjoint, refused in one line when none fits, free
again at release, kept in the share's record)."""

from __future__ import annotations

import pytest

from vmlend.errors import CmbFullError, ConfigError
from vmlend.nvme import cmb
from vmlend.nvme.shares import Geometry, Share, ShareBook

KIB = 1024


def book(cmb_bytes: int) -> ShareBook:
    return ShareBook(Geometry(63, 0, 32, 1 << 20, "nvme 0x12", cmb_bytes, 1024))


def test_registers_as_the_spec_lays_them_out():
    value = cmb.cmbsz(256 * KIB)
    assert value & cmb.CMBSZ_SQS and not value & cmb.CMBSZ_CQS
    assert value >> 8 & 0xF == 0 and value >> 12 == 64  # 4 KiB units, 64 of them
    assert cmb.decode_cmbsz(value) == (256 * KIB, True)
    assert cmb.decode_cmbsz(1 << 8 | 3 << 12) == (3 * 64 * KIB, False)  # SZU 1: 64 KiB
    assert cmb.cmbloc(2, 0) == 2 and cmb.decode_cmbloc(cmb.cmbloc(2, 8 * KIB)) == (2, 8 * KIB)
    assert cmb.CAP_CMBS == 1 << 57


@pytest.mark.parametrize("size", [0, 1000, 4 * KIB + 1, 4 << 30])
def test_sizes_the_registers_cannot_describe_are_refused(size):
    with pytest.raises(ConfigError, match="--cmb"):
        cmb.cmbsz(size)


def test_extents_are_disjoint_and_sized_for_full_queues():
    b = book(512 * KIB)
    one = b.allocate("a", 1, 10)
    two = b.allocate("b", 3, 10)
    assert one.cmb_extent == (0, 64 * KIB)
    assert two.cmb_extent == (64 * KIB, 192 * KIB)
    assert b.allocate("c", 1, 10, paths=2).cmb_extent is None  # its relay keeps its queues


def test_no_room_is_one_line_and_allocates_nothing():
    b = book(128 * KIB)
    b.allocate("a", 1, 10)
    with pytest.raises(CmbFullError) as refused:
        b.allocate("b", 2, 10)
    message = str(refused.value)
    assert "\n" not in message
    assert "need 128 KiB, largest free extent 64 KiB of 128 KiB" in message
    assert "release a share" in message and "--cmb" in message
    assert sorted(b.shares) == ["a"]
    assert b.allocate("b", 1, 10).cmb_extent == (64 * KIB, 64 * KIB)


def test_release_returns_the_extent():
    b = book(128 * KIB)
    b.allocate("a", 1, 10)
    b.allocate("b", 1, 10)
    b.release("a")
    assert b.allocate("c", 1, 10).cmb_extent == (0, 64 * KIB)


def test_a_drive_without_cmb_gives_no_extent():
    assert book(0).allocate("a", 1, 10).cmb_extent is None


def test_the_extent_is_kept_in_the_record_and_adopt_refuses_overlaps():
    b = book(256 * KIB)
    a = b.allocate("a", 1, 10)
    assert Share.from_record(a.record()) == a
    old = {k: v for k, v in a.record().items() if not k.startswith("cmb")}
    assert Share.from_record(old).cmb_extent is None  # a record from before extents
    other = book(256 * KIB)
    other.adopt(a)
    clash = Share("b", 1, 10, 100, 9, 5, 9, a.mode, None, 1, 0, 32 * KIB, 64 * KIB)
    with pytest.raises(ConfigError, match="overlaps"):
        other.adopt(clash)
    beyond = Share("b", 1, 10, 100, 9, 5, 9, a.mode, None, 1, 0, 224 * KIB, 64 * KIB)
    with pytest.raises(ConfigError, match="beyond"):
        other.adopt(beyond)
