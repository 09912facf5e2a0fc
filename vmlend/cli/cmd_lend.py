"""``vmlend lend`` / ``vmlend unlend``: offer a device to the fabric or withdraw it."""

from __future__ import annotations

import sys
from typing import Any

import click
from click.shell_completion import CompletionItem

from vmlend.cli.common import emit_json, json_option
from vmlend.cli.context import CliContext
from vmlend.errors import ConfigError
from vmlend.topology.model import DeviceState, DeviceStatus, format_fdid, parse_fdid
from vmlend.topology.selectors import DeviceWish, parse_wish
from vmlend.views.devices import device_json


class FdidType(click.ParamType[int]):
    """A fabric device id argument (``0x10`` or ``16``); bad text is a usage error."""

    name = "FDID"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        try:
            return parse_fdid(value)
        except ConfigError as e:
            self.fail(str(e), param, ctx)

    def shell_complete(
        self, ctx: click.Context, param: click.Parameter, incomplete: str
    ) -> list[CompletionItem]:
        from vmlend.cli.complete import complete_fdids

        return complete_fdids(ctx, param, incomplete)


FDID = FdidType()


class FdidOrKindType(FdidType):
    """A device by fdid (``0x10``) or chosen (``gpu``, ``nvme,lender=alpha``, an alias,
    ``vendor=10de,product=1db4``): one device."""

    name = "FDID|KIND"

    def convert(  # type: ignore[override]  # a kind is chosen later, against the fabric
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> int | DeviceWish:
        if isinstance(value, (int, DeviceWish)):
            return value
        try:
            wish = parse_wish(value)
        except ConfigError as e:
            self.fail(str(e), param, ctx)
        if wish is None:
            return super().convert(value, param, ctx)
        if wish.count != 1:
            self.fail(f"one device at a time: {value!r} asks for {wish.count}", param, ctx)
        return wish


FDID_OR_KIND = FdidOrKindType()


def _report(st: DeviceStatus, json_output: bool) -> None:
    if json_output:
        emit_json(device_json(st))
        return
    s = st.spec
    holder = f" (held by {st.holder})" if st.holder else ""
    click.echo(f"device {format_fdid(s.fdid)} ({s.kind} {s.bdf} on {s.lender}): {st.state}{holder}")


@click.command("lend")
@click.argument("fdid", type=FDID, required=False)
@click.option("--all", "lend_all", is_flag=True, help="Every device of one lender (this host's).")
@click.option("--lender", metavar="NODE", help="With --all: the lender (default: this host).")
@json_option
@click.pass_obj
def lend(
    obj: CliContext, fdid: int | None, lend_all: bool, lender: str | None, json_output: bool
) -> None:
    """Offer device FDID to the fabric so VMs on other nodes can borrow it. With --all, every
    device of one lender, in few transactions. Idempotent."""
    if lend_all == (fdid is not None):
        raise click.UsageError("name one device (FDID) or --all, not both")
    if lender is not None and not lend_all:
        raise click.UsageError("--lender goes with --all")
    fabric = obj.fabric()
    if fdid is not None:
        _report(fabric.lend(fdid), json_output)
        return
    node = lender or obj.node or fabric.local_node
    if not node:
        raise ConfigError("which lender's devices? name it: 'vmlend lend --all --lender NODE'")
    topo = fabric.topology()
    if node not in {n.name for n in topo.nodes}:
        raise ConfigError(f"no node {node!r} in the fabric; 'vmlend fabric show' lists them")
    fdids = [d.fdid for d in topo.devices if d.lender == node]
    before = {st.spec.fdid: st.state for st in fabric.devices() if st.spec.lender == node}
    from vmlend.ledger.ledger import LEND_BATCH  # not at start-up: most commands never lend

    loud = len(fdids) > LEND_BATCH and not json_output and sys.stderr.isatty()

    def progress(done: int) -> None:
        if loud:
            click.echo(f"\rlent {done}/{len(fdids)}", nl=done == len(fdids), err=True)

    done = fabric.lend_many(fdids, progress)
    if json_output:
        emit_json({"lender": node, "devices": [device_json(st) for st in done]})
        return
    already = sum(1 for f in fdids if before.get(f) != DeviceState.UNLENT)
    click.echo(
        f"lent {len(done)} devices of {node}"
        + (f" ({already} were lent already)" if already else "")
    )


@click.command("unlend")
@click.argument("fdid", type=FDID)
@json_option
@click.pass_obj
def unlend(obj: CliContext, fdid: int, json_output: bool) -> None:
    """Withdraw device FDID from the fabric (refused while a VM holds it)."""
    _report(obj.fabric().unlend(fdid), json_output)


COMMANDS = [lend, unlend]
