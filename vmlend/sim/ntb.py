"""A PXH830-class NTB adapter: its window, the segment translations and the requester LUT.

The window is a 64-bit BAR of the adapter in its node's physical address space, split into
``segments`` equal segments. Each segment can be translated to an address on one remote node
the adapter is cabled to (outbound translation, ``ntb_peer_mw_set_trans`` in Linux terms); the
remote address must be aligned to ``XLAT_ALIGN``.

The requester LUT has the entries of both directions, one per requester *device* (bus:device,
the requester id without its 3 function bits): the functions of one device share an entry
(SmartIO §8.6), and under ARI a function above 7 has a device number, and so an entry, of its
own. Outbound, it lists the local requesters allowed to cross from this node: a TLP whose
requester is not in the LUT is dropped. Inbound, an entry keyed by a remote device's
cluster-wide identity (lender node id << 16 | requester id, less the function bits) is how this
adapter knows that device: a TLP from function ``f`` of it enters this node with requester id
``bus << 8 | entry << 3 | f`` (``assigned_requester_id``; the entry is the device number on the
NTB's bus, the function passes through), and a TLP from a device with no entry here is dropped.
So two functions never share an id on this node, and the node's IOMMU tells them apart by that
id alone. The first ``2 * cpus`` entries are reserved for the CPUs (their MMIO to remote BARs).

The driver programs an entry for the functions it is asked to let across and keeps which they
are: the simulator drops a TLP of a function of the device nobody asked for (the hardware
would pass it, and the lender's IOMMU, where that function maps nothing, would stop it), and
the entry goes when its last function does.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from vmlend.errors import DmaFault, FabricError, NoPathError, ResourceExhaustedError
from vmlend.topology.model import LUT_RESERVED_PER_CPU, AdapterSpec

#: Alignment of a segment's remote (translated) address.
XLAT_ALIGN = 4096
#: Bus number of adapter 0's NTB endpoint on its node (adapter i sits on bus BASE_BUS + i).
BASE_BUS = 0xF0
#: The function bits of a requester id: what one LUT entry covers beyond its bus:device.
FUNCTION_BITS = 3


def requester_device(requester_id: int) -> int:
    """The requester device (bus:device, or a cluster-wide key less its function bits) one LUT
    entry stands for."""
    return requester_id >> FUNCTION_BITS


class SegmentMapping(msgspec.Struct, frozen=True):
    index: int
    remote_node: str
    remote_addr: int
    #: The far adapter it is mapped through (None: the one the device crossing it has a LUT
    #: entry on, the cheapest route first). A host with two adapters is reached through either.
    via: str | None = None


class NtbAdapter:
    """One adapter. ``peers`` are the nodes its cable (or switch) reaches."""

    def __init__(self, spec: AdapterSpec, window_base: int, peers: Iterable[str] = ()) -> None:
        if window_base % spec.window_size:
            raise ValueError(f"{spec.ref}: window base {window_base:#x} is not size aligned")
        self.spec = spec
        self.window_base = window_base
        self.peers = frozenset(peers)
        self.bus = BASE_BUS + spec.index
        self._segments: dict[int, SegmentMapping] = {}
        self._lut: dict[int, int] = {}  # requester device -> entry index
        self._functions: dict[int, set[int]] = {}  # requester device -> its ids let across
        self._reserved = LUT_RESERVED_PER_CPU * spec.cpus
        #: What a reset lost, as its driver's own tables still hold it (``restore``).
        self._lost_segments: dict[int, SegmentMapping] = {}
        self._lost_lut: dict[int, int] = {}
        self._lost_functions: dict[int, set[int]] = {}

    def __repr__(self) -> str:
        return f"NtbAdapter({self.ref}, window {self.window_base:#x}+{self.window_size:#x})"

    @property
    def ref(self) -> str:
        return self.spec.ref

    @property
    def node(self) -> str:
        return self.spec.node

    @property
    def window_size(self) -> int:
        return self.spec.window_size

    @property
    def segment_size(self) -> int:
        return self.spec.segment_size

    @property
    def segments(self) -> int:
        return self.spec.segments

    # --- window and segments -------------------------------------------------------------------
    def contains(self, addr: int) -> bool:
        return self.window_base <= addr < self.window_base + self.window_size

    def segment_of(self, addr: int) -> int:
        if not self.contains(addr):
            raise ValueError(f"{addr:#x} is outside the window of {self.ref}")
        return (addr - self.window_base) // self.segment_size

    def segment_base(self, index: int) -> int:
        """Local physical address where segment ``index`` starts."""
        self._check_index(index)
        return self.window_base + index * self.segment_size

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.segments:
            raise ValueError(f"{self.ref}: segment {index} out of range 0..{self.segments - 1}")

    def map_segment(
        self, index: int, remote_node: str, remote_addr: int, *, via: str | None = None
    ) -> None:
        """Translate segment ``index`` to ``remote_addr`` on ``remote_node`` (through its
        adapter ``via`` when given). Remapping a busy segment to something else is refused:
        unmap it first."""
        self._check_index(index)
        if remote_node == self.node:
            raise FabricError(f"{self.ref}: a segment cannot point back into {self.node} itself")
        if remote_node not in self.peers:
            raise NoPathError(self.node, remote_node)
        if remote_addr % XLAT_ALIGN or remote_addr < 0:
            raise FabricError(
                f"{self.ref}: remote address {remote_addr:#x} must be {XLAT_ALIGN}-byte aligned"
            )
        if via is not None and not via.startswith(f"{remote_node}:"):
            raise FabricError(f"{self.ref}: adapter {via} is not in {remote_node}")
        new = SegmentMapping(index, remote_node, remote_addr, via)
        old = self._segments.get(index) or self._lost_segments.get(index)
        if old is not None and old != new:
            raise FabricError(
                f"{self.ref}: segment {index} already maps {old.remote_node}:"
                f"{old.remote_addr:#x}; unmap it first"
            )
        self._lost_segments.pop(index, None)
        self._segments[index] = new

    def unmap_segment(self, index: int) -> bool:
        self._check_index(index)
        lost = self._lost_segments.pop(index, None) is not None
        return self._segments.pop(index, None) is not None or lost

    def segment(self, index: int) -> SegmentMapping | None:
        self._check_index(index)
        return self._segments.get(index)

    def mapped_segments(self) -> list[SegmentMapping]:
        return [self._segments[i] for i in sorted(self._segments)]

    def free_segments(self, count: int = 1) -> int:
        """First index of ``count`` consecutive unmapped segments (so a range larger than one
        segment stays contiguous in the window); ``ResourceExhaustedError`` when none."""
        run = 0
        for i in range(self.segments):
            busy = i in self._segments or i in self._lost_segments  # lost: still promised
            run = 0 if busy else run + 1
            if run == count:
                return i - count + 1
        free = self.segments - len(self._segments)
        raise ResourceExhaustedError(
            "NTB window segments", self.ref, count, min(free, count - 1), "consecutive segments"
        )

    def reset(self) -> None:
        """The adapter lost its state (a link that came back without its mappings): every
        segment translation and requester LUT entry is gone from the hardware. Its driver's
        tables keep them (``lost``) until it programs them again (``restore``) or their owner
        removes them (``unmap_segment``, ``lut_remove``)."""
        self._lost_segments.update(self._segments)
        self._lost_lut.update(self._lut)
        for dev, ids in self._functions.items():
            self._lost_functions.setdefault(dev, set()).update(ids)
        self._segments.clear()
        self._lut.clear()
        self._functions.clear()

    @property
    def lost(self) -> bool:
        """A reset lost mappings its driver has not programmed again yet."""
        return bool(self._lost_segments or self._lost_lut)

    def restore(self) -> int:
        """Program again what a reset lost (the driver's tables, minus what their owners
        removed since); returns how many segments and LUT entries it programmed."""
        n = 0
        for index, seg in sorted(self._lost_segments.items()):
            if index not in self._segments:
                self._segments[index] = seg
                n += 1
        used = set(self._lut.values())
        for dev, entry in sorted(self._lost_lut.items()):
            if dev not in self._lut and entry not in used:  # ``lut_add`` keeps lost entries
                self._lut[dev] = entry
                self._functions[dev] = set(self._lost_functions.get(dev, ()))
                used.add(entry)
                n += 1
        self._lost_segments.clear()
        self._lost_lut.clear()
        self._lost_functions.clear()
        return n

    def translate(self, addr: int) -> tuple[str, int]:
        """(remote node, remote address) behind local window address ``addr``;
        ``DmaFault(hop="ntb-segment")`` when its segment is not mapped."""
        index = self.segment_of(addr)
        seg = self._segments.get(index)
        if seg is None:
            raise DmaFault(
                "ntb-segment", addr, f"segment {index} of adapter {self.ref} is not mapped"
            )
        return seg.remote_node, seg.remote_addr + (addr - self.segment_base(index))

    # --- requester LUT ---------------------------------------------------------------------------
    @property
    def lut_usable(self) -> int:
        return self.spec.lut_usable

    @property
    def lut_free(self) -> int:
        return self.lut_usable - len(self._lut)

    @property
    def lut_used(self) -> int:
        """Entries in use: one per requester device, however many of its functions cross."""
        return len(self._lut)

    def lut_add(self, requester_id: int) -> int:
        """Let ``requester_id`` cross; returns its device's entry index (shared with the other
        functions of the device let across). Idempotent. Raises ``ResourceExhaustedError``
        when the device has no entry and every usable one is taken."""
        dev = requester_device(requester_id)
        if dev in self._lut:
            self._functions[dev].add(requester_id)
            return self._lut[dev]
        if dev in self._lost_lut:  # its driver programs the entry it had again
            entry = self._lost_lut.pop(dev)
            self._lut[dev] = entry
            self._functions[dev] = self._lost_functions.pop(dev, set()) | {requester_id}
            return entry
        used = set(self._lut.values()) | set(self._lost_lut.values())  # lost: still promised
        for entry in range(self._reserved, self.spec.lut_entries):
            if entry not in used:
                self._lut[dev] = entry
                self._functions[dev] = {requester_id}
                return entry
        raise ResourceExhaustedError(
            "requester LUT entries",
            f"adapter {self.ref}",
            len(self._lut) + 1,
            self.lut_usable,
            "entries",
        )

    def lut_remove(self, requester_id: int) -> bool:
        """Stop letting ``requester_id`` across; its device's entry goes with its last
        function. False when it was not let across (nor lost by a reset)."""
        dev = requester_device(requester_id)
        removed = False
        for table, functions in (
            (self._lut, self._functions),
            (self._lost_lut, self._lost_functions),
        ):
            ids = functions.get(dev)
            if ids is None or requester_id not in ids:
                continue
            removed = True
            ids.discard(requester_id)
            if not ids:
                del functions[dev]
                table.pop(dev, None)
        return removed

    def lut_lookup(self, requester_id: int) -> int | None:
        """The entry ``requester_id`` crosses by, None when it is not let across."""
        dev = requester_device(requester_id)
        return self._lut[dev] if requester_id in self._functions.get(dev, ()) else None

    def lut(self) -> dict[int, int]:
        """requester id -> entry, for every function let across (functions of one device
        share their entry)."""
        return {
            rid: entry
            for dev, entry in sorted(self._lut.items())
            for rid in sorted(self._functions[dev])
        }

    def assigned_requester_id(self, entry: int, key: int) -> int:
        """The requester id a TLP from the function keyed ``key`` entering through this adapter
        carries on this node when this adapter's LUT ``entry`` names its device: the entry as
        device number on the adapter's bus, the function passed through. What this node's
        IOMMU sees."""
        function = key & ((1 << FUNCTION_BITS) - 1)
        return (self.bus << 8) + (entry << FUNCTION_BITS | function)
