"""``vmlend doctor``: one line per host requirement; exit 1 when something blocks use."""

from __future__ import annotations

import os
import sys

import click

from vmlend.cli.common import emit_json, json_option
from vmlend.cli.context import CliContext
from vmlend.doctor import Status, blocking, run_checks
from vmlend.hostenv import HostEnv
from vmlend.wiring.fabric import BACKEND_ENV

_MARKS = {Status.OK: "ok", Status.WARN: "warn", Status.FAIL: "FAIL"}


@click.command("doctor")
@click.option(
    "--smartio",
    "smartio_required",
    is_flag=True,
    help="Count a missing SmartIO driver as blocking (the kernel fabric backend needs it).",
)
@json_option
@click.pass_obj
def doctor(obj: CliContext, smartio_required: bool, json_output: bool) -> None:
    """Check this host: IOMMU, vfio/mdev, SmartIO, libvirt and the hook."""
    env = HostEnv.from_env(obj.root)
    cli_pins = {
        "interpreter": os.path.abspath(sys.executable),
        "state": os.path.abspath(obj.state_path),
        "registry": obj.registry or "",
        "node": obj.node or "",
        "backend": os.environ.get(BACKEND_ENV, ""),
    }
    findings = run_checks(env, smartio_required=smartio_required, cli_pins=cli_pins)
    failed = blocking(findings)
    if json_output:
        emit_json(
            {
                "root": str(env.root),
                "ok": not failed,
                "checks": [f.as_dict() for f in findings],
            }
        )
    else:
        width = max(len(f.name) for f in findings)
        for f in findings:
            click.echo(f"{_MARKS[f.status]:<4}  {f.name:<{width}}  {f.detail}")
    if failed:
        raise SystemExit(1)


COMMANDS = [doctor]
