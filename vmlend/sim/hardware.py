"""The simulated cluster's hardware, built from a ``Topology``: nodes with RAM, IOMMUs, NTB
adapters and devices, plus guests and the hardware half of borrowing.

This is the layer below the fabric backend: it knows nothing of reservations or processes.
The backend (and the DMA-window, interrupt and peer-to-peer code) drive it through
``borrow``/``give_back`` and the primitives ``lender_domain``, ``vm_domain``, ``adapter``,
``device`` and ``guest``.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

import msgspec

from vmlend.errors import (
    BorrowTeardownError,
    DeviceHeldError,
    FabricError,
    MdevError,
    NoPathError,
    StaleTokenError,
    UnknownDeviceError,
    UnknownNodeError,
)
from vmlend.sim.addrmap import AddressMap, plan_mmio, ram_ranges
from vmlend.sim.device import SimDevice
from vmlend.sim.guest import SimGuest
from vmlend.sim.hostmem import HUGE_2M, HostMemory
from vmlend.sim.iommu import IommuDomain, NodeIommu, Requester
from vmlend.sim.mmio import MmioResolver, MmioTarget
from vmlend.sim.ntb import XLAT_ALIGN, NtbAdapter
from vmlend.sim.pci import regs
from vmlend.sim.resolver import DmaResolver, DmaTarget
from vmlend.sim.switchports import SwitchPorts
from vmlend.topology.model import BarKind, GuestRange, NodeSpec, Topology
from vmlend.topology.paths import NtbPath, route, routes
from vmlend.topology.requesters import SwitchPort, requester_device, route_ports

log = logging.getLogger(__name__)


class SimNode(msgspec.Struct):
    """One host: its address map, RAM, IOMMU, adapters (by index) and devices (by fdid)."""

    spec: NodeSpec
    address_map: AddressMap
    memory: HostMemory
    iommu: NodeIommu
    adapters: dict[int, NtbAdapter] = msgspec.field(default_factory=dict)
    devices: dict[int, SimDevice] = msgspec.field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec.name


class Borrow(msgspec.Struct, frozen=True):
    """A device under a VM's exclusive control, with the fabric resources it uses."""

    fdid: int
    node: str  # borrower node
    vm: str
    lender: str
    path: NtbPath | None  # None when the VM runs on the lender itself
    lender_entry: int | None = None  # LUT entry on the lender's adapter (the device's DMA)
    borrower_entry: int | None = None  # LUT entry on the borrower's adapter
    ingress: Requester | None = None  # how the device's DMA appears to the borrower's IOMMU


class BarWindow(msgspec.Struct, frozen=True):
    """A borrowed device's memory BAR ``bar`` as its borrower's CPU reaches it: segments
    ``first`` .. ``first + count - 1`` of the borrower's adapter ``adapter`` (the adapter of
    the device's crossing) translate to ``remote`` onward on the lender, the BAR's
    lender-physical base rounded down to the segments' 4 KiB translation alignment. Each BAR
    maps on its own whole segments, as admission counts them (``bar_segments``)."""

    fdid: int
    bar: int
    adapter: str
    first: int
    count: int
    remote: int

    def segments(self) -> range:
        return range(self.first, self.first + self.count)


class _Ingress(msgspec.Struct, frozen=True):
    """A device's crossing into ``node`` attached to a domain there. ``lut`` is the adapter
    whose LUT entry for the device this attachment made (None: the borrow's own entry)."""

    node: str
    requester: Requester
    lut: str | None = None


#: ``fn(borrow)``, run when ``borrow`` ends and before the hardware forgets it: removes every
#: mapping its owner made from or towards the device (DMA windows, peer maps, interrupt routes).
BorrowEndSubscriber = Callable[[Borrow], None]


class OpenMdev(msgspec.Struct, frozen=True):
    """An mdev a VM has open (QEMU holds its VFIO device): the VM's path to the device's config
    space, BARs and (for a share) its virtual controller. ``on_revoke`` cuts that path."""

    uuid: str
    fdid: int
    node: str
    vm: str
    on_revoke: Callable[[], object] | None = None
    share: bool = False  # a queue-level share's mdev (justified by a share, not a hold)

    @property
    def owner(self) -> tuple[str, str]:
        return (self.node, self.vm)


class ConfigWrite(msgspec.Struct, frozen=True):
    """A guest's config-space write that reached a physical device: who wrote it, and whose
    borrow the device was under at that moment (None: nobody's)."""

    fdid: int
    writer: tuple[str, str]
    owner: tuple[str, str] | None
    offset: int
    value: int


class ShareWire(msgspec.Struct, frozen=True):
    """One path a shared drive keeps for a share's VM (a real queue, an interrupt route, an
    admin doorbell route, a doorbell page), for the invariant checker to justify."""

    fdid: int
    node: str
    vm: str
    kind: str
    detail: str


class CmbWindowMap(msgspec.Struct, frozen=True):
    """The frames of a shared drive's CMB a share's VM reaches through its window (its
    CPU's view of its extent), for the invariant checker to compare with its claim."""

    fdid: int
    node: str
    vm: str
    asid: int
    frames: tuple[int, ...]


class ShareWindowMap(msgspec.Struct, frozen=True):
    """A share's CPU window onto its drive, ``kind`` "cmb" (its CMB extent) or "doorbell" (its
    own doorbell page): the segments of its node's adapter ``adapter`` it takes, for the
    invariant checker to compare with what they translate to and with its claim."""

    fdid: int
    node: str
    vm: str
    asid: int
    kind: str
    adapter: str
    segments: tuple[int, ...]


def share_user(fdid: int, node: str, backup_of: str = "") -> tuple[int, str]:
    """Who a shared drive's crossing into ``node`` is in the switch ports' tables
    (``SwitchPorts``): the node's shares' crossing, or share ``backup_of``'s backup."""
    return (fdid, f"nvme>{node}" + (f" backup of {backup_of}" if backup_of else ""))


class ShareCrossing(msgspec.Struct, frozen=True):
    """A shared drive's crossing into ``node`` over ``path``: the one the node's shares use
    (``backup_of`` "") or share ``backup_of``'s backup path."""

    fdid: int
    node: str
    backup_of: str
    path: NtbPath

    @property
    def user(self) -> tuple[int, str]:
        return share_user(self.fdid, self.node, self.backup_of)


class P2PPairRouteLike(Protocol):
    """The route a VM's peer-to-peer between two lenders takes (``vmlend.sim.p2pmap``)."""

    @property
    def node(self) -> str: ...

    @property
    def vm(self) -> str: ...

    @property
    def path(self) -> NtbPath: ...


