"""A model of vmlend's cluster protocol, explored exhaustively (issue 35, point 10).

What is modelled (docs/design.md, "The cluster"; docs/cluster.md): etcd's leases, holds,
fences and fencing tokens; each host's agent (its lease, the guard, the lost-lease recovery, a
crash and a restart that adopts its predecessor's lease); the release journal; the lender's
device (its current token, the borrow it serves, the mdevs open on it); the workload's starts
and stops; an operator's pauses and resumes. Time is discrete: a lease lasts ``ttl`` ticks
(4 by default) and the guard doubts it after ``ttl / 2``.

The two promises, as invariants:

(a) ``exclusive``: the device serves only its newest token. Every mdev open on it (the paths a
    VM reaches it by) and the borrow carry the device's current token, and that token's hold
    has not ended, or ended with its lease and the lender has not taken the device back yet
    (then it is fenced and nobody else can hold it). Checked over every schedule.
(b) ``guarded``: no two VMs that run (not paused) have one device plugged. Checked only in runs
    where every host's agent kept its budget and no operator resumed a VM blind (below).

The rules are methods of ``Model``, each a guarded action: it returns the next state or raises
``Refused`` saying why the step cannot happen, and its docstring names the design's rule it
is: rule 1, holds follow the lease (moved onto the current one after any change of it); rule 2,
the guard has its own clock (VMs with remote devices paused once TTL/2 passed since the last
good renewal); rule 3, the token is checked where the device is; rule 4, releases that cannot
land are not lost (the journal). They are fine-grained (one per step a real component logs),
so that a recorded history can be replayed through the same rules (``tests/support/replay.py``
replays the nemesis's); the explorer (``Explorer``) composes them into the atomic steps of
each actor.

Budgets (what (b) assumes, and what a real agent must measure): a real guard looks at least
once every TTL/4 and its pause lands within another TTL/4 (a bounded hypervisor call), so a VM
is paused at most TTL/2 after the lease came in doubt, before etcd may end the lease.
Discretely, a tick being TTL/4: at each tick a live guard has paused what runs with remote
devices on no lease or on one in doubt since the tick before (the lease's age TTL/2 + 1 tick),
so it is paused by the time the age reaches TTL; and no tick passes while an agent is down and
a VM of its host runs with remote devices. That is stricter than the budget (which lets an
agent be down for one tick interval) and, we argue, loses no state: its restart adopts the
lease and renews it at once, so such a run reaches what one does whose agent stays up through
the interval and crashes and restarts at its end. A tick that breaks this is a *starved* host;
an operator's resume of a VM whose host is not *settled* (agent up, lease current, followed
and not in doubt, the VM not awaiting recovery: what ``vmlend status`` shows) is *blind*. The
explorer runs twice: over every schedule, with no clock, checking (a) (``every_schedule``);
then over the runs with no starved host and no blind resume, checking (b) (``budgeted``, with
the lender left out: (b) does not depend on it). What only the first reaches is what only
fencing protects.

What is explored (``small_cluster``): two borrowing hosts with one VM each, both wanting one
device that a third host lends, its lender always up. Hot-add (``plug``) and hot-remove are
rules, not steps the explorer takes.

Simplifications, each because the real code's extra states do not change who can reach the
device: a renewal's send, etcd's receipt and the reply are one step (the guard measures from
the send, so a later receipt only makes etcd's expiry later, which the leader change covers);
etcd keeps no clock of its own: it may end a lease at any step from TTL after the send of
its last keepalive on (a later end stands for a leader change, which extends leases); the
recovery's reserve and mdev are one step (nobody can act on the device between them: the hold
and its fence are there); a hot-unplug always completes; the operator pauses only running VMs
and resumes only the VMs an operator paused (the pause marks tell them apart, with a limit
docs/cluster.md states).
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

# The VM's phases: ``preparing`` is the prepare hook between its reserve and the VM's start.
STOPPED, PREPARING, RUNNING = "stopped", "preparing", "running"
PAUSED_AGENT, PAUSED_OPERATOR = "paused-agent", "paused-operator"
PAUSED = (PAUSED_AGENT, PAUSED_OPERATOR)
LIVE = (RUNNING, *PAUSED)

#: Mutations of the protocol, each a bug an explorer must find
#: (tests/scenarios/test_agent_model.py says which).
MUTATIONS = {
    "guard-at-3/4": "the guard doubts the lease at 3/4 of the TTL instead of 1/2",
    "lender-takes-old-tokens": "the lender accepts a token older than the device's",
    "restart-neither-adopts-nor-pauses": "a restarted agent takes a fresh lease, leaves its "
    "predecessor's records where they are and pauses nothing",
    "journal-ignores-token": "a journal entry releases the device's hold whatever its token",
    "no-follow": "a new lease leaves the host's holds on the old one (rule 1 skipped)",
    "recovery-skips-operator-pauses": "the recovery leaves an operator's VM as it is",
    "resume-in-doubt": "the agent resumes a VM whatever the lease's age",
    "start-in-doubt": "a prepare starts its VM whatever the host's lease's age (found by the "
    "explorer in the design as first written)",
    "prepare-skips-reread": "the prepare starts the VM without reading its holds once more",
    "take-back-forgets-token": "a take-back leaves the device's tokens as they were, so the "
    "token it took back stays usable until a newer one comes",
}

K = TypeVar("K", int, str)
V = TypeVar("V")
# A frozen mapping: a tuple of (key, value) pairs sorted by key (hashable, so states are).
Map = tuple[tuple[K, V], ...]


def get(m: Map[K, V], key: K) -> V | None:
    for k, v in m:
        if k == key:
            return v
    return None


def put(m: Map[K, V], key: K, value: V) -> Map[K, V]:
    for i, (k, _) in enumerate(m):
        if k == key:
            return (*m[:i], (key, value), *m[i + 1:])
        if k > key:
            return (*m[:i], (key, value), *m[i:])
    return (*m, (key, value))


def drop(m: Map[K, V], key: K) -> Map[K, V]:
    return tuple(p for p in m if p[0] != key)


class Refused(Exception):
    """A rule's guard does not hold: the step cannot happen, for the reason given."""


class Lease(NamedTuple):
    host: str
    #: the earliest etcd may end it: TTL after the send of its last keepalive
    expires: float


