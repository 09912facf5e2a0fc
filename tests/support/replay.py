"""A recorded history replayed through the protocol's model (issue 35, point 10).

The nemesis's processes write their events (``vmlend.events``) to one JSON-lines file;
``replay`` orders them and feeds each to the rule of ``tests/support/agent_model.Model`` it
is, on a ``State`` sized from the history (every node, VM and device it names; the agents
down until their first start). The first event the model refuses ends the replay
(``Refusal``: the event, why, and the events before it of the same device or node).

What each event is, in the model:

- ``restart``, ``crash`` (the test): ``Model.restart``, ``Model.crash``.
- ``lease-granted`` / ``lease-adopted`` (the agent, with the keepalive's send time):
  ``grant`` (from the send: etcd counts the TTL from later) / ``adopt``; a grant after a
  restart whose lease file names a lease the replay still has means etcd said that one was
  gone, so it ``expire``s first; ``lease-followed``: ``follow`` (rule 1), placed at its
  ``done`` (when etcd took the move; the note may come seconds later, the agent stopped
  between: seed 20, 2026-11-30, the freeze-start nemesis);
  ``lease-renewed``: ``renew``; ``lease-lost``: ``expire`` (if not already) then ``lose``.
- ``reserve`` (the sim backend, once committed, with the hold's token): ``take_hold`` on the
  host's published lease (the lease file's), refused while the device is held or fenced or
  for a token not newer than every earlier one; ``release`` (a release that ended its hold):
  the hold must be there with that token, then ``end_hold``.
- ``reserve-begun`` / ``release-begun`` ... ``-done`` (the sim backend brackets each call;
  ``_cut_short``): a call whose agent was killed in it (the test's ``crash`` names the pid)
  may have committed unrecorded. Such a release of a hold whose token the device spent ends
  it, or its fence, when a later reserve of the device needs them gone
  (``unlogged_releases``), unless the hold shows up alive after. Such a reserve, like a
  ``reserve-unknown``, is added as made when a release of a token no reserve noted, by that
  VM on that device, comes after (``with_lost_reserves``; ``unlogged_reserves``), at the
  latest its commit could be; it then takes its hold as any reserve does.
- ``serve`` / ``end`` / ``take-back`` (the lender register, in the device's order):
  ``open_mdev`` / ``give_back`` (``spend`` for a release) / ``take_back`` with the fence's
  token. After each, what the device says (its token, its retired token, whom it serves)
  must be what the model's device is, and (a) (``Model.exclusive``) must hold. A refusal of
  the device's must be one the model makes too.
- ``pause`` (counted), ``resume`` (the agent's): rule 2's gate, ``Model.stale`` at the moment
  the worker read the lease: followed, renewed less than TTL/2 before.

etcd ends a lease when it likes, from TTL after its last keepalive's send on (the model's
``expire``); nobody records it. So the replay ends a lease when an event needs its holds gone
(a reserve of a device it holds, a take-back of one it held, the agent told it is lost), and
refuses the event if the lease cannot have ended yet: a take-back or a reserve before the
holder's lease could end is the bug fencing exists to stop.

Order: by time, except the registry's writes: a process logs a reserve or a release after it
committed, so one may be logged after a write that depends on it. Tokens are etcd revisions,
and per device a hold's reserve precedes its release, its serves and the next hold's reserve;
so each reserve and release is moved back to at most the time of the first event that depends
on it (``ordered``). Register events are written under the device's lock, in its order.

Not replayed (the model's state has them but the events do not say): VMs' phases and the
devices in their domains (starts, stops, plugs), the journal, the recovery's steps; so
``start``, ``plug``, ``resume``'s "every device its own", the guard's budget and promise (b)
are not checked here (the nemesis's sampler checks (b) on the hypervisors).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tests.support.agent_model import Device, Host, Model, Refused, State, Vm, drop, get, put

#: The register's ``serve``, ``end``, ``take-back``: events of the device.
DEVICE_KINDS = ("serve", "end", "take-back")


@dataclass(frozen=True)
class Event:
    t: float
    pid: int
    seq: int
    actor: str
    kind: str
    fields: dict[str, Any]
    #: the line of the file (from 1)
    line: int = 0

    @property
    def fdid(self) -> int | None:
        f = self.fields.get("fdid")
        return int(f) if f is not None else None

    @property
    def node(self) -> str:
        return str(self.fields.get("node") or self.actor)

    def describe(self) -> str:
        rest = " ".join(f"{k}={_show(k, v)}" for k, v in self.fields.items())
        who = f" {self.actor}" if self.actor else ""
        return f"line {self.line} t={self.t:.3f} pid={self.pid}{who} {self.kind} {rest}"


def _show(key: str, value: Any) -> str:
    if key == "fdid" and isinstance(value, int):
        return f"{value:#x}"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def event(kind: str, t: float, actor: str = "", pid: int = 1, seq: int = 0,
          **fields: Any) -> Event:
    """An event as a test writes one by hand."""
    return Event(t, pid, seq, actor, kind, fields)


def read_events(path: Path) -> list[Event]:
    out = []
    lines = path.read_text().split("\n")
    for i, text in enumerate(lines, 1):
        if not text.strip():
            continue
        if i == len(lines):
            break  # no newline yet: a line still being written (the agents run on)
        raw = json.loads(text)
        head = {k: raw.pop(k) for k in ("t", "pid", "seq", "actor", "kind")}
        out.append(Event(float(head["t"]), int(head["pid"]), int(head["seq"]),
                         str(head["actor"]), str(head["kind"]), raw, i))
    return out


def ordered(events: Iterable[Event]) -> list[Event]:
    """The events in the order the replay takes them (see the module's docstring): by time,
    each process's in its own order, each reserve and release moved back to the first event
    that depends on it."""
    evs = sorted(events, key=lambda e: (e.t, e.pid, e.seq))
    # one reserve per token, the first logged: a later one of the same token is a call that
    # found the hold its VM had (``created`` False), in its own place
    first: dict[int, Event] = {}
    for e in evs:
        if e.kind == "reserve" and e.fields.get("token"):
            first.setdefault(int(e.fields["token"]), e)
    reserves = [first[t] for t in sorted(first)]
    chained = {id(e) for e in reserves}
    releases = {(e.fdid, int(e.fields.get("token") or 0)): e for e in evs if e.kind == "release"}
    # a release committed no sooner than its call began; a pending release's landing (noted
    # when the agent landed it) no sooner than its first run began, which met the registry
    # away and noted that (``release-unknown``); without it, no sooner than the landing
    tried = {
        (e.fdid, int(e.fields.get("token") or 0)): float(e.fields.get("began", e.t))
        for e in evs
        if e.kind == "release-unknown"
    }
    served: dict[tuple[int | None, int], float] = {}
    for e in evs:
        if e.kind == "serve" and not e.fields.get("refused"):
            key = (e.fdid, int(e.fields["token"]))
            served[key] = min(served.get(key, math.inf), e.t)
    when: dict[int, float] = {id(e): _at(e) for e in evs}
    later_any = math.inf  # the next reserve by token, anywhere: tokens are etcd's revisions
    later_on: dict[int | None, float] = {}  # the next reserve of the device
    for e in reversed(reserves):
        token = int(e.fields["token"])
        nxt = later_on.get(e.fdid, math.inf)
        t = min(e.t, later_any, nxt, served.get((e.fdid, token), math.inf))
        rel = releases.get((e.fdid, token))
        if rel is not None:
            when[id(rel)] = min(rel.t, nxt)
            if rel.fields.get("landing"):
                when[id(rel)] = max(when[id(rel)], tried.get((e.fdid, token), rel.t))
            elif "began" in rel.fields:
                when[id(rel)] = max(when[id(rel)], float(rel.fields["began"]))
            t = min(t, when[id(rel)])
        when[id(e)] = t
        later_any = later_on[e.fdid] = t

    def key(e: Event) -> tuple[float, int, int, int, int]:
        if id(e) in chained or e.kind == "release":  # a hold's reserve, its release, the next
            return (when[id(e)], 0, int(e.fields.get("token") or 0), e.kind == "release", 0)
        return (when[id(e)], 1, 0, 0, 0)

    # a reserve noted by nobody (``with_lost_reserves``) happens where it is placed
    return [replace(e, t=when[id(e)]) if e.fields.get("unlogged") else e
            for e in sorted(evs, key=key)]


def _at(e: Event) -> float:
    """When the event happened: its time, or for a follow when etcd took the move."""
    if e.kind == "lease-followed" and "done" in e.fields:
        return float(e.fields["done"])
    return e.t


@dataclass
class Refusal:
    """The first event the model refuses: why, and what came before it."""

    event: Event
    why: str
    context: list[Event]
    state: State

    def describe(self) -> str:
        lines = [f"the model refuses {self.event.describe()}", f"  because: {self.why}",
                 "  after (the same device or node):"]
        lines += [f"    {e.describe()}" for e in self.context]
        return "\n".join(lines)


@dataclass
class Replay:
    events: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    refusal: Refusal | None = None
    #: register refusals the model also makes (a device refusing a stale step)
    device_refusals: int = 0
    #: leases the replay ended because an event needed their holds gone
    ended: int = 0
    #: the least time between the earliest a lease could end and the event that needed it
    #: ended (inf: none did)
    margin: float = math.inf
    #: reserves and releases whose transaction committed in a run whose reply was lost (a
    #: re-run found it done: a release says "released" False; a reserve says "created" False
    #: only from a vmlend before the hold's stamp let its re-run know its own hold)
    lost_replies: int = 0
    #: renewals that came more than a TTL after the one before (etcd kept the lease: a
    #: leader change extends leases)
    late_renewals: int = 0
    #: keepalives answered after the lease they renewed had ended (sent more than a TTL
    #: before the answer): no time given, nothing follows from them
    late_answers: int = 0
    #: holds (or fences) a later reserve found gone whose release began in an agent killed
    #: before it noted the release's end (its commit landed, its note did not)
    unlogged_releases: int = 0
    #: reserves added as made from the release of their hold (``with_lost_reserves``)
    unlogged_reserves: int = 0

    def summary(self) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.counts.items()))
        verdict = "every one allowed" if self.refusal is None else "REFUSED"
        return (f"{self.events} events ({kinds}): {verdict}; {self.ended} lease end(s)"
                f" inferred (the closest {self.margin:.2f} s after the earliest it could),"
                f" {self.device_refusals} stale step(s) the device refused as the"
                f" model does, {self.lost_replies} commit(s) whose reply was lost,"
                f" {self.late_renewals} renewal(s) more than a TTL after the last,"
                f" {self.late_answers} answered after their lease ended,"
                f" {self.unlogged_releases} release(s) and {self.unlogged_reserves} reserve(s)"
                f" noted by nobody (their agent killed, or the registry away)")


def _vm(node: str, vm: str) -> str:
    return f"{node}/{vm}"


def _call_key(e: Event) -> tuple[int, str, str]:
    """A bracketed call: its process, reserve or release, its id (the time it began in a
    history written before calls had ids)."""
    what = e.kind.rpartition("-")[0]
    return e.pid, what, str(e.fields.get("call") or e.fields.get("began"))


def _ident(e: Event) -> tuple[int, float, int]:
    """An event of the file as itself (events of one process never share time and seq)."""
    return e.pid, e.t, e.seq


def _cut_short(events: Iterable[Event]) -> dict[tuple[int, float, int], float]:
    """The reserves and releases (``reserve-begun``, ``release-begun``) of an agent killed in
    the call (a later ``crash`` names its pid; the call noted no ``-done``): each may have
    committed between its beginning and the kill, unrecorded. Their begun events
    (``_ident``), with the time of the kill."""
    kills: dict[int, list[float]] = {}
    for e in events:
        if e.kind == "crash" and "agent" in e.fields:
            kills.setdefault(int(e.fields["agent"]), []).append(e.t)
    open_calls: dict[tuple[int, str, str], Event] = {}
    for e in events:
        what, _, phase = e.kind.rpartition("-")
        if what not in ("reserve", "release") or e.pid not in kills:
            continue
        if phase == "begun":
            open_calls[_call_key(e)] = e
        elif phase == "done":
            open_calls.pop(_call_key(e), None)
    out = {}
    for e in open_calls.values():
        after = [t for t in kills[e.pid] if t >= e.t]  # a pid used again: its own kill
        if after:
            out[_ident(e)] = min(after)
    return out


def _newer_noted(events: Iterable[Event]) -> Callable[[int], float]:
    """token -> the earliest time a reserve of a larger token was noted: a call begun then or
    later commits a larger token (tokens are etcd revisions), so it cannot have made a hold
    of ``token``."""
    noted = sorted((int(e.fields["token"]), e.t) for e in events
                   if e.kind == "reserve" and e.fields.get("token"))

    def bound(token: int) -> float:
        return min((t for k, t in noted if k > token), default=math.inf)

    return bound


def with_lost_reserves(events: list[Event]) -> list[Event]:
    """``events`` with a ``reserve`` added for each release of a token no reserve noted, by a
    VM whose reserve of that device may have committed unrecorded (cut short by its agent's
    kill, or ``reserve-unknown``: it met the registry away) before the release: made at the
    latest it could have been (the kill, the raise, or the release that names its token if
    that came first: a ``crash`` is noted when the test learnt of the death, which for an agent
    that killed itself at a fault point is after the hook it served failed and went on), so
    that ``ordered`` places it by its token and ``take_hold`` checks it as any reserve."""
    cut = _cut_short(events)
    pending = [(e, cut[_ident(e)]) for e in events
               if e.kind == "reserve-begun" and _ident(e) in cut]
    pending += [(e, e.t) for e in events if e.kind == "reserve-unknown"]
    known = {(e.fdid, int(e.fields.get("token") or 0)) for e in events if e.kind == "reserve"}
    out = list(events)
    newer = _newer_noted(events)
    for rel in sorted((e for e in events if e.kind == "release"), key=lambda e: e.t):
        token = int(rel.fields.get("token") or 0)
        if not token or (rel.fdid, token) in known:
            continue
        fits = [(b, min(latest, rel.t)) for b, latest in pending
                if (b.fdid, b.node, b.fields.get("vm")) == (rel.fdid, rel.node, rel.fields["vm"])
                and b.t <= rel.t]
        if not fits:
            continue
        # a call that began before any newer token was noted first, then the latest
        b, latest = max(fits, key=lambda x: (float(x[0].fields.get("began", x[0].t))
                                             < newer(token), x[1]))
        pending = [(x, t) for x, t in pending if x is not b]
        known.add((rel.fdid, token))
        made = {"fdid": rel.fdid, "node": b.node, "vm": b.fields["vm"], "token": token,
                "created": True, "began": float(b.fields.get("began", b.t)), "unlogged": True}
        out.append(Event(latest, b.pid, b.seq, b.actor, "reserve", made, b.line))
    return out


class Replayer:
    """The replay's state and one handler per kind of event."""

    def __init__(self, events: list[Event], ttl: float | None = None) -> None:
        ttls = [float(e.fields["ttl"]) for e in events if "ttl" in e.fields]
        self.model = Model(ttl=ttl if ttl is not None else min(ttls, default=2.0))
        #: per (device, VM), reserves whose token is unknown (``on_reserve_unknown``): their
        #: host and when their call began; and the take-backs of tokens no reserve made yet,
        #: with the hosts that could not have lost a lease then
        self.unknown: dict[tuple[int, str], tuple[str, float]] = {}
        #: when the replay ended each lease (``_end``)
        self.ended_at: dict[int, float] = {}
        self.orphans: list[tuple[Event, frozenset[str]]] = []
        #: the calls of killed agents that noted no end (``_cut_short``), and the (device,
        #: token) of the releases among them the replay has reached: each may have committed
        self.cut_short = _cut_short(events)
        self.released_maybe: set[tuple[int, int]] = set()
        #: every token a reserve noted: etcd revisions, so one of a hold nobody noted is none
        self.noted = {int(e.fields["token"]) for e in events
                      if e.kind == "reserve" and e.fields.get("token")}
        self.newer = _newer_noted(events)
        #: per device, the newest token the replay has made a hold of
        self.newest_of: dict[int, int] = {}
        nodes: set[str] = set()
        vms: dict[str, str] = {}
        fdids: set[int] = set()
        for e in events:
            if e.actor:
                nodes.add(e.actor)
            if e.fdid is not None:
                fdids.add(e.fdid)
            if e.kind in ("reserve", "release", "reserve-unknown", "reserve-begun",
                          "release-begun"):
                nodes.add(e.node)
                vms[_vm(e.node, str(e.fields["vm"]))] = e.node
            if e.kind in ("serve", "end"):
                node, vm = self._borrower(e)
                nodes.add(node)
                vms[_vm(node, vm)] = node
            if e.kind in ("pause", "resume"):
                vms[_vm(e.actor, str(e.fields["vm"]))] = e.actor
        self.state = State(
            now=0.0,
            leases=(),
            holds=(),
            fences=(),
            devices=tuple((f, Device("lender")) for f in sorted(fdids)),
            hosts=tuple((n, Host(alive=False)) for n in sorted(nodes)),
            vms=tuple(sorted((v, Vm(h)) for v, h in vms.items())),
        )
        #: etcd's lease ids as the model's (granted in order)
        self.leases: dict[int, int] = {}
        self.result = Replay()

    @staticmethod
    def _asked(e: Event) -> list[str]:
        return str(e.fields.get("asked", "")).split()

    def _borrower(self, e: Event) -> tuple[str, str]:
        who = self._asked(e)[1]
        node, _, vm = who.partition("/")
        return node, vm

    # --- the replay ------------------------------------------------------------------------
    def run(self, events: list[Event]) -> Replay:
        done: list[Event] = []
        for e in events:
            self.state = self.state._replace(now=e.t)
            try:
                self.state = getattr(self, "on_" + e.kind.replace("-", "_"))(self.state, e)
            except Refused as r:
                near = [x for x in done if (e.fdid is not None and x.fdid == e.fdid)
                        or (x.node == e.node and x.kind.startswith(("lease", "crash", "restart")))]
                self.result.refusal = Refusal(e, str(r), near[-12:], self.state)
                break
            done.append(e)
            self.result.events += 1
            self.result.counts[e.kind] = self.result.counts.get(e.kind, 0) + 1
        if self.result.refusal is None and self.orphans:
            e = self.orphans[0][0]
            why = f"a take-back of {e.fdid:#x} with a token no reserve made"
            self.result.refusal = Refusal(e, why, [], self.state)
        return self.result

    def _lease(self, etcd_id: int) -> int:
        if etcd_id not in self.leases:
            self.leases[etcd_id] = len(self.leases) + 1
        return self.leases[etcd_id]

    def _end(self, s: State, lease: int, why: str) -> State:
        """etcd ended ``lease`` by now, or the event that needs it is refused."""
        found = get(s.leases, lease)
        if found is None:
            return s
        if s.now < found.expires:
            raise Refused(f"{why}, but lease {lease} of {found.host} cannot have ended before"
                          f" {found.expires:.3f} (TTL {self.model.ttl:g} after its last"
                          f" keepalive's send), {found.expires - s.now:.3f} s later")
        self.result.ended += 1
        self.result.margin = min(self.result.margin, s.now - found.expires)
        self.ended_at[lease] = s.now
        return self.model.expire(s, lease)

    # --- the test's kills and restarts -----------------------------------------------------
    def on_restart(self, s: State, e: Event) -> State:
        return self.model.restart(s, e.actor)

    def on_crash(self, s: State, e: Event) -> State:
        return self.model.crash(s, e.actor)

    # --- the agent's lease -----------------------------------------------------------------
    def on_lease_granted(self, s: State, e: Event) -> State:
        h = self.model.host(s, e.actor)
        sent = float(e.fields["sent"])
        if h.lease is None and h.lease_file is not None and get(s.leases, h.lease_file):
            # a restart that could not adopt: etcd said the lease file's lease is gone
            s = self._end(s._replace(now=sent), h.lease_file,
                          f"{e.actor}'s agent found its lease file's lease gone")
        lease = self._lease(int(e.fields["lease"]))
        s = self.model.grant(s._replace(now=sent), e.actor, lease)
        return s._replace(now=e.t)

    def on_lease_adopted(self, s: State, e: Event) -> State:
        h = self.model.host(s, e.actor)
        lease = self._lease(int(e.fields["lease"]))
        if h.lease_file != lease:
            raise Refused(f"{e.actor} adopts lease {lease}, its lease file names {h.lease_file}")
        return self.model.adopt(s, e.actor, float(e.fields["sent"]))

    def on_lease_followed(self, s: State, e: Event) -> State:
        s = s._replace(now=_at(e))
        h = self.model.host(s, e.actor)
        if h.lease != self._lease(int(e.fields["lease"])):
            raise Refused(f"{e.actor} follows lease {e.fields['lease']:x}, not its own")
        return self.model.follow(s, e.actor)

    def on_lease_renewed(self, s: State, e: Event) -> State:
        h = self.model.host(s, e.actor)
        lease = self._lease(int(e.fields["lease"]))
        if h.lease != lease:
            raise Refused(f"{e.actor} renews lease {lease}, its agent's is {h.lease}")
        sent = float(e.fields["sent"])
        ended = self.ended_at.get(lease)
        if get(s.leases, lease) is None and ended is not None and sent + self.model.ttl <= ended:
            # etcd answered the keepalive before it ended the lease, and the answer came
            # after the end (the network's latency; seed 20, 2026-11-30: sent 3 s before):
            # it gives the agent no time, its guard counting from the send (rule 2). The
            # lease must have ended no sooner than TTL after that send, or the event that
            # ended it in the replay came too early
            self.result.late_answers += 1
            return s
        if sent - h.sent >= self.model.ttl:
            self.result.late_renewals += 1  # etcd kept the lease past its TTL (``renew``)
        return self.model.renew(s, e.actor, sent)

    def on_lease_lost(self, s: State, e: Event) -> State:
        lease = self._lease(int(e.fields["lease"]))
        s = self._end(s, lease, f"etcd told {e.actor} its lease {lease} is gone")
        return self.model.lose(s, e.actor)

    # --- the agent's guard -----------------------------------------------------------------
    def on_pause(self, s: State, e: Event) -> State:
        return s

    def on_resume(self, s: State, e: Event) -> State:
        decided = float(e.fields["decided"])
        why = self.model.stale(s._replace(now=decided), e.actor)
        if why is not None:
            raise Refused(f"the agent resumed {e.fields['vm']}: {why}")
        return s

    # --- the registry ----------------------------------------------------------------------
    def on_reserve(self, s: State, e: Event) -> State:
        fdid, token = int(e.fields["fdid"]), int(e.fields["token"])
        vm = _vm(e.node, str(e.fields["vm"]))
        if not token:
            # its hold and fence were gone when it read them back: its lease ended and its
            # lender took the device back first (a take-back of a token the history had not
            # seen, waiting for this reserve); anything else is a reserve nobody can place
            if not self._match_orphan(s, e):
                raise Refused(
                    "a reserve whose token is unknown (its hold ended before it was read)"
                    " and no take-back of a hold nobody saw made before it"
                )
            return s
        self.unknown.pop((fdid, vm), None)  # the VM's hold shows up: no unknown one pending
        held = get(s.holds, fdid)
        if not e.fields.get("created", True):
            if held is not None and (held.vm, held.token) == (vm, token):
                self.released_maybe.discard((fdid, token))  # alive after the kill
                return s  # the VM had it
            self.result.lost_replies += 1  # this call made it; its reply was lost
        if e.fields.get("unlogged"):
            if e.t < float(e.fields["began"]):
                raise Refused(f"{vm}'s reserve of {fdid:#x} noted by nobody (token {token}) would"
                              f" have committed at {e.t:.3f}, before its call began"
                              f" ({float(e.fields['began']):.3f})")
            self.result.unlogged_reserves += 1
        fence = get(s.fences, fdid)
        if held is not None:
            if self._released_unlogged(s, fdid, held.token):
                s = self.model.end_hold(s, fdid)
            else:
                why = f"{fdid:#x} is held by {held.vm} (token {held.token})"
                s = self._end(s, held.lease, why)
        elif fence is not None and self._released_unlogged(s, fdid, fence):
            s = s._replace(fences=drop(s.fences, fdid))  # the hold had gone with its lease
        h = self.model.host(s, e.node)
        self.newest_of[fdid] = max(self.newest_of.get(fdid, 0), token)
        return self.model.take_hold(s, vm, fdid, token, h.lease_file)

    def _released_unlogged(self, s: State, fdid: int, token: int) -> bool:
        """Whether the hold ``token`` of ``fdid`` was ended by a release whose agent was
        killed after its commit, before its note: one began (cut short) and spent the token
        at the device first, as every release that can end its hold does."""
        if (fdid, token) not in self.released_maybe or self.model.device(s, fdid).retired < token:
            return False
        self.released_maybe.discard((fdid, token))
        self.result.unlogged_releases += 1
        return True

    def on_reserve_begun(self, s: State, e: Event) -> State:
        """A reserve's call began; cut short by its agent's kill, it is a reserve whose
        commit may have landed, its token unknown (as ``reserve-unknown``)."""
        if _ident(e) in self.cut_short:
            return self.on_reserve_unknown(s, e)
        return s

    def on_release_begun(self, s: State, e: Event) -> State:
        """A release's call began; cut short by its agent's kill, its commit may have
        landed: a later reserve of the device may find that hold ended (``on_reserve``)."""
        token = int(e.fields.get("token") or 0)
        if _ident(e) in self.cut_short and token:
            self.released_maybe.add((int(e.fields["fdid"]), token))
        return s

    def on_reserve_done(self, s: State, e: Event) -> State:
        return s

    def on_release_done(self, s: State, e: Event) -> State:
        return s

    def on_reserve_unknown(self, s: State, e: Event) -> State:
        """A reserve that met the registry away and raised (``began`` when its call did): its
        commit may have landed (etcd answered 503 after applying it), its token unknown. A
        take-back of a token the history never saw made, on that device, may then be that
        hold's end: one that came first waits for this (``_match_orphan``); a later one takes
        it (``on_take_back``), unless the VM's hold shows up with a token first."""
        if not self._match_orphan(s, e):
            fdid, vm = int(e.fields["fdid"]), _vm(e.node, str(e.fields["vm"]))
            self.unknown[(fdid, vm)] = (e.node, float(e.fields.get("began", e.t)))
        return s

    def on_release_unknown(self, s: State, e: Event) -> State:
        """A release that met the registry away and raised: recorded pending, it lands later
        (its landing's event is placed no sooner than this one: ``ordered``)."""
        return s

    def _match_orphan(self, s: State, e: Event) -> bool:
        """Whether a take-back of a hold nobody saw made, on ``e``'s device, waits for the
        reserve ``e``: one that came after the call began, when the VM's host could have lost
        the lease that hold was on."""
        began = float(e.fields.get("began", e.t))
        for orphan, hosts in self.orphans:
            if (orphan.fdid == e.fdid and began <= orphan.t and e.node not in hosts
                    and began < self.newer(int(self._asked(orphan)[0]))):
                self.orphans.remove((orphan, hosts))
                return True
        return False

    def _leases_alive(self, s: State) -> frozenset[str]:
        """The hosts every lease of which (the agent's, the lease file's) lives and cannot
        have ended by now: none of their holds can have ended with a lease."""
        out = set()
        for name, h in s.hosts:
            leases = [x for x in (h.lease, h.lease_file) if x is not None]
            alive = [get(s.leases, x) for x in leases]
            if alive and all(x is not None and s.now < x.expires for x in alive):
                out.add(name)
        return frozenset(out)

    def on_release(self, s: State, e: Event) -> State:
        fdid, token = int(e.fields["fdid"]), int(e.fields["token"])
        held = get(s.holds, fdid)
        vm = _vm(e.node, str(e.fields["vm"]))
        if token:
            self.unknown.pop((fdid, vm), None)  # the VM's hold shows up: no unknown pending
        if e.fields.get("lost_reply"):
            # it found its hold and fence gone: its own earlier run ended them (or the lease
            # took the hold and the lender its fence, which the replay has seen then)
            if held is None or held.token != token:
                return s
            self.result.lost_replies += 1
        if held is None or held.vm != vm or held.token != token:
            raise Refused(f"{vm} released its hold of {fdid:#x} (token {token}), but the hold"
                          f" is {held}")
        return self.model.end_hold(s, fdid)

    # --- the device ------------------------------------------------------------------------
    def on_serve(self, s: State, e: Event) -> State:
        fdid = int(e.fields["fdid"])
        token = int(self._asked(e)[0])
        node, vm = self._borrower(e)
        if e.fields.get("refused"):
            return self._refused(s, e, lambda: self.model.open_mdev(s, _vm(node, vm), fdid, token))
        s = self.model.open_mdev(s, _vm(node, vm), fdid, token)
        return self._agree(s, e)

    def on_end(self, s: State, e: Event) -> State:
        fdid = int(e.fields["fdid"])
        asked = self._asked(e)
        node, vm = self._borrower(e)
        name = _vm(node, vm)
        d = self.model.device(s, fdid)
        token = None if asked[0] == "None" else int(asked[0])
        if "spend" in asked[2:] and token is not None:
            s = self.model.spend(s, fdid, token)
        else:
            for who, t in sorted(d.sessions):
                if who == name and (token is None or t == token):
                    s = self.model.give_back(s, name, fdid, t)
        return self._agree(s, e)

    def on_take_back(self, s: State, e: Event) -> State:
        fdid = int(e.fields["fdid"])
        token = int(self._asked(e)[0])
        if e.fields.get("refused"):
            return self._refused(s, e, lambda: self.model.take_back(s, fdid))
        d = self.model.device(s, fdid)
        fence = get(s.fences, fdid)
        if fence is None and d.retired == token:
            return self._agree(s, e)  # the same take-back again (its fence's removal failed)
        newest = max(d.retired, self.newest_of.get(fdid, 0))  # a hold of it made over this
        if (fence is None and get(s.holds, fdid) is None and token > newest
                and (token > s.issued or token not in self.noted)):
            # the hold of a reserve whose token nobody read (``on_reserve_unknown``): made
            # after the device's every hold the history knows (holds of other devices noted
            # since may be newer: a reserve's agent killed after its commit, the crash noted
            # only once the start it served failed), never served, ended with its host's
            # lease. That reserve's event may come later (its answer came after the
            # take-back): then the take-back waits for it, and the run is refused if it
            # never comes
            alive = self._leases_alive(s)
            credits = [
                (key, node)
                for key, (node, began) in self.unknown.items()
                if key[0] == fdid and began <= s.now and node not in alive
                and began < self.newer(token)
            ]
            if credits:
                del self.unknown[credits[0][0]]
            else:
                self.orphans.append((e, alive))
            self.result.lost_replies += 1
            s = s._replace(fences=put(s.fences, fdid, token), issued=max(s.issued, token))
            fence = token
        if fence != token:
            raise Refused(f"a take-back of {fdid:#x} with token {token}; the fence's is {fence}")
        held = get(s.holds, fdid)
        if held is not None:
            s = self._end(s, held.lease, f"the lender takes back {fdid:#x} from {held.vm}")
        s = self.model.take_back(s, fdid)
        return self._agree(s, e)

    def _refused(self, s: State, e: Event, step: Any) -> State:
        try:
            step()
        except Refused:
            self.result.device_refusals += 1
            return s
        raise Refused("the device refused a step the model allows")

    def _agree(self, s: State, e: Event) -> State:
        """The device says what the model's device is, and (a) holds."""
        fdid = int(e.fields["fdid"])
        d = self.model.device(s, fdid)
        token, retired = int(e.fields["token"]), int(e.fields["retired"])
        borrower = str(e.fields.get("borrower") or "")
        mine = {v for v, t in d.sessions}
        want = {borrower} if borrower else set()
        # a take-back makes the fence's token the device's (the model keeps it as retired)
        same_token = token == d.token or (token == d.retired and token > d.token)
        if not same_token or retired != d.retired or mine != want:
            raise Refused(f"the device says token {token}, retired {retired}, serving"
                          f" {borrower or 'nobody'}; the model's: token {d.token}, retired"
                          f" {d.retired}, serving {sorted(mine) or 'nobody'}")
        bad = [x for x in self.model.exclusive(s) if f"{fdid:#x}" in x]
        if bad:
            raise Refused("; ".join(bad))
        return s


def replay(events: Iterable[Event], ttl: float | None = None) -> Replay:
    """``events`` (with ``with_lost_reserves``) in order (``ordered``) through the model; the
    first refusal ends it."""
    evs = ordered(with_lost_reserves(list(events)))
    return Replayer(evs, ttl).run(evs)


def replay_file(path: Path) -> Replay:
    return replay(read_events(path))
