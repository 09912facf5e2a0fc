"""The agent's loop: keep the lease alive, publish it for the host, take back fenced devices.

Bounded and observable: each pass renews the lease every ``ttl / 3`` seconds and scans the
fences of this node's devices every ``interval`` seconds (a scan instead of a watch, so a
reconnect after an etcd outage needs no re-listing). A device whose borrower died is
borrowable again within the lease TTL plus one ``interval`` (plus one transaction).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import msgspec

from vmlend.agent.guard import OPERATOR, RUNNING_VM, UNKNOWN, RemoteVmGuard
from vmlend.agent.lease import LeaseLost, SessionLease, follow_lease
from vmlend.agent.metrics import AgentMetrics
from vmlend.agent.pause_marks import PauseMarks
from vmlend.agent.reconcile import Reconciler, reconcile_host
from vmlend.agent.recover import LostLeaseRecovery, lacks_holds, vms_without_their_holds
from vmlend.agent.watch import LeaseWatch
from vmlend.errors import ConfigError, StateError, VmlendError
from vmlend.fabric.base import Fabric, RegistryFabric, TakesBack
from vmlend.hook.server import HookServer
from vmlend.hostenv import HostEnv
from vmlend.hypervisor.base import Hypervisor
from vmlend.notify import Notifier
from vmlend.ops.plug_request import PlugRequest, PlugRequests, serve_plug_requests
from vmlend.registry import EtcdRegistry, hostlease
from vmlend.registry.etcd_gateway import b64, call_deadline
from vmlend.release_journal import ReleaseJournal
from vmlend.wiring.fabric import Location, open_fabric

log = logging.getLogger(__name__)


class _PlugServer:
    """Serves plug requests on a thread of its own, every interval: plugging calls the
    hypervisor, which must not hold up the agent's loop. On a fabric of its own (the loop's is
    not shared across threads), opened on the thread. Held while the lease is in doubt
    (``may_serve``) and while a lost lease's recovery runs (``hold``)."""

    def __init__(
        self,
        open_fabric: Callable[[], Fabric],
        serve: Callable[[Fabric], None],
        may_serve: Callable[[], bool],
    ) -> None:
        self._open_fabric = open_fabric
        self._serve = serve
        self._may_serve = may_serve
        self._stop = threading.Event()
        self._held = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, interval: float) -> None:
        def run() -> None:
            fabric: Fabric | None = None
            try:
                while not self._stop.wait(interval):
                    if self._held.is_set() or not self._may_serve():
                        continue
                    try:
                        if fabric is None:
                            fabric = self._open_fabric()
                        self._serve(fabric)
                    except Exception:  # the next pass may do better
                        log.exception("serving plug requests failed")
            finally:
                if fabric is not None:
                    fabric.close()

        self._thread = threading.Thread(target=run, name="plug-requests", daemon=True)
        self._thread.start()

    def hold(self) -> None:
        self._held.set()

    def release(self) -> None:
        self._held.clear()

    def stop(self, timeout: float) -> None:
        """Stop, waiting up to ``timeout`` for a pass in progress (once: later calls return)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("a plug request is still being served as the agent stops")


class Renewals:
    """When the lease was last renewed and when it is next due. The loop renews through it,
    and so does a lost lease's recovery, which runs on the loop, while it waits for lenders
    (``keep_alive``): a recovery longer than the TTL would otherwise let the new lease end
    under it, and every VM of the host would be paused again."""

    def __init__(
        self,
        lease: SessionLease,
        *,
        renew: Callable[[SessionLease], None],
        clock: Callable[[], float],
        interval: float,
        metrics: AgentMetrics,
        watch: LeaseWatch,
        guard: RemoteVmGuard | None,
        lacks_holds: Callable[[str], bool] | None = None,
        watchdog: Callable[[], object] = lambda: None,
    ) -> None:
        self._renew = renew
        self._lacks_holds = lacks_holds
        #: The loop's liveness to systemd: a long recovery still turns (``keep_alive``).
        self._watchdog = watchdog
        self._clock = clock
        self._interval = interval
        self._metrics = metrics
        self._watch = watch
        self._guard = guard
        self.lease = lease
        self.last = self.next = clock()
        #: etcd said the lease is gone during a recovery (``keep_alive``).
        self.gone = False

    def start(self, lease: SessionLease) -> None:
        """A new lease, granted moments ago (its TTL runs since): renewed at the first chance,
        so etcd's clock and this one start again together."""
        self.lease = lease
        self.last = self.next = self._clock()
        self.gone = False

    def renew(self, *, resume: bool = True) -> bool:
        """One keepalive; whether it was answered (``LeaseLost``: etcd says the lease is gone).
        Answered, the watch's clock starts again and, with ``resume``, the VMs it paused
        resume (off this thread: ``RemoteVmGuard.resume``)."""
        now = self._clock()
        try:
            self._renew(self.lease)
        except StateError as e:
            log.warning("cannot renew lease %x: %s", self.lease.id, e)
            self._metrics.renew_failed()
            return False
        # Counted from before the call: etcd restarted the TTL at most one call deadline
        # (TTL/4) later, so the pause still comes before 3/4 TTL.
        self.last = now
        names = self._watch.renewed(hand_back=resume)
        if self._guard is not None and names:
            # the lease they resume under, read on the one thread that ends it
            self._guard.resume(
                names,
                self._watch.resume_if_fresh,
                self._watch.generation,
                lacks_holds=self._lacks_holds,
                recover=self._watch.orphan,
                hold_back=self._watch.hold_back,
            )
        return True

    def schedule(self, now: float) -> None:
        if self.gone:  # etcd said the lease is gone: the loop is to see it at once
            self.next = now
            return
        # In doubt, retry often: every moment counts before the TTL runs out.
        self.next = now + (self._interval if self._watch.in_doubt else self.lease.ttl / 3)

    def keep_alive(self) -> None:
        """Renew if due, resuming nothing: a VM the watch paused may be one the recovery has
        yet to win back (at start-up, one that ran without its holds); the loop's next renewal
        hands them back. A failure, or the lease gone, is the loop's to act on once the
        recovery is done (its reserves fail meanwhile, and it parks the VMs)."""
        self._watchdog()
        now = self._clock()
        if now >= self.next:
            try:
                self.renew(resume=False)
            except LeaseLost as e:
                # No gate resumes anything from now on, the watch pauses what runs, and the
                # loop takes the lost-lease path as soon as the recovery is done.
                log.warning("%s during the recovery", e)
                self._watch.expire()
                self.gone = True
            self.schedule(now)


