"""The guard (NVMePass's "NVMe resource domain"): each guarded I/O queue belongs to an owner
with an LBA window on one namespace and an address space for its DMA. Pure arithmetic; the
controller applies it to every command fetched from a guarded queue.
"""

from __future__ import annotations

import msgspec

from vmlend.nvme import spec

#: Owners' DMA addresses must stay below this; the owner's address-space id sits above it
#: (what a PASID does on real hardware: one device, one address space per queue owner).
ADDRESS_BITS = 47


class GuardRejection(ValueError):
    def __init__(self, status: int, why: str) -> None:
        self.status = status
        super().__init__(why)


class QueueDomain(msgspec.Struct, frozen=True):
    """Who owns a queue id and what it may reach.

    ``offset``/``length``: the owner's blocks on namespace ``nsid`` (its LBA 0 is ``offset``).
    ``view_nsid``: the namespace id the owner uses for them (its virtual controller shows one
    namespace). ``asid``: the address space of the owner's DMA (0: untagged, the host's).
    """

    owner: str
    nsid: int
    offset: int
    length: int
    view_nsid: int = 1
    asid: int = 0

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length <= 0:
            raise ValueError(f"bad LBA window {self.offset}+{self.length} for {self.owner}")
        if not 0 <= self.asid < 1 << (64 - ADDRESS_BITS):
            raise ValueError(f"address space id {self.asid} does not fit")

    def translate(self, nsid: int, slba: int, blocks: int) -> int:
        """The namespace LBA of the owner's ``slba``; ``GuardRejection`` when the command names
        another namespace or reaches outside the window."""
        if nsid != self.view_nsid:
            raise GuardRejection(spec.SC_INVALID_NAMESPACE, f"{self.owner} named namespace {nsid}")
        if slba < 0 or blocks < 1 or slba + blocks > self.length:
            raise GuardRejection(
                spec.SC_LBA_OUT_OF_RANGE,
                f"{self.owner}: LBAs {slba}+{blocks} outside its {self.length} blocks",
            )
        return self.offset + slba

    def dma_address(self, address: int) -> int:
        """The IOVA the controller issues for the owner's ``address``."""
        if not self.asid:
            return address
        if not 0 <= address < 1 << ADDRESS_BITS:
            raise GuardRejection(
                spec.SC_DATA_TRANSFER_ERROR,
                f"{self.owner}: address {address:#x} outside its {ADDRESS_BITS}-bit space",
            )
        return self.asid << ADDRESS_BITS | address


def asid_base(asid: int) -> int:
    """First IOVA of address space ``asid``."""
    return asid << ADDRESS_BITS
