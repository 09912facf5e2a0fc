"""``vmlend agent``: this host's service for a cluster registry (foreground; SIGTERM stops it)."""

from __future__ import annotations

import signal
import sys
from types import FrameType

import click

from vmlend.agent.service import DEFAULT_INTERVAL, DEFAULT_TTL, Agent, AgentConfig
from vmlend.cli.connect import open_hv
from vmlend.cli.context import CliContext
from vmlend.errors import ConfigError
from vmlend.hostenv import HostEnv
from vmlend.registry import hostlease


@click.command("agent")
@click.option(
    "--ttl",
    default=DEFAULT_TTL,
    show_default=True,
    type=click.IntRange(2, 3600),
    help="Lease TTL in seconds: how long after this host dies its holds vanish.",
)
@click.option(
    "--interval",
    default=DEFAULT_INTERVAL,
    show_default=True,
    type=click.FloatRange(0.05, 60),
    help="Seconds between scans for fenced devices this node lends.",
)
@click.option(
    "-c",
    "--connect",
    "uri",
    metavar="URI",
    help="This host's hypervisor (e.g. qemu:///system, sim:///gamma): VMs with remote devices"
    " are paused while the lease is in doubt [default: none guarded].",
)
@click.pass_obj
def agent_cmd(obj: CliContext, ttl: int, interval: float, uri: str | None) -> None:
    """Hold this host's lease on the cluster registry and take back devices whose borrower's
    lease ended. Runs in the foreground until SIGTERM or SIGINT."""
    if obj.registry is None or not obj.registry.startswith(("etcd://", "etcds://")):
        raise ConfigError("'vmlend agent' needs --registry etcd://HOST:PORT/CLUSTER")
    host = HostEnv.from_env(obj.root)
    node = obj.node or host.configured_node()
    if not node:
        raise ConfigError(
            "'vmlend agent' needs --node, VMLEND_NODE or etc/vmlend/node: which node this host is"
        )
    uri = uri or obj.uri  # its own -c wins over the global one
    hv = (lambda: open_hv(obj, uri)) if uri else None
    agent = Agent(
        AgentConfig(obj.registry, node, hostlease.lease_path(host), ttl, interval, hypervisor=hv)
    )

    def stop(signum: int, frame: FrameType | None) -> None:
        agent.stop_event.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    sys.exit(agent.run())


COMMANDS = [agent_cmd]
