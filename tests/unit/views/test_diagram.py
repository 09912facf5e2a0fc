"""The fabric and a path as pictures: DOT that Graphviz draws (a long path folded into rows
about a page wide), Mermaid with one node per stage, the device states and holders visible,
and the same numbers as the text."""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess

import msgspec
import pytest
from hypothesis import given, strategies
from lxml import etree

from tests.support.cli_cluster import GAMMA
from tests.support.paths import REPO
from vmlend.topology.model import DeviceState, Holder
from vmlend.topology.pcie import Hop, PciePath, Stage, explain
from vmlend.views.diagram import (
    STATE_FILL,
    fabric_dot,
    fabric_mermaid,
    fold,
    path_dot,
    path_mermaid,
)

DOT = shutil.which("dot")
#: About a page: the widest a path's drawing may be at its natural size (one row was 4,900).
PAGE_PT = 1000.0


def _draws(dot_text: str) -> str:
    """Graphviz's SVG of ``dot_text``: a syntax error fails the test with dot's message."""
    assert DOT, "Graphviz's dot is missing: 'make sysdeps' installs it (apt: graphviz)"
    run = subprocess.run([DOT, "-Tsvg"], input=dot_text, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stdout


def _fabric(cluster):
    cluster.define("gamma", "web", [0x10, 0x20], running=True)
    with cluster.fabric() as f:
        f.unlend(0x25)
        return f.topology(), f.devices(), f.usage()


def test_the_fabric_draws_with_every_device_in_the_colour_of_its_state(cluster):
    topo, statuses, usage = _fabric(cluster)
    text = fabric_dot(topo, statuses, usage)
    svg = _draws(text)
    for st in statuses:
        assert f"{st.fdid:#x} {st.spec.kind}" in svg
        assert f'"{f"{st.fdid:#x}"}" [label=' in text
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(f'"{st.fdid:#x}"'))
        assert STATE_FILL[st.state] in line
    states = {st.fdid: st.state for st in statuses}
    assert states[0x10] is DeviceState.RESERVED and states[0x25] is DeviceState.UNLENT
    assert "gamma/web" in svg  # the holder is written on its devices
    for a in topo.adapters():
        assert f"LUT {usage[a.ref].lut_used}/{a.lut_usable}" in svg


def test_a_node_marked_down_is_drawn_dashed_with_its_reason(cluster):
    topo, statuses, usage = _fabric(cluster)
    text = fabric_dot(topo, statuses, usage, {"beta": 'power "lost"'})
    svg = _draws(text)
    assert "DOWN: power" in svg
    beta = text[text.index('"cluster_beta"') :]
    assert "style=dashed" in beta.splitlines()[1]


def test_names_with_quotes_cannot_break_out_of_a_label(cluster):
    topo, statuses, usage = _fabric(cluster)
    odd = msgspec.structs.replace(topo, name='fab"ric\\ } graph { x')
    _draws(fabric_dot(odd, statuses, usage))


@pytest.mark.parametrize(("src", "dst", "via"), [("0x10", "0x11", None), ("0x10", "0x20", "gamma")])
def test_a_path_draws_every_stage_once_in_order(cluster, src, dst, via):
    with cluster.fabric() as f:
        path = explain(f.topology(), src, dst, via)
    svg = _draws(path_dot(path))
    assert f"{path.hops} hops, {path.roots} root complex(es)" in svg
    mermaid = path_mermaid(path)
    nodes = re.findall(r"^\s+(s\d+)[\[\(\{]", mermaid, re.MULTILINE)
    assert nodes == sorted(set(nodes), key=nodes.index)  # each stage declared once
    assert sorted(nodes, key=lambda n: int(n[1:])) == [f"s{i}" for i in range(len(path.stages))]
    edges = re.findall(r"^\s+(s\d+) --> (s\d+)$", mermaid, re.MULTILINE)
    assert edges == [(f"s{i}", f"s{i + 1}") for i in range(len(path.stages) - 1)]
    assert mermaid.count("subgraph") == mermaid.count("\n  end")
    roots = [s for s in path.stages if s.kind is Hop.ROOT_COMPLEX]
    assert mermaid.count("{{") == len(roots)  # root complexes stand out


