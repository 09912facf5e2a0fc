"""Merge what a host's driver says about the host (``FoundHost``) into a topology.

Pure: a topology (or none) and a host description in, the merged topology and what changed
out. The driver is trusted for what it sees (the host's node id, its adapters' hardware, the
back-to-back cable at each adapter, the devices installed in the host); the topology keeps what
it cannot see (names, the PCIe tree, each device's kind and interrupts, the cluster switches'
wiring). Merging the result again changes nothing. What contradicts the topology in a way
vmlend cannot decide (a device id another node has, a cable the topology runs elsewhere) is a
conflict: the caller merges nothing then.
"""

from __future__ import annotations

import re

import msgspec

from vmlend.topology.discovered import FoundDevice, FoundHost
from vmlend.topology.model import (
    AdapterSpec,
    DeviceSpec,
    GiB,
    LinkSpec,
    NodeSpec,
    Topology,
    format_fdid,
)

#: A node name as topology files allow it.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
#: The name a topology made by discovery alone gets.
DISCOVERED_NAME = "discovered"
#: The fields of a device the driver publishes (section 2); the rest are the topology's.
_PUBLISHED = ("bdf", "vendor_id", "device_id", "class_code", "dma_bits", "bars", "physfn")
#: The fields of an adapter the driver publishes; ``cpus`` and ``slot`` are the topology's.
_ADAPTER_FIELDS = ("model", "window_size", "segments", "lut_entries")


class Change(msgspec.Struct, frozen=True):
    """One thing the merge changed in the topology."""

    what: str  # "node", "adapter", "link" or "device"
    subject: str  # "gamma", "gamma:0", "gamma:0-beta:0", "0x40"
    action: str  # "added" or "updated"
    detail: str = ""

    def line(self) -> str:
        said = f"{self.action} {self.what} {self.subject}"
        return f"{said}: {self.detail}" if self.detail else said


class Merge(msgspec.Struct, frozen=True):
    """The merged topology (None when there are conflicts: nothing is to be merged), the
    changes, what was found but not merged (``notes``) and the conflicts."""

    node: str  # this host's node
    new_node: bool  # the topology had no node with the host's node id
    topology: Topology | None
    changes: tuple[Change, ...] = ()
    notes: tuple[str, ...] = ()
    conflicts: tuple[str, ...] = ()


