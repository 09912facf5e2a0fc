"""``vmlend devices``: every device of the fabric with its state and holder."""

from __future__ import annotations

import click

from vmlend.cli.common import emit_json, emit_table, json_option
from vmlend.cli.context import CliContext
from vmlend.errors import ConfigError
from vmlend.topology.model import DeviceState
from vmlend.views.devices import HEADERS, device_json, device_row


@click.command("devices")
@click.option("--lender", help="Only devices lent by this node.")
@click.option("--kind", help="Only devices of this kind (gpu, nvme, nic, vf, ...).")
@click.option("--available", is_flag=True, help="Only devices nobody holds that can be taken.")
@json_option
@click.pass_obj
def devices(
    obj: CliContext, lender: str | None, kind: str | None, available: bool, json_output: bool
) -> None:
    """List the devices of the fabric: lender, PCI address, BARs, state and holder."""
    fabric = obj.fabric(read_only=True)
    if lender is not None:
        fabric.topology().node(lender)  # an unknown node is an error, not an empty list
    # One lender's devices are read alone: at 1,024 nodes reading them all cost ~4x the rest.
    every = fabric.devices(lender)
    if kind is not None and kind not in {st.spec.kind for st in every}:
        # Like an unknown --lender: a typo should not look like an empty fabric.
        kinds = sorted({d.kind for d in fabric.topology().devices})  # the whole fabric's
        if kind not in kinds:
            known = ", ".join(kinds) or "none"
            raise ConfigError(f"no device of kind {kind!r} in the fabric; its kinds: {known}")
    rows = [
        st
        for st in every
        if (lender is None or st.spec.lender == lender)
        and (kind is None or st.spec.kind == kind)
        and (not available or st.state is DeviceState.AVAILABLE)
    ]
    if json_output:
        emit_json({"devices": [device_json(st) for st in rows]})
    else:
        emit_table(HEADERS, [device_row(st) for st in rows])
    # The kernel backend lists a device it cannot read as unavailable; say why, one line each.
    for problem in getattr(fabric, "unreadable", ()):
        click.echo(f"vmlend: warning: device left unavailable: {problem}", err=True)


COMMANDS = [devices]
