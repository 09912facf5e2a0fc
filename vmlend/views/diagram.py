"""The fabric and a PCIe path as pictures: Graphviz DOT and Mermaid text (no dependency; a
viewer or ``dot -Tsvg`` draws them).

The fabric: one box per host with its NTB adapters (LUT entries and window segments in use)
and the devices it lends, filled by state and labelled with their holder; cables between
adapters, cluster switches and the links between switches. A path: its stages in order, boxed
by the host they sit in, with the root complexes and NTB adapters drawn apart, since they are
what a path costs.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from vmlend.ledger.admission import AdapterUsage
from vmlend.messages import single_line
from vmlend.topology.model import DeviceState, DeviceStatus, Topology
from vmlend.topology.pcie import Hop, PciePath, Stage

FORMATS = ("dot", "mermaid")

#: Fill colour per device state, the same in both formats.
STATE_FILL = {
    DeviceState.UNLENT: "#d9d9d9",
    DeviceState.AVAILABLE: "#b7e1a1",
    DeviceState.RESERVED: "#ffe08a",
    DeviceState.BORROWED: "#f4a582",
    DeviceState.UNAVAILABLE: "#d6604d",
}
#: Fill colour per host of a path, in order of appearance (the fabric's own stages: none).
HOST_FILL = ("#deebf7", "#fde0dd", "#e5f5e0", "#fff7bc", "#efedf5", "#fee6ce")
_SHAPE = {
    Hop.DEVICE: ("ellipse", "stadium"),
    Hop.ROOT_COMPLEX: ("doubleoctagon", "hexagon"),
    Hop.NTB: ("box3d", "subroutine"),
    Hop.CLUSTER_SWITCH: ("diamond", "rhombus"),
}


def _dot(text: str) -> str:
    """A DOT double-quoted string (a newline becomes a centred line break)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


#: What a Mermaid label would read as markup or an entity, as entity codes (``#`` first).
_MERMAID_ENTITIES = (("#", "#35;"), ('"', "#quot;"), ("<", "#lt;"), (">", "#gt;"))


def _mermaid(text: str) -> str:
    """A Mermaid quoted label: ``#``, quotes and angle brackets as entity codes (a name cannot
    close the label, spell an entity or bring HTML), a newline as a line break."""
    for char, code in _MERMAID_ENTITIES:
        text = text.replace(char, code)
    return '"' + text.replace("\n", "<br/>") + '"'


def _text(value: str) -> str:
    """A value from the registry or the topology inside a label: its newlines and other control
    characters escaped, so only the label's own line breaks break lines."""
    return single_line(value)


def _ident(prefix: str, name: str) -> str:
    """A Mermaid node id (letters, digits and underscores) that stays unique per name."""
    return prefix + "_" + "".join(c if c.isalnum() else f"_{ord(c):x}" for c in name)


def _adapter_label(ref: str, use: AdapterUsage | None) -> str:
    if use is None:
        return ref
    a = use.adapter
    return (
        f"{_text(ref)} {_text(a.model)}\nLUT {use.lut_used}/{a.lut_usable}"
        f"\nsegments {use.segments_used}/{a.segments}"
    )


def _device_label(st: DeviceStatus) -> str:
    who = f"\n{_text(str(st.holder))}" if st.holder is not None else ""
    return f"{st.fdid:#x} {st.spec.kind}\n{st.state.value}{who}"


def _switches(topology: Topology) -> list[str]:
    names = {link.switch for link in topology.links if link.switch}
    names |= {s for pair in topology.switch_links for s in pair}
    return sorted(names)


def _cables(topology: Topology) -> Iterable[tuple[str, str, bool]]:
    """(end, end, to_switch) for every cable: adapter to switch, or adapter to adapter."""
    for link in topology.links:
        if link.switch:
            for end in link.ends:
                yield end, link.switch, True
        else:
            for a, b in itertools.pairwise(link.ends):
                yield a, b, False


