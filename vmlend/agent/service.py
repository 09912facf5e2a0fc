"""``vmlend agent``: one host's service on a cluster registry.

It keeps the host's lease (``keepalive``: a thread of its own), guards the host's VMs with
remote devices (``borrower``: a worker per VM), takes back the devices this node lends whose
holder's lease ended (``lender``), lands the releases the host's hooks could not
(``release_journal``), serves plug requests and the libvirt hook. The loop is a handful of
verbs, each bounded, none of which waits on a hypervisor call:

    keep the lease      a lost lease is replaced, the host's records moved onto the new one
    take back           fenced devices this node lends
    land releases       after a renewal, what the hooks journalled
    report              VMs whose hypervisor calls do not come back
    say                 the lease's state changes, one INFO sentence each

Start-up, in order: one agent per host (its lock), which host this is (``identity``), the
lease (the previous agent's adopted while it lives: a restart disturbs no VM; else a new one,
and the VMs' holds won back), the VMs (census and pause marks), the start-up reconcile, then
the hook. A stop (SIGTERM) keeps the lease for the next agent; ``vmlend drain`` gives it up.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import msgspec

from vmlend.agent.borrower import Borrower, GuestTable, NoBorrower
from vmlend.agent.clock import LeaseClock, LeaseState
from vmlend.agent.guest import GuestSettings, limit
from vmlend.agent.identity import Binding, HostLock, bind_node, machine_id
from vmlend.agent.keepalive import Keepalive
from vmlend.agent.leasehold import LeaseHold
from vmlend.agent.lender import take_back_fenced
from vmlend.agent.metrics import AgentMetrics
from vmlend.agent.pause_marks import PauseMarks
from vmlend.agent.plugs import PlugServer
from vmlend.agent.reconcile import Reconciler, reconcile_host
from vmlend.agent.trouble import Trouble
from vmlend.errors import ConfigError, StateError, VmlendError
from vmlend.events import EventLog
from vmlend.fabric.base import Fabric, RegistryFabric, TakesBack
from vmlend.hook.server import HookServer
from vmlend.hostenv import HostEnv
from vmlend.hypervisor.base import Hypervisor
from vmlend.notify import Notifier
from vmlend.ops.plug_request import PlugRequest
from vmlend.registry import EtcdRegistry
from vmlend.registry.etcd_gateway import call_deadline
from vmlend.registry.session import EtcdSession, HostKey
from vmlend.release_journal import ReleaseJournal, running_here
from vmlend.wiring.fabric import Location, open_fabric

log = logging.getLogger(__name__)


DEFAULT_TTL = 10
DEFAULT_INTERVAL = 0.5


class AgentFabric(Fabric, TakesBack, Protocol):
    """What the agent serves on: a fabric that can take fenced devices back."""


class AgentConfig(msgspec.Struct):
    location: Location
    node: str
    lease_file: Path
    ttl: int = DEFAULT_TTL
    interval: float = DEFAULT_INTERVAL
    #: Opens this host's hypervisor (to guard VMs with remote devices); None: none to guard.
    hypervisor: Callable[[], Hypervisor] | None = None
    #: Makes the registry match this host's VMs at start-up (with a hypervisor only).
    reconciler: Reconciler = reconcile_host
    #: Serves the libvirt hook (``vmlend.hook.server``) while the host's lease is held.
    hook_server: HookServer | None = None
    #: Tells systemd when the agent serves, how it is, and that it still runs (sd_notify).
    notifier: Notifier = msgspec.field(default_factory=Notifier)
    #: What the agent counts; scraped when ``vmlend agent --metrics`` serves it.
    metrics: AgentMetrics = msgspec.field(default_factory=AgentMetrics)
    #: Opens this host's fabric (None: ``open_fabric`` on ``location`` for ``node``; tests
    #: pass a kernel backend over a fake sysfs).
    fabric: Callable[[], Fabric] | None = None
    #: The host root (machine-id, run directory, journal); None: ``$VMLEND_ROOT`` or ``/``.
    host: HostEnv | None = None
    #: Rebind the node name to this host although another host's machine-id holds it (once
    #: that host's lease has expired).
    take_over: bool = False
    #: The registry URL the configuration names now (SIGHUP re-reads it); None: unchanged.
    reload: Callable[[], str | None] | None = None

    @property
    def run_dir(self) -> Path:
        return self.lease_file.parent

    @property
    def pause_marks_dir(self) -> Path:
        """Where the agent marks the VMs it paused (``pause_marks``): beside its lease file,
        in the host's run directory."""
        return self.run_dir / "paused"


