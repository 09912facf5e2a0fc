"""IOMMU domains with x86-style page tables (4 KiB, 2 MiB and 1 GiB pages) and the per-node
context table that says which requester is translated by which domain.

A domain stores runs of equal-sized pages (one run per ``map`` piece), so mapping 64 GiB with
1 GiB pages is 64 entries but one run; ``entries()`` still reports page-table entries, which is
what IOTLB pressure and the papers' numbers are about.
"""

from __future__ import annotations

import bisect

import msgspec

from vmlend.errors import DmaFault, IommuMappingError
from vmlend.sim.dirtylog import DirtyLog
from vmlend.topology.model import GiB, KiB, MiB

PAGE_SIZES: tuple[int, ...] = (1 * GiB, 2 * MiB, 4 * KiB)  # largest first
PAGE_4K = 4 * KiB


class Mapping(msgspec.Struct, frozen=True):
    """A run of pages of one size: [iova, iova + size) -> [phys, phys + size)."""

    iova: int
    phys: int
    size: int
    page_size: int
    writable: bool = True

    @property
    def end(self) -> int:
        return self.iova + self.size

    @property
    def pages(self) -> int:
        return self.size // self.page_size


class Requester(msgspec.Struct, frozen=True):
    """A DMA issuer as one node's IOMMU sees it: the 16-bit requester id and nothing else. A
    local function has its BDF; traffic that entered through an NTB adapter has the id that
    adapter's LUT entry assigned (on the adapter's bus)."""

    rid: int  # 16-bit bus/device/function

    def __str__(self) -> str:
        return f"{self.rid >> 8:02x}:{self.rid >> 3 & 0x1F:02x}.{self.rid & 7}"


def split_pages(iova: int, phys: int, size: int) -> list[tuple[int, int, int, int]]:
    """Cut [iova, iova+size) into runs, each using the largest page size that both addresses'
    alignment and the remaining length allow: (iova, phys, run size, page size)."""
    runs: list[tuple[int, int, int, int]] = []
    off = 0
    while off < size:
        a, p, left = iova + off, phys + off, size - off
        page = next(ps for ps in PAGE_SIZES if a % ps == 0 and p % ps == 0 and left >= ps)
        # Extend the run while the same page size keeps fitting; alignment is preserved.
        n = left // page
        if page != PAGE_SIZES[0]:
            bigger = PAGE_SIZES[PAGE_SIZES.index(page) - 1]
            # stop where a larger page would become possible (both sides aligned to it)
            if (a - p) % bigger == 0:
                to_boundary = (-a) % bigger
                if to_boundary and left - to_boundary >= bigger:
                    n = to_boundary // page
        runs.append((a, p, n * page, page))
        off += n * page
    return runs


