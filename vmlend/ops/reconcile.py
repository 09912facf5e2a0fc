"""Reconcile: find where the hypervisor, the registry and the host disagree, and repair it.

Three views of one truth: the hypervisor (which VMs run, what their live XML and vmlend
metadata name), the registry (holds) and the host (mdevs). An interruption (a release hook that
failed on a full disk, an attach killed after the reserve, a detach killed after the unplug)
leaves them apart. ``look`` gathers the views (I/O), ``find_drift`` compares them (pure), and
``fix`` repairs each drift: whatever no running VM uses is returned, whatever a running VM
uses is re-created. Only this node's holds and mdevs are judged: another node's VMs are
another hypervisor's. The mdevs judged are those vmlend recorded (``Fabric.mdev_records``):
a child vmlend did not record (another driver's type, one ``mdevctl`` or another share made
under the same parent) is never drift and never removed.

The hook's ``reconnect`` (libvirtd restarted while a VM runs) uses ``restore_running``
(``restore.py``), the same repair ``fix`` applies to a running VM's missing hold or mdev.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import msgspec

from vmlend.domain import (
    METADATA_KEY,
    NAMESPACE_URI,
    DomainDocument,
    VmlendDevice,
    read_domain,
    remove_device,
)
from vmlend.domain.model import DomainXML
from vmlend.errors import DamagedCopyError, FabricError, VmlendError
from vmlend.fabric.base import ChecksShares, Fabric, MapsP2P, WritesDmaWindows
from vmlend.kernel.dmafiles import (
    DmaReport,
    Mismatch,
    Window,
    compare_records,
    compare_windows,
    mapped_segments,
    segment_drift,
)
from vmlend.kernel.p2pfiles import P2PDifference
from vmlend.kernel.sharefiles import ShareReport, ShareValues, compare_share, runs
from vmlend.ledger.shareops import SHARE_MDEV_TYPE
from vmlend.lending.devices import holder_for, recorded_for, return_device
from vmlend.lending.shares import ShareFabric
from vmlend.ops.attach import attach_live
from vmlend.ops.definitions import plain_metadata
from vmlend.ops.restore import restore_running
from vmlend.registry.records import RuntimeRecord, same_holder
from vmlend.topology.model import (
    DeviceStatus,
    GuestRam,
    GuestRange,
    Holder,
    MdevInfo,
    format_fdid,
)

if TYPE_CHECKING:
    from vmlend.hypervisor import Hypervisor

Record = Callable[[str], None]

#: What ``fix`` does for a ``dma-windows`` drift: write the windows again, or keep what the
#: driver maps as the device's records again (a lost ``SMARTIO_DMA`` event).
REWRITE = "write the DMA windows again"
RECORD_AGAIN = "record the driver's DMA state again"
#: What ``fix`` does for an ``nvme-share`` drift of a running VM's share child whose files
#: differ from the registry's share under the same epoch.
REWRITE_SHARE = "write the registry's share to its child again"


class DriftKind(enum.StrEnum):
    HOLD_OF_STOPPED_VM = "hold-of-stopped-vm"
    HOLD_NOT_IN_XML = "hold-not-in-xml"
    MDEV_WITHOUT_HOLD = "mdev-without-hold"
    METADATA_WITHOUT_HOSTDEV = "metadata-without-hostdev"
    HOSTDEV_WITHOUT_METADATA = "hostdev-without-metadata"
    MISSING_HOLD = "missing-hold"
    MISSING_MDEV = "missing-mdev"
    HELD_BY_ANOTHER = "held-by-another"
    #: The driver's DMA windows of a running VM's child differ from what vmlend computes, or
    #: what it maps from the device's ``dma-window`` records (docs/smartio-contract.md
    #: section 8; kernel backend only).
    DMA_WINDOWS = "dma-windows"
    #: The driver's peer-to-peer maps of a running VM differ from what ``plan_p2p`` computes
    #: over the guest's BARs now, or use more segments than the VM's P2P claims (section 8).
    P2P_MAPS = "p2p-maps"
    #: A share child's ``nvme_share`` / ``nvme_share_state`` against the registry's shares of
    #: this node (docs/smartio-contract.md section 7, "Per share"; kernel backend only).
    NVME_SHARE = "nvme-share"


class Drift(msgspec.Struct, frozen=True):
    kind: DriftKind
    vm: str  # the VM concerned ("" for an mdev nobody holds)
    fdid: int | None
    mdev: str | None
    cause: str  # what the three views say, and what probably led there
    fix: str  # what ``fix`` does; when ``fixable`` is False, what the operator must do
    fixable: bool = True
    holder: Holder | None = None  # the hold concerned, if any

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "vm": self.vm,
            "fdid": format_fdid(self.fdid) if self.fdid is not None else None,
            "mdev": self.mdev,
            "cause": self.cause,
            "fix": self.fix,
            "fixable": self.fixable,
        }


class RunningVm(msgspec.Struct, frozen=True):
    """A running domain as its live XML describes it."""

    name: str
    holder: Holder
    devices: tuple[VmlendDevice, ...]  # what the vmlend metadata names
    hostdevs: frozenset[str]  # mdev UUIDs of its mdev hostdevs
    guest_ram: int
    #: Its RAM ranges by QEMU's layout rules (None: the XML does not decide them).
    ram: GuestRam | None = None


class DmaCheck(msgspec.Struct, frozen=True):
    """One running VM's child on a backend whose driver maps DMA windows: what vmlend
    computes for it and what the driver reports."""

    vm: RunningVm
    fdid: int
    mdev: str
    expected: tuple[Window, ...]
    token: int | None  # the hold's fencing token (None: no hold to compare with)
    report: DmaReport
    #: ``compare_windows`` of the above, once (none when the report is damaged): the
    #: child's drift and the segment check's "its mapping differs already" both read it.
    mismatches: tuple[Mismatch, ...]
    #: The device's ``dma-window`` runtime records, as windows (what ``SMARTIO_DMA`` kept).
    recorded: tuple[Window, ...] = ()


class DmaSegmentCheck(msgspec.Struct, frozen=True):
    """A running VM's mapped DMA windows on one lender adapter using another number of
    segments than admission claimed for them (one line, from ``segment_drift``)."""

    vm: RunningVm
    fdid: int  # a device of the VM's whose child reports the mapping
    mdev: str
    line: str


class ShareChildCheck(msgspec.Struct, frozen=True):
    """One share child vmlend recorded on this node, present on the host, on a backend whose
    driver runs shares from the child's files: what they say and the registry's share."""

    mdev: MdevInfo
    holder: Holder  # its VM as the record names it (node and name: what a share is keyed by)
    expected: ShareValues | None  # what the registry's share is written as (None: no share)
    report: ShareReport


class P2PCheck(msgspec.Struct, frozen=True):
    """One difference between a running VM's peer-to-peer maps and vmlend's plan."""

    vm: RunningVm
    difference: P2PDifference


class Views(msgspec.Struct):
    node: str
    running: list[RunningVm]
    holds: list[DeviceStatus]  # devices held by a VM of this node
    mdevs: list[MdevInfo]  # the mdevs vmlend recorded on this node (``Fabric.mdev_records``)
    defined: set[str] = msgspec.field(default_factory=set)  # names of domains that are not running
    #: devices held by VMs of other nodes (a running VM here may still name one)
    elsewhere: dict[int, DeviceStatus] = msgspec.field(default_factory=dict)
    #: UUIDs of the mdevs this host has, recorded or not (``Fabric.mdevs``)
    present: set[str] = msgspec.field(default_factory=set)
    #: The data path of running VMs' children, where the driver reports it
    dma: list[DmaCheck] = msgspec.field(default_factory=list)
    #: Peer-to-peer differences of running VMs, where the driver maps it
    p2p: list[P2PCheck] = msgspec.field(default_factory=list)
    #: Running VMs' DMA-window segments the driver maps against admission's claims
    dma_segments: list[DmaSegmentCheck] = msgspec.field(default_factory=list)
    #: The queue-level NVMe shares running VMs have on this node: (drive, VM name)
    shares: set[tuple[int, str]] = msgspec.field(default_factory=set)
    #: Share children and what their files say, where the driver runs shares from them
    share_children: list[ShareChildCheck] = msgspec.field(default_factory=list)
    #: Every share the registry has for a VM of this node (same backends): (drive, holder)
    local_shares: list[tuple[int, Holder]] = msgspec.field(default_factory=list)


def look(hv: Hypervisor, fabric: Fabric) -> Views:
    """Gather the three views of this node: the holds and mdevs first, then the domains.

    In this order a VM starting meanwhile cannot look like a stopped VM with holds: a hold
    its prepare hook makes after the holds are read is not seen at all, and one made before
    is seen with its VM already active (libvirt counts a domain active from before its
    prepare hook on). Listed the other way round, a VM not yet started when the domains were
    listed had its fresh holds read as a stopped VM's and returned (issue 20). ``fix`` checks
    again that such a VM is still not running right before it returns its holds."""
    node = fabric.local_node
    # before the children: a share made meanwhile then has its child seen too, or is not
    # seen at all (a start reserves the share before it makes the child)
    local_shares = fabric.local_shares() if isinstance(fabric, ChecksShares) else []
    held = [st for st in fabric.devices() if st.holder is not None]
    mdevs = [m for m in fabric.mdev_records() if m.node in ("", node)]
    present = {m.uuid for m in fabric.mdevs()}
    running: list[RunningVm] = []
    defined: set[str] = set()
    for info in hv.list_domains():
        if not info.active:
            defined.add(info.name)
            continue
        doc = DomainDocument.parse(hv.xml(info.name), source=f"live XML of {info.name}")
        dom = read_domain(doc.to_bytes(), strict=False)
        hostdevs = frozenset(str(h.uuid) for h in DomainXML(doc.root).mdev_hostdevs())
        holder = holder_for(fabric, info.name, dom.uuid or info.uuid)
        running.append(
            RunningVm(info.name, holder, dom.devices, hostdevs, dom.memory_bytes or 0, dom.ram)
        )
    holds = [st for st in held if st.holder is not None and st.holder.node == node]
    elsewhere = {st.fdid: st for st in held if st.holder is not None and st.holder.node != node}
    dma = _look_dma(fabric, running, present)
    p2p = _look_p2p(fabric, running)
    segments = _look_dma_segments(fabric, dma)
    views = Views(node, running, holds, mdevs, defined, elsewhere, present, dma, p2p, segments)
    if isinstance(fabric, ShareFabric) and any(d.share for vm in running for d in vm.devices):
        views.shares = {(f, vm.name) for vm in running for f in fabric.shares_held(vm.holder)}
    views.share_children = _look_share_children(fabric, mdevs, present)
    views.local_shares = local_shares
    return views


def _look_share_children(
    fabric: Fabric, mdevs: list[MdevInfo], present: set[str]
) -> list[ShareChildCheck]:
    """Each recorded share child the host has, its files beside the registry's share. A child
    without ``nvme_share`` (a driver from before section 7's files) is ``vmlend doctor``'s."""
    if not isinstance(fabric, ChecksShares):
        return []
    out = []
    for m in mdevs:
        if m.type_id != SHARE_MDEV_TYPE or m.fdid is None or m.uuid not in present:
            continue
        report = fabric.share_report(m.uuid)
        if report is None:
            continue
        holder = Holder(m.node or fabric.local_node, m.vm)
        try:
            expected = fabric.registry_share(m.fdid, holder)
        except DamagedCopyError:
            raise  # the topology could not be read: every check's problem
        except VmlendError:  # a share the driver cannot run (two paths): not this check's
            continue
        out.append(ShareChildCheck(m, holder, expected, report))
    return out


def _look_dma_segments(fabric: Fabric, checks: list[DmaCheck]) -> list[DmaSegmentCheck]:
    """Per running VM, the distinct segments its children's ``dma_state`` maps on each lender
    adapter against the VM's ``dma`` claims there (docs/smartio-contract.md section 8: equal)."""
    if not isinstance(fabric, WritesDmaWindows) or not checks:
        return []
    topology = fabric.topology()
    by_vm: dict[str, list[DmaCheck]] = {}
    for c in checks:
        by_vm.setdefault(c.vm.name, []).append(c)
    out = []
    for mine in by_vm.values():
        used: dict[str, set[int]] = {}
        for c in mine:
            if c.report.damaged or not topology.has_device(c.fdid):
                continue
            if c.mismatches:
                used.clear()  # its mapping differs already: that is the VM's one drift
                break
            lender = topology.device(c.fdid).lender
            for ref, segs in mapped_segments(c.report.state, lender).items():
                used.setdefault(ref, set()).update(segs)
        if not used:
            continue  # no child mapped yet: the claims come before the guest's enable
        first = mine[0]
        lines = segment_drift(used, fabric.dma_claimed(first.vm.holder))
        out += [DmaSegmentCheck(first.vm, first.fdid, first.mdev, line) for line in lines]
    return out


def _look_p2p(fabric: Fabric, running: list[RunningVm]) -> list[P2PCheck]:
    """Each running VM's peer-to-peer differences, where the driver maps peer-to-peer."""
    if not isinstance(fabric, MapsP2P):
        return []
    return [P2PCheck(vm, d) for vm in running for d in fabric.p2p_drift(vm.holder)]


def _look_dma(fabric: Fabric, running: list[RunningVm], present: set[str]) -> list[DmaCheck]:
    """What the driver reports for each present child of a running VM whose layout is known,
    beside what vmlend computes for it. A child the driver has no ``smartio/`` group for
    (a driver from before section 8) is ``vmlend doctor``'s to report, not drift."""
    out: list[DmaCheck] = []
    if not isinstance(fabric, WritesDmaWindows):
        return out
    for vm in running:
        if vm.ram is None:
            continue
        holds = fabric.holds_of(vm.holder)
        for dev in vm.devices:
            mdev = str(dev.mdev)
            if dev.share is not None or mdev not in present:
                continue
            report = fabric.dma_report(mdev)
            if report is None:
                continue
            try:
                expected = fabric.expected_windows(dev.fdid, vm.ram)
            except DamagedCopyError:
                raise  # the topology could not be read: every check's problem
            except VmlendError:  # the device left the fabric: other drift says so
                continue
            hold = holds.get(dev.fdid)
            token = hold.token if hold is not None and hold.token else None
            recorded = tuple(_as_window(r) for r in fabric.dma_records(dev.fdid))
            found = (
                ()
                if report.damaged
                else tuple(compare_windows(expected, token, report.written, report.state))
            )
            out.append(DmaCheck(vm, dev.fdid, mdev, expected, token, report, found, recorded))
    return out


def _as_window(r: RuntimeRecord) -> Window:
    """A ``dma-window`` record as the window it says is mapped (an unreadable ``ranges``
    field: none, which then differs from any mapping)."""
    ranges = r.data.get("ranges")
    try:
        return Window(r.key, tuple(GuestRange(int(a), int(b)) for a, b in ranges or ()))
    except (TypeError, ValueError):
        return Window(r.key, ())


def find_drift(views: Views) -> list[Drift]:
    """Every disagreement between the views, each with its cause and its repair."""
    drift: list[Drift] = []
    held = {st.fdid: st for st in views.holds}
    recorded = {m.uuid for m in views.mdevs}
    fdid_of_mdev = {m.uuid: m.fdid for m in views.mdevs}
    in_use: set[str] = set()  # mdevs a running VM has a hostdev for
    used: set[tuple[int, str]] = set()  # (fdid, vm) pairs a running VM uses or names

    for vm in views.running:
        in_use |= vm.hostdevs
        for dev in vm.devices:
            fd, mdev = format_fdid(dev.fdid), str(dev.mdev)
            used.add((dev.fdid, vm.name))
            if mdev not in vm.hostdevs:
                drift.append(
                    Drift(
                        DriftKind.METADATA_WITHOUT_HOSTDEV,
                        vm.name,
                        dev.fdid,
                        mdev,
                        f"the live metadata of running VM {vm.name!r} names device {fd} but the"
                        f" VM has no hostdev for mdev {mdev} (a detach interrupted after libvirt"
                        " unplugged it)",
                        f"drop {fd} from the live metadata and return the device",
                        holder=vm.holder,
                    )
                )
                continue
            if dev.share is not None:  # the drive is its manager's; the VM has a share
                drift.extend(_running_share_drift(vm, dev, views.shares))
                continue
            st = held.get(dev.fdid) or views.elsewhere.get(dev.fdid)
            drift.extend(_running_device_drift(vm, dev, st, recorded, views.present))
        named = {str(d.mdev) for d in vm.devices}
        for mdev in sorted(vm.hostdevs - named):
            fdid = fdid_of_mdev.get(mdev)
            st = held.get(fdid) if fdid is not None else None
            if fdid is None or st is None or st.holder is None:
                continue  # not a vmlend device: libvirt's business
            if not same_holder(st.holder, vm.holder):
                continue  # reported with the holder below
            used.add((fdid, vm.name))
            fd = format_fdid(fdid)
            drift.append(
                Drift(
                    DriftKind.HOSTDEV_WITHOUT_METADATA,
                    vm.name,
                    fdid,
                    mdev,
                    f"running VM {vm.name!r} has the hostdev of device {fd} (mdev {mdev}) but"
                    " its live metadata does not name it (an attach interrupted between"
                    " libvirt's hot-plug and the metadata write)",
                    f"finish the attach: write {fd} into the live metadata (the VM keeps the"
                    f" device; 'vmlend detach {vm.name} {fd} --live' afterwards removes it)",
                    holder=vm.holder,
                )
            )

    for st in views.holds:
        h = st.holder
        assert h is not None
        fd = format_fdid(st.fdid)
        running = next((v for v in views.running if same_holder(h, v.holder)), None)
        # the mdev recorded for this hold's VM: never another child under the same parent
        held_mdev = next(
            (m.uuid for m in views.mdevs if m.fdid == st.fdid and recorded_for(m, h)), None
        )
        if running is None:
            where = "is defined but not running" if h.vm in views.defined else "is not running"
            drift.append(
                Drift(
                    DriftKind.HOLD_OF_STOPPED_VM,
                    h.vm,
                    st.fdid,
                    held_mdev,
                    f"device {fd} is {st.state.value} for VM {h.vm!r}, which {where} here"
                    " (its release hook did not finish, e.g. on a full disk, or it was killed"
                    " without it)",
                    f"return {fd}" + (f" and remove mdev {held_mdev}" if held_mdev else ""),
                    holder=h,
                )
            )
        elif (st.fdid, running.name) not in used:
            drift.append(
                Drift(
                    DriftKind.HOLD_NOT_IN_XML,
                    running.name,
                    st.fdid,
                    held_mdev,
                    f"device {fd} is {st.state.value} for running VM {running.name!r}, whose live"
                    " XML does not name it (an attach killed after the reserve)",
                    f"return {fd}" + (f" and remove mdev {held_mdev}" if held_mdev else ""),
                    holder=h,
                )
            )

    held_fdids = set(held)
    # share children the registry has no share for: judged with their files below
    unshared = {c.mdev.uuid for c in views.share_children if c.expected is None}
    for m in views.mdevs:
        if m.uuid in in_use or m.uuid in unshared or (m.fdid is not None and m.fdid in held_fdids):
            continue
        what = f"device {format_fdid(m.fdid)}" if m.fdid is not None else "no known device"
        if m.uuid in views.present:
            cause = (
                f"mdev {m.uuid} ({what}) exists but nothing holds its device and no running VM"
                " uses it (a release or attach rollback interrupted before removing it)"
            )
            repair = f"remove mdev {m.uuid}"
        else:
            cause = (
                f"vmlend records mdev {m.uuid} ({what}), which this host does not have, and"
                " nothing holds its device (a crash between recording and creating it, or a"
                " release interrupted after removing it)"
            )
            repair = f"drop the record of mdev {m.uuid}"
        drift.append(Drift(DriftKind.MDEV_WITHOUT_HOLD, m.vm, m.fdid, m.uuid, cause, repair))
    for c in views.dma:
        drift.extend(_dma_drift(c))
    for sc in views.dma_segments:
        drift.append(
            Drift(
                DriftKind.DMA_WINDOWS,
                sc.vm.name,
                sc.fdid,
                sc.mdev,
                f"running VM {sc.vm.name!r}: {sc.line}",
                "left to the operator: stop the VM and start it again (admission counts anew)",
                fixable=False,
                holder=sc.vm.holder,
            )
        )
    drift.extend(_p2p_drift(c) for c in views.p2p)
    drift.extend(_share_child_drift(views, in_use))
    drift.extend(_missing_share_child_drift(views))
    return drift


def _share_child_drift(views: Views, in_use: set[str]) -> list[Drift]:
    """Share children against the registry's shares: a running VM's child whose files differ
    from its share, and a child whose share the registry no longer has. A child of a VM not
    running whose share the registry still has is ``mdev-without-hold``'s, as before."""
    users = {u: vm for vm in views.running for u in vm.hostdevs}
    out = []
    for c in views.share_children:
        m, fdid = c.mdev, c.mdev.fdid
        assert fdid is not None
        fd = format_fdid(fdid)
        vm = users.get(m.uuid)
        if c.expected is None:
            if m.uuid in in_use:
                continue  # its running VM's share is missing: 'missing-hold' says so
            out.append(
                Drift(
                    DriftKind.NVME_SHARE,
                    m.vm,
                    fdid,
                    m.uuid,
                    f"share mdev {m.uuid} of NVMe drive {fd} (VM {m.vm!r})"
                    f" {runs(c.report)}, but the registry has no share of {fd} for"
                    f" {c.holder.node}/{m.vm} (a release interrupted after returning the share,"
                    " or the share returned by hand)",
                    f"clear its share and remove mdev {m.uuid}",
                    holder=c.holder,
                )
            )
            continue
        if vm is None:
            continue
        diff = compare_share(c.expected, c.report)
        if diff is None:
            continue
        if diff.rewrite:
            repair = REWRITE_SHARE
        elif c.report.damaged:
            repair = "check the SmartIO driver ('dmesg', 'vmlend doctor')"
        else:
            repair = (
                f"stop VM {vm.name!r} and start it again (not fixed here: the share runs under"
                " another epoch than the registry's, which a hot move's hand-over sets)"
            )
        out.append(
            Drift(
                DriftKind.NVME_SHARE,
                vm.name,
                fdid,
                m.uuid,
                f"share mdev {m.uuid} of NVMe drive {fd} (running VM {vm.name!r}): {diff.line}",
                repair,
                fixable=diff.rewrite,
                holder=vm.holder,
            )
        )
    return out


def _missing_share_child_drift(views: Views) -> list[Drift]:
    """A share the registry has for a VM of this node without the share child on this host:
    reported, never made (as a running VM's missing share is)."""
    have = {
        (m.fdid, m.vm)
        for m in views.mdevs
        if m.type_id == SHARE_MDEV_TYPE and m.uuid in views.present
    }
    out = []
    for fdid, holder in views.local_shares:
        if (fdid, holder.vm) in have:
            continue
        fd = format_fdid(fdid)
        vm = next((v for v in views.running if v.name == holder.vm), None)
        if vm is not None:
            named = next((d for d in vm.devices if d.fdid == fdid and d.share), None)
            cause = (
                f"running VM {holder.vm!r} has a share of NVMe drive {fd} but this host has no"
                " share child for it (removed by hand, or taken with its lender and not made"
                " again)"
            )
            repair = (
                f"stop VM {holder.vm!r} and start it again (not fixed here: a share child is"
                " made by its VM's start)"
            )
            mdev = str(named.mdev) if named is not None else None
        else:
            cause = (
                f"the state has a share of NVMe drive {fd} for VM {holder.vm!r} on"
                f" {holder.node}, which does not run here, and this host has no share child for"
                " it (a start in progress, or a release interrupted before returning the share)"
            )
            repair = (
                f"once VM {holder.vm!r} is stopped, 'vmlend nvme release {fd} {holder.vm}'"
                " returns it (not fixed here: a start may be making its child now)"
            )
            mdev = None
        out.append(Drift(DriftKind.NVME_SHARE, holder.vm, fdid, mdev, cause, repair, False, holder))
    return out


def _p2p_drift(c: P2PCheck) -> Drift:
    d = c.difference
    where = f"mdev {d.mdev} of device {format_fdid(d.fdid)} (running VM {c.vm.name!r})"
    return Drift(
        DriftKind.P2P_MAPS,
        c.vm.name,
        d.fdid,
        d.mdev,
        f"{where}: {d.line}",
        "plan and write the VM's peer-to-peer maps again"
        if d.rewrite
        else "left to the operator (see the cause)",
        fixable=d.rewrite,
        holder=c.vm.holder,
    )


def _dma_drift(c: DmaCheck) -> list[Drift]:
    """One drift per difference between the driver's DMA windows and vmlend's, each one line."""
    where = f"mdev {c.mdev} of device {format_fdid(c.fdid)} (running VM {c.vm.name!r})"
    if c.report.damaged:
        lines = [(f"its SmartIO driver's data-path files are damaged: {c.report.damaged}", "")]
    else:
        lines = [(m.line, REWRITE if m.rewrite else "") for m in c.mismatches]
        if (records := compare_records(c.recorded, c.report.state)) is not None:
            lines.append((records, RECORD_AGAIN))
    return [
        Drift(
            DriftKind.DMA_WINDOWS,
            c.vm.name,
            c.fdid,
            c.mdev,
            f"{where}: {line}",
            repair or "left to the operator (see the cause)",
            fixable=bool(repair),
            holder=c.vm.holder,
        )
        for line, repair in lines
    ]


def _running_share_drift(
    vm: RunningVm, dev: VmlendDevice, shares: set[tuple[int, str]]
) -> list[Drift]:
    """A running VM's share controller without a share of the drive on this node."""
    if (dev.fdid, vm.name) in shares:
        return []
    fd = format_fdid(dev.fdid)
    return [
        Drift(
            DriftKind.MISSING_HOLD,
            vm.name,
            dev.fdid,
            str(dev.mdev),
            f"running VM {vm.name!r} uses a share of NVMe drive {fd} but the state shows none"
            f" for it on {vm.holder.node} (an interrupted live migration moved it?)",
            "finish or roll back the interrupted live migration (not fixed here: a new share"
            " would not hold the VM's blocks)",
            fixable=False,
            holder=vm.holder,
        )
    ]


def _running_device_drift(
    vm: RunningVm,
    dev: VmlendDevice,
    st: DeviceStatus | None,
    recorded: set[str],
    present: set[str],
) -> list[Drift]:
    fd, mdev = format_fdid(dev.fdid), str(dev.mdev)
    if st is None or st.holder is None:
        return [
            Drift(
                DriftKind.MISSING_HOLD,
                vm.name,
                dev.fdid,
                mdev,
                f"running VM {vm.name!r} uses device {fd} but the state shows no hold for it"
                " (the state was restored or edited, or the device returned by mistake)",
                f"reserve {fd} for {vm.name!r} again and make sure mdev {mdev} exists",
                holder=vm.holder,
            )
        ]
    if st.holder.node != vm.holder.node:  # another host won it (e.g. after this one's lease)
        return [
            Drift(
                DriftKind.HELD_BY_ANOTHER,
                vm.name,
                dev.fdid,
                mdev,
                f"running VM {vm.name!r} uses device {fd}, which VM {st.holder.vm!r} on host"
                f" {st.holder.node} holds (this host lost its hold, e.g. with its lease)",
                f"stop VM {vm.name!r} or hot-unplug the device from it ('vmlend detach"
                f" {vm.name} {fd} --live'); the hold on {st.holder.node} stays (not fixed here:"
                " only the operator may stop or change a running VM)",
                fixable=False,
                holder=vm.holder,
            )
        ]
    if not same_holder(st.holder, vm.holder):
        return [
            Drift(
                DriftKind.HELD_BY_ANOTHER,
                vm.name,
                dev.fdid,
                mdev,
                f"running VM {vm.name!r} uses device {fd}, which the state says {st.holder} holds",
                "stop one of the two VMs; then run 'vmlend reconcile --fix' (not fixed here:"
                " either VM may be the one the device really serves)",
                fixable=False,
                holder=vm.holder,
            )
        ]
    if mdev not in present or mdev not in recorded:
        if mdev not in present:
            cause = f"its mdev {mdev} is gone from this host"
            repair = f"re-create mdev {mdev}"
        else:  # its release would leave the child: vmlend removes only what it recorded
            cause = (
                f"vmlend has no record of its mdev {mdev} (the state was restored or edited,"
                " or the record ended with this host's lease)"
            )
            repair = f"record mdev {mdev} for VM {vm.name!r}"
        return [
            Drift(
                DriftKind.MISSING_MDEV,
                vm.name,
                dev.fdid,
                mdev,
                f"running VM {vm.name!r} holds device {fd} but {cause}",
                repair,
                holder=vm.holder,
            )
        ]
    return []


class FixResult(msgspec.Struct):
    fixed: list[Drift] = msgspec.field(default_factory=list)
    failed: list[tuple[Drift, str]] = msgspec.field(default_factory=list)
    left: list[Drift] = msgspec.field(default_factory=list)  # not fixable by vmlend
    #: holds of a VM that was not running when looked at but runs now: kept
    started: list[Drift] = msgspec.field(default_factory=list)


def fix(
    hv: Hypervisor, fabric: Fabric, drift: Iterable[Drift], record: Record = lambda _m: None
) -> FixResult:
    """Repair each fixable drift; one failure does not stop the others."""
    result = FixResult()
    for d in drift:
        if not d.fixable:
            result.left.append(d)
            continue
        try:
            stopped = d.kind is DriftKind.HOLD_OF_STOPPED_VM or (
                d.kind is DriftKind.NVME_SHARE and d.fix != REWRITE_SHARE
            )
            if stopped and _runs_now(hv, d.holder):
                result.started.append(d)
                continue
            _fix_one(hv, fabric, d, record)
        except VmlendError as e:
            result.failed.append((d, str(e)))
            record(f"{d.kind.value} {d.vm} {d.fdid}: FAILED: {e}")
        else:
            result.fixed.append(d)
    return result


def _runs_now(hv: Hypervisor, holder: Holder | None) -> bool:
    """Whether ``holder``'s VM is active now: checked again right before its holds are
    returned, since it may have started after the domains were listed."""
    if holder is None:
        return False
    try:
        info = hv.lookup(holder.vm)
    except VmlendError:  # gone: certainly not running
        return False
    return info.active and (not holder.vm_uuid or info.uuid.lower() == holder.vm_uuid.lower())


def _fix_one(hv: Hypervisor, fabric: Fabric, d: Drift, record: Record) -> None:
    match d.kind:
        case DriftKind.HOLD_OF_STOPPED_VM | DriftKind.HOLD_NOT_IN_XML:
            assert d.holder is not None and d.fdid is not None
            return_device(fabric, d.holder, d.fdid, d.mdev, record)
        case DriftKind.MDEV_WITHOUT_HOLD:
            assert d.mdev is not None
            if fabric.remove_mdev(d.mdev):
                record(f"mdev {d.mdev}: removed")
        case DriftKind.METADATA_WITHOUT_HOSTDEV:
            assert d.holder is not None and d.fdid is not None
            doc = DomainDocument.parse(hv.xml(d.vm), source=f"live XML of {d.vm}")
            after = remove_device(doc, d.fdid, unplugged=True)
            hv.set_metadata(
                d.vm, NAMESPACE_URI, METADATA_KEY, plain_metadata(after), live=True, config=False
            )
            record(f"live metadata of {d.vm}: {format_fdid(d.fdid)} dropped")
            return_device(fabric, d.holder, d.fdid, d.mdev, record)
        case DriftKind.HOSTDEV_WITHOUT_METADATA:
            assert d.fdid is not None
            # The attach's own re-run: it sees the plugged hostdev and writes the metadata.
            attach_live(hv, fabric, d.vm, d.fdid, record)
        case DriftKind.DMA_WINDOWS:
            assert d.fdid is not None and d.mdev is not None
            if not isinstance(fabric, WritesDmaWindows):
                raise FabricError("this fabric backend has no DMA windows to write")
            if d.fix == RECORD_AGAIN:
                if fabric.record_dma(d.mdev) is None:
                    raise FabricError(
                        f"mdev {d.mdev}'s DMA state could not be recorded (see the log):"
                        " its VM may no longer hold the device; run 'vmlend reconcile' again"
                    )
                record(f"mdev {d.mdev}: DMA state of {format_fdid(d.fdid)} recorded again")
                return
            ram = read_domain(hv.xml(d.vm), strict=False).guest_ram
            assert d.holder is not None  # every dma-windows drift names its running VM
            if fabric.write_dma_windows(d.fdid, d.mdev, ram, holder=d.holder) is not None:
                record(f"mdev {d.mdev}: DMA windows of {format_fdid(d.fdid)} written again")
        case DriftKind.NVME_SHARE:
            assert d.holder is not None and d.fdid is not None and d.mdev is not None
            if not isinstance(fabric, ChecksShares):
                raise FabricError("this fabric backend has no share files to write")
            fd = format_fdid(d.fdid)
            if d.fix == REWRITE_SHARE:
                fabric.rewrite_share(d.fdid, d.mdev, d.holder)
                record(f"mdev {d.mdev}: the registry's share of {fd} written again")
                return
            if fabric.registry_share(d.fdid, d.holder) is not None:
                raise FabricError(
                    f"the state has a share of {fd} for {d.holder} again (its VM started"
                    f" meanwhile?): mdev {d.mdev} kept; run 'vmlend reconcile' again"
                )
            if fabric.remove_mdev(d.mdev):  # its share cleared first, as a release does
                record(f"mdev {d.mdev}: share cleared, removed")
        case DriftKind.P2P_MAPS:
            assert d.holder is not None
            if not isinstance(fabric, MapsP2P):
                raise FabricError("this fabric backend has no peer-to-peer maps to write")
            fabric.sync_p2p(d.holder)
            record(f"mdev {d.mdev}: peer-to-peer maps of {d.vm} planned and written again")
        case DriftKind.MISSING_HOLD | DriftKind.MISSING_MDEV:
            assert d.holder is not None and d.fdid is not None and d.mdev is not None
            dom = read_domain(hv.xml(d.vm), strict=False)
            listed = next((v for v in dom.devices if v.fdid == d.fdid), None)
            device = VmlendDevice(
                fdid=d.fdid,
                mdev=uuid.UUID(d.mdev),
                interrupts=listed.interrupts if listed is not None else None,
            )
            problems = restore_running(
                fabric, d.holder, [device], dom.guest_ram, record, dom.interrupts_of
            )
            if problems:
                raise FabricError(problems[0])