def _size(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"


def _approx(n: int) -> str:
    """A host's RAM: in whole GiB when it is, else to one decimal (it rarely is)."""
    return _size(n) if n % GiB == 0 else f"{n / GiB:.1f}GiB"


def _show(field: str, value: object) -> str:
    if value is None:
        return "none"
    if field in ("vendor_id", "device_id"):
        return f"{value:04x}" if isinstance(value, int) else str(value)
    if field == "class_code":
        return f"{value:06x}" if isinstance(value, int) else str(value)
    if field == "physfn":
        return format_fdid(value) if isinstance(value, int) else str(value)
    if field == "window_size" and isinstance(value, int):
        return _size(value)
    if field == "bars" and isinstance(value, tuple):
        return ",".join(f"{b.index}:{_size(b.size)}:{b.kind.value}" for b in value) or "none"
    return str(value)


def _differences(old: msgspec.Struct, new: msgspec.Struct, fields: tuple[str, ...]) -> str:
    return "; ".join(
        f"{f.removesuffix('_id').removesuffix('_code')} {_show(f, getattr(old, f))}"
        f" -> {_show(f, getattr(new, f))}"
        for f in fields
        if getattr(old, f) != getattr(new, f)
    )


class _Merger:
    def __init__(self, current: Topology | None, host: FoundHost) -> None:
        self.current = current
        self.host = host
        self.changes: list[Change] = []
        self.notes: list[str] = []
        self.conflicts: list[str] = []

    # --- the node -------------------------------------------------------------------------
    def node(self, name: str | None, fallback: str) -> tuple[NodeSpec | None, bool]:
        """This host's node as the topology has it (found by node id), or a new one."""
        nodes = self.current.nodes if self.current is not None else ()
        known = next((n for n in nodes if n.node_id == self.host.node_id), None)
        if known is not None:
            if name is not None and name != known.name:
                self.conflicts.append(
                    f"this host is node {name} (--node or the configuration), but the driver's"
                    f" node id {self.host.node_id} is {known.name}'s in the topology: fix"
                    " one of them"
                )
            return known, False
        chosen = name or fallback
        if not _NAME_RE.fullmatch(chosen):
            self.conflicts.append(
                f"{chosen!r} is no node name (letters, digits, '.', '_' or '-'): name this"
                " host's node with --node"
            )
            return None, True
        other = next((n for n in nodes if n.name == chosen), None)
        if other is not None:
            self.conflicts.append(
                f"node {chosen} has node id {other.node_id} in the topology, but the driver"
                f" says this host is node id {self.host.node_id}: name this host's node with"
                " --node, or fix the id"
            )
            return None, True
        node = NodeSpec(
            name=chosen,
            node_id=self.host.node_id,
            hostname=self.host.hostname or chosen,
            ram=self.host.ram or 64 * GiB,
        )
        ram = _approx(node.ram) + ("" if self.host.ram else " (not known: the default)")
        detail = f"node id {node.node_id}, hostname {node.hostname}, RAM {ram}"
        self.changes.append(Change("node", chosen, "added", detail))
        return node, True

    # --- adapters -------------------------------------------------------------------------
    def adapters(self, node: NodeSpec) -> NodeSpec:
        by_index = {a.index: a for a in node.adapters}
        out = list(node.adapters)
        for found in sorted(self.host.adapters, key=lambda a: a.index):
            old = by_index.get(found.index)
            if old is None:
                new = AdapterSpec(
                    node=node.name,
                    index=found.index,
                    model=found.model,
                    window_size=found.window_size,
                    segments=found.segments,
                    lut_entries=found.lut_entries,
                )
                out.append(new)
                self.changes.append(
                    Change(
                        "adapter",
                        new.ref,
                        "added",
                        f"{new.model}, window {_size(new.window_size)} in {new.segments}"
                        f" segments, {new.lut_entries} LUT entries",
                    )
                )
                continue
            new = msgspec.structs.replace(
                old,
                model=found.model,
                window_size=found.window_size,
                segments=found.segments,
                lut_entries=found.lut_entries,
            )
            if new != old:
                out[out.index(old)] = new
                detail = _differences(old, new, _ADAPTER_FIELDS)
                self.changes.append(Change("adapter", new.ref, "updated", detail))
        seen = {a.index for a in self.host.adapters}
        for a in node.adapters:
            if a.index not in seen:
                self.notes.append(
                    f"kept adapter {a.ref}: the driver does not list it (remove it with a"
                    " topology file if it left the host)"
                )
        return msgspec.structs.replace(node, adapters=tuple(out))

    # --- cables ---------------------------------------------------------------------------
    def links(
        self, node: NodeSpec, nodes: list[NodeSpec], links: list[LinkSpec]
    ) -> list[LinkSpec]:
        by_id = {n.node_id: n for n in nodes}
        out = list(links)

        def cabled(ref: str) -> LinkSpec | None:
            return next((link for link in out if ref in link.ends), None)

        def where(link: LinkSpec) -> str:
            if link.switch is not None:
                return f"on switch {link.switch}"
            return "in cable " + "-".join(link.ends)

        for found in sorted(self.host.adapters, key=lambda a: a.index):
            ref = f"{node.name}:{found.index}"
            link = cabled(ref)
            if not found.link_up:
                if link is None:
                    self.notes.append(f"adapter {ref} has no link: nothing is known of its cable")
                continue
            if found.switch_port is not None:
                if link is None:
                    self.notes.append(
                        f"not merged: adapter {ref} is cabled to port {found.switch_port} of a"
                        " cluster switch, whose other ports the driver cannot see: declare the"
                        " switch in a topology file ([[switch]] ports = [...])"
                    )
                elif link.switch is None:
                    self.conflicts.append(
                        f"adapter {ref}: the driver sees a cable to port {found.switch_port} of"
                        f" a cluster switch, the topology has it {where(link)}"
                    )
                continue
            if found.peer is None:
                continue  # link without a peer the driver could name: nothing to merge
            peer_id, peer_index = found.peer
            peer_node = by_id.get(peer_id)
            if peer_node is None:
                self.notes.append(
                    f"not merged: adapter {ref}'s cable leads to node id {peer_id}, which no"
                    " node of the topology has: run 'vmlend fabric discover' there"
                )
                continue
            peer_ref = f"{peer_node.name}:{peer_index}"
            if not any(a.index == peer_index for a in peer_node.adapters):
                self.notes.append(
                    f"not merged: adapter {ref}'s cable leads to {peer_ref}, which is not in the"
                    f" topology: run 'vmlend fabric discover' on {peer_node.name}"
                )
                continue
            if link is not None:
                if link.switch is None and set(link.ends) == {ref, peer_ref}:
                    continue
                self.conflicts.append(
                    f"adapter {ref}: the driver sees a cable to {peer_ref}, the topology has"
                    f" it {where(link)}"
                )
                continue
            peer_link = cabled(peer_ref)
            if peer_link is not None:
                self.conflicts.append(
                    f"adapter {ref}: the driver sees a cable to {peer_ref}, which the topology"
                    f" has {where(peer_link)}"
                )
                continue
            new = LinkSpec(ends=(ref, peer_ref))
            # back-to-back cables before the switches, as a topology file lists them
            at = next((i for i, x in enumerate(out) if x.switch is not None), len(out))
            out.insert(at, new)
            self.changes.append(Change("link", new.names[0], "added", "back-to-back cable"))
        return out

    # --- devices --------------------------------------------------------------------------
    def devices(self, node: NodeSpec, devices: list[DeviceSpec]) -> list[DeviceSpec]:
        """This node's devices after the merge, each PF followed by its VFs."""
        others = {d.fdid: d for d in devices if d.lender != node.name}
        own = {d.fdid: d for d in devices if d.lender == node.name}
        order = [d.fdid for d in devices if d.lender == node.name]
        found = sorted(self.host.devices, key=lambda d: d.fdid)
        pf_lent = {d.fdid: d.lent for d in found if d.physfn is None}
        adapters = {a.index for a in node.adapters}
        for fd in found:
            other = others.get(fd.fdid)
            if other is not None:
                self.conflicts.append(
                    f"device {format_fdid(fd.fdid)}: the driver says it is installed here"
                    f" ({node.name} {fd.bdf}), the topology has it on {other.lender}"
                    f" ({other.bdf}): one fdid names one device"
                )
                continue
            if fd.adapter not in adapters:
                self.notes.append(
                    f"device {format_fdid(fd.fdid)} is reached through adapter {fd.adapter},"
                    " which the driver does not list"
                )
            old = own.get(fd.fdid)
            if old is None:
                own[fd.fdid] = new = _new_device(node.name, fd, pf_lent)
                order.append(fd.fdid)
                self.changes.append(
                    Change(
                        "device",
                        format_fdid(fd.fdid),
                        "added",
                        f"{new.kind} {new.bdf} {new.vendor_id:04x}:{new.device_id:04x}"
                        + (f", VF of {format_fdid(new.physfn)}" if new.physfn is not None else "")
                        + ("" if new.lent else ", unlent"),
                    )
                )
                continue
            new = msgspec.structs.replace(
                old,
                bdf=fd.bdf,
                vendor_id=fd.vendor_id,
                device_id=fd.device_id,
                class_code=fd.class_code,
                dma_bits=fd.dma_bits,
                bars=fd.bars,
                physfn=fd.physfn,
            )
            if (new.physfn is None) != (old.physfn is None):
                # 'vf' is the kind of an SR-IOV VF and of nothing else (the topology's rule)
                new = msgspec.structs.replace(
                    new,
                    kind=fd.kind,
                    intx_pin=0 if new.physfn is not None else 1,
                    lent=pf_lent.get(new.physfn, new.lent) if new.physfn is not None else new.lent,
                )
            if new != old:
                own[fd.fdid] = new
                detail = _differences(old, new, (*_PUBLISHED, "kind"))
                self.changes.append(Change("device", format_fdid(fd.fdid), "updated", detail))
        listed = {d.fdid for d in found}
        for fdid in order:
            if fdid not in listed:
                self.notes.append(
                    f"kept device {format_fdid(fdid)} ({own[fdid].bdf}): the driver does not"
                    " list it (remove it with a topology file if it left the host)"
                )
        self._check_functions(node, own)
        return _pf_then_vfs([own[f] for f in order])

    def _check_functions(self, node: NodeSpec, own: dict[int, DeviceSpec]) -> None:
        bdfs: dict[str, int] = {}
        for d in sorted(own.values(), key=lambda d: d.fdid):
            if d.bdf in bdfs:
                self.conflicts.append(
                    f"devices {format_fdid(bdfs[d.bdf])} and {format_fdid(d.fdid)} both have PCI"
                    f" address {d.bdf} on {node.name}"
                )
            bdfs.setdefault(d.bdf, d.fdid)
            if d.physfn is not None:
                pf = own.get(d.physfn)
                if pf is None or pf.physfn is not None:
                    self.conflicts.append(
                        f"device {format_fdid(d.fdid)} is a VF of {format_fdid(d.physfn)}, which"
                        f" is no physical function of {node.name}"
                    )


def _new_device(node: str, fd: FoundDevice, pf_lent: dict[int, bool]) -> DeviceSpec:
    vf = fd.physfn is not None
    return DeviceSpec(
        fdid=fd.fdid,
        lender=node,
        bdf=fd.bdf,
        kind="vf" if vf else ("pci" if fd.kind == "vf" else fd.kind),
        vendor_id=fd.vendor_id,
        device_id=fd.device_id,
        class_code=fd.class_code,
        bars=fd.bars,
        dma_bits=fd.dma_bits,
        intx_pin=0 if vf else 1,  # VFs have no INTx; a function's own pin is not published
        physfn=fd.physfn,
        # a topology lends a VF with its PF (sriov), whatever the driver says of each
        lent=pf_lent.get(fd.physfn, fd.lent) if fd.physfn is not None else fd.lent,
    )


def _pf_then_vfs(devices: list[DeviceSpec]) -> list[DeviceSpec]:
    """Each function followed by its VFs in fdid order, as a topology file's ``sriov`` lists
    them; VFs whose PF is missing last (a conflict already)."""
    vfs: dict[int, list[DeviceSpec]] = {}
    for d in devices:
        if d.physfn is not None:
            vfs.setdefault(d.physfn, []).append(d)
    out: list[DeviceSpec] = []
    for d in devices:
        if d.physfn is None:
            out.append(d)
            out.extend(sorted(vfs.pop(d.fdid, []), key=lambda v: v.fdid))
    out.extend(v for group in vfs.values() for v in group)
    return out


def merge_host(
    current: Topology | None,
    host: FoundHost,
    name: str | None = None,
    fallback: str = "",
) -> Merge:
    """``current`` with ``host`` merged in. ``name``: the node this host is said to be (for a
    new node, its name; for a known one, checked); ``fallback``: a new node's name otherwise
    (the short hostname)."""
    m = _Merger(current, host)
    fallback = fallback or host.hostname.split(".")[0]
    node, new_node = m.node(name, fallback)
    if node is None:
        return Merge(name or fallback, True, None, conflicts=tuple(m.conflicts))
    node = m.adapters(node)
    nodes = list(current.nodes) if current is not None else []
    if new_node:
        nodes.append(node)
    else:
        nodes = [node if n.name == node.name else n for n in nodes]
    links = m.links(node, nodes, list(current.links) if current is not None else [])
    devices = list(current.devices) if current is not None else []
    merged_own = m.devices(node, devices)
    # grouped by node in node order, as a topology file lists them
    by_node: dict[str, list[DeviceSpec]] = {n.name: [] for n in nodes}
    for d in devices:
        if d.lender != node.name:
            by_node[d.lender].append(d)
    by_node[node.name] = merged_own
    if m.conflicts:
        return Merge(node.name, new_node, None, tuple(m.changes), tuple(m.notes),
                     tuple(m.conflicts))  # fmt: skip
    topology = Topology(
        name=current.name if current is not None else DISCOVERED_NAME,
        nodes=tuple(nodes),
        links=tuple(links),
        devices=tuple(d for n in nodes for d in by_node[n.name]),
        source=current.source if current is not None else "<fabric discover>",
        switch_links=current.switch_links if current is not None else (),
    )
    return Merge(node.name, new_node, topology, tuple(m.changes), tuple(m.notes))
