"""Status collection: per VM its remote devices and what the data path set up for them;
per NTB adapter the LUT entries and window room in use; per cluster switch port in use its
requester entries.

VMs come from the hypervisor (domains with vmlend metadata) and from the fabric's holds (a
device held by a VM this hypervisor does not know: another node's VM, or a leftover).
The data-path records (DMA windows, interrupt vectors, P2P maps) are the registry's runtime
records of each held device; "-" when there are none. A VM's queue-level NVMe shares
(``vmlend.ledger.nvmeshares``) are runtime records of the drive's manager hold: they are shown per
VM apart from its devices (the drive itself is the manager's, not the VM's). Each device also
says which path its MSI/MSI-X take: the one its hold was admitted with (NTB through an adapter,
or the relay), and the one its XML asks for.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

from vmlend.domain import VmlendDevice, read_domain
from vmlend.errors import DamagedCopyError, UnknownDomainError, VmlendError
from vmlend.fabric.base import Fabric, MapsP2P, WritesDmaWindows
from vmlend.hypervisor import Hypervisor
from vmlend.kernel.dmafiles import DmaReport, MappedWindow, Window
from vmlend.kernel.p2pfiles import P2PLine, P2PReport
from vmlend.ledger.admission import AdapterUsage, PortUsage
from vmlend.ledger.linkfaults import LINK_FAULT
from vmlend.ledger.nvmeshares import SHARE_RECORD, ShareEntry, share_entry
from vmlend.lending.devices import holder_for
from vmlend.memory.dmarecords import DMA_REFUSAL
from vmlend.ops.live_state import LiveRecord, history
from vmlend.registry import open_registry
from vmlend.registry.records import RuntimeRecord, same_holder
from vmlend.topology.model import DeviceStatus, Holder, Topology, format_fdid
from vmlend.topology.pcie import PciePath, device_to_ram

#: Runtime record kinds shown, and their column names.
RUNTIME_KINDS = {"dma-window": "dma_windows", "irq-vector": "irq_vectors", "p2p-map": "p2p_maps"}


class DeviceView(msgspec.Struct):
    fdid: int
    state: str  # reserved / borrowed, "defined" (VM not holding it), "held elsewhere", ...
    holder: Holder | None
    mdev: str | None
    mdev_present: bool
    runtime: dict[str, list[RuntimeRecord]] = msgspec.field(default_factory=dict)
    #: The device's DMA path into the VM's RAM (None when the topology cannot say).
    path: PciePath | None = None
    #: What the device's XML asks for (``ntb``/``relay``); None: not in this VM's XML.
    interrupts_asked: str | None = None
    #: The adapter its MSI/MSI-X are mapped over (the hold's interrupt window); None: relay.
    interrupts_via: str | None = None
    #: What the SmartIO driver reports of the child's DMA windows (kernel backend, docs/
    #: smartio-contract.md section 8); None: no such report (another backend, no child).
    driver_dma: DmaReport | None = None
    #: What the driver reports of the child's peer-to-peer (``guest_bars``, ``p2p``,
    #: ``p2p_state``); None: no such report.
    driver_p2p: P2PReport | None = None

    @property
    def dma_refusal(self) -> RuntimeRecord | None:
        """The driver's refusal of the guest's last Bus Master enable, as the registry keeps
        it (``dma-refusal``, kernel backend); None: no refusal recorded."""
        return next(iter(self.runtime.get(DMA_REFUSAL, [])), None)

    @property
    def interrupts(self) -> str:
        """The path the device's MSI/MSI-X take while this VM holds it, else the one asked."""
        if not self.state.startswith(("reserved", "borrowed")):
            return f"asks {self.interrupts_asked}" if self.interrupts_asked else "-"
        return "relay" if self.interrupts_via is None else f"ntb({self.interrupts_via})"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "fdid": format_fdid(self.fdid),
            "state": self.state,
            "holder": str(self.holder) if self.holder else None,
            "mdev": self.mdev,
            "mdev_present": self.mdev_present,
            "interrupts": {
                "path": self.interrupts,
                "via": self.interrupts_via,
                "asked": self.interrupts_asked,
            },
        }
        for kind, key in RUNTIME_KINDS.items():
            out[key] = [{"key": r.key} | r.data for r in self.runtime.get(kind, [])]
        out["link_faults"] = [{"key": r.key} | r.data for r in self.runtime.get(LINK_FAULT, [])]
        out["driver_dma"] = None if self.driver_dma is None else _dma_json(self.driver_dma)
        refusal = self.dma_refusal
        out["dma_refusal"] = None if refusal is None else dict(refusal.data)
        out["driver_p2p"] = None if self.driver_p2p is None else _p2p_json(self.driver_p2p)
        out["dma_path"] = None
        if self.path is not None:
            p = self.path
            out["dma_path"] = {
                "hops": p.hops,
                "roots": p.roots,
                "ntb_crossings": p.ntb_crossings,
                "latency_ns": p.latency_ns,
                "added_ns": p.added_ns,
            }
        return out


