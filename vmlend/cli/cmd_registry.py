"""``vmlend registry roles``: the etcdctl commands that give each host its etcd user and role;
``vmlend registry upgrade``: bring a cluster's stored layout to the one this vmlend writes."""

from __future__ import annotations

from typing import cast

import click

from vmlend.cli.common import emit_action, emit_json, json_option, read_input
from vmlend.cli.context import CliContext
from vmlend.errors import ConfigError, TopologyError


@click.group("registry")
def registry() -> None:
    """The cluster registry in etcd: who may write which of its keys, and its stored layout."""


@registry.command("roles")
@click.option(
    "--topology",
    "topology_file",
    type=click.Path(dir_okay=False),
    help="Take the nodes from this topology file (TOML) instead of the registry.",
)
@click.option(
    "--only",
    "only",
    multiple=True,
    metavar="NODE",
    help="Only this host's user and role (a host added later); repeatable. Leaves out etcd's"
    " root user, the administrator and 'auth enable'.",
)
@json_option
@click.pass_obj
def roles_cmd(
    obj: CliContext, topology_file: str | None, only: tuple[str, ...], json_output: bool
) -> None:
    """Print the etcdctl commands that give every host of the cluster (--registry) an etcd
    user and role (its own node's keys and the shared ones) and the administrator one (the
    whole cluster), then enable etcd's authentication. vmlend runs none of them: review the
    script and run it with etcdctl (docs/cluster.md, "Users and roles")."""
    from vmlend.registry import parse_location
    from vmlend.registry.etcd_keys import Keys
    from vmlend.registry.roles import (
        EtcdctlTarget,
        admin_of,
        admin_permissions,
        etcdctl_script,
        host_permissions,
        user_of,
    )

    loc = parse_location(obj.location)
    if not loc.endpoints:
        raise ConfigError(
            "'vmlend registry roles' is for a cluster registry: give --registry"
            " etcd://HOST:PORT/CLUSTER (the users and roles are etcd's)"
        )
    nodes = _nodes(obj, topology_file)
    unknown = [n for n in only if n not in nodes]
    if unknown:
        raise ConfigError(f"no node {unknown[0]!r} in the topology (its nodes: {', '.join(nodes)})")
    chosen = list(only) or nodes
    if json_output:
        keys = Keys(loc.cluster)
        roles = [] if only else [(admin_of(loc.cluster), admin_permissions(keys))]
        roles += [(user_of(loc.cluster, n), host_permissions(keys, n)) for n in chosen]
        emit_json(
            {
                "cluster": loc.cluster,
                "roles": [
                    {
                        "role": name,
                        "user": name,
                        "permissions": [
                            {"kind": p.kind, "key": p.key, "prefix": p.prefix} for p in perms
                        ],
                    }
                    for name, perms in roles
                ],
            }
        )
        return
    scheme = "http" if loc.tls is None else "https"
    target = EtcdctlTarget(
        tuple(
            f"{scheme}://[{e.host}]:{e.port}" if ":" in e.host else f"{scheme}://{e}"
            for e in loc.endpoints
        ),
        *((loc.tls.cacert, loc.tls.cert, loc.tls.key) if loc.tls is not None else ()),
    )
    click.echo(etcdctl_script(loc.cluster, chosen, target, only=bool(only)), nl=False)


@registry.command("upgrade")
@json_option
@click.pass_obj
def upgrade_cmd(obj: CliContext, json_output: bool) -> None:
    """Bring the stored layout of the cluster registry (--registry) to the one this vmlend
    writes. Run it once, from any host, with every host's agent stopped and its lease ended
    (refused while one lives); then upgrade vmlend on every host and start the agents
    (docs/cluster.md, "Upgrading the stored layout"). Running it again changes nothing."""
    from vmlend.registry import open_registry, parse_location
    from vmlend.registry.etcd_store import EtcdRegistry
    from vmlend.registry.upgrade import upgrade

    loc = parse_location(obj.location)
    if not loc.endpoints:
        raise ConfigError(
            "'vmlend registry upgrade' is for a cluster registry (--registry"
            " etcd://HOST:PORT/CLUSTER): an SQLite state file is upgraded when it is opened"
        )
    with open_registry(loc, upgrading=True) as reg:
        result = upgrade(cast(EtcdRegistry, reg))  # an etcd location opens the etcd backend
    if json_output:
        emit_action(
            "upgraded" if result.steps else "unchanged",
            registry=result.registry,
            before=result.before,
            after=result.after,
            steps=result.steps,
        )
        return
    if not result.steps:
        click.echo(f"{result.registry}: layout {result.after} already; nothing to upgrade")
        return
    click.echo(f"{result.registry}: layout {result.before} -> {result.after}")
    for step in result.steps:
        click.echo(f"  {step}")


def _nodes(obj: CliContext, topology_file: str | None) -> list[str]:
    """The topology's node names: from ``topology_file``, else from the registry."""
    if topology_file is not None:
        from vmlend.topology.parse import MAX_TOPOLOGY_BYTES, parse_topology

        try:
            text = read_input(topology_file, MAX_TOPOLOGY_BYTES).decode()
        except UnicodeDecodeError:
            raise TopologyError(topology_file, "not a text file") from None
        return [n.name for n in parse_topology(text, topology_file).nodes]
    from vmlend.registry import open_registry
    from vmlend.topology.compiled import stored_topology

    with open_registry(obj.location) as reg, reg.read() as tx:
        return [n.name for n in stored_topology(tx.topology()).nodes]


COMMANDS = [registry]
