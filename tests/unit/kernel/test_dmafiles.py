"""The text of a child's ``dma_windows`` and ``dma_state`` (docs/smartio-contract.md section 8):
what vmlend writes, what it reads back, and what it makes of a difference."""

from __future__ import annotations

from pathlib import Path

import pytest

from vmlend.errors import LayoutError, SysfsAttributeError
from vmlend.kernel.dmafiles import (
    DmaState,
    DmaWord,
    MappedWindow,
    Window,
    WrittenWindows,
    compare_records,
    compare_windows,
    format_windows,
    parse_state,
    parse_windows,
    state_records,
    windows_for,
)
from vmlend.memory.layout import MemoryConfig, compute_layout
from vmlend.topology.model import GiB, GuestRange

P = Path("sys/bus/mdev/devices/u/smartio/dma_state")
SEG = 4 * GiB
#: An 8 GiB q35 guest: low RAM 0-2 GiB, high RAM 4-10 GiB (the contract's example).
RAM = compute_layout(MemoryConfig("q35", 8 * GiB)).ranges()
LOW = Window("low", (GuestRange(0, 2 * GiB),))
HIGH = Window("high", (GuestRange(4 * GiB, 10 * GiB),))


def test_the_contracts_example_is_what_vmlend_writes():
    windows = windows_for(RAM, SEG)
    assert windows == (LOW, HIGH)
    assert format_windows(42, windows) == (
        "token 42\nlow 0x0 0x80000000\nhigh 0x100000000 0x180000000\n"
    )


def test_segments_larger_than_the_gap_make_one_window():
    (only,) = windows_for(RAM, 64 * GiB)
    assert only.name == "low+high" and only.ranges == (LOW.ranges[0], HIGH.ranges[0])


def test_what_vmlend_writes_reads_back_equal():
    text = format_windows(7, (LOW, HIGH))
    assert parse_windows(text, P) == WrittenWindows(7, (LOW, HIGH))
    assert parse_windows("", P) is None  # nothing written yet


def test_more_ranges_than_a_driver_takes_is_refused_before_writing():
    many = tuple(GuestRange(i * 0x200000, i * 0x200000 + 0x1000) for i in range(65))
    with pytest.raises(LayoutError, match="at most 64"):
        format_windows(1, (Window("low", many),))


# recorded text of each state word, as section 8 prints them
MAPPED = "mapped\nlow 0 2 0x0 0xa0000 0xc0000 0x7ff40000\nhigh 0 0,1 0x100000000 0x180000000\n"


def test_mapped():
    s = parse_state(MAPPED, P)
    assert s.word is DmaWord.MAPPED
    assert s.windows == (
        MappedWindow("low", 0, (2,), (GuestRange(0, 0xA0000), GuestRange(0xC0000, 0x80000000))),
        MappedWindow("high", 0, (0, 1), (GuestRange(4 * GiB, 10 * GiB),)),
    )


def test_partial_and_a_device_of_the_vms_own_node():
    s = parse_state("partial\nlow - - 0x0 0x40000000\n", P)
    assert s == DmaState(DmaWord.PARTIAL, (MappedWindow("low", None, None, (GuestRange(0, GiB),)),))


def test_none():
    assert parse_state("none\n", P) == DmaState(DmaWord.NONE)


