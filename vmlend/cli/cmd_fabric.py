"""``vmlend fabric``: initialise the shared state with a topology and show the fabric."""

from __future__ import annotations

import click

from vmlend.cli.cmd_lend import FDID
from vmlend.cli.common import (
    check_one_output,
    emit_action,
    emit_json,
    format_option,
    json_option,
    read_input,
)
from vmlend.cli.complete import complete_nodes
from vmlend.cli.context import CliContext
from vmlend.errors import ConfigError, TopologyError
from vmlend.hook.actionlog import ActionLog, log_path_for_state
from vmlend.ledger.linkfaults import LinkChange
from vmlend.ops.identity import identity_change
from vmlend.registry.location import parse_location
from vmlend.sim.backend import SimFabric
from vmlend.views.diagram import fabric_dot, fabric_mermaid
from vmlend.views.discovered import changes_json, discover_json, found_lines
from vmlend.views.fabric import fabric_json, node_states, render_fabric
from vmlend.wiring.fabric import default_topology_text, init_fabric


@click.group("fabric")
def fabric() -> None:
    """The fabric: its nodes, NTB adapters and links, kept in the shared state."""


@fabric.command("init")
@click.option(
    "--topology",
    "topology_file",
    type=click.Path(dir_okay=False),
    help="Topology file (TOML) [default: the shipped three-node cluster].",
)
@click.option(
    "--node",
    shell_complete=complete_nodes,
    help="The node this host is [default: found by hostname].",
)
@click.option("--replace", is_flag=True, help="Replace a different topology (nothing held).")
@click.option(
    "--force", is_flag=True, help="Change this host's node even while its old node holds devices."
)
@json_option
@click.pass_obj
def init(
    obj: CliContext,
    topology_file: str | None,
    node: str | None,
    replace: bool,
    force: bool,
    json_output: bool,
) -> None:
    """Put a topology into the shared state. Running it again with the same topology changes
    nothing."""
    if topology_file is None:
        text, source = default_topology_text()
    else:
        from vmlend.topology.parse import MAX_TOPOLOGY_BYTES

        try:
            # read_input: one line for a FIFO, a device or a huge file
            text, source = read_input(topology_file, MAX_TOPOLOGY_BYTES).decode(), topology_file
        except UnicodeDecodeError:
            raise TopologyError(topology_file, "not a text file") from None
    node = node or obj.node
    sqlite_path = parse_location(obj.location).path
    # Only an SQLite state names this host's node: a cluster registry has no identity to change.
    change = identity_change(sqlite_path, node) if node and sqlite_path is not None else None
    if change is not None and change.held and not force:
        raise change.refusal()
    result = init_fabric(obj.location, text, source, node=node, replace=replace)
    topo = result.topology
    if json_output:
        emit_json(
            {
                "action": result.action,
                "state": str(obj.location),
                "topology": topo.name,
                "source": source,
                "local_node": result.local_node,
                "previous_node": change.old if change is not None else None,
                "nodes": [n.name for n in topo.nodes],
                "devices": len(topo.devices),
            }
        )
        return
    was = f" (was {change.old})" if change is not None and result.action != "created" else ""
    who = (
        f"this host is node {result.local_node}{was}"
        if result.local_node
        else "each host names its node with --node / VMLEND_NODE"
    )
    click.echo(
        f"{result.action}: {obj.location} holds topology {topo.name!r}"
        f" ({len(topo.nodes)} nodes, {len(topo.devices)} devices); {who}"
    )
    if was and change is not None and change.held:
        click.echo(
            f"vmlend: --force: {len(change.held)} hold(s) or mdev(s) of {change.old} are no"
            f" longer this host's; 'vmlend reconcile -c ...' on the host that is {change.old}"
            " now can return them",
            err=True,
        )


@fabric.command("discover")
@click.option("--dry-run", is_flag=True, help="Say what would be merged; change nothing.")
@json_option
@click.pass_obj
def discover(obj: CliContext, dry_run: bool, json_output: bool) -> None:
    """Merge this host's NTB adapters, cables and devices, as its SmartIO driver describes
    them, into the topology in the shared state.

    The node is found by the driver's node id; a new one is named by --node (or VMLEND_NODE,
    the configuration's node, etc/vmlend/node) or the short hostname. Running it again merges
    nothing. What the driver cannot see (the cluster switches' wiring, each device's
    interrupts) stays the topology file's ('vmlend fabric init --topology FILE'). A device or
    adapter in use is not described anew; what is added merges beside the holds."""
    import socket

    from vmlend.hostenv import HostEnv
    from vmlend.kernel.discover import read_host
    from vmlend.wiring.discover import discover_fabric

    env = HostEnv.from_env(obj.root)
    host = read_host(env, socket.gethostname())
    for damaged in host.damaged:
        click.echo(f"vmlend: left out a device the driver describes unsoundly: {damaged}", err=True)
    node = obj.node or env.configured_node()  # as the fabric's other commands name this host
    result = discover_fabric(obj.location, host, node=node, dry_run=dry_run)
    m = result.merge
    if json_output:
        emit_action(
            result.action,
            state=str(obj.location),
            node=m.node,
            new_node=m.new_node,
            local_node=result.local_node or None,
            found=discover_json(host),
            changes=changes_json(m.changes),
            notes=[*m.notes, *result.notes],
            topology=m.topology.name if m.topology is not None else None,
        )
        return
    for line in found_lines(host, m.node):
        click.echo(line)
    for change in m.changes:
        click.echo(("would be " if dry_run else "") + change.line())
    for note in (*m.notes, *result.notes):
        click.echo(f"note: {note}")
    n = len(m.changes)
    changes = f"{n} change{'s' if n != 1 else ''}"
    where = f"{obj.location}" + (f" (this host is node {m.node})" if result.local_node else "")
    if result.action == "unchanged":
        click.echo(f"unchanged: {where} already holds what the driver describes")
    else:
        click.echo(f"{result.action}: {changes} in {where}")


