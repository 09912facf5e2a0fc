"""The registry's runtime records of a held device's DMA windows: their kinds and fields (pure).

Both data paths keep what is mapped as ``dma-window`` records of the device's hold, one per
window (key ``low``, ``high`` or ``low+high``), removed with the hold: the simulator from the
plan it applied (``vmlend/sim/dmawin.py``, ``_plan_records``), the kernel backend from what the
SmartIO driver reports in the child's ``dma_state`` (docs/smartio-contract.md section 8). A
record's fields are the simulator's names; the kernel backend fills those the driver reports
(ranges, adapter, segments) and leaves out what only the simulator sees (IOMMU entries, the
NTB window's address). ``vmlend.sim.promises.promised_segments`` counts a VM's DMA claim as
mapped once one of its devices has a ``dma-window`` record on the adapter, so a record means
a window really mapped, never a refusal.

A refused Bus Master enable is kept apart, as one ``dma-refusal`` record (key
``bus-master``), so ``vmlend status`` shows it from any host.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vmlend.topology.model import GuestRange

#: Runtime record kind of a mapped DMA window (keys "low", "high", or "low+high").
DMA_WINDOW = "dma-window"
#: Runtime record kind of the driver's refusal of the guest's Bus Master enable.
DMA_REFUSAL = "dma-refusal"
#: The one key of a ``dma-refusal`` record: the last enable's.
REFUSAL_KEY = "bus-master"


def window_record(
    ranges: Sequence[GuestRange],
    adapter: str | None,
    segments: Sequence[int],
    segment_size: int | None,
    state: str,
) -> dict[str, Any]:
    """One mapped window as a ``dma-window`` record's data: the guest-physical ranges the
    device reaches, the lender adapter's ref (``node:index``; None: no NTB crossed) and the
    indices of the window's segments there, and the driver's word (``mapped``/``partial``)."""
    if not ranges:
        raise ValueError("a mapped window reaches at least one range")
    return {
        "gpa_start": ranges[0].start,
        "gpa_end": ranges[-1].end,
        "ranges": [[r.start, r.end] for r in ranges],
        "adapter": adapter,
        "segments": list(segments),
        "segment_size": segment_size,
        "state": state,
    }


def refusal_record(error: str, reason: str, mdev: str) -> dict[str, Any]:
    """A refused Bus Master enable as a ``dma-refusal`` record's data."""
    return {"error": error, "reason": reason, "mdev": mdev}
