"""A node's own side of its adapters, decided in one process (etcd layout 6).

A VM's claims fall on two kinds of place. Its own node's adapters and the switch ports
cabled to them (the BAR segments of what it borrows, the requester entries of those devices
on its side) are *its node's own*: only reserves for that node's VMs claim there, besides
what other hosts' VMs take when they borrow the node's own devices. Everything else (the
lender's adapter and the port toward it, links between switches) is contended between hosts.

Contended places keep unit blocks per VM (``EtcdTxn._take_units``): the blocks make racing
reserves conflict. A node's own places would need the same, a key per place per VM, so a
hold would be 3 keys and 3 more blocks; instead one process at a time decides them for the
node from memory. That process holds the node's *epoch*: the key ``decider/<node>/epoch``,
which it writes to take the node over (after reading every marker of the node's VMs,
compared, so it starts from what is committed) and which every commit that adds a claim
there compares. A process that lost the epoch learns so at its next such commit (it fails),
reads the key again, and takes the node over in turn. Its tally holds the claims of its
attempts in flight as well as the committed ones, so threads of one process decide without
conflicting.

The node's share of each place is a set of *extents*: ordinary unit blocks owned by the
node (``{"vm": "<node>", "extent": true}``), listed in ``decider/<node>/extents``. Other
hosts' VMs take blocks around them as around any other; the decider keeps its tally of the
node's claims within the extents, takes one more when it needs room (a block, so it
conflicts with any other block taken there) and gives back one no longer needed. A process
that does not decide for the node sees the node's VMs' claims as their markers hold them
(``claims_on``); what keeps its reserve within the place's room is the units it takes,
never beyond the capacity of a place with extents, and where those are short the node's
slack is given back to it (taking the node over: ``EtcdTxn._shrink_for``).

This module holds the per-process state; ``EtcdTxn`` reads and writes the keys.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence

from vmlend.registry.records import Claim
from vmlend.topology.requesters import is_port

#: An adapter (or switch port) and its unit, ``"lut"`` or ``"seg"``.
Place = tuple[str, str]
Pairs = tuple[tuple[int, Claim], ...]

#: The least an extent grows by (units), where as much is free: fewer growths, which one
#: thread of a process makes at a time (its other threads wait, then run again).
EXTENT_CHUNK = 8


class RunAgain(Exception):
    """Another thread of this process changed the node's epoch or extents meanwhile: the
    attempt runs again at once, on fresh reads (``EtcdRegistry.transact``). ``pause``: it
    did not wait for that change, holding one of its own on another node; two such attempts
    taking two nodes in opposite orders would otherwise run again in step, with no end, so
    it runs again as after a conflict (counted, after a random pause)."""

    def __init__(self, message: str, *, pause: bool = False) -> None:
        super().__init__(message)
        self.pause = pause


def _groups(claims: Iterable[tuple[int, Claim]]) -> dict[tuple[str, str, str], tuple[int, int]]:
    """Per share (adapter, kind, share), the entries and segments it uses: a claim shared by
    several holds counted once at its largest, as admission counts it."""
    groups: dict[tuple[str, str, str], tuple[int, int]] = {}
    for _f, c in claims:
        # on a switch port a requester's entry is one whatever claims it (``port_usage``)
        key = (c.adapter, "" if is_port(c.adapter) else c.kind.value, c.share)
        e, s = max(0, c.entries), max(0, c.segments)
        had = groups.get(key)
        groups[key] = (e, s) if had is None else (max(had[0], e), max(had[1], s))
    return groups


def own_usage(claims: Iterable[tuple[int, Claim]], places: Iterable[Place]) -> dict[Place, int]:
    """Per place of ``places``, what ``claims`` use there (``_groups``)."""
    want = set(places)
    out: dict[Place, int] = {}
    for (adapter, _kind, _share), (e, s) in _groups(claims).items():
        for unit, n in (("lut", e), ("seg", s)):
            if n and (adapter, unit) in want:
                out[(adapter, unit)] = out.get((adapter, unit), 0) + n
    return out


def grows(before: Iterable[tuple[int, Claim]], after: Iterable[tuple[int, Claim]]) -> bool:
    """``after`` uses more than ``before`` in some share: a new one, or a larger one. Per
    share, not per place: a VM that leaves a share its node's other VMs keep and takes a new
    one adds to what the node uses, with its own count on the place unchanged."""
    was = _groups(before)
    for key, (e, s) in _groups(after).items():
        had_e, had_s = was.get(key, (0, 0))
        if e > had_e or s > had_s:
            return True
    return False


class NodeDecider:
    """What one process knows of the node it decides for (or last did): guarded by
    ``lock``, shared by the process's threads."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.lock = threading.Lock()
        #: The thread whose attempt changes the node's epoch or extents (None: none), and
        #: what the others wait on until it settled (``EtcdTxn._hold_change``).
        self.changer: int | None = None
        self.changed = threading.Condition(self.lock)
        #: The epoch key's mod revision as this process last committed it; 0: it does not
        #: decide for the node (never did, or learned it lost the epoch).
        self.revision = 0
        self.epoch = ""
        self.pid = 0
        #: Per place, the extents ``(start, size)`` the epoch key lists.
        self.extents: dict[Place, list[tuple[int, int]]] = {}
        #: Per VM marker key, the VM's committed claims on the node's own places, and the
        #: revision they are known at (a later commit's settle may come first).
        self.committed: dict[str, tuple[int, Pairs]] = {}
        #: Per attempt in flight, the claims it would leave its VMs.
        self.flight: dict[int, Pairs] = {}

    def pairs(self) -> list[tuple[int, Claim]]:
        """The node's claims: committed, and in flight in this process (both, where an
        attempt changes a VM: counting both never counts less than either outcome)."""
        out: list[tuple[int, Claim]] = []
        for _revision, claims in self.committed.values():
            out += claims
        for claims in self.flight.values():
            out += claims
        return out

    def pairs_with(self, changes: Mapping[str, Pairs], attempt: int) -> list[tuple[int, Claim]]:
        """The node's claims as they will be once the attempt ``attempt`` committed its
        ``changes`` (per VM marker): the other VMs' committed, these VMs' changed, and the
        other attempts in flight."""
        out: list[tuple[int, Claim]] = []
        for marker, (_revision, claims) in self.committed.items():
            if marker not in changes:
                out += claims
        for claims in changes.values():
            out += claims
        for other, claims in self.flight.items():
            if other != attempt:
                out += claims
        return out

    def learn(self, revision: int, changes: Mapping[str, Pairs]) -> None:
        """A commit at ``revision`` left these VMs' claims (each kept unless this process
        knows a later one)."""
        for marker, claims in changes.items():
            if self.committed.get(marker, (0, ()))[0] < revision:
                self.committed[marker] = (revision, claims)

    def capacity(self, place: Place) -> int:
        return sum(z for _s, z in self.extents.get(place, []))

    def current(self, epoch: str) -> bool:
        """This process decides for the node, the epoch key naming ``epoch`` (only a
        takeover by this process writes its epoch: a read older than its last commit only
        makes the attempt fail its compare and run again). A forked child does not decide:
        its parent's attempts are not its own."""
        return self.revision != 0 and self.epoch == epoch and self.pid == os.getpid()

    def install(
        self,
        revision: int,
        epoch: str,
        extents: Mapping[Place, Sequence[tuple[int, int]]],
        read: tuple[int, Mapping[str, Pairs]] | None,
    ) -> None:
        """The epoch as a commit of this process at ``revision`` left it, and the extents
        (``read``: the node's claims it read, at that revision, to take the node over)."""
        if read is not None:
            if self.revision == 0 or self.epoch != epoch:
                self.committed = {}
            at, claims = read
            self.learn(at, claims)
        self.revision, self.epoch, self.pid = revision, epoch, os.getpid()
        self.extents = {p: sorted(e) for p, e in extents.items() if e}

    def lose(self) -> None:
        """Another process holds the epoch, or a commit's outcome is unknown: take the node
        over again (from what is committed) before deciding anything more."""
        self.revision = 0
        self.committed.clear()


class Deciders:
    """One ``NodeDecider`` per node, for one registry (process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nodes: dict[str, NodeDecider] = {}
        _ALL.add(self)

    def _forked(self) -> None:
        """In a forked child: locks a parent's thread held stay held; nothing is decided."""
        self._lock = threading.Lock()
        for dec in self._nodes.values():
            dec.lock = threading.Lock()
            dec.changed = threading.Condition(dec.lock)
            dec.changer = None
            dec.flight.clear()
            dec.lose()

    def of(self, node: str) -> NodeDecider:
        with self._lock:
            found = self._nodes.get(node)
            if found is None:
                found = self._nodes[node] = NodeDecider(node)
            return found


_PROCESS_LOCK = threading.Lock()
_PROCESS: dict[str, Deciders] = {}
_ALL: weakref.WeakSet[Deciders] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    global _PROCESS_LOCK
    _PROCESS_LOCK = threading.Lock()
    for deciders in list(_ALL):
        deciders._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


def process_deciders(where: str) -> Deciders:
    """This process's state of the nodes of the cluster ``where`` it decides for."""
    with _PROCESS_LOCK:
        found = _PROCESS.get(where)
        if found is None:
            found = _PROCESS[where] = Deciders()
        return found
