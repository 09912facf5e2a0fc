"""What admission promised on an adapter but is not mapped yet: the one notion both the DMA
windows (``dmawin``) and the peer-to-peer mapper (``p2pmap``) keep free for other VMs.

Pure: reads claims, holds and the runtime records of what is mapped. A VM's promise on an
adapter is its DMA-window claim until one of its devices records windows there, plus each
peer-to-peer claim (one per target BAR) until a map towards that BAR through that adapter is
recorded. Both are claimed per VM and counted once at their largest, as ``admission.usage``
counts them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from vmlend.ledger.admission import p2p_share, vm_share
from vmlend.registry import Claim, ClaimKind, HoldRecord, RuntimeRecord


def promised_segments(
    adapter: str,
    share: str,
    claims: Sequence[tuple[int, Claim]],
    holds: Mapping[int, HoldRecord],
    windows: Iterable[RuntimeRecord],
    p2p_maps: Iterable[RuntimeRecord],
) -> int:
    """Segments of ``adapter`` claimed for VMs other than the one ``share`` (``vm_share``)
    names and not mapped yet. ``windows``: DMA-window records (data ``adapter``); ``p2p_maps``:
    peer-to-peer map records (data ``adapter``, ``target``, ``bar``)."""
    windowed = {r.fdid for r in windows if r.data.get("adapter") == adapter}
    mapped_bars: set[str] = set()
    for r in p2p_maps:
        target = r.data.get("target")
        if not isinstance(target, int) or r.data.get("adapter") != adapter:
            continue
        hold = holds.get(target)
        if hold is not None:
            mapped_bars.add(p2p_share(hold.holder, target, int(r.data.get("bar", -1))))
    largest: dict[tuple[ClaimKind, str], int] = {}
    users: dict[tuple[ClaimKind, str], set[int]] = {}
    for fdid, c in claims:
        hold = holds.get(fdid)
        if c.adapter != adapter or not c.segments or hold is None:
            continue
        if vm_share(hold.holder) == share or c.kind not in (ClaimKind.DMA, ClaimKind.P2P):
            continue
        key = (c.kind, c.share)
        largest[key] = max(largest.get(key, 0), c.segments)
        users.setdefault(key, set()).add(fdid)
    total = 0
    for (kind, claim_share), n in largest.items():
        if kind is ClaimKind.DMA and users[(kind, claim_share)] & windowed:
            continue
        if kind is ClaimKind.P2P and claim_share in mapped_bars:
            continue
        total += n
    return total