class P2PCrossingLike(P2PPairRouteLike, Protocol):
    """A peer-to-peer crossing as the hardware knows it (``vmlend.sim.p2pmap.P2PCrossing``):
    a pair route plus the two devices it joins and the share user it counts as."""

    @property
    def source(self) -> int: ...

    @property
    def target(self) -> int: ...

    @property
    def user(self) -> tuple[int, str]: ...


class ShareWiring(Protocol):
    """A shared drive as the hardware knows it: what it has wired for its shares now."""

    fdid: int

    def wiring(self) -> list[ShareWire]: ...

    def crossings(self) -> list[ShareCrossing]: ...

    def cmb_frames(self) -> list[int]:
        """The frames of the drive's controller memory buffer in its lender's memory, in
        order (frame ``i`` is CMB offset ``i * FRAME``); [] when it has none."""
        ...

    def cmb_windows(self) -> list[CmbWindowMap]:
        """What each open share's VM reaches of the CMB through its window."""
        ...

    def cpu_windows(self) -> list[ShareWindowMap]:
        """The segments each open share's CPU windows onto the drive take."""
        ...


#: ``fn(link, up)``, run after a cable goes down (False) or comes back (True).
LinkSubscriber = Callable[[str, bool], None]


#: How many of the latest guest config writes the hardware keeps for the checker.
CONFIG_AUDIT = 512


def _domain_name(node: str, what: str) -> str:
    return f"{node}:{what}"


def fabric_requester_key(lender_node_id: int, requester_id: int) -> int:
    """A device's cluster-wide requester identity (the borrower-side LUT key)."""
    return lender_node_id << 16 | requester_id