class IommuDomain:
    """One I/O address space: per-device on a lender, per-VM on a borrower."""

    def __init__(self, name: str, owner: tuple[str, str] | None = None) -> None:
        self.name = name
        #: (node, vm) of the VM whose borrows justify the mappings; None: a device's own domain
        self.owner = owner
        self._starts: list[int] = []  # sorted iovas of the runs, parallel to _runs
        self._runs: list[Mapping] = []
        #: 4 KiB IOVA page numbers written through this domain since the log was last taken
        #: (None: not logging). A VM's domain maps IOVA = GPA, so these are guest pages a
        #: device dirtied: the dirty tracking a live migration copies them by (Intel VT-d's
        #: second-stage dirty bit, AMD's host-dirty bit; ``start_dirty_log``).
        self._dirty = DirtyLog()

    def __repr__(self) -> str:
        return f"IommuDomain({self.name!r}, {len(self._runs)} runs)"

    # --- changes -------------------------------------------------------------------------------
    def map(
        self,
        iova: int,
        phys: int,
        size: int,
        page_size: int | None = None,
        *,
        writable: bool = True,
    ) -> None:
        """Map [iova, iova+size) to [phys, phys+size).

        With ``page_size`` None the largest page size alignment allows is used piece by piece;
        with a given page size, all three values must be aligned to it. Refuses (changing
        nothing) when any part of the range is already mapped; ``mappings()`` shows the runs.
        """
        if size <= 0:
            raise IommuMappingError(self.name, iova, size, "size must be positive")
        if iova < 0 or phys < 0:
            raise IommuMappingError(self.name, iova, size, "addresses must not be negative")
        if page_size is None:
            if iova % PAGE_4K or phys % PAGE_4K or size % PAGE_4K:
                raise IommuMappingError(
                    self.name, iova, size, f"iova, phys ({phys:#x}) and size must be 4 KiB aligned"
                )
            # one 4 KiB page is the common call (scattered frames): skip the search
            runs = (
                [(iova, phys, size, PAGE_4K)] if size == PAGE_4K else split_pages(iova, phys, size)
            )
        else:
            if page_size not in PAGE_SIZES:
                raise IommuMappingError(
                    self.name, iova, size, f"page size {page_size:#x} is not 4 KiB, 2 MiB or 1 GiB"
                )
            if iova % page_size or phys % page_size or size % page_size:
                raise IommuMappingError(
                    self.name,
                    iova,
                    size,
                    f"iova, phys ({phys:#x}) and size must be aligned to the {page_size:#x} page",
                )
            runs = [(iova, phys, size, page_size)]
        clash = self._overlapping(iova, iova + size)
        if clash:
            m = clash[0]
            raise IommuMappingError(
                self.name, iova, size, f"overlaps the mapping {m.iova:#x}+{m.size:#x}; unmap first"
            )
        added = [Mapping(a, p, n, ps, writable) for a, p, n, ps in runs]
        for m in added:
            i = bisect.bisect_left(self._starts, m.iova)
            self._starts.insert(i, m.iova)
            self._runs.insert(i, m)

    def unmap(self, iova: int, size: int) -> int:
        """Remove the pages in [iova, iova+size); returns the bytes unmapped (holes are fine).

        Refuses to cut a large page in two (an IOMMU page table cannot), changing nothing.
        """
        end = iova + size
        hits = self._overlapping(iova, end)
        for m in hits:
            for edge in (iova, end):
                if m.iova < edge < m.end and (edge - m.iova) % m.page_size:
                    raise IommuMappingError(
                        self.name,
                        iova,
                        size,
                        f"would split a {m.page_size:#x} page of the mapping at {m.iova:#x}",
                    )
        if not hits:
            return 0
        keep: list[Mapping] = []  # the parts of the first and last run outside the range
        for m in (hits[0], hits[-1]) if len(hits) > 1 else (hits[0],):
            for lo, hi in ((m.iova, min(iova, m.end)), (max(end, m.iova), m.end)):
                if hi > lo:
                    keep.append(
                        Mapping(lo, m.phys + (lo - m.iova), hi - lo, m.page_size, m.writable)
                    )
        removed = sum(min(end, m.end) - max(iova, m.iova) for m in hits)
        # hits are consecutive in the sorted list: replace that slice in one go
        first = bisect.bisect_left(self._starts, hits[0].iova)
        last = first + len(hits)
        self._runs[first:last] = keep
        self._starts[first:last] = [m.iova for m in keep]
        return removed

    def clear(self) -> None:
        self._starts.clear()
        self._runs.clear()

    # --- dirty tracking --------------------------------------------------------------------------
    def start_dirty_log(self) -> None:
        """Log every page a write through this domain touches from now on (idempotent)."""
        self._dirty.start()

    def take_dirty(self) -> set[int]:
        """The 4 KiB IOVA page numbers written since the last take (the log goes on)."""
        return self._dirty.take()

    def stop_dirty_log(self) -> set[int]:
        """Stop logging; what was written since the last take."""
        return self._dirty.stop()

    @property
    def dirty_logging(self) -> bool:
        return self._dirty.active

    # --- lookups -------------------------------------------------------------------------------
    def _overlapping(self, lo: int, hi: int) -> list[Mapping]:
        i = max(0, bisect.bisect_right(self._starts, lo) - 1)
        out = []
        while i < len(self._runs) and self._runs[i].iova < hi:
            if self._runs[i].end > lo:
                out.append(self._runs[i])
            i += 1
        return out

    def lookup(self, iova: int) -> Mapping | None:
        """The run containing ``iova``, or None."""
        i = bisect.bisect_right(self._starts, iova) - 1
        if i >= 0 and self._runs[i].iova <= iova < self._runs[i].end:
            return self._runs[i]
        return None

    def translate(self, iova: int, *, write: bool = False) -> int:
        """The physical address behind ``iova``; ``DmaFault(hop=<domain name>)`` when unmapped
        (or written through a read-only mapping)."""
        m = self.lookup(iova)
        if m is None:
            raise DmaFault(self.name, iova, f"IOVA {iova:#x} is not mapped in domain {self.name}")
        if write and not m.writable:
            raise DmaFault(self.name, iova, f"write to read-only mapping in domain {self.name}")
        if write:
            self._dirty.mark((iova // PAGE_4K,))
        return m.phys + (iova - m.iova)

    def entries(self) -> dict[int, int]:
        """Page-table entries by page size (all three sizes always present)."""
        out = dict.fromkeys(sorted(PAGE_SIZES), 0)
        for m in self._runs:
            out[m.page_size] += m.pages
        return out

    def mappings(self) -> list[Mapping]:
        """Runs sorted by IOVA."""
        return list(self._runs)

    @property
    def mapped_bytes(self) -> int:
        return sum(m.size for m in self._runs)


class NodeIommu:
    """A node's IOMMU context table: requester -> domain. A requester with no domain attached
    is blocked (DMA remapping on, no passthrough), which is how per-device isolation works."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._ctx: dict[Requester, IommuDomain] = {}

    def attach(self, requester: Requester, domain: IommuDomain) -> None:
        current = self._ctx.get(requester)
        if current is not None and current is not domain:
            raise IommuMappingError(
                domain.name, 0, 0, f"requester {requester} is already attached to {current.name}"
            )
        self._ctx[requester] = domain

    def detach(self, requester: Requester) -> bool:
        return self._ctx.pop(requester, None) is not None

    def domain_for(self, requester: Requester) -> IommuDomain | None:
        return self._ctx.get(requester)

    def attached(self) -> dict[Requester, IommuDomain]:
        return dict(self._ctx)
