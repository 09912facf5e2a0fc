"""The queues of a share with a backup path (``paths=2``, SmartIO's multipath failover).

Two modes. **Page mode** (the steady state when the guest uses shadow doorbells and the drive
gives the share a doorbell page of its own): as for a one-path share, the primary pair of
real queues is created at the guest's own ring addresses in the primary path's address space
(``share.asid``), and the guest's doorbell page maps straight onto the share's real doorbell
page through the primary path: no software step per doorbell, no command copied. The guest
also writes each new SQ tail and CQ head into its shadow doorbell page (NVMe 1.3's Doorbell
Buffer Config, advertised by the virtual controller; ``vmlend.sim.nvme.takeover``), which is
all software needs to take the queues over when the primary path dies.

**Relay mode** (after a failover, and from the start for a guest without shadow doorbells or
a drive without doorbell pages to spare): as SmartIO's client driver does, the VM's virtual
controller keeps its own queue pairs in memory of the VM's host (``RingMemory``), the
*primary* pair's rings reached by the drive through the primary path's address space, the
*backup* pair's through the other adapter (``share.backup_asid``). Every guest doorbell write
is trapped (one software step): the relay copies the guest's new commands, unchanged (their
PRPs name guest-physical addresses, which both address spaces map onto the guest's RAM), into
the active pair's ring and rings its doorbell; completions are copied back into the guest's
completion queue with the guest's phase tag, and the guest's vector is raised. The backup
pair of each guest queue pair is created in advance, in either mode, so failover creates
nothing. The guard checks every command on either pair against the share's LBA window, and
the PRP rules are the controller's as ever.

Failover (``fail_over``, on a link event of the primary path or a command timeout), software
once, not per doorbell: the active pair becomes the backup. Queues in page mode are taken
over first: the guest's SQ tails and CQ heads come from its shadow doorbells, the drive's
position from the guest's completion queue (its tail and phase, and the SQ head its newest
entry reports), and every command between that head and the shadow tail is sent on the
backup pair, in order: none lost, none the guest saw complete run again. (The guest's
doorbell page mapping goes first: ``page_mode`` is false once the backup is active, so a
doorbell written meanwhile is trapped.) Commands the relay
had sent on the primary pair and not seen complete are sent again on the backup. From then on
every doorbell is trapped. The relay's real doorbell writes cross the NTB like any MMIO
(``vmlend.sim.mmio``): through the primary path's adapter for the primary pair, the backup's
for the backup pair, so a dead cable drops them. A command timeout is a deadline on the
injected clock (``CommandTimer``): started when the relay sends a command on a pair and
stopped by its completion, or, in page mode, started when the timer check (``timeout``, where
a driver's timer interrupt runs) finds the guest's shadow tail ahead of what its completion
queue shows done, and restarted when that moves; ``timeout`` fails over when one on the
primary pair has passed. Switching back (``switch_back``): the primary pair's queues are
deleted and created again in the relay rings, since nobody knows how far the drive got on
them (a doorbell dropped at the dead cable, or a fetch whose completion went into the void);
with the mappings lost, they are programmed again first. The share stays in relay mode until
the guest creates its queues again (after a controller reset): a real queue starts at head
and tail 0, so queues created at the guest's rings would not line up with its positions.
The admin queues stay with the manager on the lender throughout.

Limits: a guest submission queue feeds its own completion queue (as Linux's driver pairs
them); the relay keeps up to ``RELAY_ENTRIES - 1`` commands per queue in flight. In page mode
a guest may ring any doorbell of its page, its backup pair's too: only its own share suffers
(as for a one-path share in page mode). Linux's driver skips the doorbell write when the
EventIdx page says the controller needs none; nothing updates EventIdx in page mode, so the
simulated guest always writes the doorbell, as a Linux guest would need to (see
docs/nvme-sharing.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from vmlend.nvme import spec
from vmlend.nvme.shares import Share
from vmlend.sim.nvme.relayrings import (
    BACKUP,
    PAGE,
    PRIMARY,
    RELAY,
    RELAY_ENTRIES,
    RING_IOVA,
    GuestCq,
    GuestSq,
    Memory,
    PathCq,
    PathQueues,
    PathSq,
    RealDoorbell,
    RelayStats,
    ring_offset,
)
from vmlend.sim.nvme.takeover import CqPosition, ShadowDoorbells, scan_cq
from vmlend.sim.nvme.timer import CommandTimer

log = logging.getLogger(__name__)

#: The command id of a page-mode queue's deadline (the relay sent none of its commands).
_WATCH = -1


class QueueRelay:
    """The guest's I/O queues of ``share`` relayed onto a primary and a backup pair."""

    def __init__(
        self,
        share: Share,
        guest: Memory,
        rings: Memory,
        manager: PathQueues,
        doorbell: RealDoorbell,
        interrupt: Callable[[int], object],
        timer: CommandTimer[tuple[int, int, int]] | None = None,
        *,
        page: bool = False,
        dstrd: int = 0,
    ) -> None:
        """``timer``: the command deadlines (default: ``COMMAND_TIMEOUT`` on the monotonic
        clock), keyed (pair, guest queue id, command id). ``page``: the share has a doorbell
        page of its own, so queues may run in page mode (the guest must use shadow
        doorbells); ``dstrd``: the drive's doorbell stride, which the shadow page follows."""
        if share.paths < 2:
            raise ValueError(f"share {share.name} has one path: nothing to relay")
        self.share = share
        self.guest = guest
        self.rings = rings
        self.manager = manager
        self.doorbell = doorbell
        self.interrupt = interrupt
        self.timer: CommandTimer[tuple[int, int, int]] = (
            timer if timer is not None else CommandTimer()
        )
        self.active = PRIMARY
        self.stats = RelayStats()
        self._cqs: dict[int, GuestCq] = {}
        self._sqs: dict[int, GuestSq] = {}
        self._reaping = False
        #: The guest's shadow doorbells (only when page mode is possible: else not advertised).
        self.shadow: ShadowDoorbells | None = ShadowDoorbells(guest, dstrd) if page else None
        self._watch: dict[int, int] = {}  # page-mode SQ -> the done head its deadline is for

    # --- the mode --------------------------------------------------------------------------------
    @property
    def page_mode(self) -> bool:
        """The guest's doorbells go straight to the drive (no software step): the share may
        run so, the guest uses shadow doorbells, the primary path is active and none of the
        guest's queues is relayed (the doorbell page is one mapping for all of them)."""
        return (
            self.shadow is not None
            and self.shadow.configured
            and self.active == PRIMARY
            and all(q.direct for q in self._cqs.values())
            and all(q.direct for q in self._sqs.values())
        )

    @property
    def mode(self) -> str:
        return PAGE if self.page_mode else RELAY

    def configure_shadow(self, buffer: int, eventidx: int) -> int:
        """The guest's Doorbell Buffer Config. Queues it creates afterwards run in page mode;
        queues it has already (Linux configures the buffer right after creating them) move
        to page mode when nothing has run on them yet (``_aligned``). Command Sequence Error
        while page-mode queues use the buffer it has (a failover reads that one)."""
        if self.shadow is None:
            return spec.SC_INVALID_OPCODE
        if any(q.direct for q in self._cqs.values()):
            return spec.SC_COMMAND_SEQUENCE_ERROR
        status = self.shadow.configure(buffer, eventidx)
        if status == spec.SC_SUCCESS and self._cqs and self._aligned():
            self._renew_primary()
        return status

    def clear_shadow(self) -> None:
        """The guest reset its controller: the buffer is forgotten with its queues."""
        if self.shadow is not None:
            self.shadow.clear()

    # --- queue creation, forwarded by the virtual controller (``QueueForwarder``) ----------
    def _ring_iova(self, path: int, g: int, completion: bool) -> int:
        return RING_IOVA + ring_offset(self.share, path, g) + (spec.PAGE if completion else 0)

    def _real(self, path: int, g: int) -> int:
        return self.share.real_qid(g) if path == PRIMARY else self.share.backup_qid(g)

    def create_cq(
        self, share: Share, qid: int, gpa: int, entries: int, vector: int, irq: bool
    ) -> int:
        if qid in self._cqs:
            return spec.SC_INVALID_QID
        if gpa % spec.PAGE:
            return spec.SC_INVALID_FIELD
        direct = self.page_mode
        for path in (PRIMARY, BACKUP):
            if path == PRIMARY and direct:  # the guest's own ring, as for one path
                status = self.manager.create_cq(share, qid, gpa, entries, vector, irq, PRIMARY)
            else:
                self.rings.write(
                    self._ring_iova(path, qid, True) - RING_IOVA,
                    bytes(RELAY_ENTRIES * spec.CQE_SIZE),
                )
                status = self._create_path_cq(path, qid, vector)
            if status != spec.SC_SUCCESS:
                if path == BACKUP:
                    self.manager.delete_cq(share, qid, PRIMARY)
                return status
        self._cqs[qid] = GuestCq(gpa, entries, vector, irq, direct=direct)
        return spec.SC_SUCCESS

    def _create_path_cq(self, path: int, qid: int, vector: int) -> int:
        return self.manager.create_cq(
            self.share, qid, self._ring_iova(path, qid, True), RELAY_ENTRIES, vector, True, path
        )

    def _create_path_sq(self, path: int, qid: int, cqid: int) -> int:
        return self.manager.create_sq(
            self.share, qid, self._ring_iova(path, qid, False), RELAY_ENTRIES, cqid, path
        )

    def create_sq(self, share: Share, qid: int, gpa: int, entries: int, cqid: int) -> int:
        if qid in self._sqs:
            return spec.SC_INVALID_QID
        if cqid not in self._cqs:
            return spec.SC_CQ_INVALID
        if gpa % spec.PAGE:
            return spec.SC_INVALID_FIELD
        # its completion queue decides: both direct (page mode) or both relayed
        direct = self._cqs[cqid].direct and self.active == PRIMARY
        for path in (PRIMARY, BACKUP):
            if path == PRIMARY and direct:
                status = self.manager.create_sq(share, qid, gpa, entries, cqid, PRIMARY)
            else:
                status = self._create_path_sq(path, qid, cqid)
            if status != spec.SC_SUCCESS:
                if path == BACKUP:
                    self.manager.delete_sq(share, qid, PRIMARY)
                return status
        self._sqs[qid] = GuestSq(gpa, entries, cqid, direct=direct)
        return spec.SC_SUCCESS

    def delete_sq(self, share: Share, qid: int) -> int:
        sq = self._sqs.pop(qid, None)
        if sq is None:
            return spec.SC_INVALID_QID
        for path, psq in enumerate(sq.paths):
            for cid in psq.outstanding:
                self.timer.stop((path, qid, cid))
        self._unwatch(qid)
        for path in (PRIMARY, BACKUP):
            self.manager.delete_sq(share, qid, path)
        return spec.SC_SUCCESS

    def delete_cq(self, share: Share, qid: int) -> int:
        if qid not in self._cqs:
            return spec.SC_INVALID_QID
        if any(sq.cqid == qid for sq in self._sqs.values()):
            return spec.SC_INVALID_QUEUE_DELETION
        del self._cqs[qid]
        for path in (PRIMARY, BACKUP):
            self.manager.delete_cq(share, qid, path)
        return spec.SC_SUCCESS

    # --- the guest's doorbells (trapped) --------------------------------------------------------
    def sq_doorbell(self, qid: int, tail: int) -> None:
        sq = self._sqs.get(qid)
        if sq is None or sq.direct or not 0 <= tail < sq.entries:
            return
        sq.tail = tail
        self._pump(qid, sq)

    def cq_doorbell(self, qid: int, head: int) -> None:
        cq = self._cqs.get(qid)
        if cq is None or cq.direct or not 0 <= head < cq.entries:
            return
        cq.head = head
        self._deliver(cq)

    # --- moving commands and completions ------------------------------------------------------
    def _send(self, path: int, qid: int, sq: GuestSq, cmd: spec.Command, head: int) -> None:
        psq = sq.paths[path]
        at = self._ring_iova(path, qid, False) - RING_IOVA + psq.tail * spec.SQE_SIZE
        self.rings.write(at, cmd.encode())
        psq.outstanding[cmd.cid] = (cmd, head)
        self.timer.start((path, qid, cmd.cid))
        psq.tail = (psq.tail + 1) % RELAY_ENTRIES
        self.stats.relayed += 1

    def _pump(self, qid: int, sq: GuestSq) -> None:
        """Take the guest's new commands into the active pair's ring, as far as it has room."""
        path = self.active
        psq = sq.paths[path]
        sent = False
        while sq.head != sq.tail and len(psq.outstanding) < RELAY_ENTRIES - 1:
            cmd = spec.Command.decode(self.guest.read(sq.gpa + sq.head * spec.SQE_SIZE, 64))
            sq.head = (sq.head + 1) % sq.entries
            self._send(path, qid, sq, cmd, sq.head)
            sent = True
        if sent:
            self.doorbell(self._real(path, qid), False, psq.tail)
        self.reap()

    def on_interrupt(self, path: int, vector: int) -> None:
        """A real vector of one of the pairs fired (routed by the manager). A page-mode
        queue's completion is in the guest's ring already: its vector is the guest's."""
        if path == PRIMARY and any(c.direct and c.vector == vector for c in self._cqs.values()):
            self.interrupt(vector)
            return
        self.reap()

    def reap(self) -> None:
        """Completions of both pairs into the guest's completion queues; then more of the
        guest's commands where the active pair has room again."""
        if self._reaping:  # an interrupt while a doorbell write of ours is being served
            return
        self._reaping = True
        try:
            for qid, cq in list(self._cqs.items()):
                for path in (PRIMARY, BACKUP):
                    if not (cq.direct and path == PRIMARY):  # the drive writes the guest's
                        self._reap(path, qid, cq)
        finally:
            self._reaping = False
        for qid, sq in list(self._sqs.items()):
            if sq.direct:
                continue
            if sq.head != sq.tail and len(sq.paths[self.active].outstanding) < RELAY_ENTRIES - 1:
                self._pump(qid, sq)

    def _reap(self, path: int, qid: int, cq: GuestCq) -> None:
        pcq = cq.paths[path]
        base = self._ring_iova(path, qid, True) - RING_IOVA
        got = False
        while True:
            raw = self.rings.read(base + pcq.head * spec.CQE_SIZE, spec.CQE_SIZE)
            entry = spec.Completion.decode(raw)
            if entry.phase != pcq.phase:
                break
            pcq.head = (pcq.head + 1) % RELAY_ENTRIES
            if pcq.head == 0:
                pcq.phase ^= 1
            got = True
            g = self._guest_sq(path, entry.sq_id)
            sq = self._sqs.get(g) if g is not None else None
            sent = sq.paths[path].outstanding.pop(entry.cid, None) if sq is not None else None
            if sent is None or g is None:
                continue  # not outstanding (sent again elsewhere): dropped
            self.timer.stop((path, g, entry.cid))
            cq.backlog.append(
                spec.Completion(entry.cid, entry.status, g or 0, sent[1], 0, entry.result)
            )
        if got:
            self.doorbell(self._real(path, qid), True, pcq.head)
            self._deliver(cq)

    def _guest_sq(self, path: int, real: int) -> int | None:
        g = real - self.share.qid_base - (self.share.queue_pairs if path == BACKUP else 0)
        return g if 1 <= g <= self.share.queue_pairs else None

    def _deliver(self, cq: GuestCq) -> None:
        posted = False
        while cq.backlog and (cq.tail + 1) % cq.entries != cq.head:
            c = cq.backlog.pop(0)
            entry = spec.Completion(c.cid, c.status, c.sq_id, c.sq_head, cq.phase, c.result)
            self.guest.write(cq.gpa + cq.tail * spec.CQE_SIZE, entry.encode())
            cq.tail = (cq.tail + 1) % cq.entries
            if cq.tail == 0:
                cq.phase ^= 1
            self.stats.completed += 1
            posted = True
        if posted and cq.irq:
            self.interrupt(cq.vector)

    # --- failover ---------------------------------------------------------------------------------
    def outstanding(self, path: int | None = None) -> int:
        """Commands sent on pair ``path`` (default: the active one) and not completed."""
        p = self.active if path is None else path
        return sum(len(sq.paths[p].outstanding) for sq in self._sqs.values())

    def fail_over(self, why: str) -> bool:
        """The primary path failed: the backup pair takes over and every command sent on the
        primary and not completed is sent again on it. False when already on the backup."""
        if self.active == BACKUP:
            return False
        self.active = BACKUP
        self.stats.switches.append(("backup", why))
        self._take_over()
        for qid, sq in self._sqs.items():
            old = sq.paths[PRIMARY]
            lost = list(old.outstanding.values())
            old.outstanding.clear()
            for cmd, _ in lost:
                self.timer.stop((PRIMARY, qid, cmd.cid))
            for cmd, head in lost:
                self._send(BACKUP, qid, sq, cmd, head)
                self.stats.resubmitted += 1
            if lost:
                self.doorbell(self._real(BACKUP, qid), False, sq.paths[BACKUP].tail)
        log.warning("NVMe share %s: on its backup queue pairs (%s)", self.share.name, why)
        self.reap()
        return True

    def _take_over(self) -> None:
        """The page-mode queues become relayed ones, at the positions guest memory shows:
        the guest's from its shadow doorbells, the drive's from the guest's completion
        queues. Their commands not seen complete are then sent by ``_pump``."""
        seen: dict[int, CqPosition] = {}
        for qid, cq in self._cqs.items():
            if not cq.direct:
                continue
            pos = seen[qid] = self._position(cq)
            cq.tail, cq.phase = pos.tail, pos.phase
            cq.head = self._shadow(qid, True, cq.entries, pos.tail)
            cq.direct = False
        for qid, sq in self._sqs.items():
            if not sq.direct:
                continue
            self._unwatch(qid)
            done = seen[sq.cqid].sq_head if sq.cqid in seen else None
            sq.head = done or 0
            sq.tail = self._shadow(qid, False, sq.entries, sq.head)
            sq.direct = False
            self.stats.taken_over += (sq.tail - sq.head) % sq.entries
        if seen:
            log.warning(
                "NVMe share %s: %d command(s) of its page-mode queues taken over",
                self.share.name,
                self.stats.taken_over,
            )

    def _position(self, cq: GuestCq) -> CqPosition:
        """The drive's position on page-mode queue ``cq``: the entries it writes name the
        real SQ that feeds it (one SQ per CQ)."""
        sq = next((g for g, q in self._sqs.items() if self._cqs.get(q.cqid) is cq), None)
        real = self.share.real_qid(sq) if sq is not None else -1
        return scan_cq(self.guest, cq.gpa, cq.entries, real)

    def _shadow(self, qid: int, completion: bool, entries: int, default: int) -> int:
        """The guest's shadow doorbell value of ``qid``; ``default`` when it holds none a
        queue of ``entries`` could have (a guest that wrote nonsense loses its commands
        there, never another share's)."""
        value = self.shadow.value(qid, completion) if self.shadow is not None else None
        return value if value is not None and 0 <= value < entries else default

    def _unwatch(self, qid: int) -> None:
        if self._watch.pop(qid, None) is not None:
            self.timer.stop((PRIMARY, qid, _WATCH))

    def _watch_page_mode(self) -> None:
        """Deadlines of page-mode queues: while the guest's shadow tail is ahead of what
        its completion queue shows done, the oldest such command has one, started when this
        check first sees it (or sees the drive move on)."""
        for qid, sq in self._sqs.items():
            if not sq.direct:
                continue
            done = self._position(self._cqs[sq.cqid]).sq_head or 0
            tail = self._shadow(qid, False, sq.entries, done)
            if tail == done:
                self._unwatch(qid)
            elif self._watch.get(qid) != done:
                self._watch[qid] = done
                self.timer.start((PRIMARY, qid, _WATCH))

    def timeout(self) -> bool:
        """Check the command timer (where a driver's timer interrupt runs): when a command
        on the primary pair has passed its deadline on the clock (its doorbell or its
        completion died with the path), the backup takes over. True if it did. On the
        backup pair, whose doorbell may have died with a cable that is back (a missed link
        event), a command past its deadline gets its queue's doorbell written again: the
        drive fetches what it has not, and nothing twice."""
        self.reap()
        if self.active != PRIMARY:
            self._ring_again(BACKUP)
            return False
        self._watch_page_mode()
        if any(key[0] == PRIMARY for key in self.timer.expired()):
            return self.fail_over("command timeout")
        return False

    def _ring_again(self, path: int) -> None:
        late = {qid for p, qid, _cid in self.timer.expired() if p == path}
        for qid in sorted(late):
            sq = self._sqs.get(qid)
            if sq is None:
                continue
            for cid in sq.paths[path].outstanding:
                self.timer.start((path, qid, cid))  # a new deadline for the new write
            self.doorbell(self._real(path, qid), False, sq.paths[path].tail)
        if late:
            self.reap()

    def switch_back(self, why: str) -> bool:
        """The primary path works again: its pair is deleted and created again (the drive's
        position on it is unknown: a doorbell may have been dropped, a completion lost), then
        used again. False when already on it."""
        if self.active == PRIMARY:
            return False
        self.active = PRIMARY
        self._renew_primary()
        self.stats.recreated += len(self._sqs)
        self.stats.switches.append(("primary", why))
        log.warning("NVMe share %s: back on its primary queue pairs (%s)", self.share.name, why)
        self.reap()
        return True

    def _aligned(self) -> bool:
        """Every queue of the guest's could be given to the drive as it is: the guest uses
        shadow doorbells, the primary path is active, and each queue sits idle where a new
        real queue starts (SQ head and tail 0, CQ tail and head 0 with phase tag 1, nothing
        in flight on either pair): right after the guest created it, or by chance later."""
        if self.shadow is None or not self.shadow.configured or self.active != PRIMARY:
            return False
        return all(
            c.tail == 0 and c.head == 0 and c.phase == 1 and not c.backlog
            for c in self._cqs.values()
        ) and all(
            q.head == q.tail == 0 and not any(p.outstanding for p in q.paths)
            for q in self._sqs.values()
        )

    def _renew_primary(self) -> None:
        """Delete every queue's primary pair and create it again (the drive's position on it
        may be unknown): at the guest's own rings when they line up (page mode), else in the
        relay rings."""
        share = self.share
        for qid in self._sqs:
            self.manager.delete_sq(share, qid, PRIMARY)
        for qid in self._cqs:
            self.manager.delete_cq(share, qid, PRIMARY)
        direct = self._aligned()
        for qid, cq in self._cqs.items():
            cq.paths[PRIMARY] = PathCq()
            cq.direct = direct
            if direct:
                self.manager.create_cq(share, qid, cq.gpa, cq.entries, cq.vector, cq.irq)
                continue
            self.rings.write(
                self._ring_iova(PRIMARY, qid, True) - RING_IOVA,
                bytes(RELAY_ENTRIES * spec.CQE_SIZE),
            )
            self._create_path_cq(PRIMARY, qid, cq.vector)
        for qid, sq in self._sqs.items():
            for cid in sq.paths[PRIMARY].outstanding:
                self.timer.stop((PRIMARY, qid, cid))
            sq.paths[PRIMARY] = PathSq()
            sq.direct = direct
            if direct:
                self.manager.create_sq(share, qid, sq.gpa, sq.entries, sq.cqid)
            else:
                self._create_path_sq(PRIMARY, qid, sq.cqid)

    def status(self) -> dict[str, object]:
        return {
            "active": "primary" if self.active == PRIMARY else "backup",
            "mode": self.mode,
            "switches": [list(s) for s in self.stats.switches],
            "resubmitted": self.stats.resubmitted,
            "taken_over": self.stats.taken_over,
            "recreated": self.stats.recreated,
        }