def fabric_dot(
    topology: Topology,
    statuses: Sequence[DeviceStatus],
    usage: dict[str, AdapterUsage],
    down: dict[str, str] | None = None,
) -> str:
    """The fabric as a DOT graph. ``down``: node -> reason, for nodes marked down."""
    down = down or {}
    by_lender: dict[str, list[DeviceStatus]] = {}
    for st in sorted(statuses, key=lambda s: s.fdid):
        by_lender.setdefault(st.spec.lender, []).append(st)
    out = [
        f"graph {_dot(topology.name)} {{",
        '  graph [fontname="Helvetica", compound=true];',
        '  node [fontname="Helvetica", shape=box, style="rounded,filled", fillcolor=white];',
    ]
    for n in topology.nodes:
        title = f"{_text(n.name)} (node {n.node_id})"
        if n.name in down:
            title += f"\nDOWN: {_text(down[n.name])}" if down[n.name] else "\nDOWN"
        out.append(f"  subgraph {_dot('cluster_' + n.name)} {{")
        style = "dashed" if n.name in down else "solid"
        out.append(f"    label={_dot(title)}; style={style};")
        for a in n.adapters:
            label = _adapter_label(a.ref, usage.get(a.ref))
            out.append(f"    {_dot(a.ref)} [label={_dot(label)}, shape=box3d, style=filled];")
        for st in by_lender.get(n.name, []):
            fill = STATE_FILL[st.state]
            out.append(
                f"    {_dot(f'{st.fdid:#x}')} [label={_dot(_device_label(st))},"
                f' fillcolor="{fill}"];'
            )
        out.append("  }")
    for s in _switches(topology):
        label = _dot(_text(s))
        out.append(f"  {_dot('switch ' + s)} [label={label}, shape=diamond, style=filled];")
    for end, other, to_switch in _cables(topology):
        out.append(f"  {_dot(end)} -- {_dot('switch ' + other if to_switch else other)};")
    for s, t in topology.switch_links:
        out.append(f"  {_dot('switch ' + s)} -- {_dot('switch ' + t)} [penwidth=2];")
    out.append("}")
    return "\n".join(out) + "\n"


def fabric_mermaid(
    topology: Topology,
    statuses: Sequence[DeviceStatus],
    usage: dict[str, AdapterUsage],
    down: dict[str, str] | None = None,
) -> str:
    """The fabric as a Mermaid flowchart (for Markdown viewers)."""
    down = down or {}
    out = ["flowchart LR"]
    for state, fill in STATE_FILL.items():
        out.append(f"  classDef {state.value} fill:{fill},stroke:#333")
    for n in topology.nodes:
        title = f"{_text(n.name)} (node {n.node_id})" + (" DOWN" if n.name in down else "")
        out.append(f"  subgraph {_ident('node', n.name)}[{_mermaid(title)}]")
        for a in n.adapters:
            label = _adapter_label(a.ref, usage.get(a.ref))
            out.append(f"    {_ident('ad', a.ref)}[[{_mermaid(label)}]]")
        for st in sorted(statuses, key=lambda s: s.fdid):
            if st.spec.lender == n.name:
                ident = _ident("dev", f"{st.fdid:x}")
                out.append(f"    {ident}({_mermaid(_device_label(st))}):::{st.state.value}")
        out.append("  end")
    for s in _switches(topology):
        out.append(f"  {_ident('sw', s)}{{{_mermaid(_text(s))}}}")
    for end, other, to_switch in _cables(topology):
        far = _ident("sw", other) if to_switch else _ident("ad", other)
        out.append(f"  {_ident('ad', end)} --- {far}")
    for s, t in topology.switch_links:
        out.append(f"  {_ident('sw', s)} === {_ident('sw', t)}")
    return "\n".join(out) + "\n"


def _hosts(stages: Sequence[Stage]) -> list[str]:
    seen: list[str] = []
    for s in stages:
        if s.node and s.node not in seen:
            seen.append(s.node)
    return seen


def _path_title(path: PciePath, sep: str = ": ") -> str:
    return (
        f"{path.src} -> {path.dst}{sep}{path.hops} hops, {path.roots} root complex(es),"
        f" {path.ntb_crossings} NTB crossing(s), about {path.latency_ns} ns"
    )


#: Stages per row of a drawn path. One row per path was 4,900 pt wide for the 21 hops of
#: ``0x10 0x20 --via gamma``; rows of three keep every path of the shipped topology under
#: 900 pt (830 for that one).
ROW_STAGES = 3

#: A stretch of a path in one place (a host, or ``""``: the cluster switches between hosts)
#: and its stages' indexes, row by row.
Run = tuple[str, list[list[int]]]


