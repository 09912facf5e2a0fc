"""A share child's files as text (docs/smartio-contract.md section 7, "Per share"): what vmlend
writes for a share, and what it reads back from the driver, damaged files included."""

from __future__ import annotations

import pytest

from vmlend.errors import SysfsAttributeError
from vmlend.kernel.sharefiles import (
    ShareReport,
    ShareState,
    ShareValues,
    compare_share,
    compare_state,
    format_clear,
    format_share,
    parse_share,
    parse_share_state,
    parse_shares,
    share_values,
)
from vmlend.nvme.shares import Geometry, ShareBook

GEOMETRY = Geometry(queue_pairs=511, dstrd=0, vectors=32, blocks=1 << 20)


def test_a_share_is_written_as_its_real_queues_vectors_window_and_tag():
    book = ShareBook(GEOMETRY)
    book.allocate("vm:a", 3, 4096)
    share = book.allocate("vm:b", 2, 2048)
    text = format_share(share_values(share, epoch=4))
    # the second page-mode share: real queue ids from its doorbell page's second slot on
    assert text == (
        "epoch 4\n"
        f"queues {share.qid_base + 1} 2\n"
        f"vectors {share.vector_base} 2\n"
        "lba 0x1000 0x800\n"
        f"asid {share.asid}\n"
    )
    assert share.real_qid(1) == share.qid_base + 1 and share.vector_base == 4
    assert parse_share(text, "f") == (4, share_values(share, 4))


def test_a_cmb_extent_is_written_and_read_back():
    book = ShareBook(Geometry(511, 0, 32, 1 << 20, cmb_bytes=1 << 20, entries=64))
    share = book.allocate("vm:a", 1, 8)
    values = share_values(share, 0)
    assert values.cmb is not None
    assert format_share(values).endswith(f"cmb {values.cmb[0]:#x} {values.cmb[1]:#x}\n")
    assert parse_share(format_share(values), "f") == (0, values)


def test_a_two_path_share_is_not_written():
    share = ShareBook(GEOMETRY).allocate("vm:a", 1, 8, paths=2)
    with pytest.raises(ValueError, match="2 paths"):
        share_values(share, 0)


def test_clear_and_the_file_never_written():
    assert format_clear(7) == "epoch 7\n"
    assert parse_share("epoch 7\n", "f") == (7, None)
    assert parse_share("", "f") == (0, None)


@pytest.mark.parametrize(
    "text",
    [
        "queues 1 2\n",  # no epoch first
        "epoch x\nqueues 1 2\nvectors 1 2\nlba 0 8\nasid 1\n",
        "epoch 1\nvectors 1 2\nqueues 1 2\nlba 0 8\nasid 1\n",  # out of order
        "epoch 1\nqueues 1 2\nqueues 1 2\nvectors 1 2\nlba 0 8\nasid 1\n",  # twice
        "epoch 1\nqueues 1 2\nvectors 1 2\nlba 0 8\n",  # no asid
        "epoch 1\nqueues 1\nvectors 1 2\nlba 0 8\nasid 1\n",  # a word short
        "epoch 1\nqueues 1 2\nvectors 1 2\nlba 0 8\nasid 1\ncolour blue\n",
    ],
)
def test_a_damaged_share_file_names_itself(text):
    with pytest.raises(SysfsAttributeError, match=r"nvme_share.*section 7"):
        parse_share(text, "/sys/x/smartio/nvme_share")


def test_the_state_none_active_and_damaged():
    assert not parse_share_state("none\n", "s").active
    values = ShareValues(2, 5, 2, 3, 2, 0x100, 0x80, 4)
    text = "active\n" + format_share(values) + "msi 2 0xfee00000\n"
    state = parse_share_state(text, "s")
    assert state.values == values and (state.msi_mapped, state.msi_target) == (2, 0xFEE00000)
    assert compare_state(values, state) == ""
    assert "runs no share" in compare_state(values, parse_share_state("none\n", "s"))
    other = ShareValues(2, 5, 2, 3, 2, 0x100, 0x80, 5)
    assert "vmlend wrote" in compare_state(other, state)
    unmapped = parse_share_state("active\n" + format_share(values) + "msi 0 -\n", "s")
    assert unmapped.msi_target is None
    for bad in ("mapped\n", "active\nmsi 0 -\n", "active\n" + format_share(values)):
        with pytest.raises(SysfsAttributeError):
            parse_share_state(bad, "s")


def test_the_devices_list_of_shares():
    uuid = "83B8F4F2-509F-382F-3C1E-E6BFE0FA1001"
    got = parse_shares(f"{uuid} 1 2 3 4 5 0x10 0x20 6\n", "l")
    assert got == {uuid.lower(): ShareValues(1, 2, 3, 4, 5, 0x10, 0x20, 6)}
    assert parse_shares("", "l") == {}
    with pytest.raises(SysfsAttributeError):
        parse_shares(f"{uuid} 1 2 3\n", "l")


def test_a_child_against_the_registrys_share():
    """``compare_share``: equal is None; other values or a lost run under the same epoch are
    rewritten; another epoch (either way) and damaged files are not."""
    mine = ShareValues(0, 5, 2, 3, 2, 0x100, 0x80, 4)
    running = ShareState(mine, 2, 0xFEE00000)
    assert compare_share(mine, ShareReport(0, mine, running)) is None
    assert compare_share(mine, ShareReport(0, mine, None)) is None  # no state file: doctor's
    other = ShareValues(0, 5, 2, 3, 2, 0x900, 0x80, 7)
    d = compare_share(mine, ShareReport(0, other, ShareState(other)))
    assert d is not None and d.rewrite and "lba 0x900 0x80; asid 7" in d.line
    assert "\n" not in d.line
    d = compare_share(mine, ShareReport(0, mine, ShareState(None)))
    assert d is not None and d.rewrite and d.line == "the driver runs no share for it"
    never = compare_share(mine, ShareReport(0, None, ShareState(None)))
    assert never is not None and never.rewrite and "no share written" in never.line
    newer = ShareValues(1, 5, 2, 3, 2, 0x100, 0x80, 4)
    d = compare_share(mine, ShareReport(1, newer, ShareState(newer)))  # a newer run at the child
    assert d is not None and not d.rewrite
    assert d.line == "its nvme_share has epoch 1, the registry's share epoch 0"
    d = compare_share(newer, ShareReport(0, None, ShareState(None)))  # never written: epoch 0
    assert d is not None and d.rewrite
    d = compare_share(ShareValues(2, 5, 2, 3, 2, 0x100, 0x80, 4), ShareReport(1, None, None))
    assert d is not None and not d.rewrite  # cleared under an older epoch than the registry's
    d = compare_share(mine, ShareReport(damaged="x: not a number"))
    assert d is not None and not d.rewrite and "damaged" in d.line
