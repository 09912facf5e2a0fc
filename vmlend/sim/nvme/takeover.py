"""What software learns, from guest memory alone, of queues the drive ran without it.

A two-path share in page mode (``vmlend.sim.nvme.relay``) gives the guest's own rings to the
drive and maps the guest's doorbell page onto the share's real one, so no software sees a
doorbell. When its primary path dies, the relay takes the queues over, and needs to know
where the guest and the drive are on each of them:

- the guest's SQ tails and CQ heads: from its *shadow doorbells* (NVMe 1.3's Doorbell Buffer
  Config, which the virtual controller advertises in OACS): the guest writes each new value
  into a page of its own RAM before it writes the doorbell (``ShadowDoorbells``);
- how far the drive got: the guest's completion queue, which the drive fills in order with
  the phase tag flipping at each wrap (``scan_cq``): its tail and phase, and the SQ head the
  newest entry reports (the drive completes each command when it fetches it, so every
  command before that head is done, every one after it is not, as the guest can see).

A completion the drive wrote into a dead path is lost, and its command is sent again (as
Linux's multipath requeues a path's outstanding requests): run twice, never lost.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from vmlend.nvme import spec


class Memory(Protocol):
    def read(self, address: int, length: int) -> bytes: ...


class CqPosition(msgspec.Struct, frozen=True):
    """Where the drive is on a completion queue, as guest memory shows it."""

    tail: int  # the next entry it writes
    phase: int  # the phase tag it writes there
    #: The SQ head the newest entry reports; None when the drive wrote none yet.
    sq_head: int | None


def scan_cq(memory: Memory, base: int, entries: int, sq_id: int) -> CqPosition:
    """The position of the completion queue of ``entries`` at ``base`` (zeroed at its
    creation, as drivers do), whose entries the drive writes with SQ id ``sq_id``.

    Entries before the tail carry this lap's phase, entries from it on the last lap's (or
    zero): the tail is the first entry whose phase differs from entry 0's; when none does,
    the drive just wrapped and the tail is 0."""
    raw = memory.read(base, entries * spec.CQE_SIZE)
    ring = [
        spec.Completion.decode(raw[i * spec.CQE_SIZE : (i + 1) * spec.CQE_SIZE])
        for i in range(entries)
    ]
    first = ring[0].phase
    tail = next((i for i, e in enumerate(ring) if e.phase != first), 0)
    phase = first if tail else first ^ 1
    entry = ring[(tail - 1) % entries]
    # a zeroed slot names no queue: the drive wrote nothing there yet
    return CqPosition(tail, phase, entry.sq_head if entry.sq_id == sq_id else None)


class ShadowDoorbells:
    """The guest's shadow doorbell page (Doorbell Buffer Config): its values are read, never
    written, by the virtual controller; none until the guest configures it."""

    def __init__(self, memory: Memory, dstrd: int) -> None:
        self.memory = memory
        self.dstrd = dstrd
        self.buffer: int | None = None
        self.eventidx: int | None = None

    @property
    def configured(self) -> bool:
        return self.buffer is not None

    def configure(self, buffer: int, eventidx: int) -> int:
        """Doorbell Buffer Config: both pages page-aligned and in the guest's RAM, else
        Invalid Field (nothing changes)."""
        if not buffer or not eventidx or buffer % spec.PAGE or eventidx % spec.PAGE:
            return spec.SC_INVALID_FIELD
        try:
            self.memory.read(buffer, spec.PAGE)
            self.memory.read(eventidx, spec.PAGE)
        except Exception:  # no RAM there: the guest named a page it has not
            return spec.SC_INVALID_FIELD
        self.buffer, self.eventidx = buffer, eventidx
        return spec.SC_SUCCESS

    def clear(self) -> None:
        """A controller reset forgets the buffer (the guest configures it again)."""
        self.buffer = self.eventidx = None

    def value(self, qid: int, completion: bool) -> int | None:
        """The guest's last SQ tail (or CQ head) of queue ``qid``; None when not configured."""
        if self.buffer is None:
            return None
        at = self.buffer + spec.doorbell_offset(qid, completion, self.dstrd) - spec.DOORBELL_BASE
        return int.from_bytes(self.memory.read(at, 4), "little")