class AgentFabric(Fabric, TakesBack, Protocol):
    """What the agent serves on: a fabric that can take fenced devices back."""


DEFAULT_TTL = 10
DEFAULT_INTERVAL = 0.5


class AgentConfig(msgspec.Struct):
    location: Location
    node: str
    lease_file: Path
    ttl: int = DEFAULT_TTL
    interval: float = DEFAULT_INTERVAL
    #: Opens this host's hypervisor (to pause VMs with remote devices); None: none to guard.
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

    @property
    def pause_marks_dir(self) -> Path:
        """Where the agent marks the VMs it paused (``pause_marks``): beside its lease file,
        in the host's run directory."""
        return self.lease_file.parent / "paused"


class Agent:
    def __init__(self, config: AgentConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self.stop_event = threading.Event()
        self.taken_back: list[int] = []
        #: The plug requests this agent answered, with their outcome.
        self.plugged: list[PlugRequest] = []
        self._renewals: Renewals | None = None
        #: VMs an operator paused whose lost devices could not be re-reserved or unplugged
        #: yet (etcd away, the hypervisor failing), and when to try them again.
        self._operators_pending: set[str] = set()
        self._operators_next = 0.0

    def run(self) -> int:
        """Serve until ``stop_event``: 0, or 3 when stopped after losing the lease and before
        etcd granted a new one. A lost lease is replaced and the paused VMs recovered."""
        try:
            return self._run()
        finally:
            if self.config.hook_server is not None:
                self.config.hook_server.stop()  # idempotent: a clean stop did it already

    def _run(self) -> int:
        cfg = self.config
        fabric = self._open_fabric()
        # capabilities, not a backend class: the simulated fabric and the kernel backend both
        # keep their bookkeeping in the registry and take fenced devices back
        if not isinstance(fabric, RegistryFabric) or not isinstance(fabric, TakesBack):
            raise ConfigError(f"the {type(fabric).__name__} backend cannot run 'vmlend agent'")
        if not isinstance(fabric.registry, EtcdRegistry):
            raise ConfigError(
                "'vmlend agent' serves a cluster registry: give --registry etcd://HOST:PORT/CLUSTER"
            )
        registry = fabric.registry
        # Without a lease: if this agent dies uncleanly, the marker outlives hosts/<node> and
        # marks this node's devices unavailable until an agent runs here again.
        registry.gateway.call(
            "kv/put", {"key": b64(registry.keys.agent(cfg.node)), "value": b64(b"1")}
        )
        previous = self._previous_lease()
        lease = self._take_lease(registry)
        # Every call well inside the TTL: a blackholed endpoint must not hold the loop for
        # longer than the lease lives (the watch pauses the VMs regardless).
        registry.gateway.set_timeout(call_deadline(lease.ttl))
        guard = recovery = None
        hv: Hypervisor | None = None
        if cfg.hypervisor is not None:
            hv = cfg.hypervisor()
            guard = RemoteVmGuard(hv, fabric, cfg.node, PauseMarks(cfg.pause_marks_dir))
            # Who to pause first, known before a pause is needed (``guard`` says why).
            guard.start_census(min(cfg.interval * 5, lease.ttl / 4))
        # From the moment the lease exists, on its own thread: the start-up below and every
        # registry call after it may block.
        watch = LeaseWatch(
            lease.ttl,
            guard.pause if guard is not None else list,
            clock=self._clock,
            tick=min(cfg.interval, lease.ttl / 10),
            suspend=guard.suspend_if_running if guard is not None else None,
        )
        watch.start()
        cfg.metrics.follow(
            lease=watch,
            ttl=lease.ttl,
            registry=registry,
            open_fabric=self._open_fabric,
        )
        renewals = self._renewals = Renewals(
            lease,
            renew=self._renew,
            clock=self._clock,
            interval=cfg.interval,
            metrics=cfg.metrics,
            watch=watch,
            guard=guard,
            lacks_holds=self._holds_checker(hv),
            watchdog=cfg.notifier.watchdog,
        )
        if hv is not None:
            # A fenced device is back within the lender's scan interval; allow a TTL for it,
            # renewing the lease meanwhile. A VM won back resumes only while the lease is not
            # in doubt (the watch's rule).
            recovery = LostLeaseRecovery(
                hv,
                fabric,
                fence_wait=cfg.ttl,
                interval=cfg.interval,
                resume_gate=watch.resume_if_fresh,
                park=watch.park,
                keep_alive=renewals.keep_alive,
                retry=watch.orphan,
                # a device this host lends to its own VM is taken back only by this loop
                take_back=lambda: self._take_back(fabric),
                resume=guard.resume_and_unmark if guard is not None else None,
                unmark=guard.unmark_unless_paused if guard is not None else lambda _n: None,
            )
        try:
            return self._serve(registry, fabric, lease, previous, watch, guard, recovery, hv)
        finally:
            watch.stop()
            if guard is not None:
                guard.stop_census()

    def _serve(
        self,
        registry: EtcdRegistry,
        fabric: AgentFabric,
        lease: SessionLease,
        previous: int | None,
        watch: LeaseWatch,
        guard: RemoteVmGuard | None,
        recovery: LostLeaseRecovery | None,
        hv: Hypervisor | None,
    ) -> int:
        cfg = self.config
        if not self._follow_until(registry, lease, [] if previous is None else [previous]):
            return self._stopped(registry, fabric, lease)
        journal = ReleaseJournal.for_host(HostEnv.from_env())
        self._land_releases(journal, fabric)
        if hv is not None and guard is not None and recovery is not None:
            # Restarted after the lease ended: the running VMs' holds are gone. The same path
            # as a lost lease (pause, re-reserve or unplug, resume), before anything else.
            lost = self._until_reachable(lambda: vms_without_their_holds(hv, fabric))
            if lost is None:
                return self._stopped(registry, fabric, lease)
            paused: list[str] = []
            operators: list[str] = []
            if lost:
                log.error(
                    "VMs %s run without their holds (this host's lease ended while no agent"
                    " ran); pausing them to re-reserve their devices",
                    ", ".join(lost),
                )
                # With those the watch paused first: the recovery's now, or the first renewal
                # would resume them without their holds. A VM an operator paused stays paused,
                # its devices re-reserved or unplugged.
                paused, operators = self._without_holds(hv, fabric, guard, watch, lost)
            # The VMs an agent paused and did not resume (it was killed first): recovered too,
            # whether their holds outlived it or not.
            left = [n for n in guard.left_paused() if n not in paused]
            watch.withdraw(left)
            if left:
                log.warning(
                    "VMs %s were paused by this host's agent and not resumed (an earlier agent"
                    " was killed first, or this one's watch paused them); recovering them",
                    ", ".join(left),
                )
            if paused or left:
                cfg.metrics.recovered(recovery.recover(sorted({*paused, *left})))
            self._recover_operators(recovery, [n for n in operators if n not in left])
            lines = self._until_reachable(lambda: cfg.reconciler(hv, fabric))
            if lines is None:
                return self._stopped(registry, fabric, lease)
            for line in lines:
                log.warning("start-up reconcile: %s", line)
            log.warning("start-up reconcile of %s done (%d line(s))", cfg.node, len(lines))
        if cfg.hook_server is not None:
            # Last: nothing is served before this host's records are on its current lease and
            # its running VMs are reconciled with them.
            cfg.hook_server.start()
        # Ready only now: systemd orders libvirtd's guests after this, and a hook call before
        # it would have found nobody to serve it.
        cfg.notifier.ready(f"serving node {cfg.node}: lease {lease.id:x} held")
        plugs = None
        if hv is not None:
            deadline = call_deadline(lease.ttl)

            def serve(fabric: Fabric) -> None:
                assert hv is not None and isinstance(fabric, RegistryFabric)
                assert isinstance(fabric.registry, EtcdRegistry)
                fabric.registry.gateway.set_timeout(deadline)
                # A hot-plug may land after the lease came in doubt or was lost (the pause,
                # the recovery did not see the device yet): the watch looks again after each,
                # and resumes nothing of that VM meanwhile (``LeaseWatch.plugging``).
                self._serve_plugs(PlugRequests(fabric.registry), hv, fabric, watch.plugging)

            plugs = _PlugServer(self._open_fabric, serve, lambda: not watch.in_doubt)
            plugs.start(cfg.interval)
        try:
            return self._loop(registry, fabric, hv, journal, watch, guard, recovery, plugs)
        finally:
            if plugs is not None:
                plugs.stop(call_deadline(lease.ttl))

    def _loop(
        self,
        registry: EtcdRegistry,
        fabric: AgentFabric,
        hv: Hypervisor | None,
        journal: ReleaseJournal,
        watch: LeaseWatch,
        guard: RemoteVmGuard | None,
        recovery: LostLeaseRecovery | None,
        plugs: _PlugServer | None,
    ) -> int:
        """Renew, resume, take back, until stopped. No hypervisor call waits on this thread but
        the recovery after a lost lease: a domain the hypervisor does not answer for must not
        stop the renewals (the lease, and every hold of this host, would end with them)."""
        cfg = self.config
        renewals = self._renewals
        assert renewals is not None
        while not self.stop_event.is_set():
            now = self._clock()
            if now >= renewals.next:
                try:
                    if renewals.renew():
                        self._land_releases(journal, fabric)
                    elif self._clock() - renewals.last > renewals.lease.ttl:
                        raise LeaseLost(
                            f"lease {renewals.lease.id:x} not renewed for {renewals.lease.ttl} s"
                        )
                except LeaseLost as e:
                    lease = renewals.lease
                    cfg.notifier.status(f"lease {lease.id:x} lost: pausing and recovering")
                    cfg.metrics.lease_lost()
                    if plugs is not None:
                        plugs.hold()  # none served until the recovery is done
                    # First: a plug that begins after ``take_paused`` must not reserve under
                    # the lost lease while the watch counts the next one.
                    hostlease.withdraw(cfg.lease_file, lease.id)
                    paused = watch.take_paused()
                    new_lease = self._after_lost_lease(registry, lease, e, guard, paused)
                    if new_lease is None:
                        return 3
                    # A new lease: renewed at once, and by the recovery while it waits
                    # (``Renewals.keep_alive``). What the watch paused since ``take_paused``
                    # (the new lease took a while) is recovered too: taken before any renewal
                    # there would resume it.
                    late = watch.take_late()
                    renewals.start(new_lease)
                    renewals.keep_alive()  # a real renewal: only an answer restarts the watch
                    if recovery is not None and guard is not None:
                        names = set(guard.paused_after_loss) | set(late)
                        found, operators = self._without_holds(hv, fabric, guard, watch)
                        names |= set(found)
                        cfg.metrics.recovered(recovery.recover(sorted(names)))
                        self._operators_pending -= names  # the agent's own now
                        self._recover_operators(recovery, [n for n in operators if n not in names])
                    if plugs is not None:
                        plugs.release()
                    cfg.notifier.status(f"serving node {cfg.node}: lease {new_lease.id:x} held")
                    now = self._clock()
                renewals.schedule(now)
            if recovery is not None and guard is not None and (orphans := watch.take_orphans()):
                # resumed or plugged late, after the lease they were for was lost; paused again
                # (unless that failed: pause them now, since the recovery only resumes)
                if plugs is not None:
                    plugs.hold()
                ours, operators = [], []
                for name in orphans:
                    # paused since without a mark (an operator's pause after the late resume):
                    # not the agent's to resume
                    if guard.suspend_if_running(name) or not guard.paused_by_operator(name):
                        ours.append(name)
                    else:
                        operators.append(name)
                cfg.metrics.recovered(recovery.recover(ours))
                self._operators_pending -= set(ours)
                self._recover_operators(recovery, operators)
                if plugs is not None:
                    plugs.release()
            # not while in doubt: a recovery would wait for etcd on this loop
            if hv is not None and recovery is not None and guard is not None and not watch.in_doubt:
                self._retry_operators(hv, recovery, guard, watch)
            self._take_back(fabric)
            cfg.notifier.watchdog()  # the loop turns: a hang here gets the agent restarted
            self.stop_event.wait(cfg.interval)
        lease = renewals.lease
        cfg.notifier.stopping(f"stopping: giving up lease {lease.id:x}")
        if plugs is not None:
            plugs.stop(call_deadline(lease.ttl))  # before the fabric it serves on is closed
        return self._stopped(registry, fabric, lease)

    def _open_fabric(self) -> Fabric:
        cfg = self.config
        return cfg.fabric() if cfg.fabric is not None else open_fabric(cfg.location, cfg.node)

    def _renew(self, lease: SessionLease) -> None:
        """One keepalive (a method, so a test can make it block as a partition does)."""
        lease.refresh()

    def _stopped(self, registry: EtcdRegistry, fabric: Fabric, lease: SessionLease) -> int:
        """A clean stop: withdraw and revoke the lease, drop the agent marker."""
        cfg = self.config
        if cfg.hook_server is not None:
            cfg.hook_server.stop()  # what it accepted still runs under the lease
        hostlease.withdraw(cfg.lease_file, lease.id)
        try:
            registry.gateway.call("kv/deleterange", {"key": b64(registry.keys.agent(cfg.node))})
            lease.revoke()  # a clean stop: this host's records go now, not after the TTL
        except StateError as e:
            log.warning("could not revoke lease %x (it ends by its TTL): %s", lease.id, e)
        fabric.close()
        log.warning("agent for %s stopped", cfg.node)
        return 0

    def _previous_lease(self) -> int | None:
        """The lease an earlier agent of this host published and did not withdraw (it died)."""
        try:
            return hostlease.read(self.config.lease_file).lease
        except StateError:  # none, or unreadable: nothing to take over
            return None

    def _take_lease(self, registry: EtcdRegistry) -> SessionLease:
        """A new lease for this host, announced in etcd and then published in the lease file."""
        cfg = self.config
        lease = SessionLease(registry.gateway, cfg.ttl)
        lease.put(
            registry.keys.host(cfg.node),
            # "plugs": it serves plug requests (``vmlend.ops.plug_request``): it has a hypervisor
            json.dumps(
                {"pid": os.getpid(), "ttl": lease.ttl, "plugs": cfg.hypervisor is not None}
            ).encode(),
        )
        # Last: the host's processes may use the lease once the file is there.
        hostlease.publish(
            cfg.lease_file, hostlease.HostLease(lease.id, cfg.node, lease.ttl, os.getpid())
        )
        log.warning(
            "agent for %s up: lease %x (TTL %d s) published in %s",
            cfg.node,
            lease.id,
            lease.ttl,
            cfg.lease_file,
        )
        return lease

    def _after_lost_lease(
        self,
        registry: EtcdRegistry,
        lost: SessionLease,
        why: LeaseLost,
        guard: RemoteVmGuard | None,
        paused: list[str],
    ) -> SessionLease | None:
        """Say so, pause what uses remote devices and take a new lease (None: stopped first)."""
        cfg = self.config
        log.error(
            "agent for %s lost its lease (%s): this host's holds are gone; taking a new lease",
            cfg.node,
            why,
        )
        hostlease.withdraw(cfg.lease_file, lost.id)
        if guard is not None:
            # A frozen agent could not pause anything in time: pause now, before the guests
            # touch devices that may be somebody else's already.
            guard.paused_after_loss = sorted(set(paused) | set(guard.pause()))
        lease = self._retake_lease(registry)
        if lease is None:
            if guard is not None and guard.paused_after_loss:
                log.error("VMs %s stay paused", ", ".join(guard.paused_after_loss))
            return None
        # etcd may not have ended the old lease (a returning leader extends it): what is still
        # on it must move now, or it vanishes later while the VMs run.
        return lease if self._follow_until(registry, lease, [lost.id]) else None

    def _holds_checker(self, hv: Hypervisor | None) -> Callable[[str], bool] | None:
        """What a resume thread asks before it resumes a VM: whether it lacks a hold (on a
        fabric of its own: the loop's is not shared across threads)."""
        if hv is None:
            return None

        def lacks(name: str) -> bool:
            fabric = self._open_fabric()
            try:
                return lacks_holds(hv, fabric, name)
            finally:
                fabric.close()

        return lacks

    def _recover_operators(self, recovery: LostLeaseRecovery, names: list[str]) -> None:
        """Re-reserve or unplug the lost devices of VMs an operator paused, leaving them
        paused; one that cannot be done now is tried again (``_retry_operators``)."""
        if not names:
            return
        results = recovery.recover(names, leave_paused=True)
        self.config.metrics.recovered(results)
        for r in results:
            if r.outcome == "paused":
                self._operators_pending.add(r.vm)
            else:
                self._operators_pending.discard(r.vm)
        self._operators_next = self._clock() + self.config.ttl

    def _retry_operators(
        self, hv: Hypervisor, recovery: LostLeaseRecovery, guard: RemoteVmGuard, watch: LeaseWatch
    ) -> None:
        """Once a TTL after the last try: those still paused by an operator, again. One an
        operator resumed meanwhile that runs without its holds is the agent's to pause,
        recover and resume (``LeaseWatch.orphan``, on the next turn). One that is gone, shut
        off, or the agent's since (its own recovery has it) is forgotten; one whose state or
        holds cannot be told now is kept for the next try."""
        if not self._operators_pending or self._clock() < self._operators_next:
            return
        names, self._operators_pending = sorted(self._operators_pending), set()
        lacks = self._holds_checker(hv)
        again = []
        for name in names:
            whose = guard.whose_pause(name)
            if whose == OPERATOR:
                again.append(name)
            elif whose == UNKNOWN:
                self._operators_pending.add(name)
            elif whose == RUNNING_VM and lacks is not None:
                try:
                    if lacks(name):
                        watch.orphan(name)
                except VmlendError as e:
                    log.warning("cannot check the holds of %s: %s", name, e)
                    self._operators_pending.add(name)
        self._recover_operators(recovery, again)
        self._operators_next = self._clock() + self.config.ttl

    @staticmethod
    def _without_holds(
        hv: Hypervisor | None,
        fabric: Fabric,
        guard: RemoteVmGuard,
        watch: LeaseWatch,
        lost: list[str] | None = None,
    ) -> tuple[list[str], list[str]]:
        """The VMs that use devices they no longer hold (``lost``, or looked for now: after a
        lost lease, those the pause missed because its suspend failed or they began to run
        after it looked): paused now, or taken from the watch that paused them, for the
        recovery; one whose pause fails goes to the recovery on the loop's next turn. And
        apart, those an operator paused: their devices must be re-reserved or unplugged too
        (the operator's resume would run them), but they are not the agent's to resume."""
        if hv is None:
            return [], []
        if lost is None:
            try:
                lost = vms_without_their_holds(hv, fabric)
            except VmlendError as e:
                log.warning("could not look for VMs without their holds: %s", e)
                return [], []
        paused = set(guard.pause_these(lost)) | set(watch.withdraw(lost))
        operators = []
        for name in lost:
            if name in paused:
                continue
            whose = guard.whose_pause(name)  # one look: a resume between two would mislead
            if whose == RUNNING_VM:
                watch.orphan(name)  # its pause failed: paused and recovered on the next turn
            elif whose == OPERATOR:
                operators.append(name)
        return sorted(paused), operators

    def _until_reachable(self, read: Callable[[], list[str]]) -> list[str] | None:
        """``read()``, retried while etcd cannot be reached; None when stopped first."""
        while True:
            try:
                return read()
            except StateError as e:
                log.warning("start-up waits for etcd: %s", e)
                if self.stop_event.wait(self.config.interval):
                    return None

    def _follow_until(self, registry: EtcdRegistry, lease: SessionLease, known: list[int]) -> bool:
        """``_follow`` until it lands; False when the agent is stopped first."""
        while not self._follow(registry, lease, known):
            if self.stop_event.wait(self.config.interval):
                return False
        return True

    def _follow(self, registry: EtcdRegistry, lease: SessionLease, known: list[int]) -> bool:
        """Holds follow the lease: move this host's records of earlier leases onto ``lease``
        and revoke those (``lease.follow_lease``). False when etcd could not be reached."""
        try:
            moved = follow_lease(registry.gateway, registry.keys, self.config.node, lease.id, known)
        except StateError as e:
            log.warning("cannot move this host's records onto lease %x yet: %s", lease.id, e)
            return False
        if moved.moved:
            old = ", ".join(f"{x:x}" for x in moved.old)
            log.warning(
                "took over %d records of this host's previous lease(s) %s onto lease %x",
                moved.moved,
                old,
                lease.id,
            )
        return True

    def _retake_lease(self, registry: EtcdRegistry) -> SessionLease | None:
        """A new lease after the old one was lost, retried until etcd answers; None when the
        agent is stopped first."""
        while not self.stop_event.is_set():
            try:
                return self._take_lease(registry)
            except StateError as e:
                log.warning("cannot take a new lease yet: %s", e)
                self.stop_event.wait(self.config.interval)
        return None

    @staticmethod
    def _land_releases(journal: ReleaseJournal, fabric: Fabric) -> None:
        """Retry the releases this host's hooks could not land (etcd was away)."""
        try:
            for line in journal.settle(fabric):
                log.warning("%s", line)
        except StateError as e:
            log.warning("pending releases wait: %s", e)

    def _serve_plugs(
        self,
        requests: PlugRequests,
        hv: Hypervisor,
        fabric: Fabric,
        around: Callable[[str], contextlib.AbstractContextManager[Callable[[], None]]]
        | None = None,
    ) -> None:
        """Plug the devices of VMs live-migrated here back in, as their sources ask."""
        try:
            self.plugged.extend(serve_plug_requests(requests, hv, fabric, around=around))
        except VmlendError as e:
            log.warning("cannot serve plug requests: %s", e)

    def _take_back(self, fabric: TakesBack) -> None:
        try:
            fences = fabric.fenced()
        except StateError as e:
            log.warning("cannot check fenced devices: %s", e)
            return
        for fence in fences:  # one that fails does not hold up the others
            try:
                if fabric.take_back(fence):
                    self.taken_back.append(fence.fdid)
            except VmlendError as e:
                log.warning("cannot take back device %#x: %s", fence.fdid, e)