class SimHardware:
    """Everything physical in the simulated cluster."""

    def __init__(self, topology: Topology, *, seed: int = 0) -> None:
        self.topology = topology
        self.seed = seed
        self.nodes: dict[str, SimNode] = {}
        self._adapters: dict[str, NtbAdapter] = {}
        self._devices: dict[int, SimDevice] = {}
        self._lender_domains: dict[int, IommuDomain] = {}
        self._vm_domains: dict[tuple[str, str], IommuDomain] = {}
        self._guests: dict[tuple[str, str], SimGuest] = {}
        self._borrows: dict[int, Borrow] = {}
        #: fdid -> its borrow's BAR windows in the borrower adapter's window (``BarWindow``)
        self._bar_windows: dict[int, tuple[BarWindow, ...]] = {}
        self._attached: dict[int, list[_Ingress]] = {}  # fdid -> ingress attachments
        self._borrow_end: list[BorrowEndSubscriber] = []
        self._fenced: dict[int, str] = {}  # fdid -> why its last teardown failed
        #: (node, mdev UUID) -> the VM that has it open. By node: an mdev's UUID names it on
        #: its host only (sysfs), and VMs of one name on two hosts derive the same UUID.
        self._open: dict[tuple[str, str], OpenMdev] = {}
        #: fdid -> the newest hold's fencing token a step on the device carried (0: none yet)
        self._tokens: dict[int, int] = {}
        # per device, the token of the newest hold it was taken back from (``retire``)
        self._retired: dict[int, int] = {}
        self._config_audit: deque[ConfigWrite] = deque(maxlen=CONFIG_AUDIT)
        self._share_wiring: list[ShareWiring] = []
        #: Borrow ends whose owners left lender mappings behind (the fallback had to clean
        #: up): each is a bug in whoever mapped them, reported by the invariant checker.
        self.teardown_gaps: list[str] = []
        self._routes: dict[tuple[str, str], NtbPath | NoPathError | None] = {}
        #: Cables that are down, by name (``Topology.link_names``).
        self._down: set[str] = set()
        self._link_names = frozenset(topology.link_names())
        self._link_subscribers: list[LinkSubscriber] = []
        #: Link events in order: (link, "down" | "up" | "up-lost"), for status and the checker.
        self.link_log: list[tuple[str, str]] = []
        #: The cluster switch ports' requester tables (a borrow's crossing holds an entry on
        #: each port of its route).
        self.switch_ports = SwitchPorts(topology)
        #: The peer-to-peer mappers' crossings (``add_p2p_crossings``), for the checker.
        self._p2p_sources: list[Callable[[], Sequence[P2PCrossingLike]]] = []
        #: Each mapper's route per lender pair, kept while the pair has no maps
        #: (``P2PMapper.pair_routes``): what a reserve or release counts its claims on.
        self._p2p_route_sources: list[Callable[[], Sequence[P2PPairRouteLike]]] = []
        for spec in topology.nodes:
            self._build_node(spec)
        self.resolver = DmaResolver(self)
        #: CPU accesses to device BARs, through the adapters (``vmlend.sim.mmio``).
        self.mmio = MmioResolver(self)

    @classmethod
    def from_topology(cls, topology: Topology, *, seed: int = 0) -> SimHardware:
        """Build the hardware of ``topology``; ``seed`` fixes the host page scatter."""
        return cls(topology, seed=seed)

    def _peers(self, node: str, adapter_ref: str) -> set[str]:
        """The nodes some route from ``node`` leaves through adapter ``adapter_ref`` to."""
        return {
            other.name
            for other in self.topology.nodes
            if other.name != node
            and any(p.src.ref == adapter_ref for p in routes(self.topology, node, other.name))
        }

    def _build_node(self, spec: NodeSpec) -> None:
        amap = AddressMap(spec.name, spec.ram)
        node = SimNode(
            spec=spec,
            address_map=amap,
            memory=HostMemory(spec.name, ram_ranges(spec.ram), seed=self.seed),
            iommu=NodeIommu(spec.name),
        )
        self.nodes[spec.name] = node
        devices = sorted(
            (d for d in self.topology.devices if d.lender == spec.name), key=lambda d: d.fdid
        )
        plan = plan_mmio(amap, list(spec.adapters), devices)
        for a in spec.adapters:
            adapter = NtbAdapter(a, plan.windows[a.ref], self._peers(spec.name, a.ref))
            node.adapters[a.index] = adapter
            self._adapters[a.ref] = adapter
        for d in devices:
            dev = SimDevice(d, plan.bars[d.fdid])
            node.devices[d.fdid] = dev
            self._devices[d.fdid] = dev
            # Each device gets its own domain at once: isolation holds before anything is lent.
            domain = IommuDomain(_domain_name(spec.name, f"dev{d.fdid:#x}"))
            self._lender_domains[d.fdid] = domain
            node.iommu.attach(Requester(dev.requester_id), domain)

    # --- lookups ---------------------------------------------------------------------------------
    def node(self, name: str) -> SimNode:
        try:
            return self.nodes[name]
        except KeyError:
            raise UnknownNodeError(name) from None

    def adapter(self, ref: str) -> NtbAdapter:
        try:
            return self._adapters[ref]
        except KeyError:
            known = ", ".join(sorted(self._adapters)) or "none"
            raise FabricError(f"unknown NTB adapter {ref!r} (known: {known})") from None

    def adapters(self) -> list[NtbAdapter]:
        return [self._adapters[r] for r in sorted(self._adapters)]

    def device(self, fdid: int) -> SimDevice:
        try:
            return self._devices[fdid]
        except KeyError:
            raise UnknownDeviceError(fdid) from None

    def devices(self) -> list[SimDevice]:
        return [self._devices[f] for f in sorted(self._devices)]

    def route(self, src: str, dst: str) -> NtbPath | None:
        """The cheapest route from ``src`` to ``dst`` whose cables are all up (what a new
        mapping takes); ``NoPathError`` when none is."""
        # computed once per set of dead links (the cache is dropped when a link changes)
        key = (src, dst)
        if key not in self._routes:
            try:
                self._routes[key] = route(self.topology, src, dst, down=self._down)
            except NoPathError as e:
                self._routes[key] = e
        found = self._routes[key]
        if isinstance(found, NoPathError):
            raise NoPathError(src, dst)
        return found

    def routes(self, src: str, dst: str) -> list[NtbPath]:
        """Every route from ``src`` to ``dst``, dead cables or not, cheapest first."""
        return routes(self.topology, src, dst)

    def path_between(self, src_ref: str, dst_ref: str) -> NtbPath | None:
        """The route from adapter ``src_ref`` to adapter ``dst_ref`` (dead cables or not), or
        None when no cable joins them."""
        src, dst = self.adapter(src_ref), self.adapter(dst_ref)
        for p in routes(self.topology, src.node, dst.node):
            if (p.src.ref, p.dst.ref) == (src_ref, dst_ref):
                return p
        return None

    # --- links ---------------------------------------------------------------------------------
    def _check_link(self, name: str) -> None:
        if name not in self._link_names:
            known = ", ".join(self.topology.link_names()) or "none"
            raise FabricError(f"unknown link {name!r} (known: {known})")

    def links(self) -> dict[str, bool]:
        """Every cable by name: True when it is up."""
        return {n: n not in self._down for n in self.topology.link_names()}

    def link_up_now(self, name: str) -> bool:
        self._check_link(name)
        return name not in self._down

    def dead_links(self, path: NtbPath) -> list[str]:
        """The cables of ``path`` that are down now."""
        return [n for n in path.links if n in self._down]

    def on_link_change(self, fn: LinkSubscriber) -> Callable[[], None]:
        """Run ``fn(link, up)`` after a cable goes down or comes back (a link event, as the
        adapter's driver raises it); returns a remover."""
        self._link_subscribers.append(fn)

        def remove() -> None:
            if fn in self._link_subscribers:
                self._link_subscribers.remove(fn)

        return remove

    def link_down(self, name: str) -> bool:
        """Cable ``name`` fails: every mapping across it stops working (reads through it
        return all ones, writes are dropped), the mappings themselves stay. False when it was
        down already."""
        self._check_link(name)
        if name in self._down:
            return False
        self._down.add(name)
        self._routes.clear()
        self.link_log.append((name, "down"))
        log.warning("link %s down", name)
        self._notify_link(name, False)
        return True

    def link_up(self, name: str, *, keep_mappings: bool = True) -> bool:
        """Cable ``name`` comes back. With ``keep_mappings`` the adapters at its ends kept
        their state and every mapping across it works again; without, those adapters were
        reset while it was down: their window segments and requester LUT entries are gone
        (whoever made them must make them again). False when it was up already."""
        self._check_link(name)
        if name not in self._down:
            return False
        self._down.discard(name)
        self._routes.clear()
        if not keep_mappings:
            for ref in self._link_adapters(name):
                self.adapter(ref).reset()
        self.link_log.append((name, "up" if keep_mappings else "up-lost"))
        log.warning("link %s up (%s)", name, "mappings kept" if keep_mappings else "mappings lost")
        self._notify_link(name, True)
        return True

    def reprogram(self, name: str) -> int:
        """The drivers of the adapters at cable ``name``'s ends program again what a reset
        lost (``NtbAdapter.restore``); returns how many segments and LUT entries."""
        self._check_link(name)
        return sum(self.adapter(ref).restore() for ref in self._link_adapters(name))

    def link_adapters(self, name: str) -> list[str]:
        """The adapters at the ends of cable ``name`` (none for a cable between switches):
        the ones a link that comes back without its mappings reset."""
        self._check_link(name)
        return self._link_adapters(name)

    def _link_adapters(self, name: str) -> list[str]:
        """The adapters at the ends of cable ``name`` (none for a cable between switches)."""
        for link in self.topology.links:
            for end_name, ends in zip(
                link.names,
                [link.ends] if link.switch is None else [(e,) for e in link.ends],
                strict=True,
            ):
                if end_name == name:
                    return list(ends)
        return []

    def _notify_link(self, name: str, up: bool) -> None:
        failures: list[Exception] = []
        for fn in list(self._link_subscribers):
            try:
                fn(name, up)
            except Exception as e:  # every subscriber hears of it; then say so
                failures.append(e)
        if failures:
            raise failures[0]

    # --- IOMMU domains ------------------------------------------------------------------------
    def lender_domain(self, fdid: int) -> IommuDomain:
        """The device's own domain on its lender (IOVA as the device issues it -> lender
        physical). Attached from the start: a device with nothing mapped reaches nothing."""
        self.device(fdid)
        return self._lender_domains[fdid]

    def vm_domain(self, node: str, vm: str) -> IommuDomain:
        """The per-VM domain on ``node`` (created on first use). It translates what enters
        ``node`` through the NTB on behalf of the devices ``vm`` borrowed."""
        self.node(node)
        key = (node, vm)
        if key not in self._vm_domains:
            self._vm_domains[key] = IommuDomain(_domain_name(node, f"vm:{vm}"), owner=key)
        return self._vm_domains[key]

    def vm_domains(self) -> list[IommuDomain]:
        """Every per-VM domain that exists now."""
        return [self._vm_domains[k] for k in sorted(self._vm_domains)]

    def crossing_source(self, node: str, requester: Requester) -> int | None:
        """The device whose DMA enters ``node`` through the NTB as ``requester``, or None when
        no LUT entry produces that requester (a local function, or a stale attachment)."""
        for fdid in sorted(self._devices):
            try:  # FabricError: local to ``node``, unreachable, or never let across
                if self.ingress(fdid, node) == requester:
                    return fdid
            except FabricError:
                continue
        for fdid in sorted(self._devices):  # a second way in (a two-path share's backup)
            if requester in self.ingresses(fdid, node):
                return fdid
        return None

    def entry_adapters(self, fdid: int, node: str) -> list[str]:
        """The adapters of ``node`` whose LUT has an entry for ``fdid`` now (its crossing's,
        and a two-path NVMe share's backup's), cheapest route first."""
        key = self.requester_key(fdid)
        out: list[str] = []
        for p in routes(self.topology, self.device(fdid).lender, node):
            if p.dst.ref not in out and self.adapter(p.dst.ref).lut_lookup(key) is not None:
                out.append(p.dst.ref)
        return out

    def ingresses(self, fdid: int, node: str) -> list[Requester]:
        """Every requester ``fdid``'s DMA may enter ``node`` as: one per adapter of ``node``
        whose LUT names it on a route from a lender adapter that lets it out (a two-path NVMe
        share's backup path enters by a second adapter). [] for the lender itself."""
        dev = self.device(fdid)
        if dev.lender == node:
            return []
        key, out = self.requester_key(fdid), []
        for p in routes(self.topology, dev.lender, node):
            if self.adapter(p.src.ref).lut_lookup(dev.requester_id) is None:
                continue
            far = self.adapter(p.dst.ref)
            entry = far.lut_lookup(key)
            if entry is not None:
                requester = Requester(far.assigned_requester_id(entry, key))
                if requester not in out:
                    out.append(requester)
        return out

    # --- guests --------------------------------------------------------------------------------
    def create_guest(
        self,
        node: str,
        vm: str,
        ranges: list[GuestRange],
        *,
        backing: int = HUGE_2M,
        running: bool = True,
    ) -> SimGuest:
        """A guest on ``node`` whose RAM covers ``ranges``. With ``running`` False its memory
        does not exist until ``guest.start()`` (QEMU not yet started)."""
        host = self.node(node)
        if (node, vm) in self._guests:
            raise FabricError(f"guest {vm} already exists on {node}; destroy it first")
        guest = SimGuest(node, vm, ranges, host.memory, backing=backing)
        if running:
            guest.start()
        self._guests[(node, vm)] = guest
        self.vm_domain(node, vm)
        return guest

    def guest(self, node: str, vm: str) -> SimGuest:
        try:
            return self._guests[(node, vm)]
        except KeyError:
            raise FabricError(f"no guest {vm} on node {node}") from None

    def guests(self) -> list[SimGuest]:
        return list(self._guests.values())

    def destroy_guest(self, node: str, vm: str) -> None:
        """Free the guest's RAM (refused while pages are pinned). Its VM domain goes too once
        no borrowed device uses it."""
        guest = self.guest(node, vm)
        guest.stop()
        del self._guests[(node, vm)]
        if not any((b.node, b.vm) == (node, vm) for b in self._borrows.values()):
            self._vm_domains.pop((node, vm), None)

    # --- borrowing -----------------------------------------------------------------------------
    def borrowed(self, fdid: int) -> Borrow | None:
        self.device(fdid)
        return self._borrows.get(fdid)

    def borrows(self) -> list[Borrow]:
        return [self._borrows[f] for f in sorted(self._borrows)]

    def token(self, fdid: int) -> int:
        """The newest fencing token a step on ``fdid`` carried (0: none)."""
        self.device(fdid)
        return self._tokens.get(fdid, 0)

    def _check_token(self, fdid: int, token: int, what: str) -> None:
        """The lender side of fencing: a step made for a hold older than one the device has
        already served is refused; a newer token becomes the device's. 0: no hold behind the
        step (the hardware used directly), nothing to check. A token the device was taken
        back for is refused too, although it is still the newest: its hold has ended."""
        current = self._tokens.get(fdid, 0)
        if token and (token < current or token <= self._retired.get(fdid, 0)):
            raise StaleTokenError(fdid, token, current, what)
        if token > current:
            self._tokens[fdid] = token

    def spent(self, fdid: int) -> int:
        """The newest token ``fdid`` no longer serves a step for (taken back for, or its hold
        released); 0: none."""
        return self._retired.get(fdid, 0)

    def retire(self, fdid: int, token: int) -> None:
        """The lender took ``fdid`` back for the ended hold of ``token``: no step made for
        that hold, or an older one, is served from now on (its holder may still be alive, cut
        off, and try its borrow again before any newer hold has the device)."""
        self.device(fdid)
        self._retired[fdid] = max(self._retired.get(fdid, 0), token)
        self._tokens[fdid] = max(self._tokens.get(fdid, 0), token)

    def borrow(self, fdid: int, node: str, vm: str, *, token: int = 0) -> Borrow:
        """Take exclusive control of ``fdid`` for ``vm`` on ``node``: a LUT entry for the
        device's requester id on the lender's adapter, one on the borrower's adapter for the
        device's borrower-side identity, one in the requester table of each cluster switch
        port of the route (``switch_ports``; each entry per requester device, shared by its
        functions), and the crossing's requester attached to the VM's domain on ``node``.
        Idempotent for the same VM; ``DeviceHeldError`` for another;
        ``ResourceExhaustedError`` (nothing changed) when a LUT or a port's table is full
        (``SwitchPortFullError`` naming the switch and port); ``StaleTokenError``
        (nothing changed) when ``token``, the fencing token of the hold it is made for, is
        older than one the device has served."""
        dev = self.device(fdid)
        self.node(node)
        self._check_token(fdid, token, "a borrow")
        current = self._borrows.get(fdid)
        if current is not None:
            if (current.node, current.vm) == (node, vm):
                return current
            raise DeviceHeldError(fdid, current.node, current.vm)
        left = self._lender_domains[fdid].mappings()
        if left:  # whoever mapped them outlived the borrow that justified them: a bug to report
            gap = f"device {fdid:#x}: {len(left)} lender mappings left when it was borrowed again"
            log.warning("%s", gap)
            self.teardown_gaps.append(gap)
            self._lender_domains[fdid].clear()
        path = self.route(dev.lender, node)
        if path is None:
            result = Borrow(fdid, node, vm, dev.lender, None)
        else:
            result = self._borrow_remote(dev, node, vm, path)
        self._borrows[fdid] = result
        log.info("device %#x borrowed by %s/%s", fdid, node, vm)
        return result

    def reroute(self, fdid: int, *, token: int = 0) -> Borrow | None:
        """Re-establish the borrowed ``fdid``'s crossing over the cheapest live route from the
        same lender adapter when a cable of its route is down, or program it again where a
        reset lost it: a LUT entry on the new borrower adapter, its requester attached to the
        VM's domain, the old crossing removed (``_recross``, which a hot migration's
        switch-over shares). The lender's window segments and the VM's domain stay as they
        are (they name the borrower's addresses, not an adapter), so the guest does not see
        the move and does not reset the device. Returns the new borrow; None when there was
        nothing to do (not borrowed, local, all cables up and nothing lost). ``NoPathError``
        (nothing changed) when no live route is left from the lender's adapter;
        ``StaleTokenError`` (nothing changed) as ``borrow``."""
        self.device(fdid)
        self._check_token(fdid, token, "a re-route")
        b = self._borrows.get(fdid)
        if b is None or b.path is None or b.ingress is None:
            return None
        old_dst = self.adapter(b.path.dst.ref)
        key = self.requester_key(fdid)
        if not self.dead_links(b.path) and old_dst.lut_lookup(key) is not None:
            src = self.adapter(b.path.src.ref)
            if src.lut_lookup(self.device(fdid).requester_id) is not None:
                return None  # its route works
        same_src = [
            p
            for p in routes(self.topology, b.lender, b.node, down=self._down)
            if p.src.ref == b.path.src.ref
        ]
        if not same_src:
            raise NoPathError(b.lender, b.node)
        moved = self._recross(b, same_src[0], b.node, b.vm)
        log.warning(
            "device %#x: crossing to %s/%s re-established over %s",
            fdid,
            b.node,
            b.vm,
            same_src[0].describe(),
        )
        return moved

    def move_borrow(self, fdid: int, node: str, vm: str, *, token: int = 0) -> Borrow:
        """A hot migration's switch-over: the borrow of ``fdid`` follows its VM to ``vm`` on
        ``node`` without ending. The crossing is made again towards ``node`` over the cheapest
        live route (LUT entries, the requester attached to the VM's domain there) and the old
        one removed, as ``reroute`` does towards another adapter of the same node. Nothing is
        reset and no borrow-end subscriber runs: the caller re-points what it mapped for the
        device (DMA windows, interrupt routes, peer maps) and the device keeps its state.
        ``token``: the fencing token of the hold the destination now has (newer than the
        source's, which the device refuses from then on); ``StaleTokenError`` (nothing
        changed) for an older one. ``FabricError`` when the device is not borrowed."""
        self.device(fdid)
        self.node(node)
        b = self._borrows.get(fdid)
        if b is None:
            raise FabricError(f"device {fdid:#x} is not borrowed: nothing to move to {node}")
        self._check_token(fdid, token, "a hot migration's switch-over")
        if (b.node, b.vm) == (node, vm):
            return b
        moved = self._recross(b, self.route(b.lender, node), node, vm)
        log.info("device %#x: borrow moved from %s/%s to %s/%s", fdid, b.node, b.vm, node, vm)
        return moved

    def _recross(self, b: Borrow, new: NtbPath | None, node: str, vm: str) -> Borrow:
        """Point ``b``'s crossing at ``vm`` on ``node`` over ``new`` (None: ``node`` is the
        lender): the new LUT entries and context first, then the old ones go (an entry the
        new crossing reuses stays). All or nothing: a failure removes what this call made."""
        fdid = b.fdid
        rid = self.device(fdid).requester_id
        key = self.requester_key(fdid)
        lender_entry = entry = None
        ingress: Requester | None = None
        requester = requester_device(self.device(fdid).spec)
        old_ports = route_ports(b.path) if b.path is not None else ()
        new_ports = route_ports(new) if new is not None else ()
        added = [p for p in new_ports if p not in old_ports]
        old_windows = self._bar_windows.get(fdid, ())
        # the BAR windows stay where the borrower adapter and the lender's stay (a re-route
        # through other switches); else they are made on the new adapter, the old ones go
        keep = (
            new is not None
            and b.path is not None
            and (new.dst.ref, new.src.ref) == (b.path.dst.ref, b.path.src.ref)
        )
        windows: tuple[BarWindow, ...] = ()
        if new is not None:
            src, dst = self.adapter(new.src.ref), self.adapter(new.dst.ref)
            had_src, had_dst = src.lut_lookup(rid) is not None, dst.lut_lookup(key) is not None
            self.switch_ports.add(added, requester, fdid)  # all or nothing
            attached = False
            try:
                lender_entry = src.lut_add(rid)  # again, if a reset lost it
                entry = dst.lut_add(key)
                ingress = Requester(dst.assigned_requester_id(entry, key))
                host = self.node(node)
                if host.iommu.domain_for(ingress) is None:
                    host.iommu.attach(ingress, self.vm_domain(node, vm))
                    attached = True
                if keep:  # programmed again where a reset lost them
                    self._remap_bar_windows(old_windows, new.src.ref)
                    windows = old_windows
                else:
                    windows = self._map_bar_windows(self.device(fdid), new)
            except Exception:
                if attached and ingress is not None:
                    self.node(node).iommu.detach(ingress)
                if not had_dst:
                    dst.lut_remove(key)
                if not had_src:
                    src.lut_remove(rid)
                self.switch_ports.remove(added, requester, fdid)
                raise
        if b.path is not None and b.ingress is not None:
            if new is None or (new.dst.ref, node) != (b.path.dst.ref, b.node):
                self.node(b.node).iommu.detach(b.ingress)  # nothing enters through it now
                self.adapter(b.path.dst.ref).lut_remove(key)
            if new is None or new.src.ref != b.path.src.ref:
                self.adapter(b.path.src.ref).lut_remove(rid)
        self.switch_ports.remove([p for p in old_ports if p not in new_ports], requester, fdid)
        if not keep:
            self._unmap_bar_windows(old_windows)
        if windows:
            self._bar_windows[fdid] = windows
        else:
            self._bar_windows.pop(fdid, None)
        moved = Borrow(fdid, node, vm, b.lender, new, lender_entry, entry, ingress)
        self._borrows[fdid] = moved
        own = [] if ingress is None else [_Ingress(node, ingress)]
        self._attached[fdid] = own + [
            a for a in self._attached.get(fdid, []) if not (a.node == b.node and a.lut is None)
        ]
        return moved

    def crossing_ports(self, fdid: int) -> tuple[SwitchPort, ...]:
        """The switch ports the borrowed ``fdid``'s crossing holds requester entries on (its
        route's); () when it is not borrowed or is local to its VM."""
        b = self._borrows.get(fdid)
        return route_ports(b.path) if b is not None and b.path is not None else ()

    def requester_key(self, fdid: int) -> int:
        """``fdid``'s cluster-wide requester identity: the key of its LUT entries on the far
        side of a crossing."""
        dev = self.device(fdid)
        return fabric_requester_key(self.node(dev.lender).spec.node_id, dev.requester_id)

    def _borrow_remote(self, dev: SimDevice, node: str, vm: str, path: NtbPath) -> Borrow:
        src = self.adapter(path.src.ref)
        dst = self.adapter(path.dst.ref)
        key = self.requester_key(dev.fdid)
        ports = route_ports(path)
        requester = requester_device(dev.spec)
        self.switch_ports.add(ports, requester, dev.fdid)  # all or nothing
        try:
            lender_entry = src.lut_add(dev.requester_id)
        except Exception:
            self.switch_ports.remove(ports, requester, dev.fdid)
            raise
        try:
            borrower_entry = dst.lut_add(key)
        except Exception:
            src.lut_remove(dev.requester_id)
            self.switch_ports.remove(ports, requester, dev.fdid)
            raise
        ingress = Requester(dst.assigned_requester_id(borrower_entry, key))
        try:
            self.node(node).iommu.attach(ingress, self.vm_domain(node, vm))
        except Exception:
            src.lut_remove(dev.requester_id)
            dst.lut_remove(key)
            self.switch_ports.remove(ports, requester, dev.fdid)
            raise
        try:
            windows = self._map_bar_windows(dev, path)
        except Exception:
            self.node(node).iommu.detach(ingress)
            src.lut_remove(dev.requester_id)
            dst.lut_remove(key)
            self.switch_ports.remove(ports, requester, dev.fdid)
            raise
        self._bar_windows[dev.fdid] = windows
        self._attached[dev.fdid] = [_Ingress(node, ingress)]
        return Borrow(dev.fdid, node, vm, dev.lender, path, lender_entry, borrower_entry, ingress)

    # --- BAR windows: the borrower's CPU reaches the device's BARs through segments ---------
    def _map_bar_windows(self, dev: SimDevice, path: NtbPath) -> tuple[BarWindow, ...]:
        """Map each memory BAR of ``dev`` into the window of ``path``'s borrower adapter, on
        whole segments of its own (what admission claims, ``bar_segments``), translated
        through the lender's adapter of ``path``. All or nothing: ``ResourceExhaustedError``
        naming the adapter when it has no run of free segments left, nothing mapped."""
        dst = self.adapter(path.dst.ref)
        seg = dst.segment_size
        made: list[BarWindow] = []
        mapped: list[int] = []
        try:
            for bar in sorted(dev.spec.bars, key=lambda b: b.index):
                if bar.kind is BarKind.IO:
                    continue
                phys = dev.bar_phys[bar.index]
                remote = phys - phys % XLAT_ALIGN
                count = -(-(phys - remote + bar.size) // seg)
                first = dst.free_segments(count)
                for i in range(count):
                    dst.map_segment(first + i, dev.lender, remote + i * seg, via=path.src.ref)
                    mapped.append(first + i)
                made.append(BarWindow(dev.fdid, bar.index, dst.ref, first, count, remote))
        except Exception:
            for index in mapped:
                dst.unmap_segment(index)
            raise
        return tuple(made)

    def _unmap_bar_windows(self, windows: Sequence[BarWindow]) -> None:
        for w in windows:
            adapter = self.adapter(w.adapter)
            for index in w.segments():
                adapter.unmap_segment(index)

    def _remap_bar_windows(self, windows: Sequence[BarWindow], via: str) -> None:
        """Program kept windows again where a reset lost them (``map_segment`` of the same
        translation is a no-op where they are still there)."""
        for w in windows:
            adapter = self.adapter(w.adapter)
            seg = adapter.segment_size
            lender = self.device(w.fdid).lender
            for i, index in enumerate(w.segments()):
                adapter.map_segment(index, lender, w.remote + i * seg, via=via)

    def bar_windows(self, fdid: int | None = None) -> list[BarWindow]:
        """The BAR windows of the borrowed devices (``fdid``'s only, when given)."""
        return [
            w
            for f in sorted(self._bar_windows)
            if fdid in (None, f)
            for w in self._bar_windows[f]
        ]

    def bar_window_address(self, fdid: int, bar: int, offset: int) -> tuple[str, int] | None:
        """(borrower adapter, address in its window) where the borrower's CPU reaches
        ``offset`` of BAR ``bar`` of the borrowed ``fdid``; None when no window maps it."""
        for w in self._bar_windows.get(fdid, ()):
            if w.bar == bar:
                adapter = self.adapter(w.adapter)
                delta = self.device(fdid).bar_phys[bar] - w.remote
                return w.adapter, adapter.segment_base(w.first) + delta + offset
        return None

    def ingress(self, fdid: int, node: str) -> Requester:
        """The requester a DMA of the (borrowed) device carries when it enters ``node`` through
        the NTB: the id the entering adapter's own LUT entry for the device assigns, which is
        all ``node``'s IOMMU sees. ``FabricError`` when the device may not cross, or ``node``'s
        adapter has no entry for it (nothing entering as it would be translated)."""
        dev = self.device(fdid)
        path = self._crossing_path(fdid, node)
        if path is None:
            raise FabricError(f"device {fdid:#x} is local to {node}: its DMA does not cross")
        src = self.adapter(path.src.ref)
        if src.lut_lookup(dev.requester_id) is None:
            raise FabricError(
                f"device {fdid:#x} has no LUT entry on {src.ref}; borrow it before routing "
                "its DMA to another node"
            )
        dst = self.adapter(path.dst.ref)
        key = self.requester_key(fdid)
        entry = dst.lut_lookup(key)
        if entry is None:
            raise FabricError(
                f"device {fdid:#x} has no LUT entry on {dst.ref}: {node} would not know its "
                "requests"
            )
        return Requester(dst.assigned_requester_id(entry, key))

    def crossing(self, fdid: int, node: str) -> NtbPath | None:
        """The route ``fdid``'s DMA into ``node`` takes now (see ``_crossing_path``); None
        when ``node`` is its lender."""
        return self._crossing_path(fdid, node)

    def _crossing_path(self, fdid: int, node: str) -> NtbPath | None:
        """The route ``fdid``'s DMA into ``node`` takes: its borrow's, when ``node`` borrows
        it (made over the cheapest live route then, perhaps re-made over another since); else
        a shared drive's crossing into the node (not a two-path share's backup); else the
        cheapest whose far adapter has a LUT entry for it (a peer map's), else the cheapest
        live route."""
        dev = self.device(fdid)
        borrow = self._borrows.get(fdid)
        if borrow is not None and borrow.node == node and borrow.path is not None:
            return borrow.path
        for c in self.share_crossings(fdid):
            if c.node == node and not c.backup_of:
                return c.path
        key = self.requester_key(fdid)
        for p in routes(self.topology, dev.lender, node):  # dead cables too: it stays set up
            if self.adapter(p.dst.ref).lut_lookup(key) is not None:
                return p
        return self.route(dev.lender, node)

    def attach_ingress(
        self, fdid: int, node: str, domain: IommuDomain, path: NtbPath | None = None
    ) -> Requester:
        """Let ``fdid``'s DMA entering ``node`` be translated by ``domain`` (peer-to-peer to a
        device on a third node: ``domain`` maps to that device's BAR), giving the device a LUT
        entry on ``node``'s adapter if it has none: the adapter ``path`` enters by (the peer
        map's route; default: the cheapest live route). Undone by ``detach_ingress`` or
        ``give_back``."""
        dev = self.device(fdid)
        if path is None:
            path = self.route(dev.lender, node)
        if path is None:
            raise FabricError(f"device {fdid:#x} is local to {node}: its DMA does not cross")
        dst = self.adapter(path.dst.ref)
        key = self.requester_key(fdid)
        made = None
        if dst.lut_lookup(key) is None:
            dst.lut_add(key)
            made = dst.ref
        try:
            requester = self.ingress(fdid, node)
            self.node(node).iommu.attach(requester, domain)
        except Exception:
            if made is not None:
                dst.lut_remove(key)
            raise
        entries = self._attached.setdefault(fdid, [])
        if not any(a.node == node for a in entries):
            entries.append(_Ingress(node, requester, made))
        return requester

    def detach_ingress(self, fdid: int, node: str) -> bool:
        """Undo ``attach_ingress``: ``fdid``'s DMA entering ``node`` is blocked again (and the
        LUT entry it made goes). False when nothing was attached there."""
        entries = self._attached.get(fdid, [])
        for i, attached in enumerate(entries):
            if attached.node == node:
                del entries[i]
                return self._detach(fdid, attached)
        return False

    def _detach(self, fdid: int, attached: _Ingress) -> bool:
        done = self.node(attached.node).iommu.detach(attached.requester)
        if attached.lut is not None:
            self.adapter(attached.lut).lut_remove(self.requester_key(fdid))
        return done

    def on_borrow_end(self, fn: BorrowEndSubscriber) -> Callable[[], None]:
        """Run ``fn(borrow)`` whenever a borrow ends, before the hardware drops it, so whoever
        mapped something for the device (or towards its BARs) removes it in the same step.
        Subscribers run in the order they subscribed; returns a remover."""
        self._borrow_end.append(fn)

        def remove() -> None:
            if fn in self._borrow_end:
                self._borrow_end.remove(fn)

        return remove

    def fenced(self, fdid: int) -> str | None:
        """Why ``fdid`` is fenced (its last borrow teardown failed), or None."""
        self.device(fdid)
        return self._fenced.get(fdid)

    def give_back(
        self,
        fdid: int,
        node: str | None = None,
        vm: str | None = None,
        *,
        token: int = 0,
        revoke: bool = True,
    ) -> bool:
        """End the borrow of ``fdid``: every borrow-end subscriber removes what it mapped for
        or towards the device, then the hardware undoes ``borrow`` and resets the device (the
        next user gets it clean). False when it was not borrowed; ``DeviceHeldError`` when
        ``node``/``vm`` name someone else; ``StaleTokenError`` (nothing changed) when
        ``token`` is older than one the device has served (a late take-back, say). The open
        mdevs of the device are revoked in the same step, unless ``revoke`` is False: the undo
        of a borrow that could not be recorded, whose hold (and VM) goes on.

        A subscriber's error is raised as ``BorrowTeardownError`` after every other subscriber
        ran; the borrow then stays (nobody else can take the device) and the device is fenced:
        it neither masters nor decodes until a retried ``give_back`` succeeds."""
        dev = self.device(fdid)
        if token and token < self._tokens.get(fdid, 0):  # a late step of an ended hold
            raise StaleTokenError(fdid, token, self._tokens[fdid], "a give-back")
        current = self._borrows.get(fdid)
        if current is None:
            return False
        if (node is not None and node != current.node) or (vm is not None and vm != current.vm):
            raise DeviceHeldError(fdid, current.node, current.vm)
        failures: list[Exception] = []
        for fn in list(self._borrow_end):
            try:
                fn(current)
            except Exception as e:  # the rest still run: remove as much as possible
                failures.append(e)
        if failures:
            self._fence(dev, current, failures)
        self._fenced.pop(fdid, None)
        for attached in self._attached.pop(fdid, []):
            self._detach(fdid, attached)
        if current.path is not None:
            src = self.adapter(current.path.src.ref)
            dst = self.adapter(current.path.dst.ref)
            src.lut_remove(dev.requester_id)
            dst.lut_remove(self.requester_key(fdid))
            self.switch_ports.remove(route_ports(current.path), requester_device(dev.spec), fdid)
        self._unmap_bar_windows(self._bar_windows.pop(fdid, ()))  # its CPU path goes too
        left = self._lender_domains[fdid].mappings()
        if left:
            # the device's own domain is the borrow's: what no subscriber claimed goes with it,
            # but whoever mapped it should have removed it: the checker reports the gap
            gap = f"device {fdid:#x}: {len(left)} lender mappings nobody removed at borrow end"
            log.warning("%s", gap)
            self.teardown_gaps.append(gap)
            self._lender_domains[fdid].clear()
        del self._borrows[fdid]
        try:
            # the open mdevs go in the same step (config space, BARs, shares), once no borrow
            # is left that a peer mapper could map them for again
            if revoke:
                self.revoke(fdid)
        finally:
            dev.reset()  # whatever a revocation raised: the next owner finds it reset
        log.info("device %#x given back by %s/%s", fdid, current.node, current.vm)
        return True

    def _fence(self, dev: SimDevice, current: Borrow, failures: list[Exception]) -> None:
        why = "; ".join(str(e) or type(e).__name__ for e in failures)
        self._fenced[dev.fdid] = why
        # a platform write (the lender's containment), not the guest's: no listener sees it
        cmd = dev.config.command & ~(regs.COMMAND_MASTER | regs.COMMAND_MEMORY)
        dev.config.write(regs.COMMAND, 2, cmd, notify=False)
        log.error("device %#x fenced: %s", dev.fdid, why)
        raise BorrowTeardownError(dev.fdid, current.node, current.vm, why) from failures[0]

    # --- mdevs a VM has open, and what reaches a device through them ---------------------------
    def open_mdev(
        self,
        uuid: str,
        fdid: int,
        node: str,
        vm: str,
        on_revoke: Callable[[], object] | None = None,
        *,
        share: bool = False,
    ) -> OpenMdev:
        """VM ``vm`` on ``node`` opens mdev ``uuid`` of ``fdid`` (QEMU's VFIO open). One VM at a
        time: ``MdevError`` when another VM has it open, or (unless ``share``: a queue-level
        share's mdev, one per VM) another VM has an mdev of the same device open.
        ``on_revoke`` runs when the device's borrow or hold ends."""
        self.device(fdid)
        current = self._open.get((node, uuid))
        if current is not None and current.owner != (node, vm):
            raise MdevError(
                f"mdev {uuid} is open in VM {current.vm} on {current.node}; it can be opened by"
                " one VM at a time"
            )
        for other in self._open.values():
            if other.fdid == fdid and other.owner != (node, vm) and not share:
                raise MdevError(
                    f"device {fdid:#x} is open in VM {other.vm} on {other.node} (mdev"
                    f" {other.uuid}); stop that VM or hot-remove the device first"
                )
        opened = OpenMdev(uuid, fdid, node, vm, on_revoke, share)
        self._open[(node, uuid)] = opened
        return opened

    def close_mdev(self, uuid: str, node: str) -> bool:
        """The VM closed mdev ``uuid`` on ``node`` (hot-remove, VM stop). False when it was not
        open there (e.g. revoked since: another VM of the same name on another node may have
        its own mdev of that UUID open, which this must not touch)."""
        return self._open.pop((node, uuid), None) is not None

    def open_mdevs(self) -> list[OpenMdev]:
        return [self._open[k] for k in sorted(self._open, key=lambda k: (k[1], k[0]))]

    def revoke(self, fdid: int, node: str | None = None, vm: str | None = None) -> int:
        """Cut the paths of the VMs that have an mdev of ``fdid`` open (only ``node``/``vm``'s
        when given): their sessions read all ones and drop writes from now on, as for a removed
        device. Run when a borrow or a hold ends. Returns how many were cut."""
        cut = [
            o
            for o in self._open.values()
            if o.fdid == fdid and (node is None or o.node == node) and (vm is None or o.vm == vm)
        ]
        failures: list[Exception] = []
        for o in cut:
            del self._open[(o.node, o.uuid)]
            if o.on_revoke is not None:
                try:
                    o.on_revoke()
                except Exception as e:  # cut the others all the same, then say so
                    failures.append(e)
        if cut:
            log.info("device %#x: %d open mdev(s) revoked", fdid, len(cut))
        if failures:
            raise failures[0]
        return len(cut)

    def config_write(
        self, fdid: int, writer: tuple[str, str], offset: int, size: int, value: int
    ) -> None:
        """A guest's config write reaching device ``fdid`` on behalf of ``writer`` (node, VM),
        kept for the checker with whose borrow the device was under."""
        dev = self.device(fdid)
        borrow = self._borrows.get(fdid)
        owner = None if borrow is None else (borrow.node, borrow.vm)
        self._config_audit.append(ConfigWrite(fdid, writer, owner, offset, value))
        dev.config.write(offset, size, value)

    def config_writes(self) -> list[ConfigWrite]:
        """The latest guest config writes that reached devices (at most ``CONFIG_AUDIT``)."""
        return list(self._config_audit)

    # --- shared drives ---------------------------------------------------------------------
    def add_share_wiring(self, drive: ShareWiring) -> Callable[[], None]:
        """Make a shared drive's wiring visible to the invariant checker; returns a remover."""
        self._share_wiring.append(drive)

        def remove() -> None:
            if drive in self._share_wiring:
                self._share_wiring.remove(drive)

        return remove

    def share_wiring(self) -> list[ShareWire]:
        return [w for d in self._share_wiring for w in d.wiring()]

    def add_p2p_crossings(
        self, crossings: Callable[[], Sequence[P2PCrossingLike]]
    ) -> Callable[[], None]:
        """Make a peer-to-peer mapper's crossings visible to the invariant checker; returns a
        remover."""
        self._p2p_sources.append(crossings)

        def remove() -> None:
            if crossings in self._p2p_sources:
                self._p2p_sources.remove(crossings)

        return remove

    def add_p2p_routes(
        self, routes: Callable[[], Sequence[P2PPairRouteLike]]
    ) -> Callable[[], None]:
        """Make a peer-to-peer mapper's routes per lender pair visible to the ledger's count;
        returns a remover."""
        self._p2p_route_sources.append(routes)

        def remove() -> None:
            if routes in self._p2p_route_sources:
                self._p2p_route_sources.remove(routes)

        return remove

    def p2p_routes(self) -> list[P2PPairRouteLike]:
        """Every mapper's route per lender pair (maps or not)."""
        return [r for source in self._p2p_route_sources for r in source()]

    def p2p_crossings(self) -> list[P2PCrossingLike]:
        """Every peer-to-peer crossing holding switch port entries now."""
        return [c for source in self._p2p_sources for c in source()]

    def share_cmb_windows(self) -> list[CmbWindowMap]:
        """Every open share's window onto its CMB extent (``ShareWiring.cmb_windows``)."""
        return [w for d in self._share_wiring for w in d.cmb_windows()]

    def share_cpu_windows(self) -> list[ShareWindowMap]:
        """Every open share's CPU windows onto its drive (``ShareWiring.cpu_windows``)."""
        return [w for d in self._share_wiring for w in d.cpu_windows()]

    def share_cmbs(self) -> dict[int, list[int]]:
        """Each shared drive's controller memory buffer frames (``ShareWiring.cmb_frames``)."""
        return {d.fdid: d.cmb_frames() for d in self._share_wiring}

    def share_crossings(self, fdid: int | None = None) -> list[ShareCrossing]:
        """The shared drives' crossings into nodes (``fdid``'s only, when given)."""
        return [
            c for d in self._share_wiring if fdid in (None, d.fdid) for c in d.crossings()
        ]

    # --- DMA -------------------------------------------------------------------------------------
    def resolve_dma(self, fdid: int, iova: int, *, write: bool = False) -> DmaTarget:
        """Where a DMA by ``fdid`` to ``iova`` lands (see ``DmaResolver``)."""
        return self.resolver.resolve_dma(fdid, iova, write=write)

    def dma_read(self, fdid: int, iova: int, length: int) -> bytes:
        return self.resolver.dma_read(fdid, iova, length)

    def dma_write(self, fdid: int, iova: int, data: bytes) -> list[DmaTarget]:
        return self.resolver.dma_write(fdid, iova, data)

    # --- MMIO ------------------------------------------------------------------------------------
    def mmio_write(
        self,
        node: str,
        fdid: int,
        bar: int,
        offset: int,
        size: int,
        value: int,
        *,
        path: NtbPath | None = None,
    ) -> MmioTarget | None:
        """``node``'s CPU writes a register of ``fdid`` through its adapter (see
        ``MmioResolver``); None when a dead cable dropped the write."""
        return self.mmio.write(node, fdid, bar, offset, size, value, path=path)

    def mmio_read(
        self, node: str, fdid: int, bar: int, offset: int, size: int, *, path: NtbPath | None = None
    ) -> int:
        """``node``'s CPU reads a register of ``fdid``: all ones across a dead cable."""
        return self.mmio.read(node, fdid, bar, offset, size, path=path)