class Hold(NamedTuple):
    host: str
    vm: str
    token: int
    lease: int


class Device(NamedTuple):
    """The lender's side of a device: what the hardware enforces whatever etcd says."""

    lender: str
    #: the newest token a step carried to the device
    token: int = 0
    #: (vm, token) of the borrow it serves
    borrower: tuple[str, int] | None = None
    #: the mdevs open on it, (vm, token): the paths a VM reaches it by
    sessions: frozenset[tuple[str, int]] = frozenset()
    #: the newest token whose borrow the lender took back: that hold ended, so a step with it
    #: (or older) is refused. Without it a prepare that reserved, froze past its lease and
    #: thawed after the take-back opened an mdev for its ended hold (the explorer's first find)
    retired: int = 0


class Host(NamedTuple):
    alive: bool = True
    #: the agent's lease (its memory: gone with a crash)
    lease: int | None = None
    #: rule 1 done for ``lease``: every record of the host is on it
    followed: bool = False
    #: send time of the last good keepalive (or grant) of ``lease``: the guard's clock
    sent: float = 0.0
    #: run/vmlend/agent.lease: survives a crash; the hook attaches its holds to it
    lease_file: int | None = None
    #: VMs the agent has to recover (re-reserve or unplug each device)
    pending: frozenset[str] = frozenset()


class Vm(NamedTuple):
    host: str
    phase: str = STOPPED
    #: the devices in its domain, each with the token of the hold it was given under
    devices: tuple[tuple[int, int], ...] = ()
    #: releases owed to etcd (the journal, rule 4): (fdid, token)
    journal: tuple[tuple[int, int], ...] = ()


class State(NamedTuple):
    now: float
    leases: Map[int, Lease]
    holds: Map[int, Hold]
    fences: Map[int, int]
    devices: Map[int, Device]
    hosts: Map[str, Host]
    vms: Map[str, Vm]
    #: the newest token and lease id etcd made: new ones are larger
    issued: int = 0
    granted: int = 0


def initial(hosts: Iterable[str], vms: Mapping[str, str], lenders: Mapping[int, str]) -> State:
    """Agents up without a lease, every VM stopped, every device free."""
    return State(
        now=0,
        leases=(),
        holds=(),
        fences=(),
        devices=tuple(sorted((f, Device(lender)) for f, lender in lenders.items())),
        hosts=tuple(sorted((h, Host()) for h in hosts)),
        vms=tuple(sorted((v, Vm(h)) for v, h in vms.items())),
    )


def _need(cond: bool, why: str) -> None:
    if not cond:
        raise Refused(why)


