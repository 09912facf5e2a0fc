"""``vmlend demo``: the story of vmlend on the simulated cluster (``vmlend.demo`` tells it)."""

from __future__ import annotations

import click

from vmlend.cli.common import emit_json, json_option
from vmlend.cli.context import CliContext


@click.command("demo")
@json_option
@click.pass_obj
def demo(obj: CliContext, json_output: bool) -> None:
    """Run the whole vmlend story on the simulated cluster in the state (--state): a VM on
    gamma borrows two GPUs and an NVMe drive, DMA and interrupts flow, a VF is hot-added and
    removed, the VM moves to alpha, and everything is returned. Safe to run again."""
    # Imported here: vmlend.demo drives the attach and migrate commands' own code.
    from vmlend.demo import StepResult, render_step, run_demo

    def show(step: StepResult) -> None:
        head, _, body = render_step(step).partition("\n")
        click.secho(f"\n{head}", bold=True)
        if body:
            click.echo(body)

    result = run_demo(obj.state_path, on_step=None if json_output else show)
    if json_output:
        emit_json(result.json())
    else:
        click.echo(f"\nthe story took {result.seconds:.1f} s")
    if not result.ok:
        raise click.ClickException(f"demo failed at {result.error}")


COMMANDS = [demo]
