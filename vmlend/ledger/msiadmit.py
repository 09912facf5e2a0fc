"""Admission of an MSI/MSI-X window over the NTB (docs/design.md, mechanism 12; docs/interrupts.md).

Interrupts mapped over the NTB need one segment of the lender's NTB window for the VM's
interrupt target page, shared by every device the VM borrows through that adapter (like its DMA
windows). It is asked for at reservation, next to the other claims. Unlike them it is never a
reason to refuse: when the window has no segment left, the device's interrupts use the software
relay instead, and the check says so.

The claim is a lender-window claim (kind ``dma``: room in the lender's NTB window) under a share
of its own, ``msi:<node>/<vm>``, so it counts apart from the VM's DMA windows and needs no new
kind in the state's schema.
"""

from __future__ import annotations

from collections.abc import Sequence

from vmlend.registry.records import Claim, ClaimKind
from vmlend.topology.model import AdapterSpec, DeviceSpec, Holder

MSI_SHARE_PREFIX = "msi:"


def msi_share(holder: Holder) -> str:
    """One interrupt window per (lender adapter, VM): node and domain name, as DMA windows."""
    return f"{MSI_SHARE_PREFIX}{holder.node}/{holder.vm}"


def is_msi_claim(claim: Claim) -> bool:
    return claim.kind is ClaimKind.DMA and claim.share.startswith(MSI_SHARE_PREFIX)


def msi_claim(
    spec: DeviceSpec,
    adapter: AdapterSpec,
    segments_free: int,
    holder: Holder | None,
    claims: Sequence[tuple[int, Claim]],
) -> tuple[Claim | None, str]:
    """The claim for ``spec``'s interrupt window on the lender's ``adapter`` (None: use the
    relay) and why. ``segments_free``: what the adapter has left after this reservation's
    other claims."""
    if spec.msi is None and spec.msix is None:
        return None, "the device has no MSI or MSI-X: its INTx uses the relay"
    if holder is None:
        return None, "no VM given: interrupts use the relay"
    share = msi_share(holder)
    claim = Claim(adapter.ref, ClaimKind.DMA, share, segments=1, bytes=adapter.segment_size)
    if any(is_msi_claim(c) and (c.adapter, c.share) == (adapter.ref, share) for _, c in claims):
        return claim, f"MSI/MSI-X over {adapter.ref}: {holder} already has its interrupt window"
    if segments_free < 1:
        return None, f"no free segment on {adapter.ref} for an interrupt window: the relay is used"
    return claim, f"MSI/MSI-X over {adapter.ref}: 1 segment for {holder}'s interrupt target"
