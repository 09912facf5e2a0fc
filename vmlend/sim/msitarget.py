"""Borrower-side interrupt targets for MSI/MSI-X over the NTB (docs/design.md, mechanism 12).

MSI and MSI-X are posted memory writes. Instead of a lender-side handler relaying each
interrupt, the device's physical message address points, through the lender IOMMU and an NTB
segment, at a page on the borrower that decodes interrupts: a write of ``data`` there signals
the eventfd the VM's vector uses (what a borrower kernel's interrupt handler does with the
irqfd). One page per VM, reachable only through that VM's IOMMU domain, so a device can signal
only the VM that holds it.

Addresses: the page is placed in the borrower's 32-bit MMIO hole and decoded as an address-map
region of kind ``irq``, which the DMA resolver ends a request at. Both IOMMU stages use
``MSI_IOVA`` (x86's MSI window at 0xfee00000, never guest RAM) for the page.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

import msgspec

from vmlend.errors import FabricError
from vmlend.sim.addrmap import Region

if TYPE_CHECKING:
    from vmlend.sim.hardware import SimHardware

log = logging.getLogger(__name__)

PAGE = 4096
#: IOVA of the interrupt target in the device's lender domain and in the VM's domain.
MSI_IOVA = 0xFEE0_0000
#: Address-map region kind of an interrupt target (the resolver stops there).
IRQ_REGION = "irq"
#: Slots per target: message data values 0..SLOTS-1 (MSI-X allows 2048 vectors per device).
SLOTS = 8192


class _Slot(msgspec.Struct):
    fd: int | None = None  # the VM's eventfd (our own dup), None until the VMM assigns one
    held: int = 0  # interrupts that arrived before an eventfd was assigned
    #: What else the borrower's handler does for the slot (a shared drive's: its VM's share
    #: takes the completion), called after the eventfd, outside the target's lock.
    handler: Callable[[], object] | None = None


class MsiTarget(msgspec.Struct):
    """One VM's interrupt page on its borrower node."""

    node: str
    vm: str
    base: int  # borrower physical address of the page
    #: Its page's offset (in pages) from ``MSI_IOVA`` in an interrupt segment: a shared
    #: drive's ingress domain on the node maps ``MSI_IOVA + slot * PAGE`` onto this page (a
    #: borrowed device reaches it at ``MSI_IOVA`` in the VM's own domain instead).
    slot: int = 0
    delivered: int = 0
    _slots: dict[int, _Slot] = msgspec.field(default_factory=dict)
    _lock: threading.Lock = msgspec.field(default_factory=threading.Lock)

    @property
    def owner(self) -> str:
        return f"msi-target:{self.vm}"

    def allocate(self, count: int) -> int:
        """A block of ``count`` consecutive data values (one per vector); returns the first."""
        with self._lock:
            start, run = 0, 0
            for value in range(SLOTS):
                if value in self._slots:
                    start, run = value + 1, 0
                    continue
                run += 1
                if run == count:
                    for v in range(start, start + count):
                        self._slots[v] = _Slot()
                    return start
        raise FabricError(f"interrupt target of {self.vm} on {self.node}: {count} slots not free")

    def free(self, first: int, count: int) -> None:
        with self._lock:
            for value in range(first, first + count):
                slot = self._slots.pop(value, None)
                if slot is not None and slot.fd is not None:
                    os.close(slot.fd)

    def assign(self, value: int, fd: int) -> None:
        """Let data ``value`` signal eventfd ``fd`` (-1: de-assign). The target keeps its own
        descriptor, as the kernel does. Interrupts held for the slot are delivered now."""
        with self._lock:
            slot = self._slots.get(value)
            if slot is None:
                raise FabricError(f"interrupt target of {self.vm}: data {value} is not allocated")
            if slot.fd is not None:
                os.close(slot.fd)
                slot.fd = None
            if fd >= 0:
                slot.fd = os.dup(fd)
                if slot.held:
                    os.eventfd_write(slot.fd, slot.held)
                    self.delivered += slot.held
                    slot.held = 0

    def listen(self, value: int, handler: Callable[[], object] | None) -> None:
        """Let data ``value`` also run ``handler`` on each write (None: no more)."""
        with self._lock:
            slot = self._slots.get(value)
            if slot is None:
                raise FabricError(f"interrupt target of {self.vm}: data {value} is not allocated")
            slot.handler = handler

    def write(self, offset: int, value: int) -> bool:
        """A posted write of ``value`` at ``offset`` in the page: signal that slot's eventfd
        (and run its handler). False when no vector owns ``value`` (dropped, as an unrouted
        MSI is)."""
        with self._lock:
            slot = self._slots.get(value)
            if slot is None or not 0 <= offset < PAGE:
                return False
            handler = slot.handler
            if slot.fd is None:
                slot.held += 1
            else:
                os.eventfd_write(slot.fd, 1)
                self.delivered += 1
        if handler is not None:
            handler()
        return True

    def close(self) -> None:
        with self._lock:
            for slot in self._slots.values():
                if slot.fd is not None:
                    os.close(slot.fd)
            self._slots.clear()


