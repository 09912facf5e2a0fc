"""``vmlend doctor``: one line per host requirement; exit 1 when something blocks use."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click
import msgspec

from vmlend.cli.common import emit_json, json_option
from vmlend.cli.connect import connect_option
from vmlend.cli.context import CliContext
from vmlend.config import config_path
from vmlend.doctor import Status, blocking, run_checks
from vmlend.hostenv import HostEnv

_MARKS = {Status.OK: "ok", Status.WARN: "warn", Status.FAIL: "FAIL"}


@click.command("doctor")
@click.option(
    "--smartio",
    "smartio_required",
    is_flag=True,
    help="Count a missing SmartIO driver as blocking (the kernel fabric backend needs it).",
)
@click.option(
    "--libvirt-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="libvirt's config dir whose hooks to check (as 'vmlend hook install --libvirt-dir')"
    " [default: /etc/libvirt under --root].",
)
@connect_option
@json_option
@click.pass_obj
def doctor(
    obj: CliContext,
    smartio_required: bool,
    libvirt_dir: Path | None,
    uri: str | None,
    json_output: bool,
) -> None:
    """Check this host: the backend, KVM, IOMMU, vfio/mdev, SmartIO, libvirt and the hook."""
    env = HostEnv.from_env(obj.root)
    if libvirt_dir is not None:
        env = msgspec.structs.replace(env, libvirt_dir=Path(os.path.abspath(libvirt_dir)))
    cli_pins = {
        "interpreter": os.path.abspath(sys.executable),
        "config": str(config_path(obj.config_path, root=obj.root)),
        "state": os.path.abspath(obj.state_path),
        "registry": obj.registry or "",
        "node": obj.node or "",
        "backend": obj.backend or "",
    }
    findings = run_checks(
        env,
        smartio_required=smartio_required,
        cli_pins=cli_pins,
        backend=obj.backend,
        uri=uri or obj.uri,
    )
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