def test_the_mermaid_fabric_has_one_box_per_host_and_every_cable(cluster):
    topo, statuses, usage = _fabric(cluster)
    text = fabric_mermaid(topo, statuses, usage)
    assert text.count("subgraph") == len(topo.nodes)
    assert text.count(" --- ") == sum(len(link.ends) for link in topo.links if link.switch)
    for st in statuses:
        assert f":::{st.state.value}" in text


def test_the_cli_draws_and_refuses_two_outputs_at_once(cluster):
    r = cluster.cli("fabric", "show", "--format", "dot")
    assert r.exit_code == 0, r.output
    _draws(r.stdout)
    r = cluster.cli("path", "0x10", "0x20", "--format", "mermaid")
    assert r.exit_code == 0 and r.stdout.startswith("flowchart TB")
    r = cluster.cli("path", "0x10", "0x20", "--format", "dot", "--json")
    assert r.exit_code == 2 and "exclusive" in r.output
    assert cluster.cli("fabric", "show", "--format", "svg", *GAMMA).exit_code == 2


def test_a_holders_name_cannot_break_out_of_its_label(cluster):
    topo, statuses, usage = _fabric(cluster)
    evil = 'web"]\n  x[<img src=x onerror=alert(1)>] #quot; %%'
    held = [msgspec.structs.replace(st, holder=Holder("gamma", evil)) for st in statuses]
    mermaid = fabric_mermaid(topo, held, usage)
    assert "<img" not in mermaid and 'web"' not in mermaid and "#quot; %%" not in mermaid
    assert not any(line.startswith("  x[") for line in mermaid.splitlines())
    label = 'gamma/web#quot;]\\n  x[#lt;img src=x onerror=alert(1)#gt;] #35;quot; %%"'
    assert mermaid.count(label) == len(held)
    dot = fabric_dot(topo, held, usage)
    assert "gamma/web\\\"]\\\\n  x[<img" in dot  # the name's newline: a backslash and an n
    _draws(dot)


def _nodes(svg: str) -> tuple[float, dict[str, tuple[float, float, list[str]]]]:
    """The drawing's natural width in points (its viewBox; dot's ``width`` says the same) and
    each node's place (where its label starts, x and y, y growing downwards) and label lines,
    by node id."""
    root = etree.fromstring(svg.encode())
    width = float(root.get("viewBox").split()[2])
    assert float(root.get("width").removesuffix("pt")) == pytest.approx(width, abs=1)
    ns = {"svg": "http://www.w3.org/2000/svg"}
    nodes = {}
    for node in root.iterfind(".//svg:g[@class='node']", ns):
        texts = node.findall("svg:text", ns)
        where = float(texts[0].get("x")), float(texts[0].get("y"))
        nodes[node.findtext("svg:title", namespaces=ns)] = (*where, [t.text for t in texts])
    return width, nodes


def _assert_folded(path: PciePath) -> float:
    """``path`` drawn by Graphviz: every stage and every step between two once, rows read left
    to right and top to bottom as ``fold`` says, at most a page wide. Its width."""
    svg = _draws(path_dot(path))
    width, nodes = _nodes(svg)
    assert sorted(nodes) == sorted(f"s{i}" for i in range(len(path.stages)))
    for i, s in enumerate(path.stages):
        assert nodes[f"s{i}"][2] == [s.name, s.kind.value]
    for i in range(len(path.stages) - 1):
        assert f"<title>s{i}&#45;&gt;s{i + 1}</title>" in svg
    rows = [row for _, run in fold(path.stages) for row in run]
    for row in rows:
        xs = [nodes[f"s{i}"][0] for i in row]
        assert xs == sorted(xs), row  # left to right
        assert len({nodes[f"s{i}"][1] for i in row}) == 1, row  # on one line
    tops = [nodes[f"s{row[0]}"][1] for row in rows]
    assert tops == sorted(tops) and len(set(tops)) == len(tops)  # each row below the last
    assert width <= PAGE_PT, f"{width} pt wide for {len(path.stages)} stages"
    return width


