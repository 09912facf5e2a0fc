"""The fake SmartIO driver's peer-to-peer files of a child (docs/smartio-contract.md section 8):
``guest_bars`` as the guest decodes them (a test says where), ``p2p`` with the contract's write
checks and errnos, ``p2p_state`` as the driver would map, and the ``SMARTIO_BARS`` /
``SMARTIO_P2P`` change events.

Written from the contract, not from vmlend's parser (``vmlend.kernel.p2pfiles``), so a test of
vmlend against it checks the two against each other. It attaches to a ``FakeSmartio`` by a
child hook of its own: children with the ``smartio/`` group get the three files.
"""

from __future__ import annotations

import errno
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tests.support.fake_dmawin import FOUR_GIB, PAGE, Refused, number
from vmlend.kernel.udev import Uevent

if TYPE_CHECKING:
    from tests.support.fake_sysfs import FakeSmartio, _Child

MAX_MAPS = 64
DEFAULT_SEGMENT = 4 << 30


@dataclass(frozen=True, order=True)
class Line:
    target: int
    bar: int
    gpa: int
    size: int

    @property
    def end(self) -> int:
        return self.gpa + self.size


def parse_write(text: str) -> tuple[int, list[Line]]:
    """The token and lines of a ``p2p`` write; ``EINVAL`` for what is not in the format."""
    words = [ln.split() for ln in text.splitlines() if ln.strip()]
    if not words or len(words[0]) != 2 or words[0][0] != "token" or not words[0][1].isdigit():
        raise Refused(errno.EINVAL, "no 'token <decimal>' line first")
    lines = []
    for w in words[1:]:
        if len(w) != 4:
            raise Refused(errno.EINVAL, f"not '<target> <bar> <gpa> <size>': {w}")
        lines.append(Line(number(w[0]), number(w[1]), number(w[2]), number(w[3])))
    return int(words[0][1]), lines


def device_bars(text: str) -> dict[int, tuple[int, str]]:
    """A device's ``bars`` attribute: index -> (size, kind)."""
    out = {}
    for ln in text.splitlines():
        w = ln.split()
        if w:
            out[int(w[0])] = (int(w[1], 0), w[2])
    return out


@dataclass
class _ChildP2P:
    uuid: str
    fdid: int
    group: Path
    decoded: dict[int, tuple[int, int]] = field(default_factory=dict)  # index -> (gpa, size)
    token: int = 0
    lines: list[Line] = field(default_factory=list)  # the maps in place
    writes: list[str] = field(default_factory=list)


