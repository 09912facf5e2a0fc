"""The pin probe: find a guest's RAM ranges by asking whether single pages can be pinned.

The papers' method: RAM starts at well-known addresses (0, 4 GiB; 1 TiB under the AMD rule).
From each start, try pages at exponentially growing distances until pinning fails, then binary
search the last pinnable page: O(log n) probes per range instead of one per page. The probe
assumes what x86 guests give it: each range is contiguous from its start and ends before the
next well-known start. Holes inside a range are not looked for (that would take a probe per
page); the window planner finds them anyway, as pages without a host frame. The result is checked
against the computed layout, and any difference is a LayoutError — mapping a guessed range
would expose the wrong memory to a device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import msgspec

from vmlend.errors import LayoutError
from vmlend.memory.layout import (
    ABOVE_4G_START,
    AMD_ABOVE_1TB_START,
    PAGE,
    Layout,
    merge_ranges,
)
from vmlend.topology.model import GuestRange

log = logging.getLogger(__name__)

#: ``can_pin(gpa)``: can the page at guest-physical ``gpa`` be pinned?
PinOracle = Callable[[int], bool]
#: Starts probed even when the layout does not name them, to catch RAM it does not expect.
WELL_KNOWN_STARTS = (0, ABOVE_4G_START, AMD_ABOVE_1TB_START)
#: Highest guest-physical address considered (x86 has at most 52 physical address bits).
ADDRESS_LIMIT = 1 << 52


class ProbeResult(msgspec.Struct, frozen=True):
    ranges: tuple[GuestRange, ...]
    probes: int


class _Counter:
    """Wraps the oracle to count calls."""

    def __init__(self, can_pin: PinOracle) -> None:
        self.can_pin = can_pin
        self.calls = 0

    def __call__(self, gpa: int) -> bool:
        self.calls += 1
        return self.can_pin(gpa)


def _range_end(can_pin: PinOracle, start: int, page: int, limit: int) -> int:
    """End of the pinnable range that begins at ``start`` (which must be pinnable)."""
    good = start  # last page known pinnable
    step = page
    bad = None  # first page known not pinnable
    while bad is None:
        probe = start + step
        if probe >= limit:
            bad = limit
        elif can_pin(probe):
            good = probe
            step *= 2
        else:
            bad = probe
    # invariant: page `good` pins, page `bad` does not; pages are `page`-aligned offsets
    while bad - good > page:
        mid = good + ((bad - good) // page // 2) * page
        if can_pin(mid):
            good = mid
        else:
            bad = mid
    return good + page


def probe_ranges(
    can_pin: PinOracle,
    starts: Iterable[int] = WELL_KNOWN_STARTS,
    page: int = PAGE,
    limit: int = ADDRESS_LIMIT,
) -> ProbeResult:
    """Probe from each start; ranges found (merged, ascending) and the number of probes."""
    counter = _Counter(can_pin)
    found: list[GuestRange] = []
    ordered = sorted(set(starts))
    for i, start in enumerate(ordered):
        if start % page:
            raise LayoutError(f"probe start {start:#x} is not page aligned")
        if any(r.start <= start < r.end for r in found):
            continue  # already inside a range found from a lower start
        if start >= limit or not counter(start):
            continue
        # a range never runs into the next well-known start: without this bound the doubling
        # steps would leap over the PCI hole into high RAM and report one huge range
        bound = min(ordered[i + 1], limit) if i + 1 < len(ordered) else limit
        found.append(GuestRange(start, _range_end(counter, start, page, bound)))
    return ProbeResult(tuple(merge_ranges(found)), counter.calls)


def linear_walk(
    can_pin: PinOracle,
    starts: Iterable[int] = (0, ABOVE_4G_START),
    page: int = PAGE,
    limit: int = ADDRESS_LIMIT,
) -> ProbeResult:
    """The naive method: try every page from each start until one fails (for comparison)."""
    counter = _Counter(can_pin)
    found: list[GuestRange] = []
    for start in sorted(set(starts)):
        gpa = start
        while gpa < limit and counter(gpa):
            gpa += page
        if gpa > start:
            found.append(GuestRange(start, gpa))
    return ProbeResult(tuple(merge_ranges(found)), counter.calls)


def _fmt(ranges: Iterable[GuestRange]) -> str:
    return ", ".join(f"{r.start:#x}-{r.end:#x}" for r in ranges) or "none"


def probe_layout(can_pin: PinOracle, layout: Layout, page: int = PAGE) -> ProbeResult:
    """Probe the guest and check the result equals ``layout``; LayoutError on any difference.

    Probes from every range start of the layout and from the well-known starts, so RAM the
    layout does not expect (e.g. at 4 GiB when the layout says 1 TiB) is found too.
    """
    expected = layout.ranges()
    starts = {r.start for r in expected} | set(WELL_KNOWN_STARTS)
    result = probe_ranges(can_pin, starts, page)
    if list(result.ranges) != expected:
        raise LayoutError(
            f"probed guest RAM ({_fmt(result.ranges)}) differs from the layout computed for "
            f"machine {layout.machine.name} ({_fmt(expected)}); refusing to map it — check the "
            "domain XML (machine type, memory, max-ram-below-4g, CPU vendor)"
        )
    log.debug("probe matched layout with %d probes", result.probes)
    return result
