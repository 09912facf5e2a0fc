"""The simulated fabric's invariants, checked over a ``SimHardware`` (and optionally the
registry's holds and claims): every mapping is justified by a current borrow of the right VM.

``check_hardware`` is pure (it reads, never changes) and returns the violations it finds:

- ``lender-iommu``: a device's own domain maps something while it is not borrowed, or maps
  onto RAM of another VM, a BAR of a device another VM holds, an unmapped NTB segment, or a
  segment whose far side does not translate the device into its VM's domain;
- ``domain``: a VM's domain (its own, or its peer-to-peer domain on another lender) maps RAM
  or a BAR that is not that VM's;
- ``ntb-segment``: a translated segment no borrowed device's mapping uses and that is no
  BAR window of a current borrow (on the borrower adapter of its crossing, translating only
  to a BAR its VM holds) nor an open share's CPU window (translating only to its claimed CMB
  extent, or to a doorbell page of its own in the drive's BAR0);
- ``lut``: a requester LUT entry for a device that is not borrowed (or not through this adapter);
- ``port``: a cluster switch port's requester table holds an entry for a crossing that does
  not pass the port, lacks one a crossing passing it needs (a borrowed device's, a shared
  drive's into a node of its shares, peer-to-peer's between two lenders), or holds more entries
  than the switch's ``requester_entries``; a shared drive's crossing into a node where no
  current share is; a peer-to-peer crossing between devices its VM does not both borrow;
- ``context``: an IOMMU attachment of a requester no borrowed device produces, or into a domain
  of another VM; ``requester-id``: two devices entering one node as one requester id (the
  IOMMU would translate both in one context);
- ``interrupt``: a device that is not borrowed still has an interrupt route, or a route its
  maker named delivers to another VM than the device's borrower;
- ``hold``: a hold without a holder, a hardware borrow without the matching BORROWED hold;
- ``claims``: a VM's DMA-window segments on an adapter differ from what admission claimed for
  them (the planner's own count: claimed == mapped); more peer-to-peer segments mapped on an
  adapter than its P2P claims allow, or more LUT entries in use than its claims allow (P2P
  claims are an upper bound: where the guest puts a BAR is not known at reserve). A share's
  windows and a VM's interrupt window (MSI over the NTB) must match their claims exactly too,
  and so must a borrowed device's BAR windows (its hold's ``bar`` claims on the adapters of its
  VM's node) and an open share's CPU windows (its ``#cmb`` and ``#doorbell`` claims).
  On the switch ports, claimed == in use per port and requester: every entry a borrowed
  device's crossing holds is claimed by its hold (a shared drive's crossings': by its
  manager's hold; peer-to-peer's: by the target's hold, whose P2P claims on ports are an upper
  bound), and the hold of a borrowed device claims no
  port of a route between its lender and its VM's node that its crossing does not pass (a
  claim left behind by a re-route; a hot migration's other end, claimed until it is released,
  lies on routes to another node).

Shared NVMe drives (docs/nvme-sharing.md) are borrowed by their manager (``nvme-manager`` on
the lender), which justifies only the drive's untagged address space. Everything a share maps
must be justified by a current share of the right VM, given as ``shares`` (``ShareGrant``:
drive, VM, address-space id):

- ``lender-iommu``: a mapping of the drive's domain in an address space no current share has,
  or reaching anything but that share's VM's RAM (directly on the lender, or through NTB
  segments into the drive's ingress domain on the VM's node);
- ``share-domain``: the per-node ingress domain of a shared drive maps an address space of no
  current share on that node, or RAM that is not that share's VM's, or an interrupt slot onto
  anything but the target page of a VM on that node whose share was admitted with its
  interrupt window;
- ``msi``: a share's address space maps an interrupt route (MSI over the NTB) without its
  share's interrupt window admitted (``ShareGrant.msi``), or one that reaches another VM's
  interrupt target or nothing; its interrupt segments count against its ``msi:`` claim once
  per adapter with the VM's borrowed devices' (``claims``);
- ``context``/``lut``: a shared drive's crossing into a node (LUT entries on both adapters, the
  ingress context) where no current share needs it.
- ``cmb``: a share's address space maps frames of the drive's controller memory buffer outside
  the extent its share claimed, or a mapped extent is not the whole claimed one; a share's VM
  reaches through its CMB window other frames than its claimed extent's, or has a window with
  no current share claiming an extent; two claimed extents overlap or one leaves the CMB.
Without ``shares`` a shared drive's share mappings are all violations.

The hand-over rule (docs/simulator.md: when a borrow ends, every path of the old owner is cut in
that same step) adds:

- ``config-write``: a guest config write reached a device while the device was not under the
  writer's borrow (the session of another, or of no, current borrow wrote it);
- ``mdev``: an mdev open in a VM that the device's borrow or (given ``holds``) hold does not
  name, or one device's mdevs open in two VMs; a share's mdev open with no current share;
- ``share-wire``: a real queue, interrupt route, admin doorbell route or doorbell page a shared
  drive keeps for a VM that has no current share of it, or while the manager does not borrow it;
- ``teardown``: a borrow ended and its owners left lender mappings for the hardware's fallback.

Link faults (docs/simulator.md) add:

- ``link``: a borrowed device's crossing passes a dead cable while another route from its
  lender's adapter is up and has room in its switch ports' requester tables (it was not
  re-routed). A mapping across a dead cable still counts as its owner's (it comes back with
  the cable), but it reaches nothing meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import msgspec

from vmlend.errors import FabricError
from vmlend.ledger.admission import usage, vm_share
from vmlend.ledger.msiadmit import msi_share
from vmlend.ledger.nvmeadmit import (
    BACKUP_SUFFIX,
    CMB_SUFFIX,
    DOORBELL_SUFFIX,
    is_share_msi_claim,
    share_window_key,
)
from vmlend.ledger.nvmeshares import SHARE_RECORD, claims_from, share_entry
from vmlend.nvme.guard import ADDRESS_BITS
from vmlend.registry import Claim, ClaimKind, HoldRecord, Phase, StateTxn
from vmlend.registry.api import Registry
from vmlend.sim.hardware import ShareWindowMap, SimHardware
from vmlend.sim.hostmem import FRAME
from vmlend.sim.iommu import IommuDomain
from vmlend.sim.iommu import Mapping as IommuMapping
from vmlend.sim.msitarget import IRQ_REGION, MSI_IOVA
from vmlend.sim.ntb import NtbAdapter, SegmentMapping
from vmlend.sim.switchports import PortUser, user_fdid
from vmlend.topology.model import MANAGER_VM, Holder
from vmlend.topology.requesters import (
    SwitchPort,
    is_port,
    port_switch,
    ports_between,
    requester_device,
    requester_share,
    route_ports,
    share_of,
)

Owner = tuple[str, str]  # (node, vm)


class ShareGrant(msgspec.Struct, frozen=True):
    """A current share of shared drive ``fdid`` by VM ``vm`` on ``node``: it justifies the
    mappings of address space ``asid``."""

    fdid: int
    node: str
    vm: str
    asid: int
    backup: bool = False  # the address space of a two-path share's backup path
    #: The share's extent of the drive's controller memory buffer (offset, bytes), if any.
    cmb: tuple[int, int] | None = None
    #: Its interrupt window was admitted (this path's MSI over the NTB): the address space may
    #: map its VM's interrupt target, and only then.
    msi: bool = False

    @property
    def owner(self) -> Owner:
        return (self.node, self.vm)

    @property
    def msi_key(self) -> str:
        """The claim key of this address space's interrupt window."""
        key = msi_share(Holder(self.node, self.vm))
        return key + BACKUP_SUFFIX if self.backup else key

    @property
    def window_key(self) -> str:
        """The claim key of the segments this address space's windows take."""
        key = share_window_key(self.fdid, Holder(self.node, self.vm))
        return key + BACKUP_SUFFIX if self.backup else key


