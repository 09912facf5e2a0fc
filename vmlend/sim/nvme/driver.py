"""A small NVMe host driver: what Linux's nvme driver does, reduced to its flow.

Reset (CC.EN=0, wait CSTS.RDY=0), admin queue (AQA/ASQ/ACQ, enable, wait RDY), Identify,
Number of Queues, Create I/O CQ/SQ, Read/Write/Flush with PRP1/PRP2 and PRP lists, completions
reaped by phase tag (an MSI-X vector is also raised; callers may count it). Used as the guest's
driver in the tests and bench, and by the manager on the lender for the real controller.

When the controller advertises Doorbell Buffer Config (OACS bit 8), the driver gives it a
shadow doorbell page and an EventIdx page right after creating its I/O queues, as Linux's
does, and writes each new I/O SQ tail and CQ head into the shadow page before the doorbell
(unlike Linux it always writes the doorbell too: it does not read EventIdx, which no software
keeps in a share's page mode). ``shadow_doorbells=False``: a driver that never uses them.

Each submitted command has a deadline on the injected ``clock`` (``CommandTimer``, Linux's
30 s by default): ``overdue`` names the commands of a queue past it, as the driver's timeout
handler would find them. The synchronous waits (``write``, ``read``, admin commands) still
give up after a bounded number of polls: nothing in the simulator completes a command later.

Registers are reached through ``mmio`` (the BAR as the CPU sees it), queues and buffers through
``memory`` at addresses from ``alloc`` (guest-physical for a guest, IOVA for the manager).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import msgspec

from vmlend.errors import VmlendError
from vmlend.nvme import spec
from vmlend.nvme.identify import (
    MDTS,
    parse_active_nsids,
    parse_identify_controller,
    parse_identify_namespace,
)
from vmlend.nvme.prp import build_prp_list, list_pages_needed
from vmlend.sim.nvme.timer import COMMAND_TIMEOUT, Clock, CommandTimer


class Mmio(Protocol):
    def read(self, offset: int, size: int) -> int: ...

    def write(self, offset: int, size: int, value: int) -> None: ...


class Memory(Protocol):
    def read(self, address: int, length: int) -> bytes: ...

    def write(self, address: int, data: bytes) -> None: ...


Alloc = Callable[[int], int]  # bytes -> page-aligned address


class NvmeCommandError(VmlendError):
    """A command completed with an error status."""

    def __init__(self, what: str, status: int) -> None:
        self.what = what
        self.status = status
        super().__init__(f"NVMe {what} failed: {spec.status_name(status)} ({status:#x})")


class NvmeTimeoutError(VmlendError):
    def __init__(self, what: str) -> None:
        self.what = what
        super().__init__(f"NVMe controller did not {what}; check that the device is enabled")


class BumpAllocator:
    """Page-aligned allocations from [start, end) that are never freed (driver lifetime)."""

    def __init__(self, start: int, end: int) -> None:
        self.next = -(-start // spec.PAGE) * spec.PAGE
        self.end = end

    def __call__(self, size: int) -> int:
        at = self.next
        size = -(-size // spec.PAGE) * spec.PAGE
        if at + size > self.end:
            raise MemoryError(f"driver memory exhausted: {size} bytes wanted at {at:#x}")
        self.next = at + size
        return at


class QueuePair(msgspec.Struct):
    qid: int
    entries: int
    sq: int  # base addresses
    cq: int
    vector: int
    sq_tail: int = 0
    sq_head: int = 0
    cq_head: int = 0
    phase: int = 1
    next_cid: int = 0
    # command slot -> (data buffer, PRP list pages, buffer bytes)
    buffers: dict[int, tuple[int, list[int], int]] = msgspec.field(default_factory=dict)


class Request(msgspec.Struct, frozen=True):
    """One submitted I/O: its command id and where its data buffer is."""

    cid: int
    buffer: int
    length: int


_POLLS = 1000  # bounded waits: the simulated controller answers synchronously


class NvmeDriver:
    def __init__(
        self,
        mmio: Mmio,
        memory: Memory,
        alloc: Alloc,
        *,
        clock: Clock = time.monotonic,
        timeout: float = COMMAND_TIMEOUT,
        shadow_doorbells: bool = True,
    ) -> None:
        self.mmio = mmio
        self.memory = memory
        self.alloc = alloc
        self.admin: QueuePair | None = None
        self.dstrd = 0
        self.max_entries = 2
        self.queues: dict[int, QueuePair] = {}
        self.block_size = 512
        self.blocks = 0
        self.slot_bytes = spec.PAGE * 4
        #: Deadlines of the submitted commands not completed, keyed (queue id, command id).
        self.timer: CommandTimer[tuple[int, int]] = CommandTimer(timeout, clock)
        self.shadow_doorbells = shadow_doorbells
        #: The shadow doorbell page the controller took (Doorbell Buffer Config), if any.
        self.shadow: int | None = None
        self.oacs = 0

    # --- bring-up ----------------------------------------------------------------------------
    def _wait_ready(self, ready: bool, what: str) -> None:
        for _ in range(_POLLS):
            csts = self.mmio.read(spec.REG_CSTS, 4)
            if csts & spec.CSTS_CFS:
                raise NvmeTimeoutError(f"{what} (controller fatal status)")
            if bool(csts & spec.CSTS_RDY) == ready:
                return
        raise NvmeTimeoutError(what)

    def reset(self) -> None:
        cc = self.mmio.read(spec.REG_CC, 4)
        self.mmio.write(spec.REG_CC, 4, cc & ~spec.CC_EN)
        self._wait_ready(False, "become not ready after reset")
        self.queues.clear()
        self.admin = None
        self.shadow = None  # the controller forgot it
        self.timer.clear()  # the reset aborted every command

    def enable(self, admin_entries: int = 32) -> None:
        cap = self.mmio.read(spec.REG_CAP, 8)
        self.dstrd = spec.cap_dstrd(cap)
        self.max_entries = spec.cap_mqes(cap) + 1
        n = min(admin_entries, self.max_entries, 4096)
        sq, cq = self.alloc(n * spec.SQE_SIZE), self.alloc(n * spec.CQE_SIZE)
        self.memory.write(cq, bytes(n * spec.CQE_SIZE))
        self.mmio.write(spec.REG_AQA, 4, (n - 1) | (n - 1) << 16)
        self.mmio.write(spec.REG_ASQ, 8, sq)
        self.mmio.write(spec.REG_ACQ, 8, cq)
        self.mmio.write(
            spec.REG_CC,
            4,
            spec.CC_EN
            | spec.SQES_LOG2 << spec.CC_IOSQES_SHIFT
            | spec.CQES_LOG2 << spec.CC_IOCQES_SHIFT,
        )
        self._wait_ready(True, "become ready")
        self.admin = QueuePair(0, n, sq, cq, 0)

    def start(self, queues: int = 1, entries: int = 32, nsid: int = 1) -> list[QueuePair]:
        """The whole bring-up: reset, enable, identify, ask for ``queues`` pairs, create them."""
        self.reset()
        self.enable()
        self.identify_controller()
        self.blocks, self.block_size = self.identify_namespace(nsid)
        granted = self.set_queue_count(queues)
        pairs = [
            self.create_queue_pair(q, entries, vector=q) for q in range(1, min(queues, granted) + 1)
        ]
        if self.shadow_doorbells and self.oacs & spec.OACS_DBBUF:
            self.configure_doorbell_buffer()
        return pairs

    def configure_doorbell_buffer(self) -> bool:
        """Doorbell Buffer Config: a zeroed shadow doorbell page and EventIdx page; True if
        the controller took them (else the driver goes on without, as Linux's does)."""
        buffer, eventidx = self.alloc(spec.PAGE), self.alloc(spec.PAGE)
        for page in (buffer, eventidx):
            self.memory.write(page, bytes(spec.PAGE))
        done = self.admin_command(
            spec.Command(spec.ADMIN_DBBUF_CONFIG, prp1=buffer, prp2=eventidx),
            "set the doorbell buffer",
            check=False,
        )
        self.shadow = buffer if done.ok else None
        return done.ok

    # --- submission and completion -------------------------------------------------------------
    def _doorbell(self, qid: int, completion: bool, value: int) -> None:
        offset = spec.doorbell_offset(qid, completion, self.dstrd)
        if self.shadow is not None and qid:  # I/O queues only, as Linux's driver
            at = self.shadow + offset - spec.DOORBELL_BASE
            self.memory.write(at, value.to_bytes(4, "little"))
        self.mmio.write(offset, 4, value)

    def submit(self, qp: QueuePair, cmd: spec.Command) -> None:
        """Write ``cmd`` into the SQ (the doorbell is rung by ``ring``)."""
        if (qp.sq_tail + 1) % qp.entries == qp.sq_head:
            raise NvmeCommandError(f"submit on queue {qp.qid} (queue full)", spec.SC_INVALID_FIELD)
        self.memory.write(qp.sq + qp.sq_tail * spec.SQE_SIZE, cmd.encode())
        qp.sq_tail = (qp.sq_tail + 1) % qp.entries
        self.timer.start((qp.qid, cmd.cid))

    def ring(self, qp: QueuePair) -> None:
        self._doorbell(qp.qid, False, qp.sq_tail)

    def reap(self, qp: QueuePair, limit: int | None = None) -> list[spec.Completion]:
        """Completions whose phase tag says they are new; rings the CQ head doorbell."""
        out: list[spec.Completion] = []
        while limit is None or len(out) < limit:
            raw = self.memory.read(qp.cq + qp.cq_head * spec.CQE_SIZE, spec.CQE_SIZE)
            entry = spec.Completion.decode(raw)
            if entry.phase != qp.phase:
                break
            out.append(entry)
            self.timer.stop((qp.qid, entry.cid))
            qp.sq_head = entry.sq_head
            qp.cq_head = (qp.cq_head + 1) % qp.entries
            if qp.cq_head == 0:
                qp.phase ^= 1
        if out:
            self._doorbell(qp.qid, True, qp.cq_head)
        return out

    def overdue(self, qp: QueuePair) -> list[int]:
        """Command ids submitted on ``qp``, not completed, past their deadline on the clock
        (earliest first): what the driver's timeout handler would abort."""
        return [cid for qid, cid in self.timer.expired() if qid == qp.qid]

    def _call(self, qp: QueuePair, cmd: spec.Command, what: str) -> spec.Completion:
        self.submit(qp, cmd)
        self.ring(qp)
        for _ in range(_POLLS):
            for entry in self.reap(qp):
                if entry.cid == cmd.cid:
                    return entry
        raise NvmeTimeoutError(f"complete {what}")

    def _cid(self, qp: QueuePair) -> int:
        cid = qp.next_cid
        qp.next_cid = (cid + 1) % 0xFFFF
        return cid

    def admin_command(self, cmd: spec.Command, what: str, check: bool = True) -> spec.Completion:
        if self.admin is None:
            raise NvmeTimeoutError("take admin commands: enable it first")
        cmd = msgspec.structs.replace(cmd, cid=self._cid(self.admin))
        done = self._call(self.admin, cmd, what)
        if check and not done.ok:
            raise NvmeCommandError(what, done.status)
        return done

    def _scratch(self) -> int:
        if not hasattr(self, "_admin_buf"):
            self._admin_buf = self.alloc(spec.IDENTIFY_SIZE)
        return self._admin_buf

    def identify(self, cns: int, nsid: int = 0) -> bytes:
        buf = self._scratch()
        self.admin_command(
            spec.Command(spec.ADMIN_IDENTIFY, nsid=nsid, prp1=buf, cdw10=cns), "identify"
        )
        return self.memory.read(buf, spec.IDENTIFY_SIZE)

    def identify_controller(self) -> dict[str, object]:
        data = self.identify(spec.CNS_CONTROLLER)
        self.oacs = int.from_bytes(data[256:258], "little")  # what it offers, for ``start``
        return parse_identify_controller(data)

    def identify_namespace(self, nsid: int = 1) -> tuple[int, int]:
        return parse_identify_namespace(self.identify(spec.CNS_NAMESPACE, nsid))

    def active_namespaces(self) -> list[int]:
        return parse_active_nsids(self.identify(spec.CNS_ACTIVE_NSIDS))

    def set_queue_count(self, pairs: int) -> int:
        """Ask for ``pairs`` I/O queue pairs; returns how many the controller granted."""
        n = pairs - 1
        done = self.admin_command(
            spec.Command(spec.ADMIN_SET_FEATURES, cdw10=spec.FEATURE_NUM_QUEUES, cdw11=n | n << 16),
            "set number of queues",
        )
        return min(done.result & 0xFFFF, done.result >> 16) + 1

    def create_queue_pair(
        self, qid: int, entries: int = 32, vector: int = 0, irq: bool = True
    ) -> QueuePair:
        entries = min(entries, self.max_entries)
        cq, sq = self.alloc(entries * spec.CQE_SIZE), self.alloc(entries * spec.SQE_SIZE)
        return self.create_queue_pair_at(qid, sq, cq, entries, vector, irq)

    def create_queue_pair_at(
        self, qid: int, sq: int, cq: int, entries: int, vector: int = 0, irq: bool = True
    ) -> QueuePair:
        """Create I/O CQ then SQ ``qid`` on rings at ``sq``/``cq`` (already allocated)."""
        self.memory.write(cq, bytes(entries * spec.CQE_SIZE))
        flags = spec.QUEUE_PHYS_CONTIG | (spec.CQ_IRQ_ENABLED if irq else 0)
        size = (entries - 1) << 16 | qid
        self.admin_command(
            spec.Command(spec.ADMIN_CREATE_CQ, prp1=cq, cdw10=size, cdw11=flags | vector << 16),
            f"create I/O completion queue {qid}",
        )
        done = self.admin_command(
            spec.Command(
                spec.ADMIN_CREATE_SQ, prp1=sq, cdw10=size, cdw11=spec.QUEUE_PHYS_CONTIG | qid << 16
            ),
            f"create I/O submission queue {qid}",
            check=False,
        )
        if not done.ok:
            self.admin_command(
                spec.Command(spec.ADMIN_DELETE_CQ, cdw10=qid), f"delete CQ {qid}", check=False
            )
            raise NvmeCommandError(f"create I/O submission queue {qid}", done.status)
        qp = QueuePair(qid, entries, sq, cq, vector)
        self.queues[qid] = qp
        return qp

    def delete_queue_pair(self, qp: QueuePair) -> None:
        self.admin_command(spec.Command(spec.ADMIN_DELETE_SQ, cdw10=qp.qid), f"delete SQ {qp.qid}")
        self.admin_command(spec.Command(spec.ADMIN_DELETE_CQ, cdw10=qp.qid), f"delete CQ {qp.qid}")
        self.queues.pop(qp.qid, None)

    # --- I/O -----------------------------------------------------------------------------------
    def _buffer(self, qp: QueuePair, cid: int, length: int) -> tuple[int, list[int]]:
        """The data buffer and PRP list pages of command slot ``cid`` (reused across wraps)."""
        slot = cid % qp.entries
        have = qp.buffers.get(slot)
        if have is None or have[2] < length:
            size = max(length, self.slot_bytes)
            data = self.alloc(size)
            lists = [self.alloc(spec.PAGE) for _ in range(list_pages_needed(-(-size // spec.PAGE)))]
            have = qp.buffers[slot] = (data, lists, size)
        return have[0], have[1]

    def prps(self, buffer: int, length: int, lists: list[int]) -> tuple[int, int]:
        """PRP1/PRP2 for a page-aligned ``buffer`` of ``length`` bytes (writes the PRP list)."""
        pages = [buffer + i * spec.PAGE for i in range(-(-length // spec.PAGE))]
        if len(pages) == 1:
            return pages[0], 0
        if len(pages) == 2:
            return pages[0], pages[1]
        for at, raw in build_prp_list(pages[1:], lists).items():
            self.memory.write(at, raw)
        return pages[0], lists[0]

    def submit_io(
        self, qp: QueuePair, opcode: int, slba: int, blocks: int, data: bytes = b"", nsid: int = 1
    ) -> Request:
        """Queue a Read/Write/Flush (not rung). ``data`` for writes."""
        cid = self._cid(qp)
        length = blocks * self.block_size if opcode != spec.IO_FLUSH else 0
        if length > spec.PAGE << MDTS:
            raise ValueError(f"transfer of {length} bytes exceeds the controller's MDTS")
        buffer, prp1, prp2 = 0, 0, 0
        if length:
            buffer, lists = self._buffer(qp, cid, length)
            if data:
                self.memory.write(buffer, data)
            prp1, prp2 = self.prps(buffer, length, lists)
        if opcode == spec.IO_FLUSH:
            cmd = spec.Command(opcode, cid, nsid)
        else:
            cmd = spec.io_command(opcode, cid, nsid, slba, blocks, prp1, prp2)
        self.submit(qp, cmd)
        return Request(cid, buffer, length)

    def write(self, qp: QueuePair, slba: int, data: bytes, nsid: int = 1) -> spec.Completion:
        if len(data) % self.block_size:
            raise ValueError(f"write whole blocks of {self.block_size} bytes")
        req = self.submit_io(qp, spec.IO_WRITE, slba, len(data) // self.block_size, data, nsid)
        return self._finish(qp, req.cid, "write")

    def read(
        self, qp: QueuePair, slba: int, blocks: int, nsid: int = 1
    ) -> tuple[spec.Completion, bytes]:
        req = self.submit_io(qp, spec.IO_READ, slba, blocks, nsid=nsid)
        done = self._finish(qp, req.cid, "read")
        return done, self.memory.read(req.buffer, req.length) if done.ok else b""

    def flush(self, qp: QueuePair, nsid: int = 1) -> spec.Completion:
        req = self.submit_io(qp, spec.IO_FLUSH, 0, 1, nsid=nsid)
        return self._finish(qp, req.cid, "flush")

    def submit_raw(self, qp: QueuePair, cmd: spec.Command) -> spec.Completion:
        """Submit a hand-made command (tests of bad input) and wait for it."""
        return self._call(qp, cmd, f"command {cmd.opcode:#x}")

    def _finish(self, qp: QueuePair, cid: int, what: str) -> spec.Completion:
        self.ring(qp)
        for _ in range(_POLLS):
            for entry in self.reap(qp):
                if entry.cid == cid:
                    return entry
        raise NvmeTimeoutError(f"complete the {what} (queue {qp.qid})")
