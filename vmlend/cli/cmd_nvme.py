"""``vmlend nvme``: share one NVMe drive among VMs at the queue level (docs/nvme-sharing.md)."""

from __future__ import annotations

import click

from vmlend.cli.cmd_lend import FDID_OR_KIND
from vmlend.cli.common import emit_action, emit_json, emit_table, json_option
from vmlend.cli.complete import complete_fdids, complete_nodes, complete_vms
from vmlend.cli.context import CliContext
from vmlend.domain.metadata import MAX_NVME_BLOCKS
from vmlend.domain.units import parse_cli_size
from vmlend.errors import ConfigError, ResourceExhaustedError
from vmlend.ledger import nvmeshares as ledger
from vmlend.nvme.fetchroute import fetch_route
from vmlend.nvme.shares import Share
from vmlend.registry import Registry, open_registry
from vmlend.sim.nvmedrive import drive_geometry
from vmlend.topology.choose import Choice, rank_shared
from vmlend.topology.model import Holder, format_fdid, parse_fdid
from vmlend.topology.selectors import DeviceWish
from vmlend.units import format_size_exact

BLOCK = 512


def _blocks(size: str) -> int:
    n = parse_cli_size(size, limit=None)  # storage: bounded by its block count below
    if n < BLOCK or n % BLOCK:
        raise ConfigError(f"size {size!r} must be a positive multiple of {BLOCK} bytes")
    if n // BLOCK >= MAX_NVME_BLOCKS:
        raise ConfigError(f"size {size!r} is more blocks than an NVMe namespace has (2^64)")
    return n // BLOCK


@click.group("nvme")
def nvme() -> None:
    """Queue-level sharing of NVMe drives: each VM gets I/O queue pairs and an LBA window."""


@nvme.command("share")
@click.argument("fdid", shell_complete=complete_fdids)
@click.option(
    "--size",
    default="1T",
    show_default=True,
    help="Namespace size to share out (MiB, or 1T, 64GiB; 64GB is decimal).",
)
@click.option(
    "--cmb",
    default="0",
    show_default=True,
    help="Lender memory kept as the drive's controller memory buffer (MiB, or e.g. 4M, 512K):"
    " each share's submission queues get an extent of it, fetched without crossing the NTB."
    " 0: queues in guest RAM.",
)
@json_option
@click.pass_obj
def share_cmd(obj: CliContext, fdid: str, size: str, cmb: str, json_output: bool) -> None:
    """Lend FDID for sharing: its manager holds it; VMs then get shares, not the drive."""
    dev = parse_fdid(fdid)
    cmb_bytes = parse_cli_size(cmb)
    with obj.fabric() as fabric:
        geometry = drive_geometry(fabric.topology().device(dev), _blocks(size), cmb_bytes)
    with open_registry(obj.location) as reg:
        ledger.lend_shared(reg, dev, geometry)
    if json_output:
        emit_action(
            "shared",
            fdid=format_fdid(dev),
            queue_pairs=geometry.queue_pairs,
            vectors=geometry.vectors,
            blocks=geometry.blocks,
            doorbells=geometry.mode,
            cmb_bytes=geometry.cmb_bytes,
        )
        return
    near = f", {format_size_exact(cmb_bytes)} CMB for queues" if cmb_bytes else ""
    click.echo(
        f"{format_fdid(dev)} shared: {geometry.queue_pairs} queue pairs, "
        f"{geometry.vectors - 1} vectors, {size} ({geometry.mode} doorbells){near}"
    )


@nvme.command("unshare")
@click.argument("fdid", shell_complete=complete_fdids)
@json_option
@click.pass_obj
def unshare_cmd(obj: CliContext, fdid: str, json_output: bool) -> None:
    """Stop sharing FDID (refused while VMs have shares)."""
    dev = parse_fdid(fdid)
    with open_registry(obj.location) as reg:
        done = ledger.unshare(reg, dev)
    if json_output:
        emit_action("unshared" if done else "unchanged", fdid=format_fdid(dev))
        return
    click.echo(f"{format_fdid(dev)} {'no longer shared' if done else 'was not shared'}")


def _holder(obj: CliContext, vm: str, node: str | None) -> Holder:
    if node is None:
        with obj.fabric() as fabric:
            node = fabric.local_node
    return Holder(node, vm)