@dataclass(frozen=True)
class Model:
    """The protocol's rules, for a lease of ``ttl`` ticks, with the named ``mutations``
    (``MUTATIONS``) applied."""

    ttl: float = 4
    mutations: frozenset[str] = frozenset()
    #: time not modelled: etcd may end any lease at any step and an agent may give its lease
    #: up at any step (the explorer's check of (a), which must not depend on time)
    untimed: bool = False
    #: the lender's device modelled (its tokens, mdevs and borrow). Without it a start needs
    #: no mdev and a take-back only lifts the fence: (b) does not depend on the lender
    lender: bool = True

    @property
    def doubt(self) -> float:
        return self.ttl * 3 / 4 if "guard-at-3/4" in self.mutations else self.ttl / 2

    # --- reading a state ----------------------------------------------------------------------
    def host(self, s: State, name: str) -> Host:
        h = get(s.hosts, name)
        _need(h is not None, f"no host {name}")
        assert h is not None
        return h

    def vm(self, s: State, name: str) -> Vm:
        v = get(s.vms, name)
        _need(v is not None, f"no VM {name}")
        assert v is not None
        return v

    def device(self, s: State, fdid: int) -> Device:
        d = get(s.devices, fdid)
        _need(d is not None, f"no device {fdid:#x}")
        assert d is not None
        return d

    def whole(self, s: State, name: str) -> bool:
        """Every device in the VM's domain is held by it, under the token it was given."""
        v = self.vm(s, name)
        return all(_holds(s, f, name, t) for f, t in v.devices)

    def stale(self, s: State, host: str) -> str | None:
        """Why ``host`` may not run anything new on its holds now (None: it may): its agent
        must be up, its records on its lease, and that lease renewed less than TTL/2 ago.
        Past that, etcd may end the lease before the guard looks again."""
        h = self.host(s, host)
        if not h.alive:
            return f"the agent of {host} is down"
        if h.lease is None or not h.followed:
            return f"{host} has no lease its records follow"
        if s.now - h.sent >= self.doubt:
            return f"the lease of {host} is in doubt (no good renewal for TTL/2)"
        return None

    def unsettled(self, s: State, name: str) -> str | None:
        """Why the VM's host is not settled (None: it is): an operator's resume then is blind.
        Settled is what ``vmlend status`` would show: the host not ``stale``, the VM not
        awaiting its recovery."""
        v = self.vm(s, name)
        why = self.stale(s, v.host)
        if why is None and name in self.host(s, v.host).pending:
            return f"{name} awaits its recovery"
        return why

    def _fresh(self, s: State, host: str, mutation: str) -> None:
        why = self.stale(s, host)
        if why is not None and mutation in self.mutations:
            why = self.stale(s._replace(now=self.host(s, host).sent), host)  # the age ignored
        _need(why is None, why or "")

    def _set_host(self, s: State, name: str, **changes: Any) -> State:
        return s._replace(hosts=put(s.hosts, name, self.host(s, name)._replace(**changes)))

    def _set_vm(self, s: State, name: str, **changes: Any) -> State:
        return s._replace(vms=put(s.vms, name, self.vm(s, name)._replace(**changes)))

    def _set_device(self, s: State, fdid: int, **changes: Any) -> State:
        return s._replace(devices=put(s.devices, fdid, self.device(s, fdid)._replace(**changes)))

    # --- etcd ---------------------------------------------------------------------------------
    def expire(self, s: State, lease: int) -> State:
        """etcd ends a lease nobody renewed: its holds vanish, their fences stay ("a crashed
        host's holds vanish after the TTL"; "a vanished hold leaves a fence"). Never before
        TTL after its last keepalive's send; any time after it (a returning etcd leader
        extends old leases: why rule 1 exists)."""
        found = get(s.leases, lease)
        _need(found is not None, f"lease {lease} is not alive")
        assert found is not None
        _need(self.untimed or s.now >= found.expires,
              f"lease {lease} cannot end before {found.expires}")
        holds = tuple(p for p in s.holds if p[1].lease != lease)
        return s._replace(leases=drop(s.leases, lease), holds=holds)

    # --- the agent's lease --------------------------------------------------------------------
    def grant(self, s: State, host: str, lease: int) -> State:
        """The agent takes a new lease (start-up without a live predecessor's lease, or after
        a lost one): every VM with devices is then recovered ("on reconnect it resumes,
        re-reserves or unplugs")."""
        h = self.host(s, host)
        _need(h.alive and h.lease is None, f"the agent of {host} is down or has a lease")
        _need(lease > s.granted, f"lease {lease} is not new")
        pending = frozenset(
            n for n, v in s.vms if v.host == host and v.devices and v.phase in LIVE
        )
        s = s._replace(leases=put(s.leases, lease, Lease(host, s.now + self.ttl)), granted=lease)
        return self._set_host(
            s, host, lease=lease, followed=False, sent=s.now, lease_file=lease, pending=pending
        )

    def adopt(self, s: State, host: str, sent: float) -> State:
        """A restarted agent adopts its predecessor's lease while it lives (the agent's shape:
        "a restart adopts the previous lease ... so an upgrade disturbs no VM"); it recovers
        the VMs its predecessor paused (their marks) and an operator's that lack a hold."""
        h = self.host(s, host)
        _need(h.alive and h.lease is None, f"the agent of {host} is down or has a lease")
        old = get(s.leases, h.lease_file) if h.lease_file is not None else None
        _need(old is not None, f"the lease in {host}'s lease file is gone")
        assert old is not None and h.lease_file is not None
        pending = frozenset(
            n
            for n, v in s.vms
            if v.host == host
            and v.devices
            and (v.phase == PAUSED_AGENT or (v.phase == PAUSED_OPERATOR and not self.whole(s, n)))
        )
        kept = old._replace(expires=max(old.expires, sent + self.ttl))
        s = s._replace(leases=put(s.leases, h.lease_file, kept))
        return self._set_host(
            s, host, lease=h.lease_file, followed=False, sent=sent, pending=pending
        )

    def follow(self, s: State, host: str) -> State:
        """Rule 1, holds follow the lease: every hold of the host moves onto its current lease
        (tokens unchanged) and its other leases are revoked, before it serves anything."""
        h = self.host(s, host)
        _need(h.alive and h.lease is not None and not h.followed, f"{host} has nothing to follow")
        assert h.lease is not None
        _need(get(s.leases, h.lease) is not None, f"lease {h.lease} of {host} is gone")
        if "no-follow" not in self.mutations:
            holds = tuple(
                (f, x._replace(lease=h.lease) if x.host == host else x) for f, x in s.holds
            )
            leases = tuple(p for p in s.leases if p[1].host != host or p[0] == h.lease)
            s = s._replace(holds=holds, leases=leases)
        return self._set_host(s, host, followed=True)

    def renew(self, s: State, host: str, sent: float) -> State:
        """A keepalive sent at ``sent`` answered: etcd ends the lease no sooner than TTL after
        the send, and the guard's clock restarts at the send (rule 2). Answered whenever etcd
        has not ended the lease, TTL or not: etcd ends leases late (a leader change extends
        them; a busy leader revokes late), and a real agent keeps renewing in doubt. The
        explorer's agents give the lease up at the TTL instead (``Explorer.renewal``), so it
        does not explore a renewal past the TTL; the nemesis's replay met 23 in one run."""
        h = self.host(s, host)
        _need(h.alive and h.lease is not None, f"the agent of {host} has no lease")
        assert h.lease is not None
        _need(h.sent <= sent <= s.now, f"a keepalive of {host} sent at {sent} is out of order")
        old = get(s.leases, h.lease)
        _need(old is not None, f"lease {h.lease} of {host} is gone")
        assert old is not None
        kept = old._replace(expires=max(old.expires, sent + self.ttl))
        return self._set_host(s._replace(leases=put(s.leases, h.lease, kept)), host, sent=sent)

    def lose(self, s: State, host: str) -> State:
        """The agent gives its lease up: etcd said it is gone, or the TTL passed since the last
        good keepalive's send; a new lease and the recovery follow."""
        h = self.host(s, host)
        _need(h.alive and h.lease is not None, f"the agent of {host} has no lease")
        assert h.lease is not None
        gone = get(s.leases, h.lease) is None
        lost = gone or self.untimed or s.now - h.sent >= self.ttl
        _need(lost, f"lease {h.lease} of {host} is not lost")
        return self._set_host(s, host, lease=None, followed=False, sent=0)

    def crash(self, s: State, host: str) -> State:
        """The agent dies: what it knew goes; its lease file and pause marks stay."""
        _need(self.host(s, host).alive, f"the agent of {host} is down")
        return self._set_host(
            s, host, alive=False, lease=None, followed=False, sent=0, pending=frozenset()
        )

    def restart(self, s: State, host: str) -> State:
        """The agent starts again (then adopts its lease, or takes a new one)."""
        _need(not self.host(s, host).alive, f"the agent of {host} runs")
        return self._set_host(s, host, alive=True)

    # --- the guard and the recovery -----------------------------------------------------------
    def pause(self, s: State, vm: str, by: str) -> State:
        """The guard pauses a running VM with remote devices (rule 2), or an operator pauses a
        running VM."""
        v = self.vm(s, vm)
        _need(v.phase == RUNNING, f"{vm} is {v.phase}")
        if by == "agent":
            _need(self.host(s, v.host).alive, f"the agent of {v.host} is down")
            return self._set_vm(s, vm, phase=PAUSED_AGENT)
        return self._set_vm(s, vm, phase=PAUSED_OPERATOR)

    def resume(self, s: State, vm: str, by: str) -> State:
        """The agent resumes a VM it paused after a good renewal: its lease followed, renewed
        less than TTL/2 ago (rule 2), the VM recovered and holding every device it has. An
        operator resumes a VM an operator paused (no hook runs; see ``unsettled``)."""
        v = self.vm(s, vm)
        if by != "agent":
            _need(v.phase == PAUSED_OPERATOR, f"{vm} is {v.phase}, not paused by an operator")
            return self._set_vm(s, vm, phase=RUNNING)
        _need(v.phase == PAUSED_AGENT, f"{vm} is {v.phase}, not paused by the agent")
        self._fresh(s, v.host, "resume-in-doubt")
        _need(vm not in self.host(s, v.host).pending, f"{vm} awaits its recovery")
        _need(self.whole(s, vm), f"{vm} lacks a hold of a device it has")
        return self._set_vm(s, vm, phase=RUNNING)

    def recovered(self, s: State, vm: str) -> State:
        """The recovery is done with a VM: every device it still has is its own again."""
        v = self.vm(s, vm)
        h = self.host(s, v.host)
        _need(vm in h.pending, f"{vm} is not being recovered")
        _need(self.whole(s, vm), f"{vm} lacks a hold of a device it has")
        return self._set_host(s, v.host, pending=h.pending - {vm})

    # --- the workload and the hook ------------------------------------------------------------
    def reserve(self, s: State, vm: str, fdid: int, token: int) -> State:
        """Reserve (a prepare, a hot-add, or the recovery's re-reserve): refused while the
        device is held or fenced; the hold is on the host's lease, with a new, larger token
        (the fencing token); refused while the VM's own release of the device is pending (a
        start lands that first)."""
        v = self.vm(s, vm)
        h = self.host(s, v.host)
        recovering = vm in h.pending and dict(v.devices).get(fdid) is not None
        if recovering:
            _need(h.alive and h.lease is not None and h.followed, f"{v.host} cannot recover yet")
            lease = h.lease
        else:
            lease = h.lease_file
            _need(fdid not in dict(v.devices), f"{vm} has {fdid:#x} already")
            _need(fdid not in dict(v.journal), f"{vm}'s release of {fdid:#x} is pending")
        s = self.take_hold(s, vm, fdid, token, lease)
        if recovering:
            return self._set_vm(s, vm, devices=put(v.devices, fdid, token))
        if v.phase == STOPPED:
            return self._set_vm(s, vm, phase=PREPARING, devices=put(v.devices, fdid, token))
        if v.phase == PREPARING:
            return self._set_vm(s, vm, devices=put(v.devices, fdid, token))
        return s  # a hot-add: the device joins the domain with ``plug``

    def take_hold(self, s: State, vm: str, fdid: int, token: int, lease: int | None) -> State:
        """The registry's side of a reserve (one transaction): refused while the device is
        held or fenced, or with a lease that is gone; the hold and its fence, on ``lease``,
        with a new, larger token."""
        v = self.vm(s, vm)
        _need(lease is not None and get(s.leases, lease) is not None, f"{v.host} has no lease")
        assert lease is not None
        held = get(s.holds, fdid)
        _need(held is None, f"{fdid:#x} is held by {held and held.vm}")
        _need(get(s.fences, fdid) is None, f"{fdid:#x} is fenced")
        _need(token > s.issued, f"token {token} is not newer than {s.issued}")
        return s._replace(
            holds=put(s.holds, fdid, Hold(v.host, vm, token, lease)),
            fences=put(s.fences, fdid, token),
            issued=token,
        )

    def start(self, s: State, vm: str) -> State:
        """The prepare's last step reads every hold once more: the VM runs only on holds that
        are still its own ("a prepare that outlives its lease"), through mdevs the lender
        took with their tokens, and only while its host's lease is fresh (rule 2's gate, as
        for a resume: the explorer found a start under a lease past its TTL that etcd had not
        ended yet; it ended, another host took the device, and the VM ran until the guard
        looked again)."""
        v = self.vm(s, vm)
        _need(v.phase == PREPARING, f"{vm} is {v.phase}")
        self._fresh(s, v.host, "start-in-doubt")
        for fdid, token in v.devices:
            if "prepare-skips-reread" not in self.mutations:
                _need(_holds(s, fdid, vm, token), f"{vm}'s hold of {fdid:#x} ended")
            if self.lender:
                _need((vm, token) in self.device(s, fdid).sessions,
                      f"{vm} has no mdev of {fdid:#x}")
        return self._set_vm(s, vm, phase=RUNNING)

    def plug(self, s: State, vm: str, fdid: int, token: int) -> State:
        """A hot-add plugs a device it reserved: only on a hold still its own, and only while
        the host's lease is fresh (as ``start``)."""
        v = self.vm(s, vm)
        self._fresh(s, v.host, "start-in-doubt")
        _need(v.phase in LIVE and fdid not in dict(v.devices), f"{vm} cannot take {fdid:#x}")
        _need(_holds(s, fdid, vm, token), f"{vm} has no hold of {fdid:#x} for token {token}")
        return self._set_vm(s, vm, devices=put(v.devices, fdid, token))

    def unplug(self, s: State, vm: str, fdid: int) -> State:
        """A device leaves a live domain: the recovery hot-unplugs one the VM lost ("a device
        another host took meanwhile ... is hot-unplugged"), or a hot-remove returns one (its
        release is then owed, rule 4)."""
        v = self.vm(s, vm)
        token = dict(v.devices).get(fdid)
        _need(token is not None, f"{vm} has no {fdid:#x}")
        assert token is not None
        h = self.host(s, v.host)
        mine = _holds(s, fdid, vm, token)
        journal = put(v.journal, fdid, token) if mine and vm not in h.pending else v.journal
        return self._set_vm(s, vm, devices=drop(v.devices, fdid), journal=journal)

    def stop(self, s: State, vm: str) -> State:
        """The VM stops (or its start fails): every device it had is owed back to etcd, and
        the release lands now or later from the journal (rule 4)."""
        v = self.vm(s, vm)
        _need(v.phase != STOPPED, f"{vm} is stopped")
        journal = v.journal
        for fdid, token in v.devices:
            journal = put(journal, fdid, token)
        s = self._set_vm(s, vm, phase=STOPPED, devices=(), journal=journal)
        h = self.host(s, v.host)
        return self._set_host(s, v.host, pending=h.pending - {vm})

    def land(self, s: State, vm: str, fdid: int, token: int) -> State:
        """Rule 4: a release lands (at once, or later from the journal): only for the named
        device, only once the VM no longer has it, and it removes the hold and its fence only
        if the hold carries the entry's token (a newer hold is never released by an old one)."""
        v = self.vm(s, vm)
        _need(dict(v.journal).get(fdid) == token, f"{vm} owes no release of {fdid:#x}/{token}")
        _need(fdid not in dict(v.devices), f"{vm} still has {fdid:#x}")
        held = get(s.holds, fdid)
        if held is not None and (held.token == token or "journal-ignores-token" in self.mutations):
            s = self.end_hold(s, fdid)
        return self._set_vm(s, vm, journal=drop(v.journal, fdid))

    def end_hold(self, s: State, fdid: int) -> State:
        """The registry's side of a release that found its hold: hold and fence go in one
        transaction."""
        _need(get(s.holds, fdid) is not None, f"{fdid:#x} is not held")
        return s._replace(holds=drop(s.holds, fdid), fences=drop(s.fences, fdid))

    # --- the lender's device ------------------------------------------------------------------
    def open_mdev(self, s: State, vm: str, fdid: int, token: int) -> State:
        """The mdev of a hold carries its token to the device (rule 3): older than the
        device's is refused; a newer one ends every path and the borrow of an older one in
        the same step (hand-over)."""
        d = self.device(s, fdid)
        self._check_token(d, fdid, token)
        if token > d.token:
            sessions = frozenset(x for x in d.sessions if x[1] >= token)
            borrower = d.borrower if d.borrower is not None and d.borrower[1] >= token else None
            d = d._replace(token=token, sessions=sessions, borrower=borrower)
        d = d._replace(sessions=d.sessions | {(vm, token)})
        return s._replace(devices=put(s.devices, fdid, d))

    def _check_token(self, d: Device, fdid: int, token: int) -> None:
        """Rule 3 on the device: refuse a token older than its current one, or one whose
        borrow it took back."""
        if "lender-takes-old-tokens" in self.mutations:
            return
        _need(token >= d.token, f"{fdid:#x}: token {token} is older than the device's {d.token}")
        _need(token > d.retired, f"{fdid:#x}: token {token} was taken back")

    def borrow(self, s: State, vm: str, fdid: int, token: int) -> State:
        """The guest's first use borrows the device through its mdev, with the hold's token
        (the deferred borrow; rule 3: an older token than the device's is refused)."""
        d = self.device(s, fdid)
        _need(self.vm(s, vm).phase == RUNNING, f"{vm} does not run")
        _need((vm, token) in d.sessions, f"{vm} has no mdev of {fdid:#x} for token {token}")
        self._check_token(d, fdid, token)
        _need(d.borrower is None, f"{fdid:#x} is borrowed by {d.borrower}")
        return self._set_device(s, fdid, borrower=(vm, token))

    def give_back(self, s: State, vm: str, fdid: int, token: int) -> State:
        """A VM's use ends (stop, unplug, failed start): its mdev and borrow go; refused with
        a token older than the device's (a newer holder has it: not this VM's to touch)."""
        d = self.device(s, fdid)
        _need(token >= d.token, f"{fdid:#x}: token {token} is older than the device's {d.token}")
        _need((vm, token) in d.sessions, f"{vm} has no mdev of {fdid:#x} for token {token}")
        borrower = None if d.borrower == (vm, token) else d.borrower
        return self._set_device(s, fdid, sessions=d.sessions - {(vm, token)}, borrower=borrower)

    def spend(self, s: State, fdid: int, token: int) -> State:
        """A release spends its hold's token at the device before the hold goes (the sim
        register's ``end(spend)``, the SmartIO driver's ``spent``), served yet or not: that
        token's paths and borrow end and no later step may use it, as after a take-back. An
        older token than the device's changes nothing it serves. Never refused.

        The replay takes it; the explorer does not: its release lands once the VM's paths
        are closed (``land``), and the race spend closes (a win-back's mdev made after a
        release of the hold it read) is one step here (the recovery's reserve and mdev), so
        the explorer cannot reach it. Spending in ``land`` too merged 15% of the states of
        ``every_schedule`` (21,283 to 17,935) and hid ``journal-ignores-token`` (the wrong
        release spent the newer hold's token, cutting its VM off before (a) could see it)."""
        d = self.device(s, fdid)
        sessions = frozenset(x for x in d.sessions if x[1] != token)
        borrower = None if d.borrower is not None and d.borrower[1] == token else d.borrower
        return self._set_device(
            s, fdid, sessions=sessions, borrower=borrower, retired=max(d.retired, token)
        )

    def take_back(self, s: State, fdid: int) -> State:
        """The lender takes back a device whose hold vanished with its lease, with the fence's
        token (refused if older than the device's): every path and the borrow of that token or
        older end, that token is retired (no later step may use it), then the fence goes. No
        new token is made."""
        fence = get(s.fences, fdid)
        _need(fence is not None and get(s.holds, fdid) is None, f"{fdid:#x} is not fenced alone")
        assert fence is not None
        if not self.lender:
            return s._replace(fences=drop(s.fences, fdid))
        d = self.device(s, fdid)
        _need(fence >= d.token, f"{fdid:#x}: fence token {fence} is older than {d.token}")
        sessions = frozenset(x for x in d.sessions if x[1] > fence)
        borrower = d.borrower if d.borrower is not None and d.borrower[1] > fence else None
        retired = d.retired if "take-back-forgets-token" in self.mutations else fence
        s = self._set_device(s, fdid, sessions=sessions, borrower=borrower, retired=retired)
        return s._replace(fences=drop(s.fences, fdid))

    # --- the promises -------------------------------------------------------------------------
    def exclusive(self, s: State) -> list[str]:
        """(a) hardware exclusivity: the device serves only its newest token, and a VM whose
        hold ended (and was taken back) can neither DMA nor reach it."""
        out = []
        for fdid, d in s.devices:
            alive = {x.token for f, x in s.holds if f == fdid} | {get(s.fences, fdid)}
            if d.borrower is not None and d.borrower not in d.sessions:
                out.append(f"(a) {fdid:#x} serves {d.borrower[0]} with no mdev open")
            for vm, token in sorted(d.sessions):
                if token != d.token:
                    out.append(f"(a) {vm} reaches {fdid:#x} with token {token}, the device's "
                               f"is {d.token}")
                elif token not in alive:
                    out.append(f"(a) {vm} reaches {fdid:#x} with token {token}, whose hold "
                               f"ended")
        return out

    def guarded(self, s: State) -> list[str]:
        """(b) the guard: no device is in two VMs that run and are not paused."""
        users: dict[int, list[str]] = {}
        for name, v in s.vms:
            if v.phase == RUNNING:
                for fdid, _ in v.devices:
                    users.setdefault(fdid, []).append(name)
        return [f"(b) {fdid:#x} is in running VMs {', '.join(names)}"
                for fdid, names in sorted(users.items()) if len(names) > 1]


