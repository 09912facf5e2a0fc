"""What a failover reads of page-mode queues from guest memory (``vmlend.sim.nvme.takeover``):
the drive's position on a completion queue it filled, and the guest's shadow doorbells."""

from __future__ import annotations

import pytest

from vmlend.nvme import spec
from vmlend.sim.nvme.takeover import CqPosition, ShadowDoorbells, scan_cq

ENTRIES = 8
SQ = 513  # the real SQ id the drive writes into the entries


class Ram:
    """A little guest RAM: [0, size), reads outside it raise (as a guest's do)."""

    def __init__(self, size: int = 4 * spec.PAGE) -> None:
        self.data = bytearray(size)

    def read(self, address: int, length: int) -> bytes:
        if address < 0 or address + length > len(self.data):
            raise ValueError(f"no RAM at {address:#x}")
        return bytes(self.data[address : address + length])

    def write(self, address: int, data: bytes) -> None:
        self.data[address : address + len(data)] = data


def fill(ram: Ram, completions: int) -> None:
    """The drive posts ``completions`` entries in order from a zeroed ring, each reporting the
    SQ head after its command (the drive completes each command as it fetches it)."""
    tail, phase = 0, 1
    for n in range(completions):
        entry = spec.Completion(n, 0, SQ, (n + 1) % 32, phase)
        ram.write(tail * spec.CQE_SIZE, entry.encode())
        tail = (tail + 1) % ENTRIES
        if tail == 0:
            phase ^= 1


@pytest.mark.parametrize(
    ("completions", "expected"),
    [
        (0, CqPosition(0, 1, None)),  # zeroed: nothing written yet
        (3, CqPosition(3, 1, 3)),
        (ENTRIES, CqPosition(0, 0, ENTRIES)),  # a full lap: the tail wrapped, phase flipped
        (ENTRIES + 2, CqPosition(2, 0, ENTRIES + 2)),
        (2 * ENTRIES, CqPosition(0, 1, 2 * ENTRIES)),  # two laps: all phase 0, not "zeroed"
        (2 * ENTRIES + 5, CqPosition(5, 1, 2 * ENTRIES + 5)),
    ],
)
def test_the_drives_position_on_a_completion_queue(completions, expected):
    ram = Ram()
    fill(ram, completions)
    assert scan_cq(ram, 0, ENTRIES, SQ) == expected


def test_entries_of_another_queue_report_no_head():
    ram = Ram()
    fill(ram, 3)
    assert scan_cq(ram, 0, ENTRIES, SQ + 1).sq_head is None


def test_shadow_doorbells_follow_the_stride_and_refuse_bad_pages():
    ram = Ram()
    shadow = ShadowDoorbells(ram, dstrd=1)  # 8-byte doorbells
    assert shadow.value(1, False) is None  # not configured
    for buffer, eventidx in [(0, spec.PAGE), (100, spec.PAGE), (spec.PAGE, 0), (spec.PAGE, 1)]:
        assert shadow.configure(buffer, eventidx) == spec.SC_INVALID_FIELD
    assert shadow.configure(8 * spec.PAGE, spec.PAGE) == spec.SC_INVALID_FIELD  # no RAM
    assert not shadow.configured
    assert shadow.configure(spec.PAGE, 2 * spec.PAGE) == spec.SC_SUCCESS
    at = spec.PAGE + spec.doorbell_offset(2, True, 1) - spec.DOORBELL_BASE  # CQ 2 head
    ram.write(at, (5).to_bytes(4, "little"))
    assert shadow.value(2, True) == 5 and shadow.value(2, False) == 0
    shadow.clear()
    assert shadow.value(2, True) is None