@fabric.command("show")
@json_option
@format_option
@click.pass_obj
def show(obj: CliContext, json_output: bool, picture: str) -> None:
    """Show nodes (with node ids), NTB adapters (LUT and window use) and links; --format
    draws them with the devices coloured by state and their holders."""
    check_one_output(json_output, picture)
    f = obj.fabric(read_only=True)
    if json_output:
        emit_json(fabric_json(f))
    elif picture != "text":
        down = {n: why for n, (up, why) in node_states(f).items() if not up}
        draw = fabric_dot if picture == "dot" else fabric_mermaid
        click.echo(draw(f.topology(), f.devices(), f.usage(), down), nl=False)
    else:
        click.echo(render_fabric(f))


def _sim(obj: CliContext) -> SimFabric:
    f = obj.fabric()
    if not isinstance(f, SimFabric):
        raise ConfigError(
            "only the simulated fabric can mark nodes or links down or up or reclaim devices"
        )
    return f


@fabric.command("node-down")
@click.argument("node", shell_complete=complete_nodes)
@click.option("--why", default="", help="Reason shown with the node's devices.")
@json_option
@click.pass_obj
def node_down(obj: CliContext, node: str, why: str, json_output: bool) -> None:
    """Simulate NODE vanishing: its devices become unavailable and cannot be reserved."""
    f = _sim(obj)
    was_up = node_states(f).get(node, (True, ""))[0]
    f.set_node_up(node, False, why)
    if json_output:
        emit_action("marked_down" if was_up else "unchanged", node=node, why=why)
    else:
        click.echo(f"node {node} marked down; its devices are unavailable")


@fabric.command("node-up")
@click.argument("node", shell_complete=complete_nodes)
@json_option
@click.pass_obj
def node_up(obj: CliContext, node: str, json_output: bool) -> None:
    """Bring a node marked down back."""
    f = _sim(obj)
    was_up = node_states(f).get(node, (True, ""))[0]
    f.set_node_up(node, True)
    if json_output:
        emit_action("unchanged" if was_up else "marked_up", node=node)
    else:
        click.echo(f"node {node} marked up")


@fabric.command("link-down")
@click.argument("link")
@json_option
@click.pass_obj
def link_down(obj: CliContext, link: str, json_output: bool) -> None:
    """Simulate cable LINK failing (a `[[link]]` as `a:0-b:0`, a switch port as `sw/a:0`, a
    cable between switches as `sw1-sw2`; `vmlend fabric show` lists them). Reads through a
    mapping across it return all ones, writes are dropped; new reservations route around it."""
    _link_report(obj, _sim(obj).set_link_up(link, False), json_output)


@fabric.command("link-up")
@click.argument("link")
@click.option(
    "--lost",
    is_flag=True,
    help="The adapters at its ends were reset while it was down: their mappings are gone.",
)
@json_option
@click.pass_obj
def link_up(obj: CliContext, link: str, lost: bool, json_output: bool) -> None:
    """Bring cable LINK back, with its mappings intact (or, with --lost, without them)."""
    _link_report(obj, _sim(obj).set_link_up(link, True, keep_mappings=not lost), json_output, lost)


def _link_report(
    obj: CliContext, change: LinkChange, json_output: bool, lost: bool = False
) -> None:
    """Print what the link event did, and write each affected device's line to the action
    log beside an SQLite state (where ``vmlend hook log`` shows it)."""
    link, state = change.link, "up" if change.up else "down"
    down = _sim(obj).links_down()
    sqlite_path = parse_location(obj.location).path
    if sqlite_path is not None and change.faults:
        actions = ActionLog(log_path_for_state(sqlite_path))
        for f in change.faults:
            actions.record(f.holder.vm, f"link-{state}", f.line())
    if json_output:
        emit_action(
            f"marked_{state}" if change.changed else "unchanged",
            link=link,
            state=state,
            changed=change.changed,
            mappings=None if state == "down" else ("lost" if lost else "kept"),
            links_down=down,
            devices=[
                {"fdid": f"{f.fdid:#x}", "holder": str(f.holder)} | f.record()
                for f in change.faults
            ],
        )
        return
    if not change.changed:
        click.echo(f"link {link} was {state} already")
        return
    kept = "" if state == "down" else (", mappings lost" if lost else ", mappings kept")
    click.echo(f"link {link} marked {state}{kept}; down now: {', '.join(down) or 'none'}")
    for f in change.faults:
        click.echo(f"  {f.line()}")


@fabric.command("reclaim")
@click.argument("fdid", type=FDID)
@json_option
@click.pass_obj
def reclaim(obj: CliContext, fdid: int, json_output: bool) -> None:
    """Simulate FDID's lender taking it back: its hold, claims and mdev end in one step."""
    holder = _sim(obj).reclaim(fdid)
    if json_output:
        action = "unchanged" if holder is None else "reclaimed"
        emit_action(action, fdid=f"{fdid:#x}", holder=None if holder is None else str(holder))
    elif holder is None:
        click.echo(f"device {fdid:#x} was not held: nothing to reclaim")
    else:
        click.echo(f"device {fdid:#x} reclaimed from {holder}; it stays lent")


COMMANDS = [fabric]