def _holds(s: State, fdid: int, vm: str, token: int) -> bool:
    """``vm`` holds ``fdid`` under ``token`` (whatever lease the hold is on)."""
    held = get(s.holds, fdid)
    return held is not None and held.vm == vm and held.token == token


# --- the explorer --------------------------------------------------------------------------------
Step = tuple[str, State]


@dataclass
class Exploration:
    states: int
    transitions: int
    seconds: float
    #: ticks the budget refused (a starved host's runs, left out of a within-budget run)
    starved: int = 0
    #: operator resumes left out of a within-budget run as blind
    blind: int = 0
    #: the first violation found, and the shortest trace to it (the steps' labels); tokens
    #: are as ``Explorer.normal`` renumbered them in the violating state
    violation: list[str] = field(default_factory=list)
    trace: list[str] = field(default_factory=list)


@dataclass
class Explorer:
    """Every interleaving of the actors' steps from ``start``, breadth first (so the first
    violation comes with a shortest trace), each state visited once up to ``key``.

    ``within_budget``: time in ticks, only the runs where every guard keeps its budget and no
    operator resumes blind, checking (b) (and (a) if the model has the lender; ``budgeted``
    leaves it out, which (b) does not need). Otherwise the model must be ``untimed``: no clock
    at all, so every run, starved or not, is among its runs (etcd ends leases and agents give
    them up at any step; pauses change nothing on the lender and are left out), checking (a)
    (``every_schedule``)."""

    model: Model
    start: State
    within_budget: bool = False
    #: a renaming of hosts and VMs under which the cluster is the same (h0 <-> h1 with their
    #: VMs): a state and its mirror image are visited once
    mirror: Mapping[str, str] | None = None
    #: how many a run may visit before it gives up (a model that grew by mistake)
    limit: int = 3_000_000

    def __post_init__(self) -> None:
        if self.within_budget == self.model.untimed:
            raise ValueError("a within-budget run needs time; a run of every schedule, none")

    def invariants(self, s: State) -> list[str]:
        found = self.model.exclusive(s)
        return found + self.model.guarded(s) if self.within_budget else found

    def run(self) -> Exploration:
        began = time.monotonic()
        first, _ = self.normal(self.start)
        # how each state was first reached: from which state, by which step, and whether it
        # is the mirror image of where that step led (the trace's names are put back)
        parent: dict[State, tuple[State, str, bool] | None] = {first: None}
        queue = deque([first])
        result = Exploration(0, 0, 0.0)
        while queue:
            s = queue.popleft()
            for label, nxt in self.steps(s, result):
                result.transitions += 1
                if nxt == s:  # a renewal right after one, a tick with every clock at its cap
                    continue
                nxt, flipped = self.normal(nxt)
                if nxt in parent:
                    continue
                parent[nxt] = (s, label, flipped)
                bad = self.invariants(nxt)
                if bad:
                    result.violation, result.trace = self._trace(parent, nxt, bad)
                    queue.clear()
                    break
                if len(parent) >= self.limit:
                    raise RuntimeError(f"more than {self.limit} states")
                queue.append(nxt)
        result.states, result.seconds = len(parent), time.monotonic() - began
        return result

    # --- the actors' atomic steps -------------------------------------------------------------
    def steps(self, s: State, count: Exploration) -> Iterator[Step]:
        m = self.model
        if self.within_budget:
            try:
                yield "tick", self.tick(s)
            except Refused:
                count.starved += 1
        for lease, x in s.leases:
            if m.untimed or x.expires <= s.now:
                old = "" if m.host(s, x.host).lease == lease else " (an old one)"
                yield from _try(f"etcd ends {x.host}'s lease{old}", m.expire, s, lease)
        for fdid, _ in s.devices:
            yield from _try(f"lender takes back {fdid:#x}", m.take_back, s, fdid)
        for host, h in s.hosts:
            yield from self.agent(s, host, h)
        for name, v in s.vms:
            yield from self.workload(s, name, v, count)

    def agent(self, s: State, host: str, h: Host) -> Iterator[Step]:
        m = self.model
        if not h.alive:
            yield from _try(f"{host} agent restarts", self.restarted, s, host)
            return
        yield from _try(f"{host} agent crashes", m.crash, s, host)
        if m.untimed:
            yield from _try(f"{host} gives its lease up", m.lose, s, host)
        else:
            # the guard's look at its latest is part of ``tick``; an earlier one (at TTL/2)
            # reaches no state the explorer does not reach otherwise (measured), so it is
            # left out
            yield from _try(f"{host} renews", self.renewal, s, host, h)
            yield from _try(f"{host} gives its lease up",
                            lambda: m.lose(self.pause_all(s, host), host))
        yield from _try(f"{host} takes a new lease",
                        lambda: m.follow(m.grant(s, host, s.granted + 1), host))
        for name in sorted(h.pending):
            yield from _try(f"{host} recovers {name}", self.recover, s, name)
        for name, v in s.vms:
            if v.host == host and v.phase == PAUSED_AGENT:
                yield from _try(f"{host} resumes {name}", m.resume, s, name, "agent")

    def workload(self, s: State, name: str, v: Vm, count: Exploration) -> Iterator[Step]:
        m = self.model
        for fdid, _ in s.devices:
            if v.phase == STOPPED and not v.journal:
                yield from _try(f"{name} reserves {fdid:#x}",
                                m.reserve, s, name, fdid, s.issued + 1)
        for fdid, token in v.devices if m.lender else ():
            if v.phase == PREPARING and (name, token) not in m.device(s, fdid).sessions:
                yield from _try(f"{name} opens its mdev of {fdid:#x}",
                                m.open_mdev, s, name, fdid, token)
            if v.phase == RUNNING:
                yield from _try(f"{name} borrows {fdid:#x}",
                                m.borrow, s, name, fdid, token)
        for fdid, token in v.journal:
            yield from _try(f"{name}'s release of {fdid:#x} lands",
                            m.land, s, name, fdid, token)
        yield from _try(f"{name} starts", m.start, s, name)
        if v.phase != STOPPED:
            yield f"{name} stops", self.stopped(s, name, v)
        if m.untimed:
            return  # pauses change nothing a lender sees
        if v.phase == RUNNING:
            yield f"operator pauses {name}", m.pause(s, name, "operator")
        if v.phase == PAUSED_OPERATOR:
            if self.within_budget and m.unsettled(s, name):
                count.blind += 1
            else:
                yield f"operator resumes {name}", m.resume(s, name, "operator")

    # --- composite steps: what one actor does at once -----------------------------------------
    def tick(self, s: State) -> State:
        """The end of a tick interval, then time passes. Each live guard has looked by then,
        at the latest: it pauses what runs with remote devices on a lease in doubt since an
        interval before (a look every TTL/4, and a pause landing within another TTL/4). A
        host whose agent is down while such a VM runs misses its budget."""
        for name, h in s.hosts:
            if not h.alive:
                running = any(v.host == name and v.phase == RUNNING and v.devices
                              for _, v in s.vms)
                _need(not running, f"{name}'s guard misses its budget")
            else:
                s = _quietly(self.guard, s, name, self.model.doubt + 1)
        # now stays 0 and every time moves one tick into the past: an expiry that passed is
        # "due" (0), an age past the TTL is the TTL (lost whatever its age)
        ttl = self.model.ttl
        return s._replace(
            leases=tuple((i, x._replace(expires=max(x.expires - 1, 0))) for i, x in s.leases),
            hosts=tuple(
                (n, h._replace(sent=max(h.sent - 1, -ttl)) if h.lease is not None else h)
                for n, h in s.hosts
            ),
        )

    def renewal(self, s: State, host: str, h: Host) -> State:
        """A keepalive: renewed, or etcd says the lease is gone (then the lost path)."""
        _need(h.lease is not None and s.now - h.sent < self.model.ttl, "nothing to renew")
        if h.lease is not None and get(s.leases, h.lease) is None:
            return self.model.lose(self.pause_all(s, host), host)
        return self.model.renew(s, host, s.now)

    def guard(self, s: State, host: str, after: float) -> State:
        """The guard's look (rule 2): with no lease, or ``after`` ticks since the last good
        keepalive's send, pause every running VM with remote devices."""
        h = self.model.host(s, host)
        _need(h.lease is None or s.now - h.sent >= after, f"the lease of {host} is fresh")
        paused = self.pause_all(s, host)
        _need(paused != s, f"nothing runs on {host}")
        return paused

    def pause_all(self, s: State, host: str) -> State:
        for name, v in s.vms:
            if v.host == host and v.phase == RUNNING and v.devices and not self.model.untimed:
                s = self.model.pause(s, name, "agent")
        return s

    def restarted(self, s: State, host: str) -> State:
        """A restart: adopt the lease in the lease file while it lives; otherwise every VM lost
        its holds: pause the running ones, and a new lease will recover them all."""
        m = self.model
        s = m.restart(s, host)
        if "restart-neither-adopts-nor-pauses" in m.mutations:
            s = m.grant(s, host, s.granted + 1)
            return m._set_host(s, host, followed=True, pending=frozenset())
        h = m.host(s, host)
        if h.lease_file is not None and get(s.leases, h.lease_file) is not None:
            return m.follow(m.adopt(s, host, s.now), host)
        return self.pause_all(s, host)

    def recover(self, s: State, name: str) -> State:
        """The recovery of one VM: each device still its own is kept, a free one re-reserved
        (new token, new mdev), one held by another or still fenced hot-unplugged; an
        operator's VM stays paused, the agent's waits for ``resume``."""
        m = self.model
        v = m.vm(s, name)
        h = m.host(s, v.host)
        _need(h.lease is not None and h.followed, f"{v.host} has no followed lease yet")
        _need(v.phase in PAUSED or m.untimed, f"{name} must be paused first")
        skip = v.phase == PAUSED_OPERATOR and "recovery-skips-operator-pauses" in m.mutations
        for fdid, token in v.devices:
            if skip or _holds(s, fdid, name, token):
                continue
            if get(s.holds, fdid) is None and get(s.fences, fdid) is None:
                s = m.reserve(s, name, fdid, s.issued + 1)
                if m.lender:
                    s = m.open_mdev(s, name, fdid, s.issued)
            else:
                s = m.unplug(s, name, fdid)
                if m.lender:
                    s = _quietly(m.give_back, s, name, fdid, token)
        if skip:
            return m._set_host(s, v.host, pending=h.pending - {name})
        return m.recovered(s, name)

    def stopped(self, s: State, name: str, v: Vm) -> State:
        """The VM stops (or its start fails): QEMU goes, its mdevs go (the give-back), and its
        releases are owed."""
        m = self.model
        for fdid, token in v.devices if m.lender else ():
            s = _quietly(m.give_back, s, name, fdid, token)
        return m.stop(s, name)

    # --- states visited once up to what no rule can tell -------------------------------------
    def normal(self, s: State) -> tuple[State, bool]:
        """``s`` as the one state every state no rule can tell from it is visited as: tokens
        and lease ids renumbered in order, leases nothing names dropped (no hold is on them and
        no agent or lease file names them), and of ``s`` and its mirror image, one. Times are
        already relative to now, which stays 0 (``tick``). True with the mirror image."""
        tokens: set[int] = set()
        leases: set[int] = set()
        for _, d in s.devices:
            tokens.add(d.token)
            tokens.add(d.retired)
            for _, t in d.sessions:
                tokens.add(t)
            if d.borrower is not None:
                tokens.add(d.borrower[1])
        for _, x in s.holds:
            tokens.add(x.token)
            leases.add(x.lease)
        for _, t in s.fences:
            tokens.add(t)
        for _, v in s.vms:
            for _, t in v.devices:
                tokens.add(t)
            for _, t in v.journal:
                tokens.add(t)
        for _, h in s.hosts:
            if h.lease is not None:
                leases.add(h.lease)
            if h.lease_file is not None:
                leases.add(h.lease_file)
        issued, granted = max(tokens, default=0), max(leases, default=0)
        if (issued + 1 != len(tokens) or granted != len(leases)
                or any(i not in leases for i, _ in s.leases)):
            s = _renumbered(s, {t: i for i, t in enumerate(sorted(tokens))},
                            {x: i + 1 for i, x in enumerate(sorted(leases))})
        elif (s.issued, s.granted) != (issued, granted):
            s = s._replace(issued=issued, granted=granted)
        if self.mirror is None:
            return s, False
        # which way round is decided by what the hosts look like without their names (the
        # same choice for a state and its mirror image); repr breaks a tie
        sig = self._signatures(s)
        ahead = [sig[h] for h, _ in s.hosts]
        behind = [sig[self.mirror.get(h, h)] for h, _ in s.hosts]
        if ahead < behind:
            return s, False
        other = _renamed(s, self.mirror)
        if ahead > behind or repr(other) < repr(s):
            return other, True
        return s, False

    def _trace(self, parent: Mapping[State, tuple[State, str, bool] | None], end: State,
               violation: list[str]) -> tuple[list[str], list[str]]:
        """The violation and the steps from the start to ``end``, in the start's names."""
        steps: list[tuple[str, bool]] = []
        link = parent[end]
        while link is not None:
            steps.append((link[1], link[2]))
            link = parent[link[0]]
        labels, flipped = [], False
        for label, flips in reversed(steps):
            labels.append(self._named(label, flipped))
            flipped ^= flips
        return [self._named(v, flipped) for v in violation], labels

    def _named(self, text: str, flipped: bool) -> str:
        if not flipped or self.mirror is None:
            return text
        names = self.mirror
        return re.sub(r"\b\w+\b", lambda w: names.get(w.group(), w.group()), text)

    def _signatures(self, s: State) -> dict[str, tuple[Any, ...]]:
        vms: dict[str, list[tuple[str, int, int]]] = {}
        for _, v in s.vms:
            vms.setdefault(v.host, []).append((v.phase, len(v.devices), len(v.journal)))
        return {
            name: (h.alive, h.lease is None, h.followed, h.lease_file is None, len(h.pending),
                   h.sent, sorted(vms.get(name, ())))
            for name, h in s.hosts
        }