class MsiTargets:
    """The interrupt targets of a simulated cluster, by (node, vm) and by address."""

    def __init__(self, hardware: SimHardware) -> None:
        self.hw = hardware
        self._targets: dict[tuple[str, str], MsiTarget] = {}
        self._in_domain: set[tuple[str, str]] = set()  # targets mapped in their VM's domain
        # (lender adapter, borrower node, far adapter or None) -> (segment, who uses it)
        self._segments: dict[tuple[str, str, str | None], tuple[int, set[Hashable]]] = {}
        self._lock = threading.Lock()

    def acquire_segment(
        self, adapter_ref: str, node: str, user: Hashable, *, via: str | None = None
    ) -> int:
        """The lender-side window address that reaches ``MSI_IOVA`` on ``node``: one segment
        of ``adapter_ref`` translated there, shared by its users (borrowed devices, by fdid;
        shares' paths), each VM's own IOMMU domain then deciding which target page a device
        reaches, and a shared drive's ingress domain which page each slot is. ``via``: through
        that adapter of ``node`` only (a two-path share's backup path, whose DMA windows name
        it too); None follows the device's crossing into the node wherever it is routed."""
        with self._lock:
            adapter = self.hw.adapter(adapter_ref)
            key = (adapter_ref, node, via)
            if key not in self._segments:
                index = adapter.free_segments(1)
                adapter.map_segment(index, node, MSI_IOVA, via=via)
                self._segments[key] = (index, set())
            index, users = self._segments[key]
            users.add(user)
            return adapter.segment_base(index)

    def release_segment(
        self, adapter_ref: str, node: str, user: Hashable, *, via: str | None = None
    ) -> None:
        with self._lock:
            key = (adapter_ref, node, via)
            entry = self._segments.get(key)
            if entry is None:
                return
            index, users = entry
            users.discard(user)
            if not users:
                self.hw.adapter(adapter_ref).unmap_segment(index)
                del self._segments[key]

    def target(self, node: str, vm: str) -> MsiTarget:
        """The VM's target (created on first use): a page in the node's address map, with its
        own slot in the node's interrupt segments."""
        with self._lock:
            return self._target(node, vm)

    def _target(self, node: str, vm: str) -> MsiTarget:
        target = self._targets.get((node, vm))
        if target is not None:
            return target
        host = self.hw.node(node)
        base = host.address_map.place(PAGE, below_4g=True)
        slot = 1 + max((t.slot for (n, _v), t in self._targets.items() if n == node), default=0)
        target = MsiTarget(node, vm, base, slot)
        host.address_map.add(Region(base, base + PAGE, IRQ_REGION, target.owner))
        self._targets[(node, vm)] = target
        log.debug("interrupt target of %s on %s at %#x (slot %d)", vm, node, base, slot)
        return target

    def for_vm(self, node: str, vm: str) -> MsiTarget:
        """The VM's target, mapped at ``MSI_IOVA`` in the VM's IOMMU domain (the one its
        borrowed devices enter by)."""
        with self._lock:
            target = self._target(node, vm)
            if (node, vm) not in self._in_domain:
                self.hw.vm_domain(node, vm).map(MSI_IOVA, target.base, PAGE)
                self._in_domain.add((node, vm))
            return target

    def at(self, node: str, address: int) -> MsiTarget | None:
        """The target whose page holds ``address`` on ``node``."""
        with self._lock:
            for (name, _vm), t in self._targets.items():
                if name == node and t.base <= address < t.base + PAGE:
                    return t
        return None

    def targets(self) -> list[MsiTarget]:
        with self._lock:
            return list(self._targets.values())
