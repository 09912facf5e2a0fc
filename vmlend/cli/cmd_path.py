"""``vmlend path SRC DST``: one PCIe path stage by stage, with its hops, root complexes and
each element's latency (the pure logic is ``vmlend.topology.pcie``)."""

from __future__ import annotations

import click

from vmlend.cli.common import check_one_output, emit_json, emit_table, format_option, json_option
from vmlend.cli.context import CliContext
from vmlend.errors import ConfigError
from vmlend.topology.pcie import Hop, Stage, explain, explain_all
from vmlend.views.diagram import path_dot, path_mermaid

HEADERS = ("#", "HOST", "KIND", "ELEMENT", "CHIP", "NS")
ALL_HEADERS = ("ROUTE", "LATENCY", "HOPS", "ROOTS", "ADAPTERS", "LINKS")


@click.command("path")
@click.argument("src")
@click.argument("dst")
@click.option("--via", metavar="NODE", help="Device to device through the RAM of a VM on NODE.")
@click.option(
    "--all",
    "all_routes",
    is_flag=True,
    help="List every route (other adapters, other cables) with its latency, in the order used.",
)
@json_option
@format_option
@click.pass_obj
def path(
    obj: CliContext,
    src: str,
    dst: str,
    via: str | None,
    all_routes: bool,
    json_output: bool,
    picture: str,
) -> None:
    """Explain the PCIe path from SRC to DST.

    Each end is a device (fdid, e.g. 0x10) or a node (its CPU and RAM): a device and a node is
    the device's DMA into a VM's RAM on that node, a node and a device is that node's CPU
    reaching the device's BARs, two devices is peer-to-peer between them. Hops are the
    switching elements passed (numbered; the end devices are not hops, root ports are part of
    their root complex), where peer-to-peer turns follows each host's IOMMU. Each element shows
    its chip and what it adds one way (the SmartIO paper's figures; an NTB crossing about
    350 ns), the path its sum. With --all, every route between the two hosts (through other
    NTB adapters and cables) with its latency and hops; the first is the one used while all
    its cables are up (routes rank by the crossing's latency, then hops).
    """
    check_one_output(json_output, picture)
    if all_routes:
        if via is not None:
            raise ConfigError("--all lists the routes of one crossing; leave out --via")
        if picture != "text":
            raise ConfigError("--all lists routes as a table or JSON; draw one path at a time")
        _all(obj, src, dst, json_output)
        return
    found = explain(obj.fabric().topology(), src, dst, via)
    if json_output:
        emit_json(found.to_json())
        return
    if picture != "text":
        click.echo(path_dot(found) if picture == "dot" else path_mermaid(found), nl=False)
        return
    click.echo(
        f"{found.src} -> {found.dst}: {found.hops} hops, {found.roots} root complex(es),"
        f" {found.ntb_crossings} NTB crossing(s), about {found.latency_ns} ns one way"
        f" ({found.added_ns} ns of it the NTB)"
    )
    rows: list[list[str]] = []
    hop = 0
    for s in found.stages:
        number = "-"  # an end device: not a hop
        if s.kind is not Hop.DEVICE:
            hop += 1
            number = str(hop)
        rows.append([number, s.node or "(fabric)", s.kind.value, s.name, *_cost(s)])
    emit_table(HEADERS, rows)


def _cost(s: Stage) -> list[str]:
    """A stage's CHIP and NS cells: an NTB adapter's are the crossing's (on the adapter the
    TLP enters by; "-" on the far one), a root complex and an end have none."""
    if s.kind is Hop.NTB:
        return ["(crossing)", str(s.ns)] if s.ns else ["(crossing)", "-"]
    return [s.chip.value, str(s.ns)] if s.chip else ["-", "-"]


def _all(obj: CliContext, src: str, dst: str, json_output: bool) -> None:
    found = explain_all(obj.fabric().topology(), src, dst)
    if json_output:
        emit_json(
            {"src": found[0].src, "dst": found[0].dst, "routes": [p.to_json() for p in found]}
        )
        return
    click.echo(f"{found[0].src} -> {found[0].dst}: {len(found)} route(s), in the order used")
    rows = []
    for i, p in enumerate(found, 1):
        ntbs = [s.name for s in p.stages if s.kind is Hop.NTB]
        rows.append(
            [
                str(i),
                f"{p.latency_ns} ns",
                str(p.hops),
                str(p.roots),
                " -> ".join(ntbs) or "-",
                ", ".join(p.links) or "-",
            ]
        )
    emit_table(ALL_HEADERS, rows)


COMMANDS = [path]