def _renumbered(s: State, tok: Mapping[int, int], lid: Mapping[int, int]) -> State:
    """``s`` with its tokens and lease ids renamed by ``tok`` and ``lid``, the leases ``lid``
    does not name dropped."""

    def pairs(m: Map[int, int]) -> Map[int, int]:
        return tuple((f, tok[t]) for f, t in m)

    def lease(x: int | None) -> int | None:
        return None if x is None else lid[x]

    return s._replace(
        leases=tuple((lid[i], x) for i, x in s.leases if i in lid),
        holds=tuple((f, x._replace(token=tok[x.token], lease=lid[x.lease])) for f, x in s.holds),
        fences=pairs(s.fences),
        devices=tuple(
            (f, d._replace(
                token=tok[d.token],
                retired=tok[d.retired],
                borrower=None if d.borrower is None else (d.borrower[0], tok[d.borrower[1]]),
                sessions=frozenset((v, tok[t]) for v, t in d.sessions),
            ))
            for f, d in s.devices
        ),
        hosts=tuple(
            (n, h._replace(lease=lease(h.lease), lease_file=lease(h.lease_file)))
            for n, h in s.hosts
        ),
        vms=tuple((n, v._replace(devices=pairs(v.devices), journal=pairs(v.journal)))
                  for n, v in s.vms),
        issued=max(tok.values(), default=0),
        granted=max(lid.values(), default=0),
    )