def _window_json(w: Window | MappedWindow) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": w.name,
        "ranges": [{"start": r.start, "end": r.end} for r in w.ranges],
    }
    if isinstance(w, MappedWindow):
        out["adapter"] = w.adapter
        out["segments"] = None if w.segments is None else list(w.segments)
    return out


def _dma_json(report: DmaReport) -> dict[str, Any]:
    """The driver's report as ``status --json`` shows it (addresses as integers)."""
    written, state = report.written, report.state
    return {
        "token": None if written is None else written.token,
        "windows": [] if written is None else [_window_json(w) for w in written.windows],
        "state": None
        if state is None
        else {
            "word": state.word.value,
            "error": state.error or None,
            "reason": state.reason or None,
            "windows": [_window_json(w) for w in state.windows],
        },
        "damaged": report.damaged or None,
    }


def _p2p_json(report: P2PReport) -> dict[str, Any]:
    """The driver's peer-to-peer report as ``status --json`` shows it."""

    def line(ln: P2PLine) -> dict[str, Any]:
        return {"target": format_fdid(ln.target), "bar": ln.bar, "gpa": ln.gpa, "size": ln.size}

    return {
        "guest_bars": [{"bar": b.index, "gpa": b.gpa, "size": b.size} for b in report.bars],
        "token": None if report.written is None else report.written.token,
        "maps": [
            line(s.line)
            | {
                "case": s.case,
                "adapter": s.adapter,
                "segments": None if s.segments is None else list(s.segments),
            }
            for s in report.state
        ],
        "damaged": report.damaged or None,
    }


class VmView(msgspec.Struct):
    name: str
    node: str
    state: str  # virsh's words (running / paused / shut off) or "not on this hypervisor"
    devices: list[DeviceView]
    #: Its queue-level shares of NVMe drives, with what the data path last recorded.
    shares: list[ShareEntry] = msgspec.field(default_factory=list)
    #: Its finished live migrations, oldest first (``vmlend.ops.live_state``).
    live_migrations: list[LiveRecord] = msgspec.field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "node": self.node,
            "state": self.state,
            "devices": [d.to_json() for d in self.devices],
            "nvme_shares": [s.to_json() for s in self.shares],
            "live_migrations": [m.to_json() for m in self.live_migrations],
        }


def _device_view(
    st: DeviceStatus,
    holder: Holder,
    mdev: str | None,
    mdevs: set[str],
    runtime: list[RuntimeRecord],
) -> DeviceView:
    mine = st.holder is not None and same_holder(st.holder, holder)
    if mine:
        state = st.state.value
    elif st.holder is not None:
        state = f"held by {st.holder}"
    else:
        state = "not held"
    by_kind: dict[str, list[RuntimeRecord]] = {}
    if mine:
        for r in runtime:
            if r.fdid == st.fdid:
                by_kind.setdefault(r.kind, []).append(r)
    return DeviceView(st.fdid, state, st.holder, mdev, mdev is not None and mdev in mdevs, by_kind)


