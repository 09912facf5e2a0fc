"""Rows of the state database as plain typed values (no I/O)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from vmlend.topology.model import Holder

if TYPE_CHECKING:
    from vmlend.topology.chunked import Readable


class Phase(enum.StrEnum):
    RESERVED = "reserved"  # held for a VM; the hardware is not borrowed yet
    BORROWED = "borrowed"  # the guest enabled the device: NTB path and exclusive control


class ClaimKind(enum.StrEnum):
    #: one requester entry for the device's requester bus:device: in the LUT of an adapter of
    #: its crossing, or in the requester table of a cluster switch port it passes
    LUT = "lut"
    DMA = "dma"  # window segments on the lender's adapter for a VM's DMA windows
    BAR = "bar"  # window segments on the borrower's adapter for the device's BARs
    P2P = "p2p"  # segments (and LUT entries) peer-to-peer among a VM's devices can use


class TopologyRecord:
    """The installed topology: its name, the file it came from, its TOML text (the source of
    truth), the digest of that text, this state's local node, when it was installed, and the
    parsed topology compiled (``vmlend.topology.compiled``): what opening a fabric reads
    instead of parsing the text (None: not compiled, written by an older vmlend).

    A registry gives ``text`` as a function that reads it and ``compiled`` as bytes read when
    used (``chunked.Readable``): a hook call or a command needs neither the 2.9 MB of TOML of
    a 1,024-node fabric nor the whole of its compiled form. Read-only, equal by value."""

    __slots__ = ("_text", "compiled", "created", "digest", "local_node", "name", "source")

    def __init__(
        self,
        name: str,
        source: str,
        text: str | Callable[[], str],
        digest: str,
        local_node: str,
        created: float,
        compiled: bytes | Readable | None = None,
    ) -> None:
        set_ = object.__setattr__
        set_(self, "name", name)
        set_(self, "source", source)
        set_(self, "_text", text)
        set_(self, "digest", digest)
        set_(self, "local_node", local_node)
        set_(self, "created", created)
        set_(self, "compiled", compiled)

    name: str
    source: str
    _text: str | Callable[[], str]
    digest: str
    local_node: str
    created: float
    compiled: bytes | Readable | None

    @property
    def text(self) -> str:
        """The TOML the topology was parsed from (read on first use)."""
        if isinstance(self._text, str):
            return self._text
        text: str = self._text()
        object.__setattr__(self, "_text", text)
        return text

    def compiled_bytes(self) -> bytes | None:
        c = self.compiled
        return c if c is None or isinstance(c, bytes) else bytes(c.view(0, len(c)))

    def _key(self) -> tuple[object, ...]:
        return (
            self.name,
            self.source,
            self.text,
            self.digest,
            self.local_node,
            self.created,
            self.compiled_bytes(),
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TopologyRecord):
            return NotImplemented
        return self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]  # equal by value, and not a key

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a TopologyRecord is read-only ({name})")

    def __repr__(self) -> str:
        return (
            f"TopologyRecord(name={self.name!r}, source={self.source!r}, digest={self.digest!r},"
            f" local_node={self.local_node!r}, created={self.created!r})"
        )


class NodeRecord(msgspec.Struct, frozen=True):
    name: str
    up: bool
    why: str = ""


class DeviceRecord(msgspec.Struct, frozen=True):
    fdid: int
    lender: str
    lent: bool
    available: bool = True


class HoldRecord(msgspec.Struct, frozen=True):
    fdid: int
    holder: Holder
    since: float
    phase: Phase
    guest_ram: int = 0
    #: The hold's fencing token: larger for every newer hold of any device, so the device's
    #: side can refuse a step made for a hold older than the one it last served (etcd: the
    #: hold key's creation revision; SQLite: a counter of the state). 0: not known yet (a
    #: hold written in the transaction that reads it).
    token: int = 0


class ExpectedHold(msgspec.Struct, frozen=True):
    """The hold a late release may end: one the host recorded while the registry was away
    (``vmlend.release_journal``), landed later. The hold with fencing token ``token`` when
    the release knew it; else (0) a hold made before ``before`` (seconds since the epoch, on
    the clock of the host that made the hold and recorded the release: the same host). A
    newer hold, of the same VM or of another, is neither."""

    token: int = 0
    before: float = 0.0

    def admits(self, hold: HoldRecord) -> bool:
        if self.token:
            return hold.token == self.token
        return hold.since < self.before


class FenceRecord(msgspec.Struct, frozen=True):
    """Left by every hold on a cluster registry and removed with it by a normal release. A
    fence whose hold vanished (its host's lease ended) keeps the device from being borrowed
    until the lender's agent has taken it back. ``token``: the fencing token of the hold it
    was left by (``HoldRecord.token``)."""

    fdid: int
    holder: Holder
    token: int


#: An amount of an adapter resource a claim takes: never negative. A damaged record that says
#: so is refused when read, never counted as room another reserve could take.
Amount = Annotated[int, msgspec.Meta(ge=0)]


class Claim(msgspec.Struct, frozen=True):
    """One adapter resource a hold uses.

    Claims with equal ``(adapter, kind, share)`` are one resource that several holds share;
    it counts once, at the largest amount any of them claims.
    """

    #: adapter ref "node:index"; for a switch port's requester entry, the port
    #: ("switch/toward", ``vmlend.topology.requesters``: adapter refs have no "/")
    adapter: str
    kind: ClaimKind
    #: "dev:<fdid>" for per-device resources, "req:<lender>/<bus:device>" for requester
    #: entries (one for the functions of a device), "vm:<node>/<vm>" for a VM's windows
    share: str
    entries: Amount = 0  # LUT entries
    segments: Amount = 0  # NTB window segments
    bytes: Amount = 0  # window bytes (segments * segment size)


class ParentRecord(msgspec.Struct, frozen=True):
    node: str
    fdid: int
    name: str


class MdevRecord(msgspec.Struct, frozen=True):
    uuid: str
    fdid: int
    node: str
    parent: str
    type_id: str
    vm: str
    created: float


class RuntimeRecord(msgspec.Struct, frozen=True):
    """One thing the data path set up for a held device: ``kind`` is e.g. "dma-window",
    "irq-vector" or "p2p-map"; ``key`` tells records of one kind apart; ``data`` is JSON-able."""

    fdid: int
    kind: str
    key: str
    data: dict[str, Any]


def same_holder(a: Holder, b: Holder) -> bool:
    """Whether two holders are the same VM on the same node.

    The VM UUID decides when both carry one (a renamed VM is still the same VM, a redefined one
    with the same name is not); otherwise the name does.
    """
    if a.node != b.node:
        return False
    if a.vm_uuid and b.vm_uuid:
        return a.vm_uuid == b.vm_uuid
    return a.vm == b.vm