def registry_grants(tx: StateTxn) -> list[ShareGrant]:
    """The NVMe shares the registry records now, as the checker's justifications."""
    out = []
    for r in tx.runtime(None, SHARE_RECORD):
        e = share_entry(r)
        windows = {c.share for c in claims_from(r.data.get("claims")) if is_share_msi_claim(c)}
        key = msi_share(e.holder)
        out.append(
            ShareGrant(
                e.fdid,
                e.holder.node,
                e.holder.vm,
                e.share.asid,
                cmb=e.share.cmb_extent,
                msi=key in windows,
            )
        )
        if e.share.paths > 1:
            out.append(
                ShareGrant(
                    e.fdid,
                    e.holder.node,
                    e.holder.vm,
                    e.share.backup_asid,
                    backup=True,
                    msi=key + BACKUP_SUFFIX in windows,
                )
            )
    return out


class Violation(msgspec.Struct, frozen=True):
    kind: str
    where: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind} {self.where}: {self.detail}"


def check_hardware(
    hw: SimHardware,
    *,
    holds: Mapping[int, HoldRecord] | None = None,
    claims: Sequence[tuple[int, Claim]] | None = None,
    shares: Sequence[ShareGrant] = (),
) -> list[Violation]:
    """Every violation of the fabric's invariants in ``hw`` now (empty: all hold)."""
    c = _Checker(hw, shares)
    c.lender_domains()
    c.cmb_claims()
    c.cmb_windows()
    c.share_windows()
    c.vm_domains()
    c.share_domains()
    c.bar_windows()
    c.segments()
    c.luts()
    c.ports()
    c.contexts()
    c.interrupts()
    c.config_writes()
    c.open_mdevs(holds)
    c.share_wires()
    c.teardown_gaps()
    c.links()
    if holds is not None:
        c.holds(holds)
    if claims is not None:
        c.claims(claims)
        c.share_window_claims(claims)
    if holds is not None and claims is not None:
        c.claims_held(holds, claims)
        c.port_claims(holds, claims)
        c.bar_claims(holds, claims)
    return c.found


def check_with_registry(hw: SimHardware, registry: Registry) -> list[Violation]:
    """``check_hardware`` with what ``registry`` records now (holds, claims, NVMe shares) as
    the justification every mapping must have."""
    with registry.read() as tx:
        return check_hardware(hw, holds=tx.holds(), claims=tx.claims(), shares=registry_grants(tx))


def _fdids(fdids: frozenset[int] | set[int]) -> str:
    return ", ".join(f"{f:#x}" for f in sorted(fdids))


def _users(users: frozenset[PortUser] | set[PortUser]) -> str:
    """``0x10`` for a borrow's crossing, ``0x12 (nvme>gamma)`` for a share's."""
    return ", ".join(
        f"{u:#x}" if isinstance(u, int) else f"{u[0]:#x} ({u[1]})"
        for u in sorted(users, key=lambda u: (u, "") if isinstance(u, int) else u)
    )


def _target_owner(vm: str) -> str:
    """The owner name of ``vm``'s interrupt target page (``MsiTarget.owner``)."""
    return f"msi-target:{vm}"


def _fmt(m: IommuMapping) -> str:
    return f"{m.iova:#x}+{m.size:#x}->{m.phys:#x}"


