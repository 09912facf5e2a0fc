"""``vmlend path SRC DST``: one PCIe path stage by stage, with its hops, root complexes and the
latency the NTB adds (the pure logic is ``vmlend.topology.pcie``)."""

from __future__ import annotations

import click

from vmlend.cli.common import check_one_output, emit_json, emit_table, format_option, json_option
from vmlend.cli.context import CliContext
from vmlend.topology.pcie import Hop, explain
from vmlend.views.diagram import path_dot, path_mermaid

HEADERS = ("#", "HOST", "KIND", "ELEMENT")


@click.command("path")
@click.argument("src")
@click.argument("dst")
@click.option("--via", metavar="NODE", help="Device to device through the RAM of a VM on NODE.")
@json_option
@format_option
@click.pass_obj
def path(
    obj: CliContext, src: str, dst: str, via: str | None, json_output: bool, picture: str
) -> None:
    """Explain the PCIe path from SRC to DST.

    Each end is a device (fdid, e.g. 0x10) or a node (its CPU and RAM): a device and a node is
    the device's DMA into a VM's RAM on that node, a node and a device is that node's CPU
    reaching the device's BARs, two devices is peer-to-peer between them. Hops are the
    switching elements passed (numbered; the end devices are not hops, root ports are part of
    their root complex), where peer-to-peer turns follows each host's IOMMU.
    """
    check_one_output(json_output, picture)
    found = explain(obj.fabric().topology(), src, dst, via)
    if json_output:
        emit_json(found.to_json())
        return
    if picture != "text":
        click.echo(path_dot(found) if picture == "dot" else path_mermaid(found), nl=False)
        return
    click.echo(
        f"{found.src} -> {found.dst}: {found.hops} hops, {found.roots} root complex(es),"
        f" {found.ntb_crossings} NTB crossing(s), about +{found.added_ns} ns one way"
    )
    rows: list[list[str]] = []
    hop = 0
    for s in found.stages:
        number = "-"  # an end device: not a hop
        if s.kind is not Hop.DEVICE:
            hop += 1
            number = str(hop)
        rows.append([number, s.node or "(fabric)", s.kind.value, s.name])
    emit_table(HEADERS, rows)


COMMANDS = [path]
