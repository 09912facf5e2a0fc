"""``vmlend lend`` / ``vmlend unlend``: offer a device to the fabric or withdraw it."""

from __future__ import annotations

from typing import Any

import click
from click.shell_completion import CompletionItem

from vmlend.cli.common import emit_json, json_option
from vmlend.cli.context import CliContext
from vmlend.errors import ConfigError
from vmlend.topology.choose import DeviceWish, parse_wish
from vmlend.topology.model import DeviceStatus, format_fdid, parse_fdid
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
    """A device by fdid (``0x10``) or by kind (``gpu``, ``nvme,lender=alpha``): one device."""

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
@click.argument("fdid", type=FDID)
@json_option
@click.pass_obj
def lend(obj: CliContext, fdid: int, json_output: bool) -> None:
    """Offer device FDID to the fabric so VMs on other nodes can borrow it."""
    _report(obj.fabric().lend(fdid), json_output)


@click.command("unlend")
@click.argument("fdid", type=FDID)
@json_option
@click.pass_obj
def unlend(obj: CliContext, fdid: int, json_output: bool) -> None:
    """Withdraw device FDID from the fabric (refused while a VM holds it)."""
    _report(obj.fabric().unlend(fdid), json_output)


COMMANDS = [lend, unlend]
