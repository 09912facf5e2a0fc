"""``vmlend agent``: this host's service (foreground; SIGTERM stops it). On a cluster registry
it keeps the host's lease and fences; on any registry it serves the libvirt hook."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

import click

from vmlend.agent.service import DEFAULT_INTERVAL, DEFAULT_TTL, Agent, AgentConfig
from vmlend.cli.common import Seconds, hook_socket_option
from vmlend.cli.connect import open_hv
from vmlend.cli.context import CliContext
from vmlend.errors import ConfigError
from vmlend.hook.server import HookServer, identity_of, read_timeout_from_env
from vmlend.hostenv import ROOT_ENV, HostEnv
from vmlend.registry import hostlease
from vmlend.settings import NODE_ENV, REGISTRY_ENV, STATE_ENV
from vmlend.wiring.fabric import BACKEND_ENV

log = logging.getLogger(__name__)


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
    type=Seconds(0.05, 60),
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
@hook_socket_option("Serve the hook on this socket (give 'vmlend hook install' the same one)")
@click.pass_obj
def agent_cmd(
    obj: CliContext, ttl: int, interval: float, uri: str | None, hook_socket: Path | None
) -> None:
    """Serve the libvirt hook and, on a cluster registry, hold this host's lease and take back
    devices whose borrower's lease ended.

    The hook is served on <root>/run/vmlend/hook.sock (the installed hook forwards to it). On
    an SQLite registry the agent only serves the hook: no lease, no fencing scan. Runs in the
    foreground until SIGTERM or SIGINT."""
    _timestamped()
    on_etcd = obj.registry is not None and obj.registry.startswith(("etcd://", "etcds://"))
    host = HostEnv.from_env(obj.root)
    node = obj.node or host.configured_node()
    if on_etcd and not node:
        raise ConfigError(
            "'vmlend agent' needs --node, VMLEND_NODE or etc/vmlend/node: which node this host is"
        )
    if obj.root is not None:
        # The hook calls this agent runs find the host root where a hook process does.
        os.environ[ROOT_ENV] = str(obj.root)
    if obj.backend is not None:
        os.environ[BACKEND_ENV] = obj.backend  # the fabric it opens and the hook calls it runs
    socket_path = hook_socket or hostlease.hook_socket_path(host)
    server = HookServer(
        socket_path,
        identity_of(_hook_env(obj, node)),
        read_timeout=read_timeout_from_env(os.environ),
    )
    server.check_free()  # before the lease: a second agent on this host changes nothing
    stop_event = threading.Event()

    def stop(signum: int, frame: FrameType | None) -> None:
        stop_event.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if not on_etcd:
        log.warning(
            "agent on the SQLite registry %s: serving the hook only (no lease, no fencing scan;"
            " those need a cluster registry, --registry etcd://HOST:PORT/CLUSTER)",
            obj.location,
        )
        server.start()
        try:
            while not stop_event.wait(3600):
                pass
        finally:
            server.stop()
        return
    uri = uri or obj.uri  # its own -c wins over the global one
    hv = (lambda: open_hv(obj, uri)) if uri else None
    agent = Agent(
        AgentConfig(
            obj.location,
            node or "",
            hostlease.lease_path(host),
            ttl,
            interval,
            hypervisor=hv,
            hook_server=server,
        )
    )
    agent.stop_event = stop_event
    sys.exit(agent.run())


def _hook_env(obj: CliContext, node: str | None) -> dict[str, str]:
    """The environment a hook process of this agent's host works under: the process's own,
    with this command's --state/--registry/--node/--root in it."""
    env = dict(os.environ)
    env[STATE_ENV] = str(obj.state_path)
    for name, value in ((REGISTRY_ENV, obj.registry), (NODE_ENV, node), (ROOT_ENV, obj.root)):
        if value:
            env[name] = str(value)
        else:
            env.pop(name, None)
    return env


COMMANDS = [agent_cmd]


def _timestamped() -> None:
    """A long-running service's lines say when (UTC, milliseconds): what happened in which
    order around a lease loss is read from them."""
    formatter = logging.Formatter(
        "%(asctime)s.%(msecs)03dZ vmlend: %(message)s", datefmt="%Y-%m-%dT%H:%M:%S"
    )
    formatter.converter = time.gmtime
    for handler in logging.getLogger().handlers:
        handler.setFormatter(formatter)
