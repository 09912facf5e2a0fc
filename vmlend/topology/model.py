"""Plain data describing a fabric: what a topology file declares and what backends report.

No I/O here. Sizes are bytes, addresses are ints, a fabric device id (fdid) is an int that is
shown as hex (``0x10``).
"""

from __future__ import annotations

import abc
import enum
import functools
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, Protocol, TypeVar, cast

import msgspec

from vmlend.errors import ConfigError
from vmlend.topology.chips import CLUSTER_SWITCH_CHIP, HOST_SWITCH_CHIP, Chip

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

#: Requester LUT entries reserved per CPU on a PXH830-class adapter (docs/design.md, limits).
LUT_RESERVED_PER_CPU = 2

#: Requester table entries of each port of a cluster switch whose ``[[switch]]`` gives no
#: ``requester_entries``. The papers give no figure; this one is above what any port of the
#: shipped and tested topologies can need (a port to an adapter carries at most the adapter's
#: usable LUT entries, 30 on a PXH830), so a topology that says nothing is refused nothing.
DEFAULT_REQUESTER_ENTRIES = 256


#: The documented spellings of an fdid: hexadecimal with 0x (``0x10``) or decimal (``16``), in
#: ASCII digits only. ``int(text, 0)`` alone would also take ``१६``, `` 16 ``, ``0b10000``,
#: ``0o20`` and ``1_6``: a fabric device id must mean the same to every reader.
_FDID_RE = re.compile(r"0[xX][0-9a-fA-F]{1,16}|0|[1-9][0-9]{0,19}")


def parse_fdid(text: str | int) -> int:
    """Accept ``0x10``, ``16`` or an int; reject anything else with a clear message."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    elif isinstance(text, str) and _FDID_RE.fullmatch(text):
        value = int(text, 0)
    else:
        raise ConfigError(f"bad fabric device id {text!r}: expected a number such as 0x10 or 16")
    if value < 0 or value >= 1 << 32:
        raise ConfigError(f"bad fabric device id {text!r}: must be between 0 and 0xffffffff")
    return value


def format_fdid(fdid: int) -> str:
    return f"{fdid:#x}"


#: The holder name of a shared NVMe drive's manager (docs/nvme-sharing.md): reserved, no VM may
#: take it (a guest called so would pass for the manager).
MANAGER_VM = "nvme-manager"


class BarKind(enum.StrEnum):
    IO = "io"
    MEM32 = "mem32"
    MEM64 = "mem64"


class BarSpec(msgspec.Struct, frozen=True):
    index: int  # 0..5; a 64-bit BAR also uses index+1
    size: int  # bytes, a power of two
    kind: BarKind = BarKind.MEM32
    prefetch: bool = False


class MsiSpec(msgspec.Struct, frozen=True):
    vectors: int = 1  # power of two, 1..32
    bits64: bool = True
    maskable: bool = False


class MsixSpec(msgspec.Struct, frozen=True):
    vectors: int  # 1..2048
    table_bar: int
    table_offset: int
    pba_bar: int
    pba_offset: int


class DeviceSpec(msgspec.Struct, frozen=True):
    """One lendable PCIe function as the topology declares it."""

    fdid: int
    lender: str  # node name
    bdf: str  # on the lender, e.g. "0000:41:00.0"
    kind: str  # "gpu", "nvme", "nic", "vf", ... (free text shown to users)
    vendor_id: int
    device_id: int
    class_code: int  # 24-bit class/subclass/prog-if
    bars: tuple[BarSpec, ...] = ()
    dma_bits: int = 64  # device DMA address width (e.g. 40)
    intx_pin: int = 1  # 0 none, 1..4 = INTA..INTD
    msi: MsiSpec | None = None
    msix: MsixSpec | None = None
    physfn: int | None = None  # fdid of the PF when this is an SR-IOV VF
    lent: bool = True  # lent at fabric init
    slot: str | None = None  # the in-host PCIe element it hangs below (None: a root port)

    @property
    def dma_limit(self) -> int:
        """First address the device cannot reach."""
        return 1 << self.dma_bits

    @property
    def bar_bytes(self) -> int:
        return sum(b.size for b in self.bars if b.kind is not BarKind.IO)


class AdapterSpec(msgspec.Struct, frozen=True):
    """An NTB adapter (PXH830-class) in a node."""

    node: str
    index: int
    model: str = "PXH830"
    window_size: int = 128 * GiB  # the NTB BAR the adapter exposes for remote access
    segments: int = 32  # the window is split into this many equal segments
    lut_entries: int = 32
    cpus: int = 1  # LUT_RESERVED_PER_CPU entries are reserved per CPU
    slot: str | None = None  # the in-host PCIe element it hangs below (None: a root port)

    @property
    def segment_size(self) -> int:
        return self.window_size // self.segments

    @property
    def lut_usable(self) -> int:
        return self.lut_entries - LUT_RESERVED_PER_CPU * self.cpus

    @property
    def ref(self) -> str:
        return f"{self.node}:{self.index}"


class PcieKind(enum.StrEnum):
    ROOT_PORT = "root-port"
    SWITCH = "switch"  # an in-host PCIe switch
    #: An expansion chassis: its switch, behind a transparent link (a link adapter in the host,
    #: one in the chassis); three hops on a path (vmlend.topology.pcie).
    CHASSIS = "chassis"


class PcieElement(msgspec.Struct, frozen=True):
    """One element of a host's PCIe tree between its root complex and its endpoints."""

    name: str
    kind: PcieKind
    parent: str | None = None  # None for a root port (it sits on the root complex)
    #: The switch chip of a switch or a chassis (its switch); None: ``HOST_SWITCH_CHIP``. A
    #: root port has none (it is part of the root complex).
    chip: Chip | None = None

    @property
    def switch_chip(self) -> Chip:
        """The chip a TLP passes in it (a switch's, a chassis' switch's)."""
        return self.chip or HOST_SWITCH_CHIP


