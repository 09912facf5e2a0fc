"""The demo's text report: a heading per step and small tables, rendered from the step's data
(the same data ``--json`` prints), never from live objects."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vmlend.demo.nvmeshare import render_nvme_share
from vmlend.demo.story import StepResult
from vmlend.units import format_size_exact
from vmlend.views.table import render_table

Json = dict[str, Any]


def size(n: int) -> str:
    return format_size_exact(n)


def span(start: int, end: int) -> str:
    return f"{start:#x}-{end:#x}"


def entries(counts: dict[str, int]) -> str:
    return " ".join(f"{n}x{page}" for page, n in counts.items() if n) or "-"


def hooks_table(hooks: list[Json]) -> str:
    rows = [[h["node"], " ".join(h["argv"]), h["exit"], f"{h['ms']:.0f}"] for h in hooks]
    return render_table(("NODE", "HOOK CALL (argv; domain XML on stdin)", "EXIT", "MS"), rows)


def devices_table(devices: list[Json], extra: str | None = None) -> str:
    headers = ["FDID", "KIND", "LENDER", "STATE", "HOLDER", "MDEV"]
    if extra:
        headers.append(extra.upper())
    rows = []
    for d in devices:
        row = [d["fdid"], d["kind"], d["lender"], d["state"], d["holder"] or "-", d["mdev"] or "-"]
        if extra:
            row.append(d.get(extra, "-"))
        rows.append(row)
    return render_table(headers, rows)


def adapters_table(adapters: list[Json]) -> str:
    rows = [
        [
            a["adapter"],
            f"{a['lut_claimed']}/{a['lut_usable']}",
            f"{a['segments_claimed']}/{a['segments']} x {size(a['segment_size'])}",
            a["lut_entries"],
            a["segments_mapped"],
        ]
        for a in adapters
    ]
    headers = ("ADAPTER", "LUT CLAIMED", "SEGMENTS CLAIMED", "LUT ENTRIES SET", "SEGMENTS MAPPED")
    return render_table(headers, rows)


def windows_table(windows: list[Json]) -> str:
    rows = []
    for w in windows:
        segments = w.get("segments") or []
        rows.append(
            [
                w["fdid"],
                w["key"],
                span(w["gpa_start"], w["gpa_end"]),
                w.get("adapter") or "local",
                ",".join(str(i) for i in segments) or "-",
                entries(w.get("iommu_entries", {})),
                entries(w.get("lender_entries", {})),
            ]
        )
    headers = ("DEVICE", "WINDOW", "GUEST RAM", "ADAPTER", "SEGMENTS", "BORROWER IOMMU", "LENDER")
    return render_table(headers, rows)


def vectors_table(vectors: list[Json], counts: bool = False) -> str:
    headers = ["DEVICE", "MODE", "VECTORS", "PATH"]
    if counts:
        headers += ["RAISED", "RECEIVED"]
    rows = []
    for v in vectors:
        row = [v["fdid"], v["mode"], v["vectors"], v["path"]]
        if counts:
            row += [v["raised"], v["received"]]
        rows.append(row)
    return render_table(headers, rows)


def p2p_table(maps: list[Json]) -> str:
    """One row per source/target pair (the BARs of the target together)."""
    pairs: dict[tuple[str, str], list[Json]] = {}
    for m in maps:
        pairs.setdefault((m["source"], m["target"]), []).append(m)
    rows = []
    for (src, dst), group in pairs.items():
        m = group[0]
        rows.append(
            [
                f"{src} -> {dst}",
                ",".join(str(g["bar"]) for g in group),
                m["case"],
                f"{m['source_node']} -> {m['target_node']}",
                f"hops {m['hops']}, roots {m['roots']}, NTB crossings {m['ntb_crossings']}",
            ]
        )
    return render_table(("PEERS", "BARS", "CASE", "LENDERS", "ROUTE"), rows)


def hops_table(target: Json) -> str:
    rows = [[h["stage"], h["node"], f"{h['address']:#x}", h["detail"]] for h in target["hops"]]
    return render_table(("HOP", "NODE", "ADDRESS", "DETAIL"), rows)


def dma_line(d: Json) -> str:
    verdict = "the guest read the same bytes" if d["match"] else "MISMATCH"
    return (
        f"device {d['device']} DMA-wrote {d['bytes']} bytes at guest {d['gpa']:#x}"
        f" ({d['pages']} pages); host page {d['host_page']:#x}; {verdict}"
    )


def p2p_rows(writes: list[Json]) -> str:
    rows = []
    for w in writes:
        hops = w["target_hops"]["hops"]
        nodes = list(dict.fromkeys(h["node"] for h in hops))  # in the order the write passes
        rows.append(
            [
                f"{w['source']} -> {w['target']}",
                w["bar"],
                f"{w['gpa']:#x}",
                w["bytes"],
                " > ".join(nodes),
                " > ".join(h["stage"] for h in hops),
                "yes" if w["landed"] else "NO",
            ]
        )
    headers = ("PEER WRITE", "BAR", "GUEST ADDRESS", "BYTES", "NODES", "STAGES", "LANDED")
    return render_table(headers, rows)


# --- one renderer per step -----------------------------------------------------------------------


def _fabric(d: Json) -> str:
    f = d["fabric"]
    lines = [
        f"{d['action']}: state {d['state']} with the default cluster ({len(f['nodes'])} nodes,"
        f" {len(d['devices'])} devices); we act as node {d['local_node']}, the borrower"
    ]
    if d["cleaned_up"]:
        lines.append("left by an earlier run, removed: " + "; ".join(d["cleaned_up"]))
    node_rows = []
    for n in f["nodes"]:
        for a in n["adapters"] or [{}]:
            node_rows.append(
                [
                    n["name"],
                    n["id"],
                    size(n["ram"]),
                    ",".join(n["devices"]) or "-",
                    a.get("ref", "-"),
                    f"{a.get('lut_used', 0)}/{a.get('lut_usable', 0)}",
                    f"{a.get('segments', 0)} x {size(a.get('segment_size', 0))}",
                ]
            )
    headers = ("NODE", "ID", "RAM", "LENDS", "ADAPTER", "LUT USED", "WINDOW")
    dev_rows = [
        [
            x["fdid"],
            x["lender"],
            x["kind"] if not x["physfn"] else f"vf of {x['physfn']}",
            ",".join(size(b["size"]) for b in x["bars"]),
            f"{x['dma_bits']}-bit",
            x["state"],
        ]
        for x in d["devices"]
    ]
    links = "; ".join(f"switch {link['switch']}: {', '.join(link['ends'])}" for link in f["links"])
    return "\n\n".join(
        [
            "\n".join(lines),
            render_table(headers, node_rows),
            f"links: {links}",
            render_table(("FDID", "LENDER", "KIND", "BARS", "DMA", "STATE"), dev_rows),
        ]
    )


def _xml(d: Json) -> str:
    ram = ", ".join(span(a, b) for a, b in d["ram"])
    lib = d["libvirt"]
    attrs = {k: v for h in lib["hostdevs"] for k, v in h.items()}
    rows = [[x["fdid"], x["lender"], x["mdev"]] for x in d["devices"]]
    return "\n\n".join(
        [
            f"VM {d['name']} ({d['uuid']}): {d['machine']}, {size(d['memory'])} RAM at {ram}",
            render_table(("FDID", "LENDER", "MDEV (derived from the VM UUID and the fdid)"), rows),
            f"libvirt's test driver defined {lib['name']!r} on a fresh connection:\n  {lib['uri']}"
            f"\n  it kept the {len(lib['mdevs'])} mdev hostdevs and vmlend's metadata, adding"
            f" {' '.join(f'{k}={v!r}' for k, v in attrs.items() if k in ('managed', 'display'))}",
        ]
    )


def _start(d: Json) -> str:
    return "\n\n".join(
        [
            f"defined and started on {d['uri']}; the hook ran as libvirtd runs it:",
            hooks_table(d["hooks"]),
            "devices reserved and mdevs created; nothing borrowed until the guest enables them:",
            devices_table(d["devices"]),
            adapters_table(d["adapters"]),
        ]
    )


def _enable(d: Json) -> str:
    return "\n\n".join(
        [
            "memory decoding on: the deferred borrow; Bus Master on: the DMA windows",
            devices_table(d["devices"]),
            windows_table(d["windows"]),
            vectors_table(d["vectors"]),
            f"peer-to-peer: {len(d['p2p'])} BAR maps, each at the BAR's guest-physical address",
            p2p_table(d["p2p"]),
            adapters_table(d["adapters"]),
            "meanwhile `vmlend status` (another process, the shared state) shows:",
            d["status"],
        ]
    )


def _traffic(d: Json) -> str:
    (dma,) = d["dma"]
    fault = d["fault"]
    return "\n\n".join(
        [
            dma_line(dma),
            hops_table(dma["target"]),
            p2p_rows(d["p2p"]),
            f"device {fault['device']} DMA into the PCI hole at {fault['gpa']:#x}: fault at"
            f" {fault['hop']} ({fault['why']})",
            vectors_table(d["interrupts"], counts=True),
            *_failover(d.get("failover") or {}),
        ]
    )


def _failover(f: Json) -> list[str]:
    if not f.get("link"):
        return []
    return [
        f"link {f['link']} down: device {f['device']} re-routed from {f['was']} to {f['now']};"
        f" {dma_line(f['dma'])}; link back up ({', '.join(f['after_up']) or 'nothing to do'})"
    ]


def _hotplug(d: Json) -> str:
    checks = ", ".join(c["name"] if c["ok"] else f"{c['name']} FAILED" for c in d["checks"])
    ads = d["adapters"]
    rows = []
    for before, added, after in zip(ads["before"], ads["attached"], ads["after"], strict=True):
        if before == added == after:
            continue
        rows.append(
            [
                before["adapter"],
                f"{before['lut_claimed']} -> {added['lut_claimed']} -> {after['lut_claimed']}",
                f"{before['lut_entries']} -> {added['lut_entries']} -> {after['lut_entries']}",
                f"{before['segments_claimed']} -> {added['segments_claimed']}"
                f" -> {after['segments_claimed']}",
            ]
        )
    irq = d["interrupts"][0]
    return "\n\n".join(
        [
            f"vmlend attach {d['device']} ({d['kind']} from {d['lender']}) --live"
            f"\n  admission checks passed: {checks}",
            "\n".join(f"  {s}" for s in d["steps"]),
            windows_table(d["windows"]),
            dma_line(d["dma"]),
            f"{irq['mode']} x{irq['vectors']} via {irq['path']}: raised {irq['raised']},"
            f" received {irq['received']}",
            "accounting: before -> with the VF -> after the detach",
            render_table(("ADAPTER", "LUT CLAIMED", "LUT ENTRIES SET", "SEGMENTS CLAIMED"), rows),
            f"vmlend detach {d['device']}: returned to the fabric, now {d['state_after']}",
        ]
    )


def _migrate(d: Json) -> str:
    dmas = "\n".join(
        dma_line(x)
        + f"\n  path: {' > '.join(h['stage'] + '@' + h['node'] for h in x['target']['hops'])}"
        for x in d["dma"]
    )
    return "\n\n".join(
        [
            f"vmlend migrate {d['from']} -> {d['to']}:",
            "\n".join(f"  {s}" for s in d["steps"]),
            hooks_table(d["hooks"]),
            devices_table(d["devices"], extra="path"),
            windows_table(d["windows"]),
            dmas,
            p2p_rows(d["p2p_write"]),
            vectors_table(d["interrupts"], counts=True),
        ]
    )


def _stop(d: Json) -> str:
    left = d["left"]
    rows = [[k.replace("_", " "), v] for k, v in left.items()]
    return "\n\n".join(
        [
            f"shut down on {d['uri']}:",
            hooks_table(d["hooks"]),
            render_table(("STILL IN USE", "COUNT"), rows),
            devices_table(d["devices"]),
            f"the VM stays defined (stopped) on {d['defined_on']}; see it with"
            f" `vmlend --state {d['state']} status -c sim:///{d['defined_on']}`",
        ]
    )


RENDERERS: dict[str, Callable[[Json], str]] = {
    "fabric": _fabric,
    "xml": _xml,
    "start": _start,
    "enable": _enable,
    "traffic": _traffic,
    "hotplug": _hotplug,
    "migrate": _migrate,
    "stop": _stop,
    "nvme-share": render_nvme_share,
}


def render_step(result: StepResult) -> str:
    """The heading and body of one step (a failed step: its one-line error)."""
    head = f"== {result.n}. {result.title}  ({result.seconds:.1f} s)"
    if not result.ok:
        return f"{head}\nFAILED: {result.error}"
    render = RENDERERS.get(result.key)
    body = render(result.data) if render else ""
    return f"{head}\n\n{body}" if body else head
