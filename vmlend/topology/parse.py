"""Read and validate a topology file (TOML) into a ``Topology``.

Every error names the file and either the line (syntax) or the field path (meaning), e.g.
``cluster.toml: node[1] 'beta'.device[0].bars[1].size: not a power of two: 3000``.
Unknown keys are errors: a typo must not silently become a default.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from vmlend.errors import TopologyError
from vmlend.messages import plural
from vmlend.topology.chips import Chip, known_chips
from vmlend.topology.model import (
    AdapterSpec,
    BarKind,
    BarSpec,
    DeviceSpec,
    LinkSpec,
    MsiSpec,
    MsixSpec,
    NodeSpec,
    PcieElement,
    PcieKind,
    Topology,
)

_SIZE_RE = re.compile(r"^\s*(\d+)\s*(B|KiB|MiB|GiB|TiB)?\s*$")
_UNITS = {None: 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
BDF_RE = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-1][0-9a-f]\.[0-7]$")
_PINS = {"none": 0, "A": 1, "B": 2, "C": 3, "D": 4}

DEFAULT_TOPOLOGY = "default-topology.toml"

#: The largest physical address an x86-64 host decodes (52 bits): no RAM, BAR or NTB window
#: of a real host is larger, and sizes past it would overflow the address planning later.
MAX_ADDRESS = 1 << 52
#: A segment of an NTB window maps at least one page.
PAGE = 4096
#: A topology file is a description of hosts, not data: refuse what no fabric needs. 4,096
#: nodes of 16 devices each, written in the usual indented style, are ~17 MB (4 MiB refused
#: 1,024 such nodes); the cap leaves room for larger nodes and comments.
MAX_TOPOLOGY_BYTES = 64 << 20


class _Reader:
    """Walks the parsed TOML, tracking the field path for error messages."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, path: str, problem: str) -> TopologyError:
        return TopologyError(f"{self.source}: {path}" if path else self.source, problem)

    def table(self, value: Any, path: str, allowed: set[str], required: set[str]) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(path, f"expected a table, got {type(value).__name__}")
        unknown = sorted(set(value) - allowed)
        if unknown:
            raise self.fail(
                path, f"unknown key {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})"
            )
        missing = sorted(required - set(value))
        if missing:
            raise self.fail(path, f"missing required key {missing[0]!r}")
        return value

    def int_(self, value: Any, path: str, lo: int | None = None, hi: int | None = None) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(path, f"expected an integer, got {value!r}")
        if lo is not None and value < lo:
            raise self.fail(path, f"must be at least {lo}, got {value}")
        if hi is not None and value > hi:
            raise self.fail(path, f"must be at most {hi}, got {value}")
        return value

    def str_(self, value: Any, path: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.fail(path, f"expected a non-empty string, got {value!r}")
        return value

    def bool_(self, value: Any, path: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(path, f"expected true or false, got {value!r}")
        return value

    def size(
        self, value: Any, path: str, pow2: bool = False, lo: int = 1, hi: int = MAX_ADDRESS
    ) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            n = value
        elif isinstance(value, str) and (m := _SIZE_RE.match(value)):
            n = int(m.group(1)) * _UNITS[m.group(2)]
        else:
            raise self.fail(path, f'expected a size such as 4096 or "16MiB", got {value!r}')
        if n <= 0:
            raise self.fail(path, f"size must be positive, got {value!r}")
        if n < lo:
            raise self.fail(path, f"must be at least {_human(lo)}, got {value!r}")
        if n > hi:
            raise self.fail(
                path, f"must be at most {_human(hi)} (what a host can address), got {value!r}"
            )
        if pow2 and n & (n - 1):
            raise self.fail(path, f"not a power of two: {value!r}")
        return n

    def list_(self, value: Any, path: str) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(path, f"expected a list, got {type(value).__name__}")
        return value

    def chip(self, t: dict[str, Any], path: str) -> Chip | None:
        """``t``'s optional ``chip``, one of the chips whose latency vmlend knows."""
        if "chip" not in t:
            return None
        try:
            return Chip(t["chip"])
        except ValueError:
            raise self.fail(
                f"{path}.chip",
                f"unknown chip {t['chip']!r}: name one of {known_chips()} (the papers' figures)"
                " or leave chip out for the default",
            ) from None


def _human(n: int) -> str:
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if n >= _UNITS[unit] and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}"
    return f"{n}B"


def _bars(r: _Reader, raw: Any, path: str) -> tuple[BarSpec, ...]:
    bars: list[BarSpec] = []
    used: dict[int, str] = {}
    for i, b in enumerate(r.list_(raw, path)):
        p = f"{path}[{i}]"
        t = r.table(b, p, {"index", "size", "kind", "prefetch"}, {"index", "size"})
        index = r.int_(t["index"], f"{p}.index", 0, 5)
        kind_s = t.get("kind", "mem32")
        try:
            kind = BarKind(kind_s)
        except ValueError:
            raise r.fail(f"{p}.kind", f"expected io, mem32 or mem64, got {kind_s!r}") from None
        size = r.size(t["size"], f"{p}.size", pow2=True)
        if kind is BarKind.IO and size < 4:
            raise r.fail(f"{p}.size", "an I/O BAR is at least 4 bytes")
        if kind is not BarKind.IO and size < 16:
            raise r.fail(f"{p}.size", "a memory BAR is at least 16 bytes")
        if kind is BarKind.MEM32 and size > 1 << 31:
            raise r.fail(f"{p}.size", 'a 32-bit BAR cannot exceed 2GiB; use kind = "mem64"')
        slots = [index, index + 1] if kind is BarKind.MEM64 else [index]
        if kind is BarKind.MEM64 and index == 5:
            raise r.fail(f"{p}.index", "a 64-bit BAR needs two slots; index 5 has no pair")
        for s in slots:
            if s in used:
                raise r.fail(f"{p}.index", f"BAR slot {s} is already used by {used[s]}")
            used[s] = p
        prefetch = r.bool_(t.get("prefetch", False), f"{p}.prefetch")
        bars.append(BarSpec(index=index, size=size, kind=kind, prefetch=prefetch))
    return tuple(sorted(bars, key=lambda b: b.index))


def _msi(r: _Reader, raw: Any, path: str) -> MsiSpec:
    t = r.table(raw, path, {"vectors", "bits64", "maskable"}, set())
    vectors = r.int_(t.get("vectors", 1), f"{path}.vectors", 1, 32)
    if vectors & (vectors - 1):
        raise r.fail(f"{path}.vectors", f"MSI vector count must be a power of two, got {vectors}")
    return MsiSpec(
        vectors=vectors,
        bits64=r.bool_(t.get("bits64", True), f"{path}.bits64"),
        maskable=r.bool_(t.get("maskable", False), f"{path}.maskable"),
    )


def _msix(r: _Reader, raw: Any, path: str, bars: tuple[BarSpec, ...]) -> MsixSpec:
    t = r.table(
        raw,
        path,
        {"vectors", "table_bar", "table_offset", "pba_bar", "pba_offset"},
        {"vectors", "table_bar", "table_offset", "pba_bar", "pba_offset"},
    )
    vectors = r.int_(t["vectors"], f"{path}.vectors", 1, 2048)
    by_index = {b.index: b for b in bars}
    spec = MsixSpec(
        vectors=vectors,
        table_bar=r.int_(t["table_bar"], f"{path}.table_bar", 0, 5),
        table_offset=r.int_(t["table_offset"], f"{path}.table_offset", 0),
        pba_bar=r.int_(t["pba_bar"], f"{path}.pba_bar", 0, 5),
        pba_offset=r.int_(t["pba_offset"], f"{path}.pba_offset", 0),
    )
    for what, bar_i, off, length in (
        ("table", spec.table_bar, spec.table_offset, 16 * vectors),
        ("pba", spec.pba_bar, spec.pba_offset, 8 * ((vectors + 63) // 64)),
    ):
        bar = by_index.get(bar_i)
        if bar is None or bar.kind is BarKind.IO:
            raise r.fail(f"{path}.{what}_bar", f"BAR {bar_i} is not a memory BAR of this device")
        if off % 8:
            raise r.fail(f"{path}.{what}_offset", "must be 8-byte aligned")
        if off + length > bar.size:
            raise r.fail(
                f"{path}.{what}_offset",
                f"{what} ({length} bytes at {off:#x}) does not fit BAR {bar_i} ({bar.size} bytes)",
            )
    return spec


_DEVICE_KEYS = {
    "fdid", "bdf", "kind", "vendor", "device", "class", "bars", "dma_bits", "intx", "msi",
    "msix", "sriov", "lent", "slot",
}  # fmt: skip
_SRIOV_KEYS = {"vfs", "first_fdid", "device", "bars", "msix", "msi", "dma_bits"}


def _pcie(r: _Reader, raw: Any, path: str) -> tuple[PcieElement, ...]:
    """A host's PCIe tree: root ports on the root complex, switches and chassis below a
    parent declared before them (so there are no cycles)."""
    out: list[PcieElement] = []
    for i, item in enumerate(r.list_(raw, path)):
        p = f"{path}[{i}]"
        t = r.table(item, p, {"name", "kind", "parent", "chip"}, {"name", "kind"})
        name = r.str_(t["name"], f"{p}.name")
        if any(e.name == name for e in out):
            raise r.fail(f"{p}.name", f"duplicate PCIe element name {name!r}")
        kind_s = t["kind"]
        try:
            kind = PcieKind(kind_s)
        except ValueError:
            raise r.fail(
                f"{p}.kind", f"expected root-port, switch or chassis, got {kind_s!r}"
            ) from None
        parent = None
        chip = r.chip(t, p)
        if kind is PcieKind.ROOT_PORT:
            if "parent" in t:
                raise r.fail(f"{p}.parent", "a root port sits on the root complex: no parent")
            if chip is not None:
                raise r.fail(
                    f"{p}.chip", "a root port is part of the root complex, which has no chip"
                )
        else:
            if "parent" not in t:
                raise r.fail(f"{p}.parent", f"a {kind.value} needs a parent declared before it")
            parent = r.str_(t["parent"], f"{p}.parent")
            if not any(e.name == parent for e in out):
                known = ", ".join(e.name for e in out) or "none"
                raise r.fail(
                    f"{p}.parent", f"no PCIe element {parent!r} declared before it (known: {known})"
                )
        out.append(PcieElement(name, kind, parent, chip))
    return tuple(out)


def _slot(
    r: _Reader, t: dict[str, Any], path: str, elements: tuple[PcieElement, ...]
) -> str | None:
    if "slot" not in t:
        return None
    slot = r.str_(t["slot"], f"{path}.slot")
    if not any(e.name == slot for e in elements):
        known = ", ".join(e.name for e in elements) or "none (declare [[node.pcie]])"
        raise r.fail(f"{path}.slot", f"no PCIe element {slot!r} in this node (known: {known})")
    return slot


def _device(
    r: _Reader, raw: Any, path: str, lender: str, elements: tuple[PcieElement, ...] = ()
) -> list[DeviceSpec]:
    t = r.table(raw, path, _DEVICE_KEYS, {"fdid", "bdf", "kind", "vendor", "device", "class"})
    bdf = r.str_(t["bdf"], f"{path}.bdf").lower()
    if not BDF_RE.match(bdf):
        raise r.fail(f"{path}.bdf", f"expected a PCI address like 0000:41:00.0, got {bdf!r}")
    bars = _bars(r, t.get("bars", []), f"{path}.bars")
    pin_s = t.get("intx", "A")
    if pin_s not in _PINS:
        raise r.fail(f"{path}.intx", f"expected A, B, C, D or none, got {pin_s!r}")
    pf = DeviceSpec(
        fdid=r.int_(t["fdid"], f"{path}.fdid", 0, 0xFFFFFFFF),
        lender=lender,
        bdf=bdf,
        kind=r.str_(t["kind"], f"{path}.kind"),
        vendor_id=r.int_(t["vendor"], f"{path}.vendor", 0, 0xFFFE),
        device_id=r.int_(t["device"], f"{path}.device", 0, 0xFFFF),
        class_code=r.int_(t["class"], f"{path}.class", 0, 0xFFFFFF),
        bars=bars,
        dma_bits=r.int_(t.get("dma_bits", 64), f"{path}.dma_bits", 32, 64),
        intx_pin=_PINS[pin_s],
        msi=_msi(r, t["msi"], f"{path}.msi") if "msi" in t else None,
        msix=_msix(r, t["msix"], f"{path}.msix", bars) if "msix" in t else None,
        lent=r.bool_(t.get("lent", True), f"{path}.lent"),
        slot=_slot(r, t, path, elements),
    )
    out = [pf]
    if "sriov" in t:
        sp = f"{path}.sriov"
        s = r.table(t["sriov"], sp, _SRIOV_KEYS, {"vfs", "first_fdid", "device"})
        vfs = r.int_(s["vfs"], f"{sp}.vfs", 1, 256)
        first = r.int_(s["first_fdid"], f"{sp}.first_fdid", 0, 0xFFFFFFFF - vfs)
        vf_bars = _bars(r, s.get("bars", []), f"{sp}.bars")
        bus, rest = bdf.rsplit(":", 1)
        dev_no = int(rest.split(".")[0], 16)
        for i in range(vfs):
            # VFs follow the PF's function numbers (ARI-style routing), one function each.
            fn = i + 1
            vf_bdf = f"{bus}:{dev_no + fn // 8:02x}.{fn % 8}"
            out.append(
                DeviceSpec(
                    fdid=first + i,
                    lender=lender,
                    bdf=vf_bdf,
                    kind="vf",
                    vendor_id=pf.vendor_id,
                    device_id=r.int_(s["device"], f"{sp}.device", 0, 0xFFFF),
                    class_code=pf.class_code,
                    bars=vf_bars,
                    dma_bits=r.int_(s.get("dma_bits", pf.dma_bits), f"{sp}.dma_bits", 32, 64),
                    intx_pin=0,  # VFs have no INTx (SR-IOV spec)
                    msi=_msi(r, s["msi"], f"{sp}.msi") if "msi" in s else None,
                    msix=_msix(r, s["msix"], f"{sp}.msix", vf_bars) if "msix" in s else None,
                    physfn=pf.fdid,
                    lent=pf.lent,
                    slot=pf.slot,  # a VF is a function of its PF: same place in the tree
                )
            )
    return out


def _adapter(
    r: _Reader, raw: Any, path: str, node: str, elements: tuple[PcieElement, ...] = ()
) -> AdapterSpec:
    keys = {"index", "model", "window", "segments", "lut_entries", "cpus", "slot"}
    t = r.table(raw, path, keys, {"index"})
    a = AdapterSpec(
        node=node,
        index=r.int_(t["index"], f"{path}.index", 0, 15),
        model=r.str_(t.get("model", "PXH830"), f"{path}.model"),
        window_size=r.size(t.get("window", "128GiB"), f"{path}.window", pow2=True),
        segments=r.int_(t.get("segments", 32), f"{path}.segments", 1, 4096),
        lut_entries=r.int_(t.get("lut_entries", 32), f"{path}.lut_entries", 1, 4096),
        cpus=r.int_(t.get("cpus", 1), f"{path}.cpus", 0, 64),
        slot=_slot(r, t, path, elements),
    )
    if a.segments & (a.segments - 1):
        raise r.fail(f"{path}.segments", f"must be a power of two, got {a.segments}")
    if a.window_size // a.segments < PAGE:
        raise r.fail(
            f"{path}.window",
            f"{_human(a.window_size)} split into {a.segments} segments leaves less than a"
            f" {_human(PAGE)} page per segment; give at least {_human(a.segments * PAGE)}",
        )
    if a.lut_usable < 1:
        raise r.fail(
            f"{path}.lut_entries",
            f"{a.lut_entries} entries leave none after {plural(a.cpus, 'CPU')} reserve 2 each",
        )
    return a


def parse_topology(text: str, source: str = "<string>") -> Topology:
    import tomllib  # here, not above: opening a compiled topology (compiled.py) parses no TOML

    r = _Reader(source)
    if len(text) > MAX_TOPOLOGY_BYTES:
        raise TopologyError(
            source, f"{len(text)} characters is not a topology (at most {MAX_TOPOLOGY_BYTES})"
        )
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise TopologyError(source, f"not valid TOML: {e}") from None
    except RecursionError:  # tomllib recurses into nested arrays and inline tables
        raise TopologyError(source, "values are nested too deeply to be a topology") from None
    top = r.table(doc, "", {"name", "node", "link", "switch", "switch_link"}, {"node"})
    nodes: list[NodeSpec] = []
    devices: list[DeviceSpec] = []
    seen_ids: dict[int, str] = {}
    seen_fdids: dict[int, str] = {}
    for i, raw in enumerate(r.list_(top["node"], "node")):
        p = f"node[{i}]"
        node_keys = {"name", "id", "hostname", "ram", "adapter", "device", "pcie", "iommu"}
        t = r.table(raw, p, node_keys, {"name", "id"})
        name = r.str_(t["name"], f"{p}.name")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
            raise r.fail(f"{p}.name", f"use letters, digits, '.', '_' or '-', got {name!r}")
        p = f"node[{i}] {name!r}"
        if any(n.name == name for n in nodes):
            raise r.fail(f"{p}.name", f"duplicate node name {name!r}")
        node_id = r.int_(t["id"], f"{p}.id", 1, 0xFFFF)
        if node_id in seen_ids:
            raise r.fail(f"{p}.id", f"node id {node_id} is already used by {seen_ids[node_id]}")
        seen_ids[node_id] = name
        pcie = _pcie(r, t.get("pcie", []), f"{p}.pcie")
        adapters = tuple(
            _adapter(r, a, f"{p}.adapter[{j}]", name, pcie)
            for j, a in enumerate(r.list_(t.get("adapter", []), f"{p}.adapter"))
        )
        if len({a.index for a in adapters}) != len(adapters):
            raise r.fail(f"{p}.adapter", "adapter indexes must be unique within a node")
        bdfs: set[str] = set()
        for j, d in enumerate(r.list_(t.get("device", []), f"{p}.device")):
            for dev in _device(r, d, f"{p}.device[{j}]", name, pcie):
                if dev.fdid in seen_fdids:
                    raise r.fail(
                        f"{p}.device[{j}].fdid",
                        f"fdid {dev.fdid:#x} is already used by {seen_fdids[dev.fdid]}",
                    )
                if dev.bdf in bdfs:
                    raise r.fail(f"{p}.device[{j}].bdf", f"duplicate PCI address {dev.bdf}")
                seen_fdids[dev.fdid] = f"{name} {dev.bdf}"
                bdfs.add(dev.bdf)
                devices.append(dev)
        nodes.append(
            NodeSpec(
                name=name,
                node_id=node_id,
                hostname=r.str_(t.get("hostname", name), f"{p}.hostname"),
                adapters=adapters,
                ram=r.size(t.get("ram", "64GiB"), f"{p}.ram", lo=1 << 20),
                pcie=pcie,
                iommu=r.bool_(t.get("iommu", True), f"{p}.iommu"),
            )
        )
    refs = {a.ref for n in nodes for a in n.adapters}
    cabled: dict[str, str] = {}
    links: list[LinkSpec] = []

    def ends(raw: Any, path: str, where: str, minimum: int) -> tuple[str, ...]:
        items = [r.str_(x, f"{path}[{k}]") for k, x in enumerate(r.list_(raw, path))]
        if len(items) < minimum:
            raise r.fail(path, f'needs at least {minimum} adapter references like "alpha:0"')
        for k, ref in enumerate(items):
            if ref not in refs:
                raise r.fail(
                    f"{path}[{k}]", f"no adapter {ref!r} (known: {', '.join(sorted(refs))})"
                )
            if ref in cabled:
                raise r.fail(f"{path}[{k}]", f"adapter {ref} is already cabled in {cabled[ref]}")
            cabled[ref] = where
        return tuple(items)

    for i, raw in enumerate(r.list_(top.get("link", []), "link")):
        t = r.table(raw, f"link[{i}]", {"ends"}, {"ends"})
        pair = ends(t["ends"], f"link[{i}].ends", f"link[{i}]", 2)
        if len(pair) != 2:
            raise r.fail(f"link[{i}].ends", "a back-to-back link joins exactly two adapters")
        links.append(LinkSpec(ends=pair))
    for i, raw in enumerate(r.list_(top.get("switch", []), "switch")):
        keys = {"name", "ports", "chip", "requester_entries"}
        t = r.table(raw, f"switch[{i}]", keys, {"name", "ports"})
        sw = r.str_(t["name"], f"switch[{i}].name")
        # a port is named switch/toward (vmlend.topology.requesters) and its requester entries
        # are claimed under that name: a "/" or ":" would make it pass for another's, or for
        # an adapter's
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", sw):
            raise r.fail(f"switch[{i}].name", f"use letters, digits, '.', '_' or '-', got {sw!r}")
        if any(link.switch == sw for link in links):
            raise r.fail(f"switch[{i}].name", f"duplicate switch name {sw!r}")
        ports = ends(t["ports"], f"switch[{i}].ports", f"switch {sw}", 1)
        requesters = None
        if "requester_entries" in t:
            path = f"switch[{i}].requester_entries"
            requesters = r.int_(t["requester_entries"], path, 1, 65536)
        chip = r.chip(t, f"switch[{i}]")
        links.append(LinkSpec(ends=ports, switch=sw, chip=chip, requester_entries=requesters))
    switch_links = _switch_links(r, top.get("switch_link", []), links)
    for d in devices:
        if d.physfn is None and d.kind == "vf":
            raise r.fail(f"device {d.fdid:#x}", "kind 'vf' is reserved for SR-IOV VFs")
    return Topology(
        name=r.str_(top.get("name", Path(source).stem), "name"),
        nodes=tuple(nodes),
        links=tuple(links),
        devices=tuple(devices),
        source=source,
        switch_links=switch_links,
    )


def _switch_links(r: _Reader, raw: Any, links: list[LinkSpec]) -> tuple[tuple[str, str], ...]:
    """Cables between cluster switches: each joins two distinct declared switches, once."""
    switches = sorted(link.switch for link in links if link.switch)
    out: list[tuple[str, str]] = []
    for i, item in enumerate(r.list_(raw, "switch_link")):
        p = f"switch_link[{i}]"
        t = r.table(item, p, {"ends"}, {"ends"})
        ends = [r.str_(x, f"{p}.ends[{k}]") for k, x in enumerate(r.list_(t["ends"], f"{p}.ends"))]
        if len(ends) != 2:
            raise r.fail(f"{p}.ends", f"a switch link joins exactly two switches, got {len(ends)}")
        for k, sw in enumerate(ends):
            if sw not in switches:
                known = ", ".join(switches) or "none"
                raise r.fail(f"{p}.ends[{k}]", f"no switch {sw!r} (known: {known})")
        if ends[0] == ends[1]:
            raise r.fail(f"{p}.ends", f"switch {ends[0]} cannot be linked to itself")
        pair = (ends[0], ends[1]) if ends[0] < ends[1] else (ends[1], ends[0])
        if pair in out:
            raise r.fail(f"{p}.ends", f"switches {pair[0]} and {pair[1]} are already linked")
        out.append(pair)
    return tuple(out)


def load_topology(path: str | Path | None = None) -> Topology:
    """Load a topology file, or the shipped default cluster when ``path`` is None."""
    if path is None:
        from importlib import resources  # only the built-in default needs it

        text = resources.files("vmlend.data").joinpath(DEFAULT_TOPOLOGY).read_text()
        return parse_topology(text, f"<builtin {DEFAULT_TOPOLOGY}>")
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise TopologyError(str(p), f"cannot read: {e.strerror}") from None
    return parse_topology(text, str(p))
