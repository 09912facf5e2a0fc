"""``vmlend reconcile``: report where the hypervisor, the registry and the host disagree, and
with ``--fix`` repair it. The comparison and the repairs are in ``vmlend.ops.reconcile``."""

from __future__ import annotations

import logging

import click

from vmlend.cli.common import emit_json, json_option
from vmlend.cli.connect import connect_option, fabric_for, open_hv
from vmlend.cli.context import CliContext
from vmlend.ops.reconcile import Drift, find_drift, fix, look
from vmlend.topology.model import format_fdid

log = logging.getLogger(__name__)


def _line(d: Drift) -> str:
    what = f"device {format_fdid(d.fdid)}" if d.fdid is not None else f"mdev {d.mdev}"
    return f"{d.kind.value}: {d.vm or '-'} {what}: {d.cause}"


@click.command("reconcile")
@click.option("--fix", "do_fix", is_flag=True, help="Repair what can be repaired.")
@click.option("--dry-run", is_flag=True, help="With --fix: say what would be done; change nothing.")
@connect_option
@json_option
@click.pass_obj
def reconcile_cmd(
    obj: CliContext, do_fix: bool, dry_run: bool, uri: str | None, json_output: bool
) -> None:
    """Compare running VMs, the state's holds and the host's mdevs; --fix returns what no
    running VM uses and re-creates what a running VM needs."""
    hv = open_hv(obj, uri)
    try:
        fabric = fabric_for(obj, hv, read_only=not do_fix or dry_run)
        drift = find_drift(look(hv, fabric))
        result = fix(hv, fabric, drift, log.info) if do_fix and not dry_run else None
    finally:
        hv.close()
    if json_output:
        out: dict[str, object] = {"node": fabric.local_node, "drift": [d.to_json() for d in drift]}
        if result is not None:
            out["fixed"] = [d.to_json() for d in result.fixed]
            out["failed"] = [d.to_json() | {"error": e} for d, e in result.failed]
            out["left"] = [d.to_json() for d in result.left]
            out["kept"] = [d.to_json() for d in result.started]
        emit_json(out)
    elif not drift:
        where = fabric.local_node or "this host (no node given)"
        click.echo(f"no drift on {where}: hypervisor, state and mdevs agree")
    elif result is None:
        verb = "would" if dry_run else "--fix would"
        for d in drift:
            click.echo(_line(d))
            click.echo(f"  {verb} {d.fix}" if d.fixable else f"  to do by hand: {d.fix}")
        if not do_fix:
            click.echo(f"{len(drift)} drift(s); 'vmlend reconcile --fix' repairs them")
    else:
        for d in result.fixed:
            click.echo(f"fixed {_line(d)}\n  done: {d.fix}")
        for d, e in result.failed:
            click.echo(f"FAILED {_line(d)}\n  {e}")
        for d in result.left:
            click.echo(f"left {_line(d)}\n  to do by hand: {d.fix}")
        for d in result.started:
            click.echo(f"kept {_line(d)}\n  its VM started meanwhile")
    # Like diff: 1 while drift remains (reported, or left after --fix), 0 once all agree.
    if (result is None and drift) or (result is not None and (result.failed or result.left)):
        raise SystemExit(1)


COMMANDS = [reconcile_cmd]
