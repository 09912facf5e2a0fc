"""virsh's four flags for where a change applies: ``--live``, ``--config``, ``--persistent``
(the definition, and the running domain too when it runs) and ``--current`` (the running
domain if it runs, else the definition; also what no flag means)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from vmlend.hypervisor import Hypervisor


def impact_options(live_help: str, config_help: str) -> Callable[..., Any]:
    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        f = click.option(
            "--current",
            is_flag=True,
            help="The running domain if it runs, else its definition (the default).",
        )(f)
        f = click.option(
            "--persistent",
            is_flag=True,
            help="The definition, and the running domain too when it runs.",
        )(f)
        f = click.option("--config", is_flag=True, help=config_help)(f)
        return click.option("--live", is_flag=True, help=live_help)(f)

    return decorate


def resolve_impact(
    hv: Hypervisor, vm: str, *, live: bool, config: bool, persistent: bool, current: bool
) -> tuple[bool, bool]:
    """``(live, config)`` as the operations take them; (False, False) means current."""
    if current and (live or config or persistent):
        raise click.UsageError("--current cannot be combined with --live, --config or --persistent")
    if persistent:
        return live or hv.lookup(vm).active, True
    return live, config