@pytest.mark.parametrize(
    ("src", "dst", "via", "hops"),
    [
        ("0x10", "0x11", None, 7),
        ("0x10", "gamma", None, 11),
        ("0x10", "0x20", None, 17),
        ("0x10", "0x20", "gamma", 21),
        ("0x10", "0x11", "gamma", None),  # alpha twice: out to gamma's RAM and back
    ],
)
def test_a_path_is_folded_into_rows_about_a_page_wide(cluster, src, dst, via, hops):
    with cluster.fabric() as f:
        path = explain(f.topology(), src, dst, via)
    assert hops is None or path.hops == hops
    _assert_folded(path)


def test_the_shipped_path_pictures_are_about_a_page_wide():
    pictures = sorted((REPO / "docs" / "pictures").glob("path-*.svg"))
    assert len(pictures) == 2  # draw.sh's path-local-p2p.svg and path-via-ram.svg
    for picture in pictures:
        width, nodes = _nodes(picture.read_text())
        assert nodes and width <= PAGE_PT, f"{picture.name}: {width} pt wide"


def _generated_path(depth: int, switches: int) -> PciePath:
    """Device to device through the RAM of a third host, longer than any the shipped topology
    has: each device ``depth`` expansion chassis deep, ``switches`` cluster switches each way."""

    def chassis(host: str) -> list[Stage]:  # from the device up to its host's root complex
        out = [Stage(Hop.DEVICE, f"gpu of {host}", host)]
        for k in range(depth, 0, -1):
            out += [
                Stage(Hop.CHASSIS, f"chassis{k} switch", host),
                Stage(Hop.CHASSIS_LINK, f"chassis{k} link adapter", host),
                Stage(Hop.HOST_LINK, f"host link adapter to chassis{k}", host),
            ]
        return [*out, Stage(Hop.ROOT_COMPLEX, f"{host} root complex via rp1", host)]

    def fabric() -> list[Stage]:
        return [Stage(Hop.CLUSTER_SWITCH, f"mxs824-{k}", "") for k in range(switches)]

    def ntb(host: str) -> Stage:
        return Stage(Hop.NTB, f"{host}:0", host)

    ram = [ntb("gamma"), Stage(Hop.ROOT_COMPLEX, "gamma root complex via rp1", "gamma")]
    there = [*chassis("alpha"), ntb("alpha"), *fabric(), *ram, ntb("gamma"), *fabric()]
    stages = (*there, ntb("beta"), *reversed(chassis("beta")))
    return PciePath("device 0x10", "device 0x20 via RAM of gamma", stages)


def test_a_generated_path_twice_as_long_as_the_shipped_ones_is_no_wider():
    path = _generated_path(depth=6, switches=3)
    assert path.hops > 2 * 21
    _assert_folded(path)


def test_a_host_passed_twice_is_two_boxes_of_one_colour(cluster):
    with cluster.fabric() as f:
        path = explain(f.topology(), "0x10", "0x11", "gamma")
    assert path.stages[0].node == path.stages[-1].node == "alpha"
    text = path_dot(path)
    boxes = re.findall(r'subgraph "cluster_\d+_(\w+)" \{\n.*fillcolor="(#\w+)"', text)
    assert [host for host, _ in boxes] == ["alpha", "gamma", "alpha"]
    assert boxes[0][1] == boxes[2][1] != boxes[1][1]
    mermaid = path_mermaid(path)
    assert re.findall(r'subgraph \w+\["(\w+)"\]', mermaid) == ["alpha", "gamma", "alpha"]


@given(
    nodes=strategies.lists(strategies.sampled_from(["alpha", "beta", ""]), max_size=60),
    per_row=strategies.integers(1, 6),
)
def test_fold_keeps_every_stage_in_order_in_rows_of_one_place(nodes, per_row):
    stages = [Stage(Hop.SWITCH, f"e{i}", node) for i, node in enumerate(nodes)]
    runs = fold(stages, per_row)
    rows = [row for _, run in runs for row in run]
    assert [i for row in rows for i in row] == list(range(len(stages)))
    assert all(0 < len(row) <= per_row for row in rows)
    for host, run in runs:
        assert {stages[i].node for row in run for i in row} == {host}
        assert max(map(len, run)) - min(map(len, run)) <= 1  # as even as can be
        assert len(run) == -(-sum(map(len, run)) // per_row)  # no more rows than needed
    assert all(a != b for (a, _), (b, _) in itertools.pairwise(runs))  # each run is whole
