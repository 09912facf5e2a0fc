"""Keeping the host's lease: adopting the previous agent's, taking a new one when it is lost,
and settling a lease (DESIGN, rule 1: holds follow the lease) before any VM may win its
devices back under it. The etcd operations are the session's (``vmlend.registry.session``);
what is decided here is their order.

- **Adopt or grant.** A restarted agent renews the lease its predecessor published in the run
  directory: while etcd still has it, it is this agent's (no VM is paused, no hold moves).
  Otherwise a new lease.
- **Settle.** Move every record of this host still on an earlier lease onto this one (fence
  tokens included) and revoke the earlier; announce ``hosts/<node>`` on it; publish the lease
  file (last: the host's processes may use the lease once it is there); then say so on the
  clock (``followed``), which lets the VMs' workers win their devices back.
- **Replace.** etcd said the lease is gone: withdraw the lease file, take a new lease (retried
  until etcd answers; the workers keep the VMs paused meanwhile), settle it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from vmlend.agent.clock import LeaseClock
from vmlend.errors import LeaseExpiredError, StateError
from vmlend.registry import hostlease
from vmlend.registry.session import EtcdSession, Grant, HostKey, LeaseLost

log = logging.getLogger(__name__)

T = TypeVar("T")


class LeaseHold:
    def __init__(
        self,
        session: Callable[[], EtcdSession],
        clock: LeaseClock,
        *,
        node: str,
        ttl: int,
        lease_file: Path,
        host_key: Callable[[Grant], HostKey],
        stop: threading.Event,
        interval: float,
        now: Callable[[], float],
        wake: Callable[[], None] = lambda: None,
    ) -> None:
        self._session = session
        self._clock = clock
        self._node = node
        self._ttl = ttl
        self._lease_file = lease_file
        self._host_key = host_key
        self._stop = stop
        self._interval = interval
        self._now = now
        #: Renew now (the keepalive: a new lease is renewed at once).
        self.wake = wake

    def previous(self) -> int | None:
        """The lease an earlier agent of this host published and did not give up (it was
        stopped, restarted or killed): adopted while etcd still has it."""
        try:
            published = hostlease.read(self._lease_file)
        except StateError:  # none, or unreadable: nothing to adopt
            return None
        if published.node != self._node:
            log.warning(
                "the lease file %s is node %s's, not %s: not adopted",
                self._lease_file,
                published.node,
                self._node,
            )
            return None
        return published.lease

    def adopt_or_grant(self, previous: int | None) -> Grant:
        """The previous agent's lease if etcd still has it (renewed at once, so its end is
        known), else a new one. On the clock either way."""
        session = self._session()
        if previous:
            try:  # a keepalive: etcd's time-to-live counts whole seconds, 0.5 s left is 0
                sent = self._now()
                ttl = session.keepalive(previous)
                self._clock.start(previous, ttl, sent, followed=True)
                return Grant(previous, ttl)
            except LeaseLost:
                log.warning("the previous agent's lease %x has ended: taking a new one", previous)
        sent = self._now()
        grant = session.grant(self._ttl)
        self._clock.start(grant.id, grant.ttl, sent, followed=False)
        return grant

    def settle(self, lease: Grant, previous: int | None, *, adopted: bool) -> None:
        """``lease`` (on the clock already) is this host's from now on (see the module's
        docstring). Left undone when the agent stops first or the lease ends meanwhile (the
        agent's loop replaces it)."""
        # Adopted too: a predecessor killed between two batches of its own move left records
        # on an older lease, which nobody renews.
        moved = self.until_reachable(
            lambda: self._session().follow(lease.id, [previous] if previous else []), lease.id
        )
        if moved is None:
            return
        if moved.moved:
            log.warning(
                "moved %d record(s) of this host's earlier lease(s) %s onto lease %x",
                moved.moved,
                ", ".join(f"{x:x}" for x in moved.old),
                lease.id,
            )

        def announce() -> bool:
            self._session().announce(self._host_key(lease))
            return True

        if self.until_reachable(announce, lease.id) is None:
            return
        # etcd took the move and the announcement under the lease by now: the history's
        # follow is then, however long this process is stopped before it says so below
        done = self._now()
        hostlease.publish(
            self._lease_file, hostlease.HostLease(lease.id, self._node, lease.ttl, os.getpid())
        )
        self._clock.followed(lease.id, done)
        log.info(
            "agent for %s: lease %x (TTL %d s) %s, published in %s",
            self._node,
            lease.id,
            lease.ttl,
            "adopted" if adopted else "granted",
            self._lease_file,
        )

    def replace(self, lost: int) -> bool:
        """The lease ``lost`` is gone with every hold on it: a new one, settled. False when
        the agent stopped first."""
        hostlease.withdraw(self._lease_file, lost)
        sent = self._now()
        lease = self.until_reachable(lambda: self._session().grant(self._ttl))
        if lease is None:
            return False
        self._clock.start(lease.id, lease.ttl, sent, followed=False)
        self.wake()
        self.settle(lease, lost, adopted=False)
        return not self._stop.is_set()

    def until_reachable(self, call: Callable[[], T], lease: int = 0) -> T | None:
        """``call()``, retried while etcd cannot be reached; None when stopped first, or when
        ``lease`` (a lease the call writes under) ended meanwhile: the loop replaces it."""
        while True:
            try:
                return call()
            except (LeaseLost, LeaseExpiredError):
                if not lease:
                    raise
                self._clock.gone(lease)
                return None
            except StateError as e:
                log.info("waiting for etcd: %s", e)
                if self._stop.wait(self._interval):
                    return None