class FakeP2P:
    """The peer-to-peer half of a ``FakeSmartio``'s children."""

    def __init__(self, smartio: FakeSmartio) -> None:
        self.smartio = smartio
        self.fake = smartio.fake
        self.children: dict[str, _ChildP2P] = {}
        #: Which VFIO container each child is open in (default: one for all): ``EXDEV``
        #: for a target with no child in the source's.
        self.containers: dict[str, str] = {}
        #: ``ENOSPC`` for the next writes (no free segment or LUT entry now).
        self.full = False
        #: Segments per adapter window, numbered from the top as the simulator's mapper takes
        #: them; chunk (lender, adapter, base) -> segment, shared by every map in the chunk.
        self.segments = 32
        self._chunks: dict[tuple[int, int, int], int] = {}
        self.fake.child_hooks.append(self._child_added)

    # --- the files ---------------------------------------------------------------------------
    def _child_added(self, child: _Child) -> None:
        group = child.path / "smartio"
        fdid = next((f for f in self.smartio.devs if self.smartio._name(f) == child.parent), None)
        if fdid is None or not group.is_dir():
            return
        for name in ("guest_bars", "p2p", "p2p_state"):
            (group / name).write_text("")
        c = self.children[child.uuid] = _ChildP2P(child.uuid, fdid, group)
        self.fake.handlers[(group / "p2p").resolve()] = lambda text: self._store(c, text)

    def _sync(self, c: _ChildP2P) -> None:
        bars = "".join(f"{i} {g:#x} {s:#x}\n" for i, (g, s) in sorted(c.decoded.items()))
        (c.group / "guest_bars").write_text(bars)
        lines = sorted(c.lines)
        if c.token or lines:
            (c.group / "p2p").write_text(
                f"token {c.token}\n"
                + "".join(f"{ln.target:#x} {ln.bar} {ln.gpa:#x} {ln.size:#x}\n" for ln in lines)
            )
        else:
            (c.group / "p2p").write_text("")
        (c.group / "p2p_state").write_text("".join(self._state_line(c, ln) for ln in lines))

    def _state_line(self, c: _ChildP2P, ln: Line) -> str:
        src, dst = self.smartio.devs[c.fdid], self.smartio.devs[ln.target]
        head = f"{ln.target:#x} {ln.bar} {ln.gpa:#x} {ln.size:#x}"
        if src.lender_node_id == dst.lender_node_id:
            return f"{head} same-lender - -\n"
        case = "borrower-local" if dst.lender_node_id == self.smartio.node_id else "other-lender"
        adapter = int(src.attrs["lender_adapter"])
        seg = self.smartio.segment_size or DEFAULT_SEGMENT
        used = []
        for base in range(ln.gpa // seg * seg, ln.end, seg):
            key = (src.lender_node_id, adapter, base)
            if key not in self._chunks:
                taken = {s for k, s in self._chunks.items() if k[:2] == key[:2]}
                self._chunks[key] = max(set(range(self.segments)) - taken)
            used.append(self._chunks[key])
        return f"{head} {case} {adapter} {','.join(map(str, used))}\n"

    # --- the store handler -------------------------------------------------------------------
    def _store(self, c: _ChildP2P, text: str) -> None:
        path = c.group / "p2p"
        c.writes.append(text)
        try:
            token, lines = self.check(c, text)
        except Refused as e:
            raise OSError(e.code, f"{e} ({errno.errorcode[e.code]})", str(path)) from None
        c.token, c.lines = token, lines
        self._sync(c)

    def check(self, c: _ChildP2P, text: str) -> tuple[int, list[Line]]:
        """The write ``text`` to ``c``'s ``p2p`` as the driver takes it, or ``Refused``."""
        devs = self.smartio.devs
        token, lines = parse_write(text)
        if len(lines) > MAX_MAPS:
            raise Refused(errno.E2BIG, f"{len(lines)} maps")
        seen: set[tuple[int, int]] = set()
        for ln in lines:
            if ln.target == c.fdid:
                raise Refused(errno.EINVAL, "the child's own fdid")
            if ln.target not in devs:
                raise Refused(errno.ENODEV, f"no device {ln.target:#x}")
            bars = device_bars((self.smartio._dir(ln.target) / "bars").read_text())
            size, kind = bars.get(ln.bar, (0, ""))
            if size != ln.size or kind == "io":
                raise Refused(
                    errno.EINVAL, f"{ln.target:#x} has no memory BAR {ln.bar} of that size"
                )
            if ln.size < PAGE or ln.gpa % ln.size:
                raise Refused(errno.EINVAL, "a BAR below a page or misaligned")
            if kind == "mem32" and ln.end > FOUR_GIB:
                raise Refused(errno.EINVAL, "a mem32 BAR past 4 GiB")
            if (ln.target, ln.bar) in seen:
                raise Refused(errno.EINVAL, "one BAR twice")
            seen.add((ln.target, ln.bar))
        reach = 1 << int(devs[c.fdid].attrs["dma_bits"])
        if any(ln.end > reach for ln in lines):
            raise Refused(errno.ERANGE, "a BAR past the device's reach")
        dev = devs[c.fdid]
        if token < dev.token or token <= dev.spent:
            raise Refused(errno.ESTALE, f"token {token} older than the device's {dev.token}")
        self._check_overlap(c, lines)
        for ln in lines:
            target = self._child_of(ln.target, self.containers.get(c.uuid, ""))
            if target is None:
                raise Refused(errno.EXDEV, f"{ln.target:#x} is not a device of this VM")
            if devs[c.fdid].borrower != self.smartio.node_id:
                raise Refused(errno.ENOTCONN, "the device is not borrowed now")
            if devs[ln.target].borrower != self.smartio.node_id:
                raise Refused(errno.ENOTCONN, f"{ln.target:#x} is not borrowed now")
            if target.decoded.get(ln.bar) != (ln.gpa, ln.size):
                raise Refused(errno.EAGAIN, f"BAR {ln.bar} of {ln.target:#x} is not decoded there")
        if self.full and lines:
            raise Refused(errno.ENOSPC, "no free segment")
        return token, sorted(lines)

    def _check_overlap(self, c: _ChildP2P, lines: list[Line]) -> None:
        written = self.smartio.windows.get(c.uuid)
        ranges = [r for _, rs in written.windows for r in rs] if written else []
        spans = sorted([(ln.gpa, ln.end) for ln in lines] + ranges)
        for (_, end), (start, _) in itertools.pairwise(spans):
            if start < end:
                raise Refused(errno.EEXIST, "a BAR overlaps the windows or another line")

    def _child_of(self, fdid: int, container: str) -> _ChildP2P | None:
        return next(
            (
                t
                for t in self.children.values()
                if t.fdid == fdid and self.containers.get(t.uuid, "") == container
            ),
            None,
        )

    # --- what the guest and the fabric do ----------------------------------------------------
    def decode(self, uuid: str, bars: dict[int, int], announce: bool = True) -> None:
        """The guest decodes the child's memory BARs ``index -> gpa`` now (empty: decoding
        off). The driver removes every map in any child to one of its BARs that moved or went,
        then (``announce``) sends ``SMARTIO_BARS`` for the child and ``SMARTIO_P2P`` for each
        child whose maps it removed."""
        c = self.children[uuid]
        sizes = device_bars((self.smartio._dir(c.fdid) / "bars").read_text())
        decoded = {i: (gpa, sizes[i][0]) for i, gpa in bars.items() if sizes[i][1] != "io"}
        if decoded == c.decoded:
            return
        gone = {i for i, v in c.decoded.items() if decoded.get(i) != v}
        c.decoded = decoded
        self._sync(c)
        touched = self._drop(lambda ln: ln.target == c.fdid and ln.bar in gone)
        if announce:
            self.announce(uuid, bars=True)
            for u in touched:
                self.announce(u, p2p=True)

    def end_borrow(self, fdid: int) -> list[str]:
        """``fdid``'s borrow ended: every map it issued or that targets it goes; the children
        whose ``p2p_state`` changed, each announced with ``SMARTIO_P2P``."""
        touched = self._drop(lambda ln: ln.target == fdid)
        for c in self.children.values():
            if c.fdid == fdid and c.lines:
                c.lines = []
                self._sync(c)
                touched.append(c.uuid)
        for u in touched:
            self.announce(u, p2p=True)
        return touched

    def _drop(self, doomed: Callable[[Line], bool]) -> list[str]:
        touched = []
        for c in self.children.values():
            kept = [ln for ln in c.lines if not doomed(ln)]
            if kept != c.lines:
                c.lines = kept
                self._sync(c)
                touched.append(c.uuid)
        return touched

    def announce(self, uuid: str, *, bars: bool = False, p2p: bool = False) -> Uevent:
        """The child's ``change`` uevent, to the fake's listeners (a test's uevent source)."""
        c = self.children[uuid]
        props = {"SMARTIO_FDID": f"{c.fdid:#x}"}
        if bars:
            props["SMARTIO_BARS"] = str(len(c.decoded))
        if p2p:
            props["SMARTIO_P2P"] = str(len(c.lines))
        ev = Uevent("change", uuid, "mdev", props)
        self.fake.emit(ev)
        return ev

    def state(self, uuid: str) -> str:
        return (self.children[uuid].group / "p2p_state").read_text()

    def written(self, uuid: str) -> list[Line]:
        return list(self.children[uuid].lines)
