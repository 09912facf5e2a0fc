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
import msgspec

from vmlend.agent.metrics import AgentMetrics, MetricsAccess, parse_address, parse_user
from vmlend.agent.service import DEFAULT_INTERVAL, DEFAULT_TTL, Agent, AgentConfig
from vmlend.cli.common import Seconds, emit_action, hook_socket_option, json_option
from vmlend.cli.connect import open_hv
from vmlend.cli.context import CliContext
from vmlend.errors import ConfigError
from vmlend.hook.server import HookServer, identity_of, read_timeout_from_env
from vmlend.hostenv import ROOT_ENV, HostEnv
from vmlend.notify import Notifier
from vmlend.registry import hostlease
from vmlend.settings import NODE_ENV, REGISTRY_ENV, STATE_ENV
from vmlend.wiring.fabric import BACKEND_ENV

log = logging.getLogger(__name__)


class MetricsUser(click.ParamType[tuple[str, str]]):
    """``USER:BCRYPT-HASH`` (``vmlend.agent.metrics.parse_user``)."""

    name = "user:bcrypt"

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> tuple[str, str]:
        if isinstance(value, tuple):
            return value
        try:
            return parse_user(str(value))
        except ConfigError as e:
            self.fail(str(e), param, ctx)


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
@click.option(
    "--metrics",
    "metrics_at",
    metavar="HOST:PORT",
    help="Serve Prometheus metrics at http://HOST:PORT/metrics (LUT and window use, holds,"
    " fences, lease age, hook calls, the process) and the agent's health at /health; :PORT"
    " listens on 127.0.0.1 only [default: not served].",
)
@click.option(
    "--metrics-tls-cert",
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="Serve the metrics over HTTPS with this PEM certificate (with --metrics-tls-key).",
)
@click.option(
    "--metrics-tls-key",
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="The metrics certificate's unencrypted PEM key.",
)
@click.option(
    "--metrics-user",
    "metrics_users",
    multiple=True,
    type=MetricsUser(),
    metavar="USER:BCRYPT",
    help="A user who may scrape, with a bcrypt hash of their password ('htpasswd -nBC 12"
    " USER'), as Prometheus's exporter web configuration; repeatable. Given, every request"
    " needs basic auth. Best kept in the configuration file ([agent] metrics-user = [...]).",
)
@click.option(
    "--take-over",
    is_flag=True,
    help="Bind the node name to this host although another host's machine-id holds it (a"
    " reinstalled or replaced host), once that host's lease has expired.",
)
@click.pass_obj
def agent_cmd(
    obj: CliContext,
    ttl: int,
    interval: float,
    uri: str | None,
    hook_socket: Path | None,
    metrics_at: str | None,
    take_over: bool,
    metrics_tls_cert: str | None = None,
    metrics_tls_key: str | None = None,
    metrics_users: tuple[tuple[str, str], ...] = (),
) -> None:
    """Serve the libvirt hook and, on a cluster registry, hold this host's lease and take back
    devices whose borrower's lease ended.

    The hook is served on <root>/run/vmlend/hook.sock (the installed hook forwards to it). On
    an SQLite registry the agent only serves the hook: no lease, no fencing scan. Runs in the
    foreground until SIGTERM or SIGINT, which keep the lease for the next agent (a restart
    disturbs no VM; 'vmlend drain' gives the lease up); SIGHUP re-reads the registry's
    endpoints from the configuration file."""
    _timestamped()
    # A service says what it decides, one sentence each (WARNING is for trouble).
    logging.getLogger("vmlend").setLevel(min(logging.getLogger("vmlend").level or 20, 20))
    _to_system_log(obj.root)
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
    metrics = AgentMetrics()
    server = HookServer(
        socket_path,
        identity_of(_hook_env(obj, node)),
        read_timeout=read_timeout_from_env(os.environ),
        observe=metrics.observe_hook,
    )
    # Bound before the lease: a bad address, a port in use or an unusable certificate changes
    # nothing.
    access = MetricsAccess(metrics_tls_cert, metrics_tls_key, dict(metrics_users))
    if not metrics_at and access != MetricsAccess():
        raise ConfigError(
            "metrics-tls-cert, metrics-tls-key and metrics-user configure the metrics endpoint:"
            " give --metrics HOST:PORT too"
        )
    scrape = None
    if metrics_at:
        from vmlend.agent.metrics_http import MetricsServer

        scrape = MetricsServer(metrics, parse_address(metrics_at), access)
        scrape.bind()
    server.check_free()  # before the lease: a second agent on this host changes nothing
    if scrape is not None:
        scrape.start()
    try:
        _serve(obj, node, on_etcd, uri, ttl, interval, host, server, metrics, take_over)
    finally:
        if scrape is not None:
            scrape.stop()