class NodeSpec(msgspec.Struct, frozen=True):
    name: str
    node_id: int  # fabric node id (SmartIO NodeId)
    hostname: str
    adapters: tuple[AdapterSpec, ...] = ()
    ram: int = 64 * GiB  # host RAM, backs guests running here
    pcie: tuple[PcieElement, ...] = ()  # root ports, switches, chassis, parents first
    #: Its IOMMU (with ACS redirect) is on: peer-to-peer below its root complex goes up through
    #: it, and it can lend to VMs (a VM's device needs it to mirror the guest's layout). Off,
    #: peer-to-peer turns at the nearest common switch and the host lends to nobody's VM.
    iommu: bool = True


class LinkSpec(msgspec.Struct, frozen=True):
    """A cable between adapters: two ends back-to-back, or a switch joining several."""

    ends: tuple[str, ...]  # adapter refs "node:index"
    switch: str | None = None
    #: The switch's chip; None: ``CLUSTER_SWITCH_CHIP`` (a back-to-back cable has none).
    chip: Chip | None = None
    #: Entries of each of the switch's port requester tables (one per requester bus:device
    #: crossing the port); None: ``DEFAULT_REQUESTER_ENTRIES`` (a back-to-back cable has none).
    requester_entries: int | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """The names of its cables, each addressable on its own (``vmlend fabric link-down``):
        a back-to-back cable is ``a-b`` (its ends as declared, e.g. ``gamma:1-beta:0``), each
        port of a switch ``switch/adapter`` (``sw1/gamma:1``)."""
        if self.switch is None:
            return ("-".join(self.ends),)
        return tuple(f"{self.switch}/{end}" for end in self.ends)


_T = TypeVar("_T")
_K = TypeVar("_K")
_V = TypeVar("_V")
_K_contra = TypeVar("_K_contra", contravariant=True)
_V_co = TypeVar("_V_co", covariant=True)


class _Lookup(Protocol[_K_contra, _V_co]):
    def get(self, key: _K_contra, /) -> _V_co | None: ...


class SpecTable(Sequence[_V], Generic[_K, _V], abc.ABC):
    """What a ``Topology`` decoded on demand holds instead of its ``nodes`` or ``devices``
    tuple (``vmlend.topology.sliced``): equal to that tuple, and able to find one record by
    its key without decoding the others."""

    @abc.abstractmethod
    def get(self, key: _K, /) -> _V | None: ...


def _first_by(items: Iterable[_V], key: Callable[[_V], _K]) -> dict[_K, _V]:
    """``items`` by ``key``, the first of each key winning (as a scan from the start would)."""
    out: dict[_K, _V] = {}
    for item in items:
        out.setdefault(key(item), item)
    return out


