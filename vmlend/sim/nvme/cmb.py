"""A shared drive's controller memory buffer in lender memory, and a guest's view of its extent
(``vmlend.nvme.cmb`` has the register layout and the extent arithmetic).

The drive fetches from a submission queue in its CMB as from any memory, through its lender
IOMMU: the share's address space maps ``GUEST_CMB_BASE`` onto the frames of the share's extent
and nothing else of the CMB, so a queue of one share can never name another's extent (the
fetch faults at ``lender-iommu``). The guest's CPU reaches its extent as BAR 2 of its virtual
controller: stages, each with the name a ``DmaFault.hop`` carries when it refuses,

``cmb``          the access leaves the share's extent (its VM's mapping of the BAR covers its
                 extent only: an access beyond it reaches nothing, another share's least of all)
``link-down``    a cable of the route is down: a read returns all ones, a write is dropped
``no-target``    the share is closed or was taken from its VM (a removed device), or no
                 segment of the VM's adapter of the route maps its extent (its CMB window)
``ntb-segment``  the window's segment is not translated (a reset lost it) or translates
                 elsewhere than the extent

then, from a VM on another node, its adapter and the lender's (the drive's crossing into the
node, as the share's doorbells take it), then the lender's RAM frame of the extent. The window
is whole segments of the VM's adapter (what admission claims with the share, ``nvmeadmit.
cpu_window_claims``); each segment translates to the frame its first byte of the extent is in.
The simulator's CMB is frames of lender RAM, not one BAR region, so the rest of a segment is
resolved frame by frame.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import msgspec

from vmlend.errors import DmaFault
from vmlend.nvme.cmb import GUEST_CMB_BASE
from vmlend.sim.hostmem import FRAME, HostMemory, OwnedFrames
from vmlend.sim.resolver import Hop
from vmlend.topology.paths import NtbPath


class CmbMemory(OwnedFrames):
    """``size`` bytes of lender memory the manager keeps as the drive's CMB."""

    def __init__(self, memory: HostMemory, size: int, owner: str) -> None:
        super().__init__(memory, size, owner, "the controller memory buffer")

    @property
    def size(self) -> int:
        return len(self.frames) * FRAME

    def extent_frames(self, offset: int, size: int) -> list[int]:
        """The frames backing ``size`` bytes at ``offset`` (both whole frames)."""
        first, count = offset // FRAME, -(-size // FRAME)
        if offset % FRAME or first + count > len(self.frames):
            raise ValueError(f"extent {offset:#x}+{size:#x} is not in the CMB")
        return self.frames[first : first + count]

class CmbAccess(msgspec.Struct, frozen=True):
    """Where a guest CPU access to its CMB lands: RAM of ``node`` at ``phys``."""

    node: str
    phys: int
    hops: tuple[Hop, ...]

    @property
    def crossed_ntb(self) -> bool:
        return any(h.stage == "borrower-adapter" for h in self.hops)

    def describe(self) -> str:
        return " | ".join(str(h) for h in self.hops)


