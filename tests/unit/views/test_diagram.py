"""The fabric and a path as pictures: DOT that Graphviz draws, Mermaid with one node per stage,
the device states and holders visible, and the same numbers as the text."""

from __future__ import annotations

import re
import shutil
import subprocess

import msgspec
import pytest

from tests.support.cli_cluster import GAMMA
from vmlend.topology.model import DeviceState, Holder
from vmlend.topology.pcie import Hop, explain
from vmlend.views.diagram import STATE_FILL, fabric_dot, fabric_mermaid, path_dot, path_mermaid

DOT = shutil.which("dot")


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
    assert r.exit_code == 0 and r.stdout.startswith("flowchart LR")
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
