"""``vmlend status [VM]``: per VM its remote devices and what the data path set up for them,
with each device's PCIe path into the VM's RAM (``vmlend path`` explains it stage by stage);
each VM's queue-level NVMe shares (queue pairs, LBA window, real queue ids, doorbell mode,
guard rejections); per NTB adapter the LUT entries and window room in use; per cluster switch
port in use its requester entries (the fullest few in the text); each VM's live
migrations (downtime, each device's blackout). The collection is in ``vmlend.ops.status``;
this module renders it.
"""

from __future__ import annotations

import click

from vmlend.cli.common import emit_json, json_option
from vmlend.cli.complete import complete_vms
from vmlend.cli.connect import connect_option, fabric_for, open_hv
from vmlend.cli.context import CliContext
from vmlend.ops.reconcile import find_drift, look
from vmlend.ops.status import add_history, collect, port_rows, read_runtime, usage_rows
from vmlend.views.status import render_status


@click.command("status")
@click.argument("vm", required=False, shell_complete=complete_vms)
@connect_option
@json_option
@click.pass_obj
def status_cmd(obj: CliContext, vm: str | None, uri: str | None, json_output: bool) -> None:
    """Per VM its remote devices (state, holder, mdev, DMA windows, vectors, P2P maps) and
    NVMe shares (queue pairs, LBA window, real queues, guard rejections); per NTB adapter the
    LUT entries and window in use; per switch port in use its requester entries."""
    hv = open_hv(obj, uri)
    try:
        fabric = fabric_for(obj, hv, read_only=True)
        vms = collect(hv, fabric, read_runtime(obj.location), vm)
        add_history(vms, obj.state_path.parent)
        usage = usage_rows(fabric.usage())
        ports = port_rows(fabric.port_usage())
        drift = find_drift(look(hv, fabric))
    finally:
        hv.close()
    if json_output:
        emit_json(
            {
                "node": fabric.local_node,
                "vms": [v.to_json() for v in vms],
                "adapters": usage,
                "ports": ports,
                "drift": [d.to_json() for d in drift],
            }
        )
    else:
        empty = "no VMs with remote devices"
        if vm is not None:
            empty = f"VM {vm!r} has no remote devices; 'vmlend attach' adds one"
        click.echo(render_status(vms, usage, empty, ports))
        if drift:
            kinds = ", ".join(sorted({d.kind.value for d in drift}))
            click.echo(
                f"\nDRIFT: {len(drift)} disagreement(s) between VMs, state and mdevs ({kinds});"
                " 'vmlend reconcile' explains them, 'vmlend reconcile --fix' repairs them"
            )


COMMANDS = [status_cmd]