@pytest.mark.parametrize(
    ("text", "error", "reason"),
    [
        ("refused ENODATA no windows were written\n", "ENODATA", "no windows were written"),
        ("refused EFAULT page 0x7ff40000 does not pin", "EFAULT", "page 0x7ff40000 does not pin"),
        ("refused ENOSPC 2 of 3 segments free\n", "ENOSPC", "2 of 3 segments free"),
    ],
)
def test_refused(text, error, reason):
    s = parse_state(text, P)
    assert (s.word, s.error, s.reason) == (DmaWord.REFUSED, error, reason)
    assert s.summary() == f"refused {error}: {reason}"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "empty"),
        ("mapping\n", "unknown state"),
        ("refused\n", "refused <ERRNO> <reason>"),
        ("refused 61 no data\n", "refused <ERRNO> <reason>"),
        ("refused ENODATA\n", "refused <ERRNO> <reason>"),
        ("refused ENODATA x\nlow 0 0 0x0 0x1000\n", "one line"),
        ("none\nlow 0 0 0x0 0x1000\n", "maps nothing"),
        ("none now\n", "stands alone"),
        ("mapped\n", "no window"),
        ("mapped\nlow 0 - 0x0 0x1000\n", "both '-'"),
        ("mapped\nlow 0 1 0x0\n", "expected"),
        ("mapped\nlow 0 1 0x0 0x1000\nlow 0 1 0x2000 0x1000\n", "twice"),
        ("mapped\nmiddle 0 1 0x0 0x1000\n", "unknown window"),
        ("mapped\nlow 0 x 0x0 0x1000\n", "segment indices"),
        ("mapped\nlow 0 1 0x2000 0x1000 0x0 0x1000\n", "out of order"),
        ("mapped\nlow 0 1 0x0 0x0\n", "empty"),
        ("mapped\nlow 0 1 0x0 0x1000 0x1000 0x1000\n", "touching"),
    ],
)
def test_damaged_state_is_one_error_naming_the_file(text, problem):
    with pytest.raises(SysfsAttributeError, match=problem) as e:
        parse_state(text, P)
    assert "dma_state" in str(e.value)


@pytest.mark.parametrize(
    "text",
    [
        "low 0x0 0x1000\n",
        "token x\n",
        "token 1\nlow 0x0\n",
        "token 1\nlow 0x0 0x1000\nlow 0x2000 0x1000\n",
    ],
)
def test_damaged_windows(text):
    with pytest.raises(SysfsAttributeError):
        parse_windows(text, P)


def test_agreement_is_silent():
    written = WrittenWindows(5, (LOW, HIGH))
    assert compare_windows((LOW, HIGH), 5, written, DmaState(DmaWord.NONE)) == []
    # the legacy window left out of a mapping is no difference
    assert (
        compare_windows(
            (LOW, HIGH),
            5,
            written,
            parse_state(MAPPED, P),
        )
        == []
    )


def test_no_windows_written_is_repaired_by_a_write():
    (m,) = compare_windows((LOW, HIGH), 5, None, DmaState(DmaWord.NONE))
    assert m.rewrite and "no DMA windows written" in m.line and "reconcile --fix" in m.line


def test_other_windows_or_an_older_token():
    other = WrittenWindows(4, (LOW,))
    lines = compare_windows((LOW, HIGH), 5, other, DmaState(DmaWord.NONE))
    assert [m.rewrite for m in lines] == [True, True]
    assert "vmlend computed low 0x0-0x80000000; high" in lines[0].line
    assert "token 4, the hold's is 5" in lines[1].line


def test_while_mapped_only_a_restart_helps():
    other = WrittenWindows(5, (LOW,))
    state = parse_state("mapped\nlow 0 0 0x0 0x80000000\n", P)
    (m,) = compare_windows((LOW, HIGH), 5, other, state)
    assert not m.rewrite and "stop the VM and start it again" in m.line


def test_a_mapping_other_than_the_written_windows():
    written = WrittenWindows(5, (LOW, HIGH))
    state = parse_state("mapped\nlow 0 0 0x0 0x40000000\nhigh 0 1 0x100000000 0x180000000\n", P)
    (m,) = compare_windows((LOW, HIGH), 5, written, state)
    assert "the driver maps low 0x0-0x40000000" in m.line and not m.rewrite


def test_a_refusal_is_reported_and_only_enodata_is_repaired_by_writing():
    written = WrittenWindows(5, (LOW, HIGH))
    (m,) = compare_windows(
        (LOW, HIGH), 5, written, parse_state("refused EFAULT page 0x1000 does not pin\n", P)
    )
    assert "EFAULT page 0x1000 does not pin" in m.line and not m.rewrite
    (m,) = compare_windows(None, None, None, parse_state("refused ENODATA none written\n", P))
    assert m.rewrite