@nvme.command("reserve")
@click.argument("fdid", type=FDID_OR_KIND)
@click.argument("vm", shell_complete=complete_vms)
@click.option("--queues", type=click.IntRange(1, 0xFFFE), default=1, show_default=True)
@click.option(
    "--paths",
    type=click.IntRange(1, 2),
    default=1,
    show_default=True,
    help="2: a backup queue pair per queue pair, through another adapter of the VM's host.",
)
@click.option("--size", required=True, help="The VM's namespace size: MiB, or e.g. 64G.")
@click.option("--node", shell_complete=complete_nodes, help="The VM's node (default: this host's).")
@click.option(
    "--ram",
    default="0",
    help="The VM's RAM (MiB, or e.g. 8G): its DMA windows' NTB room is claimed.",
)
@json_option
@click.pass_obj
def reserve_cmd(
    obj: CliContext,
    fdid: int | DeviceWish,
    vm: str,
    queues: int,
    paths: int,
    size: str,
    node: str | None,
    ram: str,
    json_output: bool,
) -> None:
    """Claim a share of FDID for VM: queue pairs, MSI-X vectors, an LBA window and the NTB
    resources of its DMA path (of both paths with --paths 2).

    FDID may be chosen among the drives lent for sharing: by kind (nvme), vendor and product
    ids (vendor=8086,product=0a54) or an alias of the configuration file's [alias] table; the
    one with the shortest path to the VM's node that has room is taken, or the one the VM
    already has a share of."""
    holder = _holder(obj, vm, node)
    blocks, guest_ram = _blocks(size), parse_cli_size(ram)
    with open_registry(obj.location) as reg:
        candidates = [fdid] if isinstance(fdid, int) else _ranked(obj, reg, fdid, holder)
        dev, share = _reserve_first(reg, candidates, holder, queues, blocks, guest_ram, paths)
    if json_output:
        emit_action(
            "reserved",
            fdid=format_fdid(dev),
            vm=holder.vm,
            node=holder.node,
            queue_pairs=share.queue_pairs,
            lba_offset=share.lba_offset,
            blocks=share.blocks,
            paths=share.paths,
            cmb=share.as_dict()["cmb"],
        )
        return
    click.echo(
        f"{holder}: {share.queue_pairs} queue pair(s) of {format_fdid(dev)}, "
        f"LBAs {share.lba_offset}..{share.lba_offset + share.blocks - 1}"
        + (f", {share.paths} paths (primary and backup)" if share.paths > 1 else "")
        + (f", {format_size_exact(share.cmb_bytes)} of its CMB" if share.cmb_bytes else "")
    )


def _ranked(obj: CliContext, reg: Registry, wish: DeviceWish, holder: Holder) -> list[Choice]:
    """The shared drives ``wish`` matches, best first for ``holder`` (``rank_shared``)."""
    drives = ledger.shared_drives(reg)
    mine = [f for f, (_, _, entries) in drives.items() if any(e.holder == holder for e in entries)]
    with obj.fabric(read_only=True) as fabric:
        topology = fabric.topology()
    return rank_shared(topology, drives, wish, holder.node, aliases=obj.aliases, mine=mine)


def _reserve_first(
    reg: Registry,
    candidates: list[int] | list[Choice],
    holder: Holder,
    queues: int,
    blocks: int,
    guest_ram: int,
    paths: int,
) -> tuple[int, Share]:
    """A share of the first of ``candidates`` that has room (a chosen one said on stderr, as
    ``xml new`` says its choices); the first one's refusal when none has."""
    refusals: list[ResourceExhaustedError] = []
    for candidate in candidates:
        dev = candidate if isinstance(candidate, int) else candidate.fdid
        try:
            share = ledger.reserve_share(
                reg, dev, holder, queues, blocks, guest_ram=guest_ram, paths=paths
            )
        except ResourceExhaustedError as e:
            refusals.append(e)
            if len(candidates) > 1:
                click.echo(f"vmlend: not {format_fdid(dev)}: {e}", err=True)
            continue
        if isinstance(candidate, Choice):
            click.echo(f"chose {candidate.describe()}", err=True)
        return dev, share
    raise refusals[0]


@nvme.command("release")
@click.argument("fdid", shell_complete=complete_fdids)
@click.argument("vm", shell_complete=complete_vms)
@click.option("--node", shell_complete=complete_nodes, help="The VM's node (default: this host's).")
@json_option
@click.pass_obj
def release_cmd(obj: CliContext, fdid: str, vm: str, node: str | None, json_output: bool) -> None:
    """Return VM's share of FDID."""
    dev = parse_fdid(fdid)
    holder = _holder(obj, vm, node)
    with open_registry(obj.location) as reg:
        done = ledger.release_share(reg, dev, holder)
    if json_output:
        action = "released" if done else "unchanged"
        emit_action(action, fdid=format_fdid(dev), vm=holder.vm, node=holder.node)
        return
    click.echo(f"{holder}: {'share returned' if done else 'had no share'} of {format_fdid(dev)}")