def _renamed(s: State, names: Mapping[str, str]) -> State:
    """``s`` with its hosts and VMs renamed by ``names``."""

    def n(x: str) -> str:
        return names.get(x, x)

    return s._replace(
        leases=tuple((i, x._replace(host=n(x.host))) for i, x in s.leases),
        holds=tuple((f, x._replace(host=n(x.host), vm=n(x.vm))) for f, x in s.holds),
        devices=tuple(
            (f, d._replace(
                borrower=None if d.borrower is None else (n(d.borrower[0]), d.borrower[1]),
                sessions=frozenset((n(v), t) for v, t in d.sessions),
            ))
            for f, d in s.devices
        ),
        hosts=tuple(sorted(
            (n(name), h._replace(pending=frozenset(n(v) for v in h.pending)))
            for name, h in s.hosts
        )),
        vms=tuple(sorted((n(v), x._replace(host=n(x.host))) for v, x in s.vms)),
    )


def _try(label: str, step: Callable[..., State], *args: Any) -> Iterator[Step]:
    """``step(*args)`` under ``label``, or nothing when refused."""
    try:
        nxt = step(*args)
    except Refused:
        return
    yield label, nxt


def _quietly(step: Callable[..., State], s: State, *args: Any) -> State:
    """``step(s, *args)``, or ``s`` unchanged when refused (a give-back the device refuses
    changes nothing: the path was cut already)."""
    try:
        return step(s, *args)
    except Refused:
        return s


def small_cluster() -> State:
    """What the exploration covers: hosts h0 and h1, VM v0 on h0 and v1 on h1, both wanting
    the one device 0x10, which a third host lends."""
    return initial(["h0", "h1"], {"v0": "h0", "v1": "h1"}, {0x10: "lender"})


#: ``small_cluster``'s symmetry: h0 and v0 play the part of h1 and v1
SMALL_MIRROR = {"h0": "h1", "h1": "h0", "v0": "v1", "v1": "v0"}


def every_schedule(mutations: Iterable[str] = ()) -> Explorer:
    """(a) over every run of ``small_cluster``, starved or not: no clock, the lender's device
    modelled."""
    model = Model(mutations=frozenset(mutations), untimed=True)
    return Explorer(model, small_cluster(), mirror=SMALL_MIRROR)


def budgeted(mutations: Iterable[str] = ()) -> Explorer:
    """(b) over the runs of ``small_cluster`` in which every guard keeps its budget and no
    operator resumes blind: ticks of TTL/4, the lender left out."""
    model = Model(mutations=frozenset(mutations), lender=False)
    return Explorer(model, small_cluster(), within_budget=True, mirror=SMALL_MIRROR)