class Topology(msgspec.Struct, frozen=True, dict=True):
    """A fabric as declared. Immutable, so what is derived from it (the lookup tables below,
    the routes of ``vmlend.topology.paths``) is computed once per instance and kept in its
    ``__dict__`` (``dict=True``), which msgspec leaves out of equality, hashing and encoding;
    a changed topology is another instance, which starts with nothing derived."""

    name: str
    nodes: tuple[NodeSpec, ...]
    links: tuple[LinkSpec, ...]
    devices: tuple[DeviceSpec, ...]
    source: str = "<builtin>"
    #: Cables between two cluster switches (cascaded switches), by switch name.
    switch_links: tuple[tuple[str, str], ...] = ()

    # A topology decoded on demand holds ``SpecTable``s, which find a record by key
    # themselves: building a dict of every node or device would decode them all.
    @functools.cached_property
    def _node_index(self) -> _Lookup[str, NodeSpec]:
        nodes: Sequence[NodeSpec] = self.nodes
        if isinstance(nodes, SpecTable):
            return nodes
        return _first_by(nodes, lambda n: n.name)

    @functools.cached_property
    def _device_index(self) -> _Lookup[int, DeviceSpec]:
        devices: Sequence[DeviceSpec] = self.devices
        if isinstance(devices, SpecTable):
            return devices
        return _first_by(devices, lambda d: d.fdid)

    @functools.cached_property
    def _adapter_index(self) -> dict[str, AdapterSpec]:
        return _first_by(self.adapters(), lambda a: a.ref)

    @functools.cached_property
    def _switch_chips(self) -> dict[str, Chip]:
        found = _first_by((link for link in self.links if link.switch), lambda s: s.switch)
        return {name: link.chip or CLUSTER_SWITCH_CHIP for name, link in found.items() if name}

    @functools.cached_property
    def _switch_requesters(self) -> dict[str, int]:
        found = _first_by((link for link in self.links if link.switch), lambda s: s.switch)
        return {
            name: link.requester_entries or DEFAULT_REQUESTER_ENTRIES
            for name, link in found.items()
            if name
        }

    @functools.cached_property
    def _derived(self) -> dict[Callable[[Topology], object], object]:
        return {}

    def derived(self, build: Callable[[Topology], _T]) -> _T:
        """``build(self)``, computed on the first call with this ``build`` and kept for the
        next ones (a pure function of the topology, such as its route table)."""
        memo = self._derived
        if build not in memo:
            memo[build] = build(self)
        return cast(_T, memo[build])

    def node(self, name: str) -> NodeSpec:
        from vmlend.errors import UnknownNodeError

        found = self._node_index.get(name)
        if found is None:
            raise UnknownNodeError(name)
        return found

    def device(self, fdid: int) -> DeviceSpec:
        from vmlend.errors import UnknownDeviceError

        found = self._device_index.get(fdid)
        if found is None:
            raise UnknownDeviceError(fdid)
        return found

    def has_device(self, fdid: int) -> bool:
        return self._device_index.get(fdid) is not None

    def has_node(self, name: str) -> bool:
        return self._node_index.get(name) is not None

    def devices_of(self, lender: str) -> list[DeviceSpec]:
        """The devices node ``lender`` lends, in declaration order (decoding only those)."""
        devices: Sequence[DeviceSpec] = self.devices
        of_lender = getattr(devices, "of_lender", None)
        if of_lender is not None:
            return cast(list[DeviceSpec], of_lender(lender))
        return [d for d in devices if d.lender == lender]

    def adapter(self, ref: str) -> AdapterSpec | None:
        """The adapter ``ref`` (``node:index``) names, None when there is none."""
        nodes: Sequence[NodeSpec] = self.nodes
        if isinstance(nodes, SpecTable):
            # its node alone (an index is digits, so the node's name is all before the last
            # colon); the first of that ref, as the dict over every adapter would give
            node = nodes.get(ref.rpartition(":")[0])
            return next((a for a in node.adapters if a.ref == ref), None) if node else None
        return self._adapter_index.get(ref)

    def switch_chip(self, switch: str) -> Chip:
        """The chip of cluster switch ``switch`` (``CLUSTER_SWITCH_CHIP`` unless declared)."""
        return self._switch_chips.get(switch, CLUSTER_SWITCH_CHIP)

    def switch_requester_entries(self, switch: str) -> int:
        """Entries of each port requester table of cluster switch ``switch``
        (``DEFAULT_REQUESTER_ENTRIES`` unless declared)."""
        return self._switch_requesters.get(switch, DEFAULT_REQUESTER_ENTRIES)

    def adapters(self) -> list[AdapterSpec]:
        return [a for n in self.nodes for a in n.adapters]

    def link_names(self) -> list[str]:
        """Every cable by name: back-to-back links (``a-b``), switch ports (``sw/ref``) and
        cables between switches (``sw1-sw2``), in declaration order."""
        out = [name for link in self.links for name in link.names]
        return out + [f"{a}-{b}" for a, b in self.switch_links]