class CmbWindow:
    """A guest's CMB (its extent), as its CPU reaches it from ``node``.

    ``route``: the route from the lender to ``node`` the access takes (None on the lender);
    ``dead``: the cables of a route that are down; ``alive``: the share is open."""

    def __init__(
        self,
        memory: HostMemory,
        lender: str,
        node: str,
        frames: list[int],
        route: Callable[[], NtbPath | None],
        dead: Callable[[NtbPath], list[str]],
        alive: Callable[[], bool],
        name: str,
        carried: Callable[[int, NtbPath], int] | None = None,
    ) -> None:
        self.memory = memory
        self.lender = lender
        self.node = node
        self.frames = frames
        self.route = route
        self.dead = dead
        self.alive = alive
        self.name = name
        #: ``carried(offset, route)``: the address in the window of ``route``'s adapter that
        #: carries ``offset`` of the extent, or ``DmaFault`` (None: no window modelled)
        self.carried = carried
        self.size = len(frames) * FRAME
        self.writes = 0  # CPU writes that reached the extent
        self.dropped = 0  # writes a dead cable dropped

    def resolve(self, offset: int, size: int) -> CmbAccess:
        """The target of a ``size``-byte access at ``offset`` of the guest's CMB (inside one
        frame); ``DmaFault`` naming the stage that refused."""
        gpa = GUEST_CMB_BASE + offset
        hops = [Hop("cpu", self.node, gpa, f"CMB of {self.name} +{offset:#x}")]
        if offset < 0 or size <= 0 or offset + size > self.size:
            raise DmaFault(
                "cmb",
                gpa,
                f"{size} bytes at {offset:#x} leave the {self.size:#x}-byte CMB extent of"
                f" {self.name}: its VM's window maps its own extent only",
            )
        if not self.alive():
            raise DmaFault("no-target", gpa, f"NVMe share {self.name} is closed")
        if self.node != self.lender:
            path = self.route()
            if path is None:
                raise DmaFault("no-target", gpa, f"no route joins {self.node} and {self.lender}")
            window = self.carried(offset, path) if self.carried is not None else gpa
            hops.append(Hop("borrower-adapter", self.node, window, path.dst.ref))
            down = self.dead(path)
            if down:
                raise DmaFault(
                    "link-down",
                    gpa,
                    f"link {', '.join(down)} of {path.describe()} is down: reads return all"
                    " ones, writes are dropped",
                )
            hops.append(Hop("lender-adapter", self.lender, gpa, path.src.ref))
        phys = self.frames[offset // FRAME] + offset % FRAME
        hops.append(Hop("ram", self.lender, phys, f"CMB extent of {self.name}"))
        return CmbAccess(self.lender, phys, tuple(hops))

    def _pieces(self, offset: int, length: int) -> list[tuple[int, int, CmbAccess | None]]:
        out: list[tuple[int, int, CmbAccess | None]] = []
        at, end = offset, offset + length
        while at < end:
            n = min(end - at, FRAME - at % FRAME)
            try:
                target: CmbAccess | None = self.resolve(at, n)
            except DmaFault as fault:
                if fault.hop not in ("link-down", "no-target", "ntb-segment"):
                    raise
                target = None
            out.append((at - offset, n, target))
            at += n
        return out

    def write(self, offset: int, data: bytes) -> None:
        """The guest's CPU writes ``data`` at ``offset``: every piece resolved first (an access
        outside the extent raises and writes nothing); a piece a dead cable, a closed share or
        an untranslated window stops is dropped."""
        for pos, n, target in self._pieces(offset, len(data)):
            if target is None:
                self.dropped += 1
                continue
            self.memory.write(target.phys, data[pos : pos + n])
            self.writes += 1

    def read(self, offset: int, length: int) -> bytes:
        """What the guest's CPU reads: all ones where a dead cable or closed share stops it."""
        out = bytearray()
        for _pos, n, target in self._pieces(offset, length):
            out += b"\xff" * n if target is None else self.memory.read(target.phys, n)
        return bytes(out)


class GuestMemory(Protocol):
    def read(self, gpa: int, length: int) -> bytes: ...

    def write(self, gpa: int, data: bytes) -> None: ...


class GuestWithCmb:
    """A guest's address space as its NVMe driver uses it: its CMB at ``GUEST_CMB_BASE``,
    RAM elsewhere."""

    def __init__(self, ram: GuestMemory, cmb: CmbWindow) -> None:
        self.ram = ram
        self.cmb = cmb

    def _in_cmb(self, address: int) -> bool:
        return GUEST_CMB_BASE <= address < GUEST_CMB_BASE + (1 << 40)

    def read(self, address: int, length: int) -> bytes:
        if self._in_cmb(address):
            return self.cmb.read(address - GUEST_CMB_BASE, length)
        return self.ram.read(address, length)

    def write(self, address: int, data: bytes) -> None:
        if self._in_cmb(address):
            self.cmb.write(address - GUEST_CMB_BASE, data)
        else:
            self.ram.write(address, data)
