"""``vmlend demo``: the story of vmlend on the simulated cluster, step by step.

Each step is a small function over a ``Demo``; later work appends steps (reserve, start a VM,
DMA through the NTB, hot-add, migrate...) to ``STEPS``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import click

from vmlend.cli.cmd_devices import HEADERS, device_row
from vmlend.cli.cmd_fabric import render_fabric
from vmlend.cli.common import CliContext, render_table
from vmlend.fabric.base import Fabric
from vmlend.fabric.open import default_topology_text, init_fabric


@dataclass
class Demo:
    """What the steps share: the CLI context, the fabric once it exists, and the output."""

    obj: CliContext
    echo: Callable[[str], None] = click.echo
    fabric_: Fabric | None = field(default=None, repr=False)

    @property
    def fabric(self) -> Fabric:
        if self.fabric_ is None:
            self.fabric_ = self.obj.fabric()
        return self.fabric_


@dataclass(frozen=True)
class Step:
    title: str
    run: Callable[[Demo], None]


def _init(demo: Demo) -> None:
    text, source = default_topology_text()
    result = init_fabric(demo.obj.state_path, text, source, node=demo.obj.node or "gamma")
    demo.echo(
        f"{result.action}: state {demo.obj.state_path} with the default cluster"
        f" ({len(result.topology.nodes)} nodes, {len(result.topology.devices)} devices);"
        f" we act as node {result.local_node}, the borrower"
    )


def _show(demo: Demo) -> None:
    demo.echo(render_fabric(demo.fabric))


def _devices(demo: Demo) -> None:
    demo.echo(render_table(HEADERS, [device_row(st) for st in demo.fabric.devices()]))


STEPS: list[Step] = [
    Step("Initialise the simulated cluster in the shared state", _init),
    Step("The fabric: nodes, NTB adapters and the switch", _show),
    Step("The devices alpha and beta lend", _devices),
]


@click.command("demo")
@click.pass_obj
def demo(obj: CliContext) -> None:
    """Run the vmlend story on the simulated cluster (uses the state path)."""
    d = Demo(obj)
    for i, step in enumerate(STEPS, 1):
        click.secho(f"\n== {i}. {step.title}", bold=True)
        step.run(d)


COMMANDS = [demo]