def fold(stages: Sequence[Stage], per_row: int = ROW_STAGES) -> list[Run]:
    """How a path is drawn: its runs of consecutive stages in one place, each in rows of at most
    ``per_row`` as even as can be (8 stages: 3, 3, 2). A host the path passes twice has two
    runs; no row holds two runs' stages, so the hosts' boxes stack without overlapping."""
    runs: list[Run] = []
    for host, group in itertools.groupby(range(len(stages)), key=lambda i: stages[i].node):
        run = list(group)
        count = -(-len(run) // per_row)
        size, extra = divmod(len(run), count)
        rows: list[list[int]] = []
        for k in range(count):
            start = k * size + min(k, extra)
            rows.append(run[start : start + size + (1 if k < extra else 0)])
        runs.append((host, rows))
    return runs


def path_dot(path: PciePath) -> str:
    """A path as a DOT digraph folded to about a page wide: rows of at most ``ROW_STAGES``
    stages, read left to right and top to bottom like text, each host's rows boxed in its
    colour (a host passed twice: two boxes, one colour)."""
    hosts = _hosts(path.stages)
    fill = {h: HOST_FILL[i % len(HOST_FILL)] for i, h in enumerate(hosts)}
    title = _dot(_path_title(path, "\n"))  # two lines: one would be the widest row
    out = [
        "digraph path {",
        f'  graph [fontname="Helvetica", labelloc=t, label={title}];',
        '  node [fontname="Helvetica", shape=box, style=filled];',
    ]

    def node(i: int) -> str:
        s = path.stages[i]
        shape = _SHAPE.get(s.kind, ("box", ""))[0]
        label = f"{_text(s.name)}\n{s.kind.value}"
        return f"s{i} [label={_dot(label)}, shape={shape}, fillcolor=white];"

    runs = fold(path.stages)
    for n, (host, rows) in enumerate(runs):
        indent = "    " if host else "  "
        if host:
            out.append(f"  subgraph {_dot(f'cluster_{n}_{host}')} {{")
            out.append(f'    label={_dot(_text(host))}; style=filled; fillcolor="{fill[host]}";')
        for row in rows:
            out += [f"{indent}{node(i)}" for i in row]
            out.append(f"{indent}{{ rank=same; {' '.join(f's{i};' for i in row)} }}")
        if host:
            out.append("  }")
    # Heavy invisible edges between the rows' first stages keep them in one column, so every
    # row starts at the left; without them each row starts under the end of the one before
    # and the drawing drifts sideways (1,984 pt instead of 830 for 0x10 0x20 --via gamma).
    starts = [row[0] for _, rows in runs for row in rows]
    out += [f"  s{a} -> s{b} [style=invis, weight=10];" for a, b in itertools.pairwise(starts)]
    out += [f"  s{a} -> s{a + 1};" for a in range(len(path.stages) - 1)]
    out.append("}")
    return "\n".join(out) + "\n"


def path_mermaid(path: PciePath) -> str:
    """A path as a Mermaid flowchart, top to bottom (a column about a page wide: Mermaid has no
    rows to fold it into), each host a subgraph (a host passed twice: two)."""

    def node(i: int) -> str:
        s = path.stages[i]
        label = _mermaid(f"{_text(s.name)}\n{s.kind.value}")
        shape = _SHAPE.get(s.kind, ("", ""))[1]
        opening, closing = {
            "stadium": ("([", "])"),
            "hexagon": ("{{", "}}"),
            "subroutine": ("[[", "]]"),
            "rhombus": ("{", "}"),
        }.get(shape, ("[", "]"))
        return f"s{i}{opening}{label}{closing}"

    out = ["flowchart TB", f"  %% {_text(_path_title(path))}"]
    for n, (host, rows) in enumerate(fold(path.stages)):
        stages = [i for row in rows for i in row]
        if not host:
            out += [f"  {node(i)}" for i in stages]
            continue
        out.append(f"  subgraph {_ident(f'run{n}', host)}[{_mermaid(_text(host))}]")
        out += [f"    {node(i)}" for i in stages]
        out.append("  end")
    out += [f"  s{a} --> s{a + 1}" for a in range(len(path.stages) - 1)]
    return "\n".join(out) + "\n"