class _Checker:
    def __init__(self, hw: SimHardware, shares: Sequence[ShareGrant] = ()) -> None:
        self.hw = hw
        self.found: list[Violation] = []
        self.owners: dict[int, Owner] = {b.fdid: (b.node, b.vm) for b in hw.borrows()}
        # (adapter ref, segment) -> devices whose lender mapping points into it
        self.segment_users: dict[tuple[str, int], set[int]] = {}
        # drives their manager holds for sharing: their shares justify the tagged mappings
        self.shared = {f for f, (_n, vm) in self.owners.items() if vm == MANAGER_VM}
        self.grants: dict[int, dict[int, ShareGrant]] = {}
        for g in shares:
            self.grants.setdefault(g.fdid, {})[g.asid] = g
        # (adapter ref, segment) -> the shares whose windows point into it
        self.share_segments: dict[tuple[str, int], set[ShareGrant]] = {}
        # (adapter ref, segment) -> the shares' address spaces whose interrupt route uses it
        self.share_msi: dict[tuple[str, int], set[ShareGrant]] = {}
        # (adapter ref, segment) -> what those mappings reach through it ("ram", "bar", ...)
        self.segment_reaches: dict[tuple[str, int], set[str]] = {}
        # shared drive -> its controller memory buffer's frames (physical -> CMB offset)
        self.cmb_frames: dict[int, dict[int, int]] = {
            fdid: {phys: i * FRAME for i, phys in enumerate(frames)}
            for fdid, frames in hw.share_cmbs().items()
        }
        # (adapter ref, segment) -> the borrowed device whose BAR window it is
        self.bar_segments: dict[tuple[str, int], int] = {}
        # (adapter ref, segment) -> the share's CPU window onto its drive it belongs to
        self.window_segments: dict[tuple[str, int], ShareWindowMap] = {}
        # (drive, address space) -> bytes of the CMB its share's address space maps
        self.cmb_mapped: dict[tuple[int, int], int] = {}

    def bad(self, kind: str, where: str, detail: str) -> None:
        self.found.append(Violation(kind, where, detail))

    # --- what an address on a node is --------------------------------------------------------
    def _target_ok(self, node: str, addr: int, owner: Owner) -> str | None:
        """Why ``addr`` on ``node`` is not ``owner``'s to reach (None: it is). NTB windows are
        the caller's business."""
        region = self.hw.node(node).address_map.find(addr)
        if region is None:
            return f"{addr:#x} decodes to nothing on {node}"
        if region.kind == "ram":
            tag = self.hw.node(node).memory.owner_of(addr)
            if node != owner[0] or tag != owner[1]:
                return f"{addr:#x} is RAM of {tag or 'nobody'} on {node}, not of {owner[1]}"
        elif region.kind == IRQ_REGION:
            if node != owner[0] or region.owner != _target_owner(owner[1]):
                return (
                    f"{addr:#x} is the interrupt target {region.owner} on {node}, not "
                    f"{owner[1]}'s"
                )
        elif region.kind == "bar":
            assert region.fdid is not None
            if self.owners.get(region.fdid) != owner:
                held = self.owners.get(region.fdid)
                who = f"{held[0]}/{held[1]}" if held else "nobody"
                return f"{addr:#x} is a BAR of {region.fdid:#x}, held by {who}"
        return None

    @staticmethod
    def _ends(m: IommuMapping) -> Iterator[int]:
        yield m.phys
        if m.size > 1:
            yield m.phys + m.size - 1

    # --- the checks ------------------------------------------------------------------------------
    def lender_domains(self) -> None:
        for dev in self.hw.devices():
            domain = self.hw.lender_domain(dev.fdid)
            owner = self.owners.get(dev.fdid)
            for m in domain.mappings():
                where = f"{domain.name} {_fmt(m)}"
                if owner is None:
                    self.bad("lender-iommu", where, f"device {dev.fdid:#x} is not borrowed")
                    continue
                asid = m.iova >> ADDRESS_BITS
                if dev.fdid in self.shared and asid:
                    self._share_mapping(dev.fdid, dev.lender, m, asid, where)
                    continue
                self._lender_mapping(dev.fdid, dev.lender, m, owner, where)

    def _grant(self, fdid: int, asid: int) -> ShareGrant | None:
        return self.grants.get(fdid, {}).get(asid)

    def _share_mapping(
        self, fdid: int, lender: str, m: IommuMapping, asid: int, where: str
    ) -> None:
        """A mapping in address space ``asid`` of shared drive ``fdid``: its share's VM's RAM
        only, on the lender or through segments into the drive's ingress domain there."""
        grant = self._grant(fdid, asid)
        if grant is None:
            self.bad(
                "lender-iommu", where, f"address space {asid} of {fdid:#x} is no current share's"
            )
            return
        if self._cmb_mapping(fdid, m, grant, where):
            return
        for adapter, index, seg in self._crossed_segments(fdid, lender, m, grant.owner, where):
            if seg.remote_addr == MSI_IOVA:  # an interrupt segment: the share's MSI route
                self._share_msi(fdid, adapter, index, seg, m, grant, where)
                continue
            self.share_segments.setdefault((adapter.ref, index), set()).add(grant)
            if seg.remote_node != grant.node:
                self.bad(
                    "lender-iommu",
                    where,
                    f"crosses to {seg.remote_node}, but address space {asid} is the share of "
                    f"{grant.node}/{grant.vm}",
                )
            elif seg.remote_addr >> ADDRESS_BITS != asid:
                self.bad(
                    "lender-iommu",
                    where,
                    f"segment {index} of {adapter.ref} leaves address space {asid}",
                )

    def _share_msi(
        self,
        fdid: int,
        adapter: NtbAdapter,
        index: int,
        seg: SegmentMapping,
        m: IommuMapping,
        grant: ShareGrant,
        where: str,
    ) -> None:
        """A share's address space mapped onto an interrupt segment: only with its interrupt
        window admitted, and reaching its own VM's target through the drive's ingress domain
        on the VM's node (never another VM's)."""
        self.share_msi.setdefault((adapter.ref, index), set()).add(grant)
        if not grant.msi:
            self.bad(
                "msi",
                where,
                f"address space {grant.asid} of {grant.node}/{grant.vm} maps an interrupt route"
                " its share was not admitted with",
            )
        if seg.remote_node != grant.node:
            self.bad(
                "msi",
                where,
                f"crosses to {seg.remote_node}, but address space {grant.asid} is the share of "
                f"{grant.node}/{grant.vm}",
            )
            return
        remote = seg.remote_addr + m.phys - adapter.segment_base(index)
        domain = self._ingress_domain(fdid, seg.remote_node)
        found = domain.lookup(remote) if domain is not None else None
        if found is None:
            self.bad("msi", where, f"reaches nothing at {remote:#x} on {seg.remote_node}")
            return
        why = self._target_ok(seg.remote_node, found.phys + remote - found.iova, grant.owner)
        if why:
            self.bad("msi", where, why)

    def _ingress_domain(self, fdid: int, node: str) -> IommuDomain | None:
        """Shared drive ``fdid``'s ingress domain on ``node``, if its DMA enters there."""
        for requester, domain in self.hw.node(node).iommu.attached().items():
            if self.hw.crossing_source(node, requester) == fdid:
                return domain
        return None

    def _cmb_mapping(self, fdid: int, m: IommuMapping, grant: ShareGrant, where: str) -> bool:
        """A mapping of a share's address space into the drive's CMB: inside the share's own
        extent only (counted for ``cmb_claims``). False when ``m`` is not into the CMB."""
        frames = self.cmb_frames.get(fdid, {})
        first = m.phys - m.phys % FRAME
        if first not in frames:
            return False
        for phys in range(first, m.phys + m.size, FRAME):
            offset = frames.get(phys)
            extent = grant.cmb
            if offset is None or extent is None or not extent[0] <= offset < sum(extent):
                mine = f"{extent[0]:#x}+{extent[1]:#x}" if extent else "none"
                self.bad(
                    "cmb",
                    where,
                    f"address space {grant.asid} of {grant.node}/{grant.vm} reaches CMB offset"
                    f" {offset if offset is None else hex(offset)}, outside its extent ({mine})",
                )
                return True
            key = (fdid, grant.asid)
            self.cmb_mapped[key] = self.cmb_mapped.get(key, 0) + FRAME
        return True

    def cmb_claims(self) -> None:
        """Each share's CMB extent as mapped equals its extent as claimed (a mapped extent of
        another size is the wrong one), and the claimed extents of a drive are disjoint and
        inside its CMB."""
        for (fdid, asid), mapped in sorted(self.cmb_mapped.items()):
            grant = self._grant(fdid, asid)
            want = grant.cmb[1] if grant is not None and grant.cmb is not None else 0
            if mapped != want:
                self.bad(
                    "cmb",
                    f"{fdid:#x} address space {asid}",
                    f"{mapped:#x} bytes of the CMB mapped, {want:#x} claimed",
                )
        for fdid, grants in sorted(self.grants.items()):
            # a drive whose manager lost it keeps no CMB: its shares' records map nothing
            size = len(self.cmb_frames.get(fdid, {})) * FRAME or None
            extents = sorted(
                (g for g in grants.values() if g.cmb is not None), key=lambda g: g.cmb or (0, 0)
            )
            end = 0
            for g in extents:
                assert g.cmb is not None
                offset, length = g.cmb
                if offset < end or (size is not None and offset + length > size):
                    self.bad(
                        "cmb",
                        f"{fdid:#x} {g.node}/{g.vm}",
                        f"CMB extent {offset:#x}+{length:#x} overlaps another or leaves the"
                        f" {size:#x}-byte CMB",
                    )
                end = max(end, offset + length)

    def cmb_windows(self) -> None:
        """Each share's VM reaches through its CMB window exactly the frames of the extent
        its share claimed, and only while it has a current share."""
        for w in self.hw.share_cmb_windows():
            where = f"{w.fdid:#x} CMB window of {w.node}/{w.vm}"
            grant = self._grant(w.fdid, w.asid)
            if grant is None or grant.owner != (w.node, w.vm) or grant.cmb is None:
                self.bad("cmb", where, "open, but no current share of that VM claims an extent")
                continue
            frames = sorted(self.cmb_frames.get(w.fdid, {}).items(), key=lambda f: f[1])
            offset, size = grant.cmb
            want = tuple(p for p, at in frames if offset <= at < offset + size)
            if w.frames != want:
                self.bad(
                    "cmb",
                    where,
                    f"reaches {len(w.frames)} frame(s) other than its claimed extent"
                    f" {offset:#x}+{size:#x}",
                )

    def share_windows(self) -> None:
        """Each open share's CPU windows onto its drive: their segments are justified by the
        share, and translate only to its claimed CMB extent (the frame each segment's first
        byte is in) or into the drive's BAR0, each VM onto a doorbell page of its own
        (``ntb-segment``)."""
        pages: dict[tuple[int, int], str] = {}
        for w in self.hw.share_cpu_windows():
            for index in w.segments:  # reported here, not again as nobody's segment
                self.window_segments[(w.adapter, index)] = w
            grant = self._grant(w.fdid, w.asid)
            who = f"{w.node}/{w.vm}"
            if grant is None or grant.owner != (w.node, w.vm):
                self.bad(
                    "ntb-segment",
                    f"{w.adapter} {w.kind} window of {who}",
                    f"kept for {who}, which has no current share of {w.fdid:#x}",
                )
                continue
            adapter = self.hw.adapter(w.adapter)
            lender = self.hw.device(w.fdid).lender
            extent: tuple[int, ...] = ()
            if w.kind == "cmb" and grant.cmb is not None:
                offset, size = grant.cmb
                frames = sorted(self.cmb_frames.get(w.fdid, {}).items(), key=lambda f: f[1])
                extent = tuple(p for p, at in frames if offset <= at < offset + size)
            for i, index in enumerate(w.segments):
                seg = adapter.segment(index)
                if seg is None:
                    continue  # lost by a reset: promised, it reaches nothing until reprogrammed
                if w.kind == "cmb":
                    at = i * adapter.segment_size // FRAME  # the frame its first byte is in
                    ok = seg.remote_node == lender and seg.remote_addr == (
                        extent[at] if at < len(extent) else -1
                    )
                else:
                    region = self.hw.node(seg.remote_node).address_map.find(seg.remote_addr)
                    ok = region is not None and region.kind == "bar" and region.fdid == w.fdid
                    other = pages.setdefault((w.fdid, seg.remote_addr), who)
                    ok = ok and other == who
                if not ok:
                    self.bad(
                        "ntb-segment",
                        f"{w.adapter}[{index}]",
                        f"{w.kind} window of {who} translates to {seg.remote_node}:"
                        f"{seg.remote_addr:#x}, not its own "
                        + ("claimed CMB extent" if w.kind == "cmb" else "doorbell page")
                        + f" of {w.fdid:#x}",
                    )

    def share_window_claims(self, claims: Sequence[tuple[int, Claim]]) -> None:
        """Each open share's CPU windows take exactly the segments its share claimed for them
        on its node's adapters (``nvmeadmit.cpu_window_claims``): claimed == mapped, per
        adapter and VM."""
        claimed: dict[str, dict[str, int]] = {}
        for _fdid, c in claims:
            if c.kind is ClaimKind.BAR and c.share.endswith((CMB_SUFFIX, DOORBELL_SUFFIX)):
                on = claimed.setdefault(c.share, {})
                on[c.adapter] = max(on.get(c.adapter, 0), c.segments)
        for w in self.hw.share_cpu_windows():
            suffix = CMB_SUFFIX if w.kind == "cmb" else DOORBELL_SUFFIX
            key = share_window_key(w.fdid, Holder(w.node, w.vm)) + suffix
            want = {
                ref: n
                for ref, n in claimed.get(key, {}).items()
                if ref.rsplit(":", 1)[0] == w.node
            }
            if {w.adapter: len(w.segments)} != want:
                self.bad(
                    "claims",
                    f"{w.adapter} {w.node}/{w.vm}",
                    f"{w.kind} window of {w.fdid:#x}: {len(w.segments)} segment(s) mapped on"
                    f" {w.adapter}, claimed {want or 'none'}",
                )

    def _crossed_segments(
        self, fdid: int, lender: str, m: IommuMapping, owner: Owner, where: str
    ) -> Iterator[tuple[NtbAdapter, int, SegmentMapping]]:
        """The NTB segments lender mapping ``m`` of ``fdid`` points into, each recorded as used
        by the device (an unmapped one is a violation). A mapping to anything but an NTB window
        is checked here, as a local target of ``owner``, and yields nothing."""
        region = self.hw.node(lender).address_map.find(m.phys)
        if region is None or region.kind != "ntb":
            for addr in self._ends(m):
                why = self._target_ok(lender, addr, owner)
                if why:
                    self.bad("lender-iommu", where, why)
                    return
            return
        assert region.adapter is not None
        adapter = self.hw.adapter(region.adapter)
        first = adapter.segment_of(m.phys)
        last = adapter.segment_of(min(m.phys + m.size - 1, region.end - 1))
        for index in range(first, last + 1):
            seg = adapter.segment(index)
            if seg is None:
                self.bad(
                    "lender-iommu", where, f"points at unmapped segment {index} of {adapter.ref}"
                )
                continue
            self.segment_users.setdefault((adapter.ref, index), set()).add(fdid)
            yield adapter, index, seg

    def _lender_mapping(
        self, fdid: int, lender: str, m: IommuMapping, owner: Owner, where: str
    ) -> None:
        for adapter, index, seg in self._crossed_segments(fdid, lender, m, owner, where):
            try:
                requester = self.hw.ingress(fdid, seg.remote_node)
            except FabricError as e:
                self.bad("lender-iommu", where, f"crosses to {seg.remote_node} but {e}")
                continue
            far = self.hw.node(seg.remote_node).iommu.domain_for(requester)
            if far is not None:
                # what the device reaches through this segment: the first address it uses there
                start = max(m.phys, adapter.segment_base(index))
                self._classify(
                    ref_index=(adapter.ref, index),
                    node=seg.remote_node,
                    domain=far,
                    remote=seg.remote_addr + start - adapter.segment_base(index),
                )
            if far is None or far.owner != owner:
                got = far.name if far else "no domain"
                self.bad(
                    "lender-iommu",
                    where,
                    f"enters {seg.remote_node} as {requester} into {got}, not a domain of "
                    f"{owner[0]}/{owner[1]}",
                )

    def _vm_owned_domains(self) -> list[tuple[str, IommuDomain]]:
        seen: dict[int, tuple[str, IommuDomain]] = {}
        for d in self.hw.vm_domains():
            assert d.owner is not None
            seen[id(d)] = (d.owner[0], d)
        for name, node in self.hw.nodes.items():
            for d in node.iommu.attached().values():
                if d.owner is not None:
                    seen[id(d)] = (name, d)
        return list(seen.values())

    def vm_domains(self) -> None:
        borrowers = set(self.owners.values())
        for node, domain in self._vm_owned_domains():
            assert domain.owner is not None
            for m in domain.mappings():
                where = f"{domain.name} {_fmt(m)}"
                if domain.owner not in borrowers:
                    self.bad(
                        "domain", where, f"{domain.owner[0]}/{domain.owner[1]} borrows nothing"
                    )
                    continue
                for addr in self._ends(m):
                    why = self._target_ok(node, addr, domain.owner)
                    if why:
                        self.bad("domain", where, why)
                        break

    def share_domains(self) -> None:
        """The ingress domain of each shared drive on each node: every mapping in the address
        space of a current share of a VM on that node, onto that VM's RAM."""
        for name, node in self.hw.nodes.items():
            for requester, domain in node.iommu.attached().items():
                fdid = self.hw.crossing_source(name, requester)
                if fdid not in self.shared:
                    continue
                for m in domain.mappings():
                    where = f"{domain.name} {_fmt(m)}"
                    asid = m.iova >> ADDRESS_BITS
                    if not asid and m.iova >= MSI_IOVA:
                        self._share_slot(fdid, name, m, where)
                        continue
                    grant = self._grant(fdid, asid)
                    if grant is None or grant.node != name:
                        self.bad(
                            "share-domain",
                            where,
                            f"address space {asid} of {fdid:#x} is no current share on {name}",
                        )
                        continue
                    for addr in self._ends(m):
                        why = self._target_ok(name, addr, grant.owner)
                        if why:
                            self.bad("share-domain", where, why)
                            break

    def _share_slot(self, fdid: int, node: str, m: IommuMapping, where: str) -> None:
        """An interrupt slot in a shared drive's ingress domain: onto the target of a VM on
        ``node`` with a current share of the drive admitted with an interrupt window."""
        region = self.hw.node(node).address_map.find(m.phys)
        vms = {
            _target_owner(g.vm): g
            for g in self.grants.get(fdid, {}).values()
            if g.node == node and g.msi
        }
        if region is None or region.kind != IRQ_REGION or region.owner not in vms:
            got = f"{region.kind} {region.owner}" if region is not None else "nothing"
            self.bad(
                "share-domain",
                where,
                f"an interrupt slot onto {got}: no VM on {node} with a current share of "
                f"{fdid:#x} and its interrupt window",
            )

    def _share_crosses(self, fdid: int, node: str, adapter: str | None = None) -> bool:
        """A current share of ``fdid`` is of a VM on ``node`` (``adapter``: reached through
        that adapter of the lender)."""
        lender = self.hw.device(fdid).lender
        for g in self.grants.get(fdid, {}).values():
            if adapter is None:
                if g.node == node:
                    return True
                continue
            # any route, a dead one too: a mapping across a dead cable is still the share's
            if any(p.src.ref == adapter for p in self.hw.routes(lender, g.node)):
                return True
        return False

    def links(self) -> None:
        """A borrowed device whose crossing passes a dead cable while another route from its
        lender's adapter is up was not re-routed: its VM reads all ones for nothing."""
        for b in self.hw.borrows():
            if b.path is None:
                continue
            dead = self.hw.dead_links(b.path)
            if not dead:
                continue
            requester = requester_device(self.hw.device(b.fdid).spec)
            live = [
                p
                for p in self.hw.routes(b.lender, b.node)
                if p.src.ref == b.path.src.ref
                and not self.hw.dead_links(p)
                and self._port_room(route_ports(p), requester)
            ]
            if live:
                self.bad(
                    "link",
                    f"device {b.fdid:#x}",
                    f"crosses dead {', '.join(dead)} to {b.node}/{b.vm} while"
                    f" {live[0].describe()} is up",
                )

    def _port_room(self, ports: Sequence[SwitchPort], requester: str) -> bool:
        """Each of ``ports`` has ``requester``'s entry or room for it: a route a re-route
        could take (one whose port tables are full refuses it)."""
        tables = self.hw.switch_ports
        return all(
            requester in (have := tables.entries(p.name)) or len(have) < tables.size(p)
            for p in ports
        )

    def bar_windows(self) -> None:
        """Each BAR window's segments sit on the borrower adapter of its device's crossing
        and translate to a BAR its VM holds (``ntb-segment``); they are justified by it."""
        for w in self.hw.bar_windows():
            where = f"{w.adapter} BAR window of {w.fdid:#x} BAR {w.bar}"
            b = self.hw.borrowed(w.fdid)
            if b is None or b.path is None or b.path.dst.ref != w.adapter:
                on = "not borrowed" if b is None else f"crossing by {b.path and b.path.dst.ref}"
                self.bad("ntb-segment", where, f"kept while the device is {on}")
                continue
            adapter = self.hw.adapter(w.adapter)
            dev = self.hw.device(w.fdid)
            start = dev.bar_phys[w.bar]
            for i, index in enumerate(w.segments()):
                self.bar_segments[(w.adapter, index)] = w.fdid
                seg = adapter.segment(index)
                if seg is None:
                    continue  # lost by a reset: promised, it reaches nothing until reprogrammed
                # where the window's first byte of the BAR (of this segment) lands
                addr = seg.remote_addr + (start - w.remote if i == 0 else 0)
                region = self.hw.node(seg.remote_node).address_map.find(addr)
                held = None if region is None else self.owners.get(region.fdid or -1)
                if region is None or region.kind != "bar" or held != (b.node, b.vm):
                    what = "nothing" if region is None else f"{region.kind} {region.fdid}"
                    self.bad(
                        "ntb-segment",
                        f"{w.adapter}[{index}]",
                        f"BAR window of {w.fdid:#x} translates to {seg.remote_node}:{addr:#x}"
                        f" ({what}), not a BAR {b.node}/{b.vm} holds",
                    )

    def bar_claims(
        self, holds: Mapping[int, HoldRecord], claims: Sequence[tuple[int, Claim]]
    ) -> None:
        """Per borrowed device, its BAR windows' segments on each adapter of its VM's node
        equal its hold's ``bar`` claims there (admission's ``window-bars``): claimed ==
        mapped, per adapter and VM."""
        claimed: dict[int, dict[str, int]] = {}
        for fdid, c in claims:
            if c.kind is ClaimKind.BAR:
                on = claimed.setdefault(fdid, {})
                on[c.adapter] = max(on.get(c.adapter, 0), c.segments)
        mapped: dict[int, dict[str, int]] = {}
        for w in self.hw.bar_windows():
            on = mapped.setdefault(w.fdid, {})
            on[w.adapter] = on.get(w.adapter, 0) + w.count
        for b in self.hw.borrows():
            hold = holds.get(b.fdid)
            if b.path is None or hold is None or hold.phase is not Phase.BORROWED:
                continue  # reserved: the claims are made before the hardware follows
            if (hold.holder.node, hold.holder.vm) != (b.node, b.vm):
                continue  # ``holds`` reports it
            have = mapped.get(b.fdid, {})
            # claims on another node's adapters: a hot migration's other end, until released
            want = {
                ref: n
                for ref, n in claimed.get(b.fdid, {}).items()
                if ref.rsplit(":", 1)[0] == b.node
            }
            for ref in sorted(set(have) | set(want)):
                if have.get(ref, 0) != want.get(ref, 0):
                    self.bad(
                        "claims",
                        f"{ref} {b.node}/{b.vm}",
                        f"{have.get(ref, 0)} BAR-window segment(s) of {b.fdid:#x} mapped,"
                        f" {want.get(ref, 0)} claimed",
                    )

    def segments(self) -> None:
        for adapter in self.hw.adapters():
            for seg in adapter.mapped_segments():
                if (adapter.ref, seg.index) in self.bar_segments:
                    continue  # a BAR window (``bar_windows``)
                if (adapter.ref, seg.index) in self.window_segments:
                    continue  # a share's CPU window (``share_windows``)
                if not self.segment_users.get((adapter.ref, seg.index)):
                    self.bad(
                        "ntb-segment",
                        f"{adapter.ref}[{seg.index}]",
                        f"translates to {seg.remote_node}:{seg.remote_addr:#x} for no borrowed "
                        "device",
                    )

    def luts(self) -> None:
        by_rid = {(d.lender, d.requester_id): d.fdid for d in self.hw.devices()}
        by_key = {self.hw.requester_key(d.fdid): d.fdid for d in self.hw.devices()}
        for adapter in self.hw.adapters():
            for rid, entry in sorted(adapter.lut().items()):
                where = f"{adapter.ref} LUT entry {entry}"
                fdid = by_rid.get((adapter.node, rid))
                if fdid is not None:  # outbound: a local function allowed to cross
                    if fdid not in self.owners:
                        self.bad("lut", where, f"lets {fdid:#x} across, which is not borrowed")
                    elif fdid in self.shared and not self._share_crosses(fdid, "", adapter.ref):
                        self.bad("lut", where, f"lets shared {fdid:#x} across for no share")
                    continue
                fdid = by_key.get(rid)  # inbound: how this adapter names a remote function
                if fdid is None or fdid not in self.owners:
                    self.bad("lut", where, f"key {rid:#x} names no borrowed device")
                    continue
                if fdid in self.shared and not self._share_crosses(fdid, adapter.node):
                    self.bad("lut", where, f"names shared {fdid:#x}, no share on {adapter.node}")
                    continue
                try:
                    requester = self.hw.ingress(fdid, adapter.node)
                except FabricError:
                    requester = None
                iommu = self.hw.node(adapter.node).iommu
                if requester is None or iommu.domain_for(requester) is None:
                    self.bad("lut", where, f"names {fdid:#x}, which enters no domain here")

    def ports(self) -> None:
        """Each switch port's requester table holds exactly the entries the crossings through
        it need (the borrowed devices', and the shared drives' into their shares' nodes),
        within the switch's size; a shared drive crosses only into a node some current share
        is on."""
        need: dict[str, dict[str, set[PortUser]]] = {}
        for b in self.hw.borrows():
            requester = requester_device(self.hw.device(b.fdid).spec)
            for p in self.hw.crossing_ports(b.fdid):
                need.setdefault(p.name, {}).setdefault(requester, set()).add(b.fdid)
        for c in self.hw.share_crossings():
            if not self._share_crosses(c.fdid, c.node):
                self.bad(
                    "port",
                    f"NVMe drive {c.fdid:#x} into {c.node}",
                    f"its crossing over {c.path.describe()} holds requester entries for no"
                    f" current share on {c.node}",
                )
            requester = requester_device(self.hw.device(c.fdid).spec)
            for p in route_ports(c.path):
                need.setdefault(p.name, {}).setdefault(requester, set()).add(c.user)
        for x in self.hw.p2p_crossings():
            owner = (x.node, x.vm)
            if self.owners.get(x.source) != owner or self.owners.get(x.target) != owner:
                self.bad(
                    "port",
                    f"peer-to-peer {x.source:#x} -> {x.target:#x}",
                    f"its crossing over {x.path.describe()} holds requester entries while"
                    f" {x.node}/{x.vm} does not borrow both",
                )
            requester = requester_device(self.hw.device(x.source).spec)
            for p in route_ports(x.path):
                need.setdefault(p.name, {}).setdefault(requester, set()).add(x.user)
        tables = self.hw.switch_ports
        for name in sorted(set(tables.ports()) | set(need)):
            have = tables.entries(name)
            wanted = need.get(name, {})
            for requester, users in have.items():
                if extra := users - wanted.get(requester, set()):
                    self.bad(
                        "port",
                        f"{name} entry {requester}",
                        f"held for {_users(extra)}, whose crossing does not pass it",
                    )
            for requester, crossing in sorted(wanted.items()):
                if missing := crossing - have.get(requester, frozenset()):
                    self.bad(
                        "port",
                        name,
                        f"no entry for requester {requester} of {_users(missing)}, whose"
                        " crossing passes it",
                    )
            size = self.hw.topology.switch_requester_entries(port_switch(name))
            if len(have) > size:
                self.bad("port", name, f"{len(have)} requester entries, the switch has {size}")

    def port_claims(
        self, holds: Mapping[int, HoldRecord], claims: Sequence[tuple[int, Claim]]
    ) -> None:
        """Claimed == in use on the switch ports, per port and requester (see the module's
        ``claims``)."""
        claimed: dict[int, set[tuple[str, str]]] = {}
        p2p: dict[int, set[tuple[str, str]]] = {}  # an upper bound: BARs not placed yet
        for fdid, c in claims:
            if c.kind is ClaimKind.LUT and is_port(c.adapter):
                claimed.setdefault(fdid, set()).add((c.adapter, c.share))
            elif c.kind is ClaimKind.P2P and is_port(c.adapter):
                p2p.setdefault(fdid, set()).add((c.adapter, c.share))
        used: dict[int, set[tuple[str, str]]] = {}
        tables = self.hw.switch_ports
        for name in tables.ports():
            for requester, users in tables.entries(name).items():
                for user in users:
                    used.setdefault(user_fdid(user), set()).add((name, share_of(requester)))
        borrows = {b.fdid: b for b in self.hw.borrows()}
        for fdid in sorted(set(used) | set(claimed)):
            have, mine = used.get(fdid, set()), claimed.get(fdid, set())
            for port, share in sorted(have - mine - p2p.get(fdid, set())):
                self.bad(
                    "claims",
                    port,
                    f"requester entry {share} of {fdid:#x} in use, not claimed by its hold",
                )
            b = borrows.get(fdid)
            hold = holds.get(fdid)
            if b is None or hold is None or hold.phase is not Phase.BORROWED:
                continue  # reserved: the claims are made before the hardware follows
            if (hold.holder.node, hold.holder.vm) != (b.node, b.vm):
                continue  # ``holds`` reports it
            between = self._only_between(b.lender, b.node)
            share = requester_share(self.hw.device(fdid).spec)
            for port, claimed_share in sorted(mine - have):
                if port in between or claimed_share != share:
                    self.bad(
                        "claims",
                        port,
                        f"requester entry {claimed_share} claimed for {fdid:#x}, whose"
                        " crossing does not hold it",
                    )

    def _only_between(self, lender: str, node: str) -> set[str]:
        """The ports of routes between ``lender`` and ``node`` that no route from ``lender``
        to another node passes: where a claim of the hold's crossing can only have been left
        behind by a re-route (which moves a crossing between routes to the same node). A
        port also on a route to another node may be claimed for that node: a hot migration
        claims the destination's route before the switch-over and releases the source's after
        it, and on a fabric with two routes between two nodes those can share a port."""
        topology = self.hw.topology
        others: set[str] = set()
        for n in topology.nodes:
            if n.name not in (lender, node):
                others |= ports_between(topology, lender, n.name)
        return ports_between(topology, lender, node) - others

    def contexts(self) -> None:
        for name, node in self.hw.nodes.items():
            # The IOMMU knows a crossing device only by the id its entering LUT entry assigns:
            # two devices entering as one id (two LUT keys on one entry) share a context, so
            # one VM's domain would translate another's DMA.
            entering: dict[int, list[int]] = {}
            for dev in self.hw.devices():
                try:  # FabricError: local to ``name``, or not let into it
                    rid = self.hw.ingress(dev.fdid, name).rid
                except FabricError:
                    continue
                entering.setdefault(rid, []).append(dev.fdid)
            for rid, fdids in sorted(entering.items()):
                if len(fdids) > 1:
                    devs = " and ".join(f"{f:#x}" for f in fdids)
                    self.bad("requester-id", f"{name} rid {rid:#06x}", f"{devs} enter as it")
            for requester, domain in node.iommu.attached().items():
                where = f"{name} context {requester}"
                fdid = self.hw.crossing_source(name, requester)
                if fdid is None:
                    local = [d for d in node.devices.values() if d.requester_id == requester.rid]
                    if not local:
                        self.bad(
                            "context", where, f"no borrowed device enters as it ({domain.name})"
                        )
                    elif domain is not self.hw.lender_domain(local[0].fdid):
                        self.bad("context", where, f"a local function in {domain.name}")
                    continue
                if fdid in self.shared:  # the drive's ingress domain (``share_domains``)
                    if domain.owner is not None or not self._share_crosses(fdid, name):
                        self.bad("context", where, f"shared {fdid:#x} enters for no share here")
                    continue
                owner = self.owners.get(fdid)
                if owner is None or domain.owner != owner:
                    who = f"{owner[0]}/{owner[1]}" if owner else "nobody"
                    self.bad("context", where, f"device {fdid:#x} (held by {who}) in {domain.name}")

    def interrupts(self) -> None:
        for dev in self.hw.devices():
            if dev.interrupt_routes and dev.fdid not in self.owners:
                self.bad(
                    "interrupt",
                    f"device {dev.fdid:#x}",
                    f"{dev.interrupt_routes} interrupt route(s) but it is not borrowed",
                )
                continue
            borrower = self.owners.get(dev.fdid)
            for owner in dev.interrupt_route_owners():
                if owner != borrower:
                    by = f"{borrower[0]}/{borrower[1]}" if borrower else "nobody"
                    self.bad(
                        "interrupt",
                        f"device {dev.fdid:#x}",
                        f"a route to {owner[0]}/{owner[1]} while {by} borrows it",
                    )

    def config_writes(self) -> None:
        for w in self.hw.config_writes():
            if w.owner != w.writer:
                held = f"{w.owner[0]}/{w.owner[1]}" if w.owner else "nobody"
                self.bad(
                    "config-write",
                    f"device {w.fdid:#x} offset {w.offset:#x}",
                    f"{w.writer[0]}/{w.writer[1]} wrote {w.value:#x} while {held} borrowed it",
                )

    def open_mdevs(self, holds: Mapping[int, HoldRecord] | None) -> None:
        users: dict[int, set[Owner]] = {}
        for o in self.hw.open_mdevs():
            where = f"mdev {o.uuid} ({o.fdid:#x})"
            if o.share:
                if not any(g.owner == o.owner for g in self.grants.get(o.fdid, {}).values()):
                    self.bad("mdev", where, f"open in {o.node}/{o.vm}, which has no share of it")
                continue
            users.setdefault(o.fdid, set()).add(o.owner)
            borrower = self.owners.get(o.fdid)
            if borrower is not None and borrower != o.owner:
                by = f"{borrower[0]}/{borrower[1]}"
                self.bad("mdev", where, f"open in {o.node}/{o.vm}, borrowed by {by}")
            if holds is not None:
                hold = holds.get(o.fdid)
                if hold is None or (hold.holder.node, hold.holder.vm) != o.owner:
                    who = str(hold.holder) if hold else "nobody"
                    self.bad("mdev", where, f"open in {o.node}/{o.vm}, held by {who}")
        for fdid, owners in sorted(users.items()):
            if len(owners) > 1:
                names = ", ".join(f"{n}/{v}" for n, v in sorted(owners))
                self.bad("mdev", f"device {fdid:#x}", f"open in two VMs: {names}")

    def share_wires(self) -> None:
        for w in self.hw.share_wiring():
            where = f"{w.fdid:#x} {w.kind} {w.detail}"
            owner = self.owners.get(w.fdid)
            if owner is None or owner[1] != MANAGER_VM:
                self.bad("share-wire", where, f"for {w.node}/{w.vm}, but no manager borrows it")
            elif not any(g.owner == (w.node, w.vm) for g in self.grants.get(w.fdid, {}).values()):
                self.bad("share-wire", where, f"for {w.node}/{w.vm}, which has no current share")

    def teardown_gaps(self) -> None:
        for gap in self.hw.teardown_gaps:
            self.bad("teardown", "borrow end", gap)

    def holds(self, holds: Mapping[int, HoldRecord]) -> None:
        for fdid, hold in sorted(holds.items()):
            if not hold.holder.node or not hold.holder.vm:
                self.bad("hold", f"device {fdid:#x}", f"hold without a holder ({hold.holder!r})")
        for fdid, (node, vm) in sorted(self.owners.items()):
            its = holds.get(fdid)
            if its is None or (its.holder.node, its.holder.vm) != (node, vm):
                self.bad("hold", f"device {fdid:#x}", f"borrowed by {node}/{vm} without its hold")
            elif its.phase is not Phase.BORROWED:
                self.bad("hold", f"device {fdid:#x}", f"borrowed but its hold is {its.phase}")

    def claims_held(
        self, holds: Mapping[int, HoldRecord], claims: Sequence[tuple[int, Claim]]
    ) -> None:
        """Every claim belongs to a current hold: one a release left behind would count
        against the adapter for ever (admission refuses what the fabric could carry)."""
        for fdid, c in claims:
            if fdid not in holds:
                self.bad(
                    "claims",
                    f"device {fdid:#x}",
                    f"{c.kind.value} claim on {c.adapter} without a hold",
                )

    def claims(self, claims: Sequence[tuple[int, Claim]]) -> None:
        window_claims: dict[tuple[str, str], int] = {}
        for _fdid, c in claims:
            if c.kind is ClaimKind.DMA:
                key = (c.adapter, c.share)
                window_claims[key] = max(window_claims.get(key, 0), c.segments)
        windows: dict[tuple[str, str], int] = {}
        for (ref, _index), grants in self.share_segments.items():
            for g in grants:
                key = (ref, g.window_key)
                windows[key] = windows.get(key, 0) + 1
        # interrupt windows (MSI over the NTB): one per adapter and VM, claimed as such; a
        # segment a VM's borrowed devices and its shares both use counts once for it
        irq: set[tuple[str, str, int]] = set()
        for (ref, index), grants in self.share_msi.items():
            irq |= {(ref, g.msi_key, index) for g in grants}
        p2p: dict[str, int] = {}
        for (ref, index), users in self.segment_users.items():
            users = users - self.shared  # a shared drive's segments are its shares' (above)
            if not users:
                continue
            if "irq" in self.segment_reaches.get((ref, index), set()):
                for owner in {self.owners[f] for f in users if f in self.owners}:
                    irq.add((ref, msi_share(Holder(*owner)), index))
                continue
            if not self._is_window_segment(ref, index, users):
                p2p[ref] = p2p.get(ref, 0) + 1
                continue
            for owner in {self.owners[f] for f in users if f in self.owners}:
                key = (ref, vm_share(Holder(*owner)))
                windows[key] = windows.get(key, 0) + 1
        for ref, key_, _index in irq:
            windows[(ref, key_)] = windows.get((ref, key_), 0) + 1
        for key in sorted(windows):
            have, want = windows[key], window_claims.get(key, 0)
            if have != want:  # admission counts with the planner: exactly what enable maps
                self.bad(
                    "claims",
                    f"{key[0]} {key[1]}",
                    f"{have} DMA-window segment(s) mapped, {want} claimed",
                )
        p2p_claimed = usage(
            self.hw.topology, [(f, c) for f, c in claims if c.kind is ClaimKind.P2P]
        )
        for ref in sorted(p2p):
            want = p2p_claimed[ref].segments_used if ref in p2p_claimed else 0
            if p2p[ref] > want:
                self.bad(
                    "claims",
                    ref,
                    f"{p2p[ref]} peer-to-peer segment(s) mapped, at most {want} claimed",
                )
        claimed = usage(self.hw.topology, claims)
        for adapter in self.hw.adapters():
            used = adapter.lut_used
            want = claimed[adapter.ref].lut_used if adapter.ref in claimed else 0
            if used > want:
                self.bad("claims", adapter.ref, f"{used} LUT entries in use, {want} claimed")

    def _classify(
        self, ref_index: tuple[str, int], node: str, domain: IommuDomain, remote: int
    ) -> None:
        m = domain.lookup(remote)
        region = None
        if m is not None:
            region = self.hw.node(node).address_map.find(m.phys + remote - m.iova)
        kind = region.kind if region is not None else "nothing"
        self.segment_reaches.setdefault(ref_index, set()).add(kind)

    def _is_window_segment(self, ref: str, index: int, users: set[int]) -> bool:
        """A segment into a VM's RAM (a DMA window), not towards a peer's BAR."""
        return "ram" in self.segment_reaches.get((ref, index), set())