@nvme.command("path")
@click.argument("vm", shell_complete=complete_vms)
@click.option("--node", shell_complete=complete_nodes, help="The VM's node (default: this host's).")
@json_option
@click.pass_obj
def path_cmd(obj: CliContext, vm: str, node: str | None, json_output: bool) -> None:
    """Show where VM's shares keep their submission queues and the route of each command fetch.

    A fetch is the drive reading a queue entry: from guest RAM across the NTB and back, or,
    with the share's queues in the drive's controller memory buffer (``vmlend nvme share
    --cmb``), from the lender's own memory. Hops and nanoseconds are counted as ``vmlend
    path`` counts them; the completion is a posted write into guest RAM either way."""
    holder = _holder(obj, vm, node)
    with open_registry(obj.location) as reg:
        drives = ledger.shared_drives(reg)
    mine = [
        (fdid, e.share)
        for fdid, (_, _, entries) in drives.items()
        for e in entries
        if e.holder == holder
    ]
    if not mine:
        raise ConfigError(
            f"{holder} has no share of an NVMe drive; reserve one first"
            " ('vmlend nvme reserve FDID VM --size SIZE')"
        )
    with obj.fabric(read_only=True) as fabric:
        topology = fabric.topology()
    routes = [
        (share, fetch_route(topology, fdid, holder.node, share.cmb_extent is not None))
        for fdid, share in mine
    ]
    if json_output:
        emit_json(
            {
                "vm": holder.vm,
                "node": holder.node,
                "shares": [{**r.to_json(), "cmb": share.as_dict()["cmb"]} for share, r in routes],
            }
        )
        return
    for share, r in routes:
        f, c = r.fetch, r.completion
        where = (
            f"in the drive's CMB on {topology.device(r.fdid).lender}"
            f" (extent {share.cmb_offset:#x}+{format_size_exact(share.cmb_bytes)})"
            if share.cmb_extent is not None
            else f"in guest RAM on {holder.node}"
        )
        click.echo(f"{format_fdid(r.fdid)} -> {holder}: submission queues {where}")
        click.echo(
            f"  fetch:      {f.hops} hops, {f.ntb_crossings} NTB crossing(s), {f.latency_ns} ns"
            f" one way, {r.fetch_ns} ns per fetch (there and back)"
        )
        click.echo(
            f"  completion: {c.hops} hops, {c.ntb_crossings} NTB crossing(s), {c.latency_ns} ns"
            " one way (a posted write into guest RAM)"
        )


@nvme.command("status")
@json_option
@click.pass_obj
def status_cmd(obj: CliContext, json_output: bool) -> None:
    """Shared drives and each VM's share: queue pairs, LBA window, guard rejections."""
    with open_registry(obj.location) as reg:
        drives = ledger.shared_drives(reg)
    if json_output:
        emit_json(
            {
                "drives": [
                    {
                        "fdid": format_fdid(fdid),
                        "manager": str(manager),
                        "queue_pairs": geo.queue_pairs,
                        "vectors": geo.vectors,
                        "blocks": geo.blocks,
                        "doorbells": geo.mode,
                        "cmb_bytes": geo.cmb_bytes,
                        "shares": [e.to_json() for e in entries],
                    }
                    for fdid, (manager, geo, entries) in drives.items()
                ]
            }
        )
        return
    if not drives:
        click.echo("no drive is shared ('vmlend nvme share FDID' on its lender)")
        return
    rows = []
    for fdid, (_, geo, entries) in drives.items():
        for e in entries:
            s = e.share
            rows.append(
                (
                    format_fdid(fdid),
                    str(e.holder),
                    s.queue_pairs,
                    f"{s.lba_offset}+{s.blocks} ({format_size_exact(s.blocks * BLOCK)})",
                    ",".join(map(str, e.real_queues)) or "-",
                    geo.mode,
                    f"{s.cmb_offset:#x}+{format_size_exact(s.cmb_bytes)}"
                    if s.cmb_offset is not None
                    else "-",
                    e.rejections,
                )
            )
        if not entries:
            rows.append((format_fdid(fdid), "-", 0, "-", "-", geo.mode, "-", 0))
    emit_table(
        ("FDID", "VM", "QUEUE PAIRS", "LBA WINDOW", "REAL QIDS", "DOORBELLS", "CMB", "REJECTED"),
        rows,
    )


COMMANDS = [nvme]
