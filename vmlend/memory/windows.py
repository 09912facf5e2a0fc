"""DMA window planning: make a guest's RAM reachable for a remote device, low and high.

Pure: :func:`plan_dma_windows` checks everything and returns a :class:`DmaPlan` (or raises and
nothing is mapped); :func:`apply_plan` then programs three translation stages through duck-typed
objects with ``map(iova, phys, size)`` (and ``unmap(iova, size)`` for undo):

1. borrower IOMMU (per VM): IOVA = GPA -> the host frames backing the guest, so each window is
   one contiguous IOVA range; 1 GiB / 2 MiB pages where the host frames allow it.
2. NTB segments: lender-side window address of each segment -> borrower IOVA.
3. lender IOMMU (the device's domain): IOVA = GPA -> the NTB window address. The guest driver
   programs plain guest-physical addresses and the device's DMA lands in the right host page.

Segments are segment-size aligned in borrower IOVA (NTB translation alignment), so a window
covers its ranges rounded out to whole segments; only real RAM is mapped inside it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Protocol

import msgspec

from vmlend.errors import DmaLimitError, LayoutError, ResourceExhaustedError
from vmlend.memory.layout import FOUR_GIB, PAGE, merge_ranges
from vmlend.topology.model import AdapterSpec, Check, GiB, GuestRange, MiB

log = logging.getLogger(__name__)

#: IOMMU page sizes tried, largest first.
IOMMU_PAGE_SIZES = (GiB, 2 * MiB, PAGE)


class Mapper(Protocol):
    def map(self, iova: int, phys: int, size: int) -> None: ...


class FrameRun(msgspec.Struct, frozen=True):
    """Guest-physical [gpa, gpa+size) is backed by host-physical [host, host+size)."""

    gpa: int
    host: int
    size: int


class Mapping(msgspec.Struct, frozen=True):
    """One translation: [iova, iova+size) -> [phys, phys+size) in pages of ``page_size``."""

    iova: int
    phys: int
    size: int
    page_size: int = PAGE

    @property
    def entries(self) -> int:
        return self.size // self.page_size


class WindowPlan(msgspec.Struct, frozen=True):
    name: str  # "low", "high", or "low+high" when segments are too large to keep them apart
    ranges: tuple[GuestRange, ...]  # the RAM this window exposes
    span: GuestRange  # borrower IOVA covered by the window's segments (segment aligned)
    segments: tuple[int, ...]  # adapter segment indices, in window order
    borrower_maps: tuple[Mapping, ...]
    ntb_maps: tuple[Mapping, ...]  # iova = lender-side window address, phys = borrower IOVA
    lender_maps: tuple[Mapping, ...]  # iova = GPA, phys = lender-side window address

    def entries(self) -> dict[int, int]:
        """Borrower IOMMU entries per page size."""
        counts: dict[int, int] = {}
        for m in self.borrower_maps:
            counts[m.page_size] = counts.get(m.page_size, 0) + m.entries
        return counts


class DmaPlan(msgspec.Struct, frozen=True):
    adapter: str
    segment_size: int
    windows: tuple[WindowPlan, ...]
    checks: tuple[Check, ...]

    @property
    def segments_used(self) -> tuple[int, ...]:
        return tuple(s for w in self.windows for s in w.segments)

    def entries(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for w in self.windows:
            for size, n in w.entries().items():
                counts[size] = counts.get(size, 0) + n
        return counts


def runs_from_pages(pages: Iterable[tuple[int, int]], page: int = PAGE) -> list[FrameRun]:
    """Coalesce (gpa, host physical address) page pairs into runs contiguous on both sides."""
    runs: list[FrameRun] = []
    for gpa, host in sorted(pages):
        if gpa % page or host % page:
            raise LayoutError(f"page pair {gpa:#x} -> {host:#x} is not {page}-byte aligned")
        last = runs[-1] if runs else None
        if last and last.gpa + last.size == gpa and last.host + last.size == host:
            runs[-1] = FrameRun(last.gpa, last.host, last.size + page)
        elif last and gpa < last.gpa + last.size:
            raise LayoutError(f"guest page {gpa:#x} is backed twice")
        else:
            runs.append(FrameRun(gpa, host, page))
    return runs


def _align_down(v: int, a: int) -> int:
    return v - v % a


def _align_up(v: int, a: int) -> int:
    return -(-v // a) * a


def split_pages(
    iova: int, phys: int, size: int, sizes: Sequence[int] = IOMMU_PAGE_SIZES
) -> list[Mapping]:
    """Cover one contiguous run with the largest pages its alignment allows."""
    if size <= 0:
        return []
    for i, ps in enumerate(sizes):
        if (phys - iova) % ps:
            continue  # iova and phys disagree modulo ps: never both aligned
        lo, hi = _align_up(iova, ps), _align_down(iova + size, ps)
        if lo >= hi:
            continue
        if ps == sizes[-1]:
            return [Mapping(iova, phys, size, ps)]
        smaller = sizes[i + 1 :]
        head = split_pages(iova, phys, lo - iova, smaller)
        tail = split_pages(hi, phys + (hi - iova), iova + size - hi, smaller)
        return [*head, Mapping(lo, phys + (lo - iova), hi - lo, ps), *tail]
    raise LayoutError(f"run {iova:#x}+{size:#x} is not a whole number of {sizes[-1]}-byte pages")


def _borrower_maps(rng: GuestRange, runs: Sequence[FrameRun]) -> list[Mapping]:
    """Borrower IOMMU mappings IOVA = GPA -> host for ``rng``; LayoutError on a gap."""
    maps: list[Mapping] = []
    pos = rng.start
    for run in runs:
        if run.gpa + run.size <= pos or run.gpa >= rng.end:
            continue
        if run.gpa > pos:
            break
        end = min(run.gpa + run.size, rng.end)
        maps.extend(split_pages(pos, run.host + (pos - run.gpa), end - pos))
        pos = end
        if pos >= rng.end:
            break
    if pos < rng.end:
        raise LayoutError(
            f"no host frame backs guest-physical {pos:#x}; the guest's RAM "
            f"{rng.start:#x}-{rng.end:#x} must be pinned before it is mapped"
        )
    return maps


def _free_runs(free: Sequence[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for s in sorted(set(free)):
        if runs and runs[-1][-1] + 1 == s:
            runs[-1].append(s)
        else:
            runs.append([s])
    return runs


def _take_segments(free: list[int], count: int) -> tuple[int, ...]:
    """A contiguous run of ``count`` free segments if there is one (best fit), else the lowest."""
    fitting = [r for r in _free_runs(free) if len(r) >= count]
    chosen = min(fitting, key=len)[:count] if fitting else sorted(free)[:count]
    for s in chosen:
        free.remove(s)
    return tuple(chosen)


def _coalesce(maps: Iterable[Mapping]) -> list[Mapping]:
    out: list[Mapping] = []
    for m in maps:
        last = out[-1] if out else None
        if (
            last
            and last.page_size == m.page_size
            and last.iova + last.size == m.iova
            and last.phys + last.size == m.phys
        ):
            out[-1] = Mapping(last.iova, last.phys, last.size + m.size, m.page_size)
        else:
            out.append(m)
    return out


def _window(
    name: str,
    ranges: list[GuestRange],
    runs: Sequence[FrameRun],
    segments: tuple[int, ...],
    seg: int,
    ntb_base: int,
) -> WindowPlan:
    span = GuestRange(_align_down(ranges[0].start, seg), _align_up(ranges[-1].end, seg))
    borrower = [m for r in ranges for m in _borrower_maps(r, runs)]
    ntb = [
        Mapping(ntb_base + s * seg, span.start + i * seg, seg, seg) for i, s in enumerate(segments)
    ]
    lender: list[Mapping] = []
    for r in ranges:
        # split at segment boundaries: each chunk goes to its own segment's window address
        pos = r.start
        while pos < r.end:
            index = (pos - span.start) // seg
            chunk_end = min(r.end, span.start + (index + 1) * seg)
            addr = ntb_base + segments[index] * seg + (pos - span.start) % seg
            lender.extend(split_pages(pos, addr, chunk_end - pos))
            pos = chunk_end
    return WindowPlan(
        name=name,
        ranges=tuple(ranges),
        span=span,
        segments=segments,
        borrower_maps=tuple(_coalesce(borrower)),
        ntb_maps=tuple(_coalesce(ntb)),
        lender_maps=tuple(_coalesce(lender)),
    )


def _group_segments(group: Sequence[GuestRange], seg: int) -> int:
    return (_align_up(group[-1].end, seg) - _align_down(group[0].start, seg)) // seg


def window_groups(
    ram: Sequence[GuestRange], segment_size: int
) -> list[tuple[str, list[GuestRange]]]:
    """The guest's RAM split into the windows the planner maps: ``low`` (below 4 GiB) and
    ``high`` (from 4 GiB, hot-plug DIMMs included), or one ``low+high`` window when the
    segments are too large to keep the two apart. LayoutError for a range across 4 GiB."""
    ranges = merge_ranges(ram)
    seg = segment_size
    groups = [
        ("low", [r for r in ranges if r.start < FOUR_GIB]),
        ("high", [r for r in ranges if r.start >= FOUR_GIB]),
    ]
    groups = [(n, g) for n, g in groups if g]
    for _, g in groups:
        if g[-1].end > FOUR_GIB and g[0].start < FOUR_GIB:
            raise LayoutError(f"RAM range {g[0].start:#x}-{g[-1].end:#x} crosses 4 GiB")
    if len(groups) == 2 and _align_up(groups[0][1][-1].end, seg) > _align_down(
        groups[1][1][0].start, seg
    ):
        # segments larger than the gap: both windows would share a segment, so use one
        groups = [("low+high", groups[0][1] + groups[1][1])]
    return groups


def window_segments(ram: Sequence[GuestRange], segment_size: int) -> int:
    """How many NTB segments the DMA windows of a guest with RAM ``ram`` take: each window
    covers its ranges rounded out to whole segments, so the gaps between them (the PCI hole
    below 4 GiB, the space before hot-plug DIMMs) count where they share a segment with RAM.
    The planner maps exactly this many; admission claims exactly this many."""
    if segment_size <= 0 or segment_size % PAGE:
        raise LayoutError(f"NTB segment size {segment_size} is not a page multiple")
    return sum(_group_segments(g, segment_size) for _, g in window_groups(ram, segment_size))


def plan_dma_windows(
    ram: Sequence[GuestRange],
    backing: Sequence[FrameRun],
    adapter: AdapterSpec,
    free_segments: Iterable[int],
    dma_bits: int = 64,
    device: str = "device",
    ntb_base: int = 0,
) -> DmaPlan:
    """Plan the low and high DMA windows of one guest for one device; raise if anything is short.

    ``ram``: the guest's RAM ranges (from the layout, confirmed by the probe). ``backing``: the
    host frames behind them (see :func:`runs_from_pages`). ``adapter``/``free_segments``: the
    lender-side NTB adapter whose window the device uses and its unused segment indices.
    ``dma_bits``: the device's DMA address width. ``ntb_base``: the window's address on the
    lender. Refusals (LayoutError, ResourceExhaustedError, DmaLimitError) name what is short by
    how much; nothing is mapped by planning.
    """
    ranges = merge_ranges(ram)
    if not ranges:
        raise LayoutError("the guest has no RAM ranges to map")
    seg = adapter.segment_size
    if seg <= 0 or seg % PAGE:
        raise LayoutError(f"NTB segment size {seg} of {adapter.ref} is not a page multiple")
    checks: list[Check] = []

    limit = 1 << dma_bits
    top = ranges[-1].end
    if top > limit:
        raise DmaLimitError(device, dma_bits, top)
    checks.append(Check("dma-limit", True, f"guest RAM ends at {top:#x}, within {limit:#x}"))

    groups = window_groups(ranges, seg)
    need = {n: _group_segments(g, seg) for n, g in groups}
    total = sum(need.values())
    if total > adapter.segments:
        raise ResourceExhaustedError(
            "NTB window room", adapter.ref, total * seg, adapter.window_size, "bytes"
        )
    checks.append(
        Check("ntb-window", True, f"{total * seg} of {adapter.window_size} bytes", dict(need))
    )
    free = sorted(set(free_segments))
    bad = [s for s in free if not 0 <= s < adapter.segments]
    if bad:
        raise LayoutError(f"free segment indices {bad} are outside {adapter.ref}'s window")
    if total > len(free):
        raise ResourceExhaustedError("free NTB segments", adapter.ref, total, len(free), "segments")
    checks.append(Check("ntb-segments", True, f"{total} of {len(free)} free segments"))

    # `free` is a private copy: a refusal below (e.g. RAM not backed) changes nothing
    runs = sorted(backing, key=lambda r: r.gpa)
    windows: list[WindowPlan] = []
    taken: dict[str, tuple[int, ...]] = {}
    for name, _ in sorted(groups, key=lambda g: -need[g[0]]):  # biggest first: best fit
        taken[name] = _take_segments(free, need[name])
    for name, g in groups:
        windows.append(_window(name, g, runs, taken[name], seg, ntb_base))
    plan = DmaPlan(adapter.ref, seg, tuple(windows), tuple(checks))
    log.debug(
        "DMA plan for %s: segments %s, entries %s", device, plan.segments_used, plan.entries()
    )
    return plan


def _steps(
    plan: DmaPlan, borrower_iommu: Mapper, ntb: Mapper, lender_iommu: Mapper
) -> list[tuple[Mapper, Mapping]]:
    """Every map call of the plan in apply order: borrower IOMMU, NTB, lender IOMMU."""
    steps: list[tuple[Mapper, Mapping]] = []
    for w in plan.windows:
        steps += [(borrower_iommu, m) for m in w.borrower_maps]
    for w in plan.windows:
        steps += [(ntb, m) for m in w.ntb_maps]
    for w in plan.windows:
        steps += [(lender_iommu, m) for m in w.lender_maps]
    return steps


def apply_plan(plan: DmaPlan, borrower_iommu: Mapper, ntb: Mapper, lender_iommu: Mapper) -> None:
    """Program the plan: borrower IOMMU, then NTB segments, then lender IOMMU.

    The device side goes last so the device can never reach a window whose backing is not in
    place. If a ``map`` call fails, what was already mapped is unmapped (through
    ``unmap(iova, size)`` where the object has it) and the error is raised again.
    """
    done: list[tuple[Mapper, Mapping]] = []
    try:
        for stage, m in _steps(plan, borrower_iommu, ntb, lender_iommu):
            stage.map(m.iova, m.phys, m.size)
            done.append((stage, m))
    except Exception:
        _undo(done)
        raise


def unapply_plan(plan: DmaPlan, borrower_iommu: Mapper, ntb: Mapper, lender_iommu: Mapper) -> None:
    """Remove what :func:`apply_plan` mapped, in reverse order (device side first)."""
    _undo(_steps(plan, borrower_iommu, ntb, lender_iommu))


def _undo(done: list[tuple[Mapper, Mapping]]) -> None:
    for stage, m in reversed(done):
        unmap = getattr(stage, "unmap", None)
        if unmap is None:
            continue
        try:
            unmap(m.iova, m.size)
        except Exception:  # keep undoing the rest; the first error is what the caller sees
            log.warning("unmap %#x+%#x failed during undo", m.iova, m.size, exc_info=True)
