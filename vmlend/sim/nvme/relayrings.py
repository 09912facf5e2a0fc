"""What a two-path share's queue relay keeps (``vmlend.sim.nvme.relay``): where its rings sit
in each path's address space, the manager's side it calls, and its book of each guest queue on
each pair (pure data)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import msgspec

from vmlend.nvme import spec
from vmlend.nvme.shares import Share

#: Where the relay rings sit in each path's address space (above any guest RAM).
RING_IOVA = 1 << 46
#: Entries of each relay ring: one page of submissions, one page of completions.
RELAY_ENTRIES = spec.PAGE // spec.SQE_SIZE
PAIR_BYTES = 2 * spec.PAGE
PRIMARY, BACKUP = 0, 1
PAGE, RELAY = "page", "relay"


def ring_bytes(queue_pairs: int) -> int:
    """Relay memory of a share of ``queue_pairs``: a ring pair per queue pair and path."""
    return 2 * queue_pairs * PAIR_BYTES


def ring_offset(share: Share, path: int, guest_qid: int) -> int:
    """Offset in the relay memory of path ``path``'s ring pair for guest queue ``guest_qid``
    (its submission ring; the completion ring is the next page)."""
    return (path * share.queue_pairs + guest_qid - 1) * PAIR_BYTES


class Memory(Protocol):
    def read(self, address: int, length: int) -> bytes: ...

    def write(self, address: int, data: bytes) -> None: ...


class PathQueues(Protocol):
    """The manager's side: create and delete a path's real queues (statuses returned)."""

    def create_cq(
        self, share: Share, qid: int, gpa: int, entries: int, vector: int, irq: bool, path: int = 0
    ) -> int: ...

    def create_sq(
        self, share: Share, qid: int, gpa: int, entries: int, cqid: int, path: int = 0
    ) -> int: ...

    def delete_sq(self, share: Share, qid: int, path: int = 0) -> int: ...

    def delete_cq(self, share: Share, qid: int, path: int = 0) -> int: ...


RealDoorbell = Callable[[int, bool, int], None]  # (real qid, completion, value)


class PathSq(msgspec.Struct):
    tail: int = 0
    #: cid -> (the command, the guest SQ head after it): sent on this pair, not completed
    outstanding: dict[int, tuple[spec.Command, int]] = msgspec.field(default_factory=dict)


class PathCq(msgspec.Struct):
    head: int = 0
    phase: int = 1


class GuestCq(msgspec.Struct):
    gpa: int
    entries: int
    vector: int
    irq: bool
    tail: int = 0
    head: int = 0
    phase: int = 1
    backlog: list[spec.Completion] = msgspec.field(default_factory=list)
    paths: list[PathCq] = msgspec.field(default_factory=lambda: [PathCq(), PathCq()])
    #: page mode: its primary real CQ is the guest's ring, written by the drive directly
    direct: bool = False


class GuestSq(msgspec.Struct):
    gpa: int
    entries: int
    cqid: int
    head: int = 0
    tail: int = 0
    paths: list[PathSq] = msgspec.field(default_factory=lambda: [PathSq(), PathSq()])
    #: page mode: its primary real SQ is the guest's ring, rung by the guest directly
    direct: bool = False


class RelayStats(msgspec.Struct):
    relayed: int = 0  # commands sent on a real pair (resubmissions included)
    completed: int = 0  # completions handed to the guest
    resubmitted: int = 0  # commands sent again on the other pair after a failover
    recreated: int = 0  # primary pairs deleted and created again (at each switch back)
    #: commands of page-mode queues the guest had rung (or not) and the drive had not
    #: completed, sent on the backup pair when the relay took the queues over
    taken_over: int = 0
    #: each switch: ("backup" | "primary", why)
    switches: list[tuple[str, str]] = msgspec.field(default_factory=list)