def _serve(
    obj: CliContext,
    node: str | None,
    on_etcd: bool,
    uri: str | None,
    ttl: int,
    interval: float,
    host: HostEnv,
    server: HookServer,
    metrics: AgentMetrics,
    take_over: bool = False,
) -> None:
    stop_event = threading.Event()
    reload_event = threading.Event()

    def stop(signum: int, frame: FrameType | None) -> None:
        stop_event.set()

    def reload(signum: int, frame: FrameType | None) -> None:
        reload_event.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, reload)
    if not on_etcd:
        log.warning(
            "agent on the SQLite registry %s: serving the hook only (no lease, no fencing scan;"
            " those need a cluster registry, --registry etcd://HOST:PORT/CLUSTER)",
            obj.location,
        )
        from vmlend.agent.identity import HostLock

        # The hook asks this lock whether the agent lives: while it does, no hook runs a call
        # beside it (two writers of one host), on SQLite as on etcd.
        lock = HostLock.of(host)
        lock.acquire()
        metrics.follow(
            open_fabric=lambda: obj.fabric(read_only=True),
            health=lambda: (True, f"serving the hook on {server.path} (SQLite: no lease)"),
        )
        server.start()
        notifier = Notifier()
        notifier.ready(f"serving the hook on {server.path} (SQLite: no lease)")
        tick = notifier.watchdog_seconds / 4 if notifier.watchdog_seconds else 3600
        try:
            while not stop_event.wait(tick):
                notifier.watchdog()
        finally:
            notifier.stopping("stopping")
            server.stop()
            lock.release()
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
            metrics=metrics,
            host=host,
            take_over=take_over,
            reload=lambda: _registry_in_file(obj),
        )
    )
    agent.stop_event = stop_event
    agent.reload_event = reload_event
    sys.exit(agent.run())


def _registry_in_file(obj: CliContext) -> str | None:
    """The registry URL the configuration file names now (SIGHUP), if any."""
    from vmlend.config import config_path, read_config

    path = config_path(str(obj.config_path) if obj.config_path else None, root=obj.root)
    value = read_config(path).get("registry")
    return value if isinstance(value, str) else None


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


@click.command("drain")
@click.option(
    "-c",
    "--connect",
    "uri",
    metavar="URI",
    help="This host's hypervisor: drain refuses while a VM here uses a remote device.",
)
@json_option
@click.pass_obj
def drain_cmd(obj: CliContext, uri: str | None, json_output: bool) -> None:
    """Decommission this host's agent: give up its lease (every record of the host goes with
    it) and its node name. Run with the agent stopped, once no VM here uses a remote device;
    a stop or restart of the agent keeps the lease, so only this gives it up."""
    from vmlend.agent.drain import drain, vms_with_remote_devices
    from vmlend.agent.identity import HostLock, machine_id
    from vmlend.registry.session import EtcdSession

    host = HostEnv.from_env(obj.root)
    node = obj.node or host.configured_node()
    if not node:
        raise ConfigError("'vmlend drain' needs --node, VMLEND_NODE or etc/vmlend/node")
    uri = uri or obj.uri
    with obj.fabric() as fabric:
        registry = getattr(fabric, "registry", None)
        if registry is None or not hasattr(registry, "gateway"):
            raise ConfigError("'vmlend drain' drains a host of a cluster registry (etcd)")
        running = None
        if uri:
            lenders = {d.fdid: d.lender for d in fabric.topology().devices}
            running = vms_with_remote_devices(open_hv(obj, uri), node, lenders)
        else:
            click.echo(
                "vmlend: no hypervisor given (-c URI): not checked whether VMs here use remote"
                " devices",
                err=True,
            )
        session = EtcdSession(registry.gateway, registry.keys, node)
        done = drain(
            session,
            HostLock.of(host),
            hostlease.lease_path(host),
            machine_id(host),
            running,
        )
    if json_output:
        action = "drained" if done.revoked or done.unbound else "unchanged"
        emit_action(action, **msgspec.to_builtins(done))
        return
    for line in done.lines:
        click.echo(line)


COMMANDS = [agent_cmd, drain_cmd]


def _to_system_log(root: Path | None) -> None:
    """Also log to journald (or syslog) with the VM and device as fields, where the host has
    one. Under systemd, stderr already goes to the journal (``JOURNAL_STREAM`` names it): the
    stderr lines stop then, or every line would be there twice."""
    from vmlend.journal import SystemLogHandler, open_system_log

    sink = open_system_log(HostEnv.from_env(root).root, "vmlend-agent")
    if sink is None:
        return
    top = logging.getLogger()
    top.addHandler(SystemLogHandler(sink))
    if _stderr_is_the_journal():
        for handler in list(top.handlers):
            if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stderr:
                top.removeHandler(handler)


def _stderr_is_the_journal() -> bool:
    device, _, inode = os.environ.get("JOURNAL_STREAM", "").partition(":")
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):
        return False
    return f"{st.st_dev}:{st.st_ino}" == f"{device}:{inode}"


def _timestamped() -> None:
    """A long-running service's lines say when (UTC, milliseconds): what happened in which
    order around a lease loss is read from them."""
    formatter = logging.Formatter(
        "%(asctime)s.%(msecs)03dZ vmlend: %(message)s", datefmt="%Y-%m-%dT%H:%M:%S"
    )
    formatter.converter = time.gmtime
    for handler in logging.getLogger().handlers:
        handler.setFormatter(formatter)