def _sizes(ref: str) -> int | None:
    return {"beta:0": SEG}.get(ref)


def test_a_mapped_state_becomes_one_record_per_window():
    text = "partial\nlow 0 0 0x0 0xa0000 0xc0000 0x7ff40000\nhigh 0 1,2 0x100000000 0x180000000\n"
    kept = state_records(parse_state(text, P), "u1", "beta", _sizes)
    assert kept.refusal is None
    assert kept.windows["low"] == {
        "gpa_start": 0,
        "gpa_end": 2 * GiB,
        "ranges": [[0, 0xA0000], [0xC0000, 2 * GiB]],
        "adapter": "beta:0",
        "segments": [0],
        "segment_size": SEG,
        "state": "partial",
    }
    assert kept.windows["high"]["segments"] == [1, 2]


def test_a_local_device_has_no_adapter_and_an_unknown_adapter_no_size():
    local = state_records(parse_state("mapped\nlow - - 0x0 0x1000\n", P), "u1", "beta", _sizes)
    assert (local.windows["low"]["adapter"], local.windows["low"]["segments"]) == (None, [])
    assert local.windows["low"]["segment_size"] is None
    other = state_records(parse_state("mapped\nlow 3 0 0x0 0x1000\n", P), "u1", "beta", _sizes)
    assert other.windows["low"]["adapter"] == "beta:3"
    assert other.windows["low"]["segment_size"] is None


def test_none_keeps_nothing_and_a_refusal_only_the_refusal():
    assert state_records(DmaState(DmaWord.NONE), "u1", "beta", _sizes).windows == {}
    refused = parse_state("refused ENOSPC too few free segments on beta:0\n", P)
    kept = state_records(refused, "u1", "beta", _sizes)
    assert kept.windows == {}
    assert kept.refusal == {
        "error": "ENOSPC",
        "reason": "too few free segments on beta:0",
        "mdev": "u1",
    }


def test_records_agree_with_what_is_mapped_or_say_what_differs():
    mapped = parse_state("mapped\nlow 0 0 0x0 0x80000000\n", P)
    assert compare_records([LOW], mapped) is None
    assert compare_records([], DmaState(DmaWord.NONE)) is None
    assert compare_records([LOW], None) is None  # no report: nothing to compare
    refused = parse_state("refused ENODATA no windows\n", P)
    assert compare_records([], refused) is None  # a refusal maps nothing
    line = compare_records([LOW], refused)
    assert line is not None and "records DMA windows low 0x0-0x80000000" in line
    assert "says refused (" in line
    line = compare_records([], mapped)
    assert line is not None and "records DMA windows none" in line and "says mapped low" in line


def test_the_segments_a_state_maps_are_counted_per_lender_adapter_once():
    from vmlend.kernel.dmafiles import mapped_segments, segment_drift

    text = "mapped\nlow 0 0 0x0 0x80000000\nhigh 1 3,4 0x100000000 0x100000000\n"
    state = parse_state(text, Path("dma_state"))
    used = mapped_segments(state, "alpha")
    assert used == {"alpha:0": {0}, "alpha:1": {3, 4}}
    assert segment_drift(used, {"alpha:0": 1, "alpha:1": 2}) == []
    assert segment_drift(used, {"alpha:0": 1}) == [
        "the driver maps the VM's DMA windows on alpha:1 with 2 segment(s), admission claimed 0"
    ]
    # a window crossing no NTB, or a driver that does not say, adds nothing; nor a refusal
    local = parse_state("mapped\nlow - - 0x0 0x80000000\n", Path("dma_state"))
    assert mapped_segments(local, "alpha") == {}
    refused = parse_state("refused ENODATA no windows\n", Path("dma_state"))
    assert mapped_segments(refused, "alpha") == {} and mapped_segments(None, "alpha") == {}