# --- what backends report at run time ------------------------------------------------------


class InterruptPath(enum.StrEnum):
    """How a remote device's MSI/MSI-X reach its VM (docs/interrupts.md). INTx always takes
    the relay: it is a wire and cannot cross the NTB."""

    NTB = "ntb"  # mapped over the NTB when the window has room; else the relay (fallback)
    RELAY = "relay"  # the software relay, always

    @classmethod
    def parse(cls, text: str) -> InterruptPath:
        try:
            return cls(text.strip().lower())
        except ValueError:
            choices = " or ".join(repr(p.value) for p in cls)
            raise ConfigError(f"bad interrupts {text!r}: expected {choices}") from None


#: What a device whose VM and metadata say nothing gets: the NTB when admissible.
DEFAULT_INTERRUPTS = InterruptPath.NTB


class DeviceState(enum.StrEnum):
    UNLENT = "unlent"  # known to the fabric, not offered
    AVAILABLE = "available"  # lent, nobody holds it
    RESERVED = "reserved"  # held for a VM (mdev exists), hardware not yet borrowed
    BORROWED = "borrowed"  # the guest enabled it: NTB mappings and exclusive control active
    UNAVAILABLE = "unavailable"  # the lender (or its mdev parent) vanished


class Holder(msgspec.Struct, frozen=True):
    """Who holds a device: a VM on a borrower node."""

    node: str
    vm: str
    vm_uuid: str = ""

    def __str__(self) -> str:
        return f"{self.node}/{self.vm}"


class DeviceStatus(msgspec.Struct, frozen=True):
    spec: DeviceSpec
    state: DeviceState
    holder: Holder | None = None

    @property
    def fdid(self) -> int:
        return self.spec.fdid


class Reservation(DeviceStatus, frozen=True):
    """What ``Fabric.reserve`` returns: the device's status, and whether this very call made
    the hold (False when the holder already had it). Decided inside the backend's write
    transaction, so an undo journal can trust it even when processes race."""

    created: bool = False

    @classmethod
    def of(cls, status: DeviceStatus, *, created: bool) -> Reservation:
        return cls(**msgspec.structs.asdict(status), created=created)


class MdevInfo(msgspec.Struct, frozen=True):
    uuid: str
    parent: str  # mdev parent device name
    type_id: str
    fdid: int | None = None
    node: str = ""
    vm: str = ""
    #: From ``Fabric.create_mdev``: whether this very call created the child (False when it
    #: existed already). Decided atomically by the backend; False in listings.
    created: bool = False

    # Equality is the mdev's identity: what create_mdev returned equals what mdevs() lists
    # (and a repeated create_mdev's answer) whoever created it, so ``created`` stays out of
    # it, and out of the hash with it (equal objects hash equal).
    def _identity(self) -> tuple[object, ...]:
        return tuple(getattr(self, f) for f in self.__struct_fields__ if f != "created")

    def __eq__(self, other: object) -> bool:
        if type(other) is not MdevInfo:
            return NotImplemented
        return self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash(self._identity())


class GuestRange(msgspec.Struct, frozen=True):
    """A guest-physical RAM range [start, end)."""

    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


class GuestRam(msgspec.Struct, frozen=True):
    """A guest's RAM as its DMA windows will map it: the guest-physical ranges of its layout
    (low RAM, high RAM, cold-plugged DIMMs), ascending. Admission counts window segments and
    checks DMA reach from these, not from a byte total (``vmlend.memory.windows``)."""

    ranges: tuple[GuestRange, ...] = ()

    @property
    def size(self) -> int:
        return sum(r.size for r in self.ranges)

    @property
    def top(self) -> int:
        """First address past the guest's RAM (0 without RAM)."""
        return max((r.end for r in self.ranges), default=0)


class Check(msgspec.Struct):
    """One admission check and its outcome (shown by --dry-run and in errors)."""

    name: str
    ok: bool
    detail: str = ""
    data: dict[str, object] = msgspec.field(default_factory=dict)