class Agent:
    def __init__(self, config: AgentConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._now = clock
        self.stop_event = threading.Event()
        #: Set by SIGHUP: the loop reopens its registry connections (new endpoints).
        self.reload_event = threading.Event()
        self.clock = LeaseClock(clock, EventLog.from_env(config.node))
        self.taken_back: list[int] = []
        #: Keepalives answered (the metrics, and tests that a renewal waits for nothing).
        self.renewals = 0
        #: The plug requests this agent answered, with their outcome.
        self.plugged: list[PlugRequest] = []
        self.borrower: Borrower = NoBorrower()
        self._host = config.host or HostEnv.from_env()
        self._lock = HostLock(config.run_dir / "agent.lock")
        self._session: EtcdSession | None = None
        self._keepalive_session: EtcdSession | None = None
        self._renewed = threading.Event()
        self.lease: LeaseHold
        self._said: tuple[LeaseState, int, bool] | None = None
        self._scan_trouble = Trouble(log, "looking for fenced devices")

    # --- start and stop -----------------------------------------------------------------------
    def run(self) -> int:
        """Serve until ``stop_event``: 0, or 3 when stopped before a lease was held."""
        self._lock.acquire()  # before anything: a second agent on this host changes nothing
        try:
            return self._run()
        finally:
            if self.config.hook_server is not None:
                self.config.hook_server.stop()  # idempotent
            self._lock.release()

    def _run(self) -> int:
        cfg = self.config
        me = machine_id(self._host)
        fabric = self.open_fabric()
        self._session = self._new_session(_cluster_registry(fabric))
        keepalive_fabric = self.open_fabric()  # its own connection: it waits for nothing
        self._keepalive_session = self._new_session(_cluster_registry(keepalive_fabric))
        keepalive = Keepalive(
            self.clock,
            lambda: self._keepalive_session_(),
            now=self._now,
            renewed=self._on_renewal,
            failed=cfg.metrics.renew_failed,
        )
        hold = self.lease = LeaseHold(
            self._session_,
            self.clock,
            node=cfg.node,
            ttl=cfg.ttl,
            lease_file=cfg.lease_file,
            host_key=lambda g: HostKey(
                g.id, os.getpid(), g.ttl, plugs=cfg.hypervisor is not None, machine_id=me
            ),
            stop=self.stop_event,
            interval=cfg.interval,
            now=self._now,
            wake=keepalive.wake,
        )
        try:
            previous = hold.previous()
            verdict = hold.until_reachable(
                lambda: bind_node(self._session_(), me, previous, take_over=cfg.take_over)
            )
            if verdict is Binding.TAKE_OVER:
                log.warning("node %s is now bound to this host (machine-id %s)", cfg.node, me)
            lease = hold.until_reachable(lambda: hold.adopt_or_grant(previous))
            if verdict is None or lease is None:
                return 3
            keepalive.start()
            hold.settle(lease, previous, adopted=lease.id == previous)
            if self.stop_event.is_set():
                return 3
            cfg.notifier.status(f"serving node {cfg.node}: lease {lease.id:x} held")
            return self._serve(fabric)
        finally:
            keepalive.stop()
            keepalive_fabric.close()
            fabric.close()

    def _serve(self, fabric: AgentFabric) -> int:
        cfg = self.config
        hv = cfg.hypervisor() if cfg.hypervisor is not None else None
        if hv is not None:
            self.borrower = GuestTable(
                hv,
                self.clock,
                self.open_fabric,
                node=cfg.node,
                lenders={d.fdid: d.lender for d in fabric.topology().devices},
                marks=PauseMarks(cfg.pause_marks_dir),
                settings=GuestSettings(
                    period=min(cfg.interval * 5, cfg.ttl / 4),
                    fence_wait=float(cfg.ttl),
                    interval=cfg.interval,
                ),
                recovered=lambda r: cfg.metrics.recovered([r]),
                now=self._now,
            )
        cfg.metrics.follow(
            lease=_LeaseSource(self.clock, self.borrower),
            ttl=cfg.ttl,
            registry=_cluster_registry(fabric),
            open_fabric=self.open_fabric,
            health=self._health,
        )
        journal = ReleaseJournal.for_host(self._host)
        self.borrower.start()
        self._land_releases(journal, fabric, hv)
        if hv is not None:
            self.borrower.settle(float(cfg.ttl))
            lines = self.lease.until_reachable(lambda: cfg.reconciler(hv, fabric))
            if lines is None:
                return self._stopped()
            for line in lines:
                log.info("start-up reconcile: %s", line)
            log.info("start-up reconcile of %s done (%d line(s))", cfg.node, len(lines))
        if cfg.hook_server is not None:
            # Last: nothing is served before this host's records are on its current lease and
            # its running VMs are guarded.
            cfg.hook_server.before = self._before_hook_call
            cfg.hook_server.start()
        cfg.notifier.ready(f"serving node {cfg.node}: lease {self.clock.view().lease:x} held")
        plugs = PlugServer(self, hv) if hv is not None else None
        if plugs is not None:
            plugs.start(cfg.interval)
        try:
            self._loop(fabric, journal, hv)
        finally:
            if plugs is not None:
                plugs.stop(call_deadline(cfg.ttl))
        return self._stopped()

    def _stopped(self) -> int:
        """A stop: the lease stays for the next agent (it adopts it within its TTL: no VM is
        paused or loses a device); ``vmlend drain`` gives it up."""
        cfg = self.config
        cfg.notifier.stopping("stopping: the lease is kept for the next agent")
        if cfg.hook_server is not None:
            cfg.hook_server.stop()  # what it accepted still runs under the lease
        self.borrower.stop()
        view = self.clock.view()
        log.warning(
            "agent for %s stopped; lease %x is kept for the next agent (it ends %.0f s after"
            " its last renewal unless one adopts it; 'vmlend drain' gives it up)",
            cfg.node,
            view.lease,
            view.ttl,
        )
        return 0

    # --- the loop -----------------------------------------------------------------------------
    def _loop(self, fabric: AgentFabric, journal: ReleaseJournal, hv: Hypervisor | None) -> None:
        cfg = self.config
        while not self.stop_event.is_set():
            self._say()
            if self.reload_event.is_set():
                fabric = self._reload(fabric)
            view = self.clock.view()
            if view.state is LeaseState.LOST:
                cfg.metrics.lease_lost()
                cfg.notifier.status(f"lease {view.lease:x} lost: taking a new one")
                if not self.lease.replace(view.lease):
                    return
                lease = self.clock.view().lease
                cfg.notifier.status(f"serving node {cfg.node}: lease {lease:x} held")
                continue
            self.taken_back += take_back_fenced(fabric, self._scan_trouble)
            if self._renewed.is_set():
                self._renewed.clear()
                self._land_releases(journal, fabric, hv)
            self.borrower.report(stuck_after=call_deadline(cfg.ttl) * 2)
            cfg.notifier.watchdog()  # the loop turns: a hang here gets the agent restarted
            self.stop_event.wait(cfg.interval)

    def _say(self) -> None:
        """One INFO sentence when the lease's state changes (WARNING when it is trouble)."""
        view = self.clock.view()
        now = (view.state, view.lease, view.followed)
        if now == self._said:
            return
        self._said = now
        if view.state is LeaseState.HELD:
            log.info("lease %x held (%.1f s of %g s left)", view.lease, view.left, view.ttl)
        elif view.state is LeaseState.DOUBT:
            guarded = (
                "; VMs with remote devices are paused until a renewal lands"
                if self.config.hypervisor is not None
                else ""
            )
            log.warning(
                "lease %x in doubt: not renewed for %.1f s (%.1f s of %g s left)%s",
                view.lease,
                self.clock.age(),
                max(0.0, view.left),
                view.ttl,
                guarded,
            )
        else:
            log.error("lease %x lost: this host's holds are gone", view.lease)

    def _health(self) -> tuple[bool, str]:
        """What ``/health`` says: well while the lease is settled (held, and this host's
        records on it), one line either way."""
        view = self.clock.view()
        line = (
            f"node {self.config.node}: lease {view.lease:x} {view.state.value}"
            f" ({max(0.0, view.left):.1f} s of {view.ttl:g} s left)"
        )
        return view.settled, line

    def _on_renewal(self) -> None:
        self.renewals += 1
        self._renewed.set()

    # --- what the loop and the hook server call -----------------------------------------------
    def _before_hook_call(self, action: str, vm: str, xml: bytes) -> str | None:
        """Run by the hook server before a call (never waits on libvirt): the prepare of a VM
        with remote devices announces it to the guard, and is refused while the lease is not
        settled (its VM would be paused at once, and its reserve may be under a lease about
        to end)."""
        if action != "prepare" or not self.borrower.guards(xml):
            return None
        view = self.clock.view()
        if not view.settled:
            words = {"held": "new", "doubt": "in doubt", "lost": "lost"}[view.state.value]
            return (
                f"cannot start VM {vm!r} now: this host's lease is {words}"
                f" ({max(0.0, view.left):.1f} s of {view.ttl:g} s left); 'vmlend agent' pauses"
                " VMs with remote devices until it renews; start it again then"
            )
        self.borrower.announce(vm)
        return None

    def _land_releases(
        self, journal: ReleaseJournal, fabric: Fabric, hv: Hypervisor | None
    ) -> None:
        """Retry the releases this host's hooks could not land (etcd was away): only of VMs
        the hypervisor says do not run here (bounded: a hung one is asked once)."""
        try:
            timeout = call_deadline(self.config.ttl)
            for line in journal.settle(fabric, runs=running_here(hv, timeout)):
                log.info("%s", line)
        except StateError as e:
            log.info("pending releases wait: %s", e)

    def _reload(self, fabric: AgentFabric) -> AgentFabric:
        """SIGHUP: reopen the registry connections (the endpoint list may have changed); the
        lease and every VM stay as they are."""
        self.reload_event.clear()
        cfg = self.config
        try:
            url = cfg.reload() if cfg.reload is not None else None
            if url is not None and url != str(cfg.location):
                if _cluster_of(url) != _cluster_of(str(cfg.location)):
                    raise ConfigError(
                        f"the configuration names another cluster ({url}): restart the agent"
                        " to serve it"
                    )
                cfg.location = url
            new = self.open_fabric()
            registry = _cluster_registry(new)
            keepalive = self.open_fabric()
            self._keepalive_session = self._new_session(_cluster_registry(keepalive))
        except VmlendError as e:
            log.warning("reload: the configuration was not taken (%s); serving on as before", e)
            return fabric
        self._session = self._new_session(registry)
        fabric.close()
        log.info("reload: serving on %s", registry.gateway.where)
        return new

    # --- helpers ------------------------------------------------------------------------------
    @staticmethod
    def registry_of(fabric: Fabric) -> EtcdRegistry:
        return _cluster_registry(fabric)

    def open_fabric(self) -> AgentFabric:
        cfg = self.config
        fabric = cfg.fabric() if cfg.fabric is not None else open_fabric(cfg.location, cfg.node)
        limit(fabric, call_deadline(cfg.ttl))  # no request may outlast a quarter of the TTL
        # capabilities, not a backend class: the simulated fabric and the kernel backend both
        # keep their bookkeeping in the registry and take fenced devices back
        if not isinstance(fabric, RegistryFabric) or not isinstance(fabric, TakesBack):
            fabric.close()
            raise ConfigError(f"the {type(fabric).__name__} backend cannot run 'vmlend agent'")
        return fabric

    def _new_session(self, registry: EtcdRegistry) -> EtcdSession:
        # Every call well inside the TTL: a blackholed endpoint must not hold anything for
        # longer than the lease lives (the guard pauses the VMs regardless).
        registry.gateway.set_timeout(call_deadline(self.config.ttl))
        return EtcdSession(registry.gateway, registry.keys, self.config.node)

    def _session_(self) -> EtcdSession:
        assert self._session is not None
        return self._session

    def _keepalive_session_(self) -> EtcdSession:
        assert self._keepalive_session is not None
        return self._keepalive_session

class _LeaseSource:
    """What the metrics read of the lease and the VMs."""

    def __init__(self, clock: LeaseClock, borrower: Borrower) -> None:
        self._clock = clock
        self._borrower = borrower

    def age(self) -> float:
        return self._clock.age()

    def paused_count(self) -> int:
        return self._borrower.paused_count()


def _cluster_of(url: str) -> str:
    """The cluster name of a registry URL (its path): endpoints may change, the cluster not."""
    return url.rstrip("/").rpartition("/")[2]


def _cluster_registry(fabric: Fabric) -> EtcdRegistry:
    if not isinstance(fabric, RegistryFabric) or not isinstance(fabric.registry, EtcdRegistry):
        raise ConfigError(
            "'vmlend agent' serves a cluster registry: give --registry etcd://HOST:PORT/CLUSTER"
        )
    return fabric.registry