def collect(
    hv: Hypervisor, fabric: Fabric, runtime: list[RuntimeRecord], vm: str | None = None
) -> list[VmView]:
    """Every vmlend VM of ``hv``, then VMs known only from the fabric's holds."""
    statuses = {st.fdid: st for st in fabric.devices()}
    mdevs = {m.uuid for m in fabric.mdevs()}
    node = fabric.local_node
    shares = [share_entry(r) for r in runtime if r.kind == SHARE_RECORD]
    views: list[VmView] = []
    seen: list[Holder] = []
    if vm is None:
        domains = hv.list_domains()
    elif _fabric_only(hv, fabric, vm, {s.holder.vm for s in shares}):
        domains = []
    else:
        domains = [hv.lookup(vm)]
    for info in domains:
        live = read_domain(hv.xml(info.name), strict=False)
        # A running domain's definition may name devices the guest gets at its next start.
        pending: list[VmlendDevice] = []
        if info.active and info.persistent:
            config = read_domain(hv.xml(info.name, inactive=True), strict=False)
            have = {d.fdid for d in live.devices}
            pending = [d for d in config.devices if d.fdid not in have]
        if not live.devices and not pending:
            continue
        holder = holder_for(fabric, info.name, live.uuid or info.uuid)
        seen.append(holder)
        # a share's drive is held by its manager: the share, not the drive, is the VM's
        devices = []
        for d in live.devices:
            if d.fdid in statuses and d.share is None:
                view = _device_view(statuses[d.fdid], holder, str(d.mdev), mdevs, runtime)
                view.interrupts_asked = live.interrupts_of(d).value
                devices.append(view)
        for d in pending:
            if d.fdid in statuses and d.share is None:
                view = _device_view(statuses[d.fdid], holder, str(d.mdev), mdevs, runtime)
                view.state = "at next start"
                view.interrupts_asked = config.interrupts_of(d).value
                devices.append(view)
        views.append(VmView(info.name, node, info.state.words, devices, _shares_of(shares, holder)))
    for holder, held in _other_holders(statuses.values(), seen, shares):
        if vm is not None and holder.vm != vm:
            continue
        owned = {m.fdid: m.uuid for m in fabric.mdevs() if m.vm == holder.vm}
        devices = [_device_view(st, holder, owned.get(st.fdid), mdevs, runtime) for st in held]
        where = "not on this hypervisor" if holder.node == node else f"on {holder.node}"
        views.append(VmView(holder.vm, holder.node, where, devices, _shares_of(shares, holder)))
    topology = fabric.topology()
    for v in views:
        for dv in v.devices:
            dv.path = _dma_path(topology, dv.fdid, v.node)
            if isinstance(fabric, WritesDmaWindows) and dv.mdev_present and dv.mdev:
                dv.driver_dma = fabric.dma_report(dv.mdev)
            if isinstance(fabric, MapsP2P) and dv.mdev_present and dv.mdev:
                dv.driver_p2p = fabric.p2p_report(dv.mdev, dv.fdid)
            if dv.holder is not None and dv.holder.node == v.node and dv.holder.vm == v.name:
                window = fabric.interrupt_window(dv.fdid)
                dv.interrupts_via = None if window is None else window.adapter
    return views


def add_history(views: list[VmView], state_dir: Path) -> None:
    """Each VM's live-migration history, as this host's state directory keeps it."""
    for v in views:
        v.live_migrations = history(state_dir, v.name)


def _dma_path(topology: Topology, fdid: int, node: str) -> PciePath | None:
    try:
        return device_to_ram(topology, fdid, node)
    except DamagedCopyError:
        raise  # the topology could not be read: not "no path"
    except VmlendError:  # e.g. no NTB path to the lender: admission says so where it matters
        return None


def _fabric_only(hv: Hypervisor, fabric: Fabric, vm: str, sharers: set[str]) -> bool:
    """``vm`` is unknown to ``hv`` but holds devices or NVMe shares (``sharers``) in the
    fabric (else the lookup error)."""
    try:
        hv.lookup(vm)
        return False
    except UnknownDomainError:
        if vm in sharers or any(st.holder and st.holder.vm == vm for st in fabric.devices()):
            return True
        raise


def _shares_of(shares: Iterable[ShareEntry], holder: Holder) -> list[ShareEntry]:
    return sorted((s for s in shares if same_holder(s.holder, holder)), key=lambda s: s.fdid)


def _other_holders(
    statuses: Iterable[DeviceStatus], seen: list[Holder], shares: Iterable[ShareEntry] = ()
) -> list[tuple[Holder, list[DeviceStatus]]]:
    """Holders of devices or shares not among ``seen``, each with the devices it holds."""
    groups: dict[tuple[str, str, str], list[DeviceStatus]] = {}
    for st in statuses:
        h = st.holder
        if h is None or any(same_holder(h, s) for s in seen):
            continue
        groups.setdefault((h.node, h.vm, h.vm_uuid), []).append(st)
    for e in shares:
        h = e.holder
        known = [Holder(*key) for key in groups]
        if any(same_holder(h, s) for s in [*seen, *known]):
            continue
        groups[(h.node, h.vm, h.vm_uuid)] = []
    return [(Holder(*key), sts) for key, sts in sorted(groups.items())]


def usage_rows(usage: dict[str, AdapterUsage]) -> list[dict[str, Any]]:
    out = []
    for ref, u in sorted(usage.items()):
        a = u.adapter
        out.append(
            {
                "adapter": ref,
                "lut_used": u.lut_used,
                "lut_usable": a.lut_usable,
                "window_used": u.window_used,
                "window_size": a.window_size,
                "segments_used": u.segments_used,
                "segments": a.segments,
            }
        )
    return out


def port_rows(ports: Iterable[PortUsage]) -> list[dict[str, Any]]:
    """Each switch port in use: its switch, name, requester entries used and its table's size."""
    return [
        {"switch": p.switch, "port": p.port, "used": p.used, "capacity": p.capacity}
        for p in ports
    ]


def read_runtime(registry: str | Path) -> list[RuntimeRecord]:
    """The runtime records in the registry at ``registry`` (a URL or an SQLite path)."""
    with open_registry(registry) as reg, reg.read() as tx:
        return tx.runtime()
