"""A simulated NVMe controller behind one function's BAR0.

It does what a drive does for an unmodified driver: registers (CAP, VS, INTMS/INTMC, CC, CSTS,
AQA, ASQ, ACQ, doorbells from 0x1000 with the CAP.DSTRD stride), enable and reset, the admin
commands a driver needs, Read/Write/Flush with PRPs, completions with phase tags, and one MSI-X
vector per completion queue. Every queue entry, PRP list and data byte moves through ``dma``
(the simulator's resolver), so it honours the windows and faults of any DMA.

The guard: a queue id may be given a ``QueueDomain`` before it is created. Commands fetched
from that queue are then checked against the owner's LBA window (LBA Out of Range, counted)
and every address the controller issues for the queue pair carries the owner's address space.

Work happens synchronously on the doorbell write that makes it visible: an SQ tail doorbell
fetches and executes up to the new tail (as far as its CQ has room), a CQ head doorbell frees
room and resumes queues that waited for it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

import msgspec

from vmlend.errors import DmaFault
from vmlend.nvme import spec
from vmlend.nvme.guard import GuardRejection, QueueDomain
from vmlend.nvme.identify import MDTS, active_nsids, identify_controller, identify_namespace
from vmlend.nvme.prp import PrpError, prp_pieces
from vmlend.sim.nvme.namespace import Namespace

log = logging.getLogger(__name__)


class DmaPort(Protocol):
    """The controller's bus-master access (raises ``DmaFault``)."""

    def read(self, iova: int, length: int) -> bytes: ...

    def write(self, iova: int, data: bytes) -> None: ...


class RegisterFile(Protocol):
    """BAR memory as ``vmlend.sim.pci.bar.BarMemory`` offers it."""

    def read(self, bar: int, offset: int, size: int) -> int: ...

    def write_bytes(self, bar: int, offset: int, data: bytes) -> None: ...

    def add_listener(self, fn: Callable[[int, int, int, int], None]) -> Callable[[], None]: ...


StrayDoorbell = Callable[[int, bool, int], None]


class ControllerConfig(msgspec.Struct, frozen=True):
    """What the drive offers. ``queue_pairs``: I/O queue pairs (ids 1..queue_pairs);
    ``entries``: largest queue (CAP.MQES + 1); ``vectors``: MSI-X vectors."""

    queue_pairs: int = 63
    entries: int = 1024
    dstrd: int = 0
    vectors: int = 32
    serial: str = "VMLEND0001"
    model: str = "vmlend simulated NVMe"
    vendor_id: int = 0x8086

    def __post_init__(self) -> None:
        if not 1 <= self.queue_pairs <= 0xFFFE:
            raise ValueError(
                f"an NVMe controller has 1..65534 I/O queue pairs, not {self.queue_pairs}"
            )
        if not 2 <= self.entries <= 0x10000:
            raise ValueError(f"queue entries must be 2..65536, not {self.entries}")
        if not 0 <= self.dstrd <= 15:
            raise ValueError(f"DSTRD is 0..15, not {self.dstrd}")

    @property
    def stride(self) -> int:
        return 4 << self.dstrd

    def doorbell_end(self) -> int:
        """First BAR0 offset after the doorbells of every queue id."""
        return spec.doorbell_offset(self.queue_pairs + 1, False, self.dstrd)


class _Queue(msgspec.Struct):
    qid: int
    base: int
    size: int
    domain: QueueDomain | None


class _Sq(_Queue):
    cqid: int = 0
    head: int = 0
    tail: int = 0
    stopped: str = ""  # why the controller stopped fetching (a fault on the ring)


class _Cq(_Queue):
    vector: int = 0
    irq: bool = True
    tail: int = 0
    head: int = 0
    phase: int = 1


class ControllerStats(msgspec.Struct):
    commands: int = 0
    rejections: dict[str, int] = msgspec.field(default_factory=dict)  # guard rejections per owner
    faults: list[DmaFault] = msgspec.field(default_factory=list)  # the last few DMA faults
    interrupts: int = 0


class NvmeController:
    """The controller model on BAR ``bar_index`` of ``regs``."""

    def __init__(
        self,
        regs: RegisterFile,
        dma: DmaPort,
        interrupt: Callable[[int], object],
        namespaces: list[Namespace],
        config: ControllerConfig | None = None,
        *,
        bar_index: int = 0,
        msix_enabled: Callable[[], bool] = lambda: True,
    ) -> None:
        self.regs = regs
        self.dma = dma
        self.config = config or ControllerConfig()
        self.bar_index = bar_index
        self._interrupt = interrupt
        self._msix_enabled = msix_enabled
        self.namespaces = {ns.nsid: ns for ns in namespaces}
        self.stats = ControllerStats()
        self._lock = threading.RLock()
        self._sqs: dict[int, _Sq] = {}
        self._cqs: dict[int, _Cq] = {}
        self._domains: dict[int, QueueDomain] = {}
        self._stray: list[StrayDoorbell] = []
        self._enabled = False
        self._csts = 0
        self._intmask = 0
        self._queues_allocated = self.config.queue_pairs
        self._remove = regs.add_listener(self._on_write)
        self._publish()

    # --- registers ---------------------------------------------------------------------------
    @property
    def cap(self) -> int:
        return spec.make_cap(mqes=self.config.entries - 1, dstrd=self.config.dstrd)

    def _put(self, offset: int, size: int, value: int) -> None:
        self.regs.write_bytes(self.bar_index, offset, value.to_bytes(size, "little"))

    def _publish(self) -> None:
        """Put the read-only registers back (software writes to them have no effect)."""
        self._put(spec.REG_CAP, 8, self.cap)
        self._put(spec.REG_VS, 4, spec.VERSION_1_4)
        self._put(spec.REG_INTMS, 4, self._intmask)
        self._put(spec.REG_INTMC, 4, self._intmask)
        self._put(spec.REG_CSTS, 4, self._csts)

    def _reg(self, offset: int, size: int) -> int:
        return self.regs.read(self.bar_index, offset, size)

    def _on_write(self, bar: int, offset: int, size: int, value: int) -> None:
        if bar != self.bar_index:
            return
        with self._lock:
            if offset >= spec.DOORBELL_BASE:
                self._doorbell(offset, size, value)
                return
            if offset <= spec.REG_INTMS < offset + size:
                self._intmask |= value >> 8 * (spec.REG_INTMS - offset) & 0xFFFFFFFF
            if offset <= spec.REG_INTMC < offset + size:
                self._intmask &= ~(value >> 8 * (spec.REG_INTMC - offset)) & 0xFFFFFFFF
            if offset < spec.REG_CC + 4 and offset + size > spec.REG_CC:
                self._cc_written(self._reg(spec.REG_CC, 4))
            self._publish()

    def _cc_written(self, cc: int) -> None:
        if cc & spec.CC_SHN_MASK:
            self._csts |= spec.CSTS_SHST_COMPLETE
        if cc & spec.CC_EN and not self._enabled:
            self._enable()
        elif not cc & spec.CC_EN and self._enabled:
            self.reset_queues()
            self._csts = 0

    def _enable(self) -> None:
        aqa = self._reg(spec.REG_AQA, 4)
        asq = self._reg(spec.REG_ASQ, 8)
        acq = self._reg(spec.REG_ACQ, 8)
        sqs, cqs = (aqa & 0xFFF) + 1, (aqa >> 16 & 0xFFF) + 1
        if asq % spec.PAGE or acq % spec.PAGE or sqs < 2 or cqs < 2:
            log.warning(
                "NVMe enable with a bad admin queue (AQA %#x ASQ %#x ACQ %#x)", aqa, asq, acq
            )
            self._csts = spec.CSTS_CFS
            return
        self._cqs[0] = _Cq(0, acq, cqs, None, vector=0, irq=True)
        self._sqs[0] = _Sq(0, asq, sqs, None, cqid=0)
        self._queues_allocated = self.config.queue_pairs
        self._enabled = True
        self._csts = spec.CSTS_RDY

    def reset_queues(self) -> None:
        """Controller reset (CC.EN 1 -> 0): every queue is gone, and so are the queue domains
        (whoever shares the drive sets them again)."""
        with self._lock:
            self._sqs.clear()
            self._cqs.clear()
            self._domains.clear()
            self._enabled = False

    def function_reset(self) -> None:
        """After a function level reset the BAR is back to power-on: registers again."""
        with self._lock:
            self.reset_queues()
            self._csts = 0
            self._intmask = 0
            self._publish()

    def close(self) -> None:
        self._remove()

    @property
    def lock(self) -> threading.RLock:
        """Held while the controller works; whoever drives it from outside (the manager) takes
        it first, so there is one lock order."""
        return self._lock

    @property
    def ready(self) -> bool:
        return bool(self._csts & spec.CSTS_RDY)

    # --- the guard's configuration (vendor sideband, see docs/nvme-sharing.md) --------------
    def set_domain(self, qid: int, domain: QueueDomain) -> None:
        """Give queue id ``qid`` an owner before it is created; refused while it exists."""
        if not 1 <= qid <= self.config.queue_pairs:
            raise ValueError(f"queue id {qid} is not an I/O queue of this controller")
        with self._lock:
            if qid in self._sqs or qid in self._cqs:
                raise ValueError(f"queue {qid} exists; delete it before changing its owner")
            if domain.nsid not in self.namespaces:
                raise ValueError(f"namespace {domain.nsid} does not exist")
            if domain.offset + domain.length > self.namespaces[domain.nsid].blocks:
                raise ValueError(f"LBA window of {domain.owner} is beyond namespace {domain.nsid}")
            self._domains[qid] = domain

    def rename_owner(self, old: str, new: str) -> None:
        """The queues of owner ``old`` (and its guard rejections) are ``new``'s from now on: a
        share following its VM to another node keeps its queues, address space and blocks."""
        with self._lock:
            for qid, d in list(self._domains.items()):
                if d.owner == old:
                    self._domains[qid] = msgspec.structs.replace(d, owner=new)
            for q in [*self._sqs.values(), *self._cqs.values()]:
                if q.domain is not None and q.domain.owner == old:
                    q.domain = msgspec.structs.replace(q.domain, owner=new)
            if old in self.stats.rejections:
                self.stats.rejections[new] = self.stats.rejections.pop(old)

    def clear_domain(self, qid: int) -> None:
        with self._lock:
            self._domains.pop(qid, None)

    def domain(self, qid: int) -> QueueDomain | None:
        return self._domains.get(qid)

    def queue_ids(self) -> list[int]:
        """Existing I/O submission queue ids."""
        return sorted(q for q in self._sqs if q)

    def sq_tail(self, qid: int) -> int | None:
        """The tail the last doorbell write of submission queue ``qid`` that arrived set
        (None: no such queue)."""
        sq = self._sqs.get(qid)
        return sq.tail if sq else None

    def sq_stopped(self, qid: int) -> str:
        sq = self._sqs.get(qid)
        return sq.stopped if sq else ""

    def on_stray_doorbell(self, fn: StrayDoorbell) -> Callable[[], None]:
        """``fn(qid, completion, value)`` for doorbell writes of queues that do not exist (a
        real drive reports them as an "Invalid Doorbell Register" asynchronous event)."""
        self._stray.append(fn)
        return lambda: self._stray.remove(fn) if fn in self._stray else None

    # --- doorbells -----------------------------------------------------------------------------
    def _doorbell(self, offset: int, size: int, value: int) -> None:
        slot = spec.doorbell_of(offset, self.config.dstrd)
        if slot is None or size != 4 or not self._enabled:
            return
        qid, completion = slot
        if completion:
            cq = self._cqs.get(qid)
            if cq is None or value >= cq.size:
                self._report_stray(qid, completion, value)
                return
            cq.head = value
            for waiting in list(self._sqs.values()):
                if waiting.cqid == qid and waiting.head != waiting.tail:
                    self._run(waiting)
            return
        sq = self._sqs.get(qid)
        if sq is None or value >= sq.size:
            self._report_stray(qid, completion, value)
            return
        sq.tail = value
        self._run(sq)

    def _report_stray(self, qid: int, completion: bool, value: int) -> None:
        for fn in list(self._stray):
            fn(qid, completion, value)

    # --- DMA on a queue's behalf -------------------------------------------------------------
    @staticmethod
    def _iova(domain: QueueDomain | None, address: int) -> int:
        return domain.dma_address(address) if domain else address

    def _fault(self, fault: DmaFault) -> None:
        self.stats.faults = [*self.stats.faults[-15:], fault]
        log.info("NVMe DMA fault: %s", fault)

    def _run(self, sq: _Sq) -> None:
        touched: set[int] = set()
        while sq.head != sq.tail and not sq.stopped and sq.qid in self._sqs:
            cq = self._cqs.get(sq.cqid)
            if cq is None or (cq.tail + 1) % cq.size == cq.head:
                break  # no room: wait for the CQ head doorbell
            try:
                raw = self.dma.read(
                    self._iova(sq.domain, sq.base + sq.head * spec.SQE_SIZE), spec.SQE_SIZE
                )
            except (DmaFault, GuardRejection) as e:
                sq.stopped = str(e)
                if isinstance(e, DmaFault):
                    self._fault(e)
                break
            sq.head = (sq.head + 1) % sq.size
            cmd = spec.Command.decode(raw)
            self.stats.commands += 1
            status, result = self._admin(cmd) if sq.qid == 0 else self._io(cmd, sq.domain)
            entry = spec.Completion(cmd.cid, status, sq.qid, sq.head, cq.phase, result)
            try:
                self.dma.write(
                    self._iova(cq.domain, cq.base + cq.tail * spec.CQE_SIZE), entry.encode()
                )
            except (DmaFault, GuardRejection) as e:
                if isinstance(e, DmaFault):
                    self._fault(e)
                continue  # the completion is lost, as on hardware
            cq.tail = (cq.tail + 1) % cq.size
            if cq.tail == 0:
                cq.phase ^= 1
            if cq.irq:
                touched.add(cq.qid)
        for qid in sorted(touched):
            cq = self._cqs.get(qid)
            if cq is None:
                continue
            if not self._msix_enabled() and self._intmask & 1 << cq.vector:
                continue
            self.stats.interrupts += 1
            self._interrupt(cq.vector)

    # --- admin commands ------------------------------------------------------------------------
    def _admin(self, cmd: spec.Command) -> tuple[int, int]:
        handlers: dict[int, Callable[[spec.Command], tuple[int, int]]] = {
            spec.ADMIN_IDENTIFY: self._identify,
            spec.ADMIN_CREATE_CQ: self._create_cq,
            spec.ADMIN_CREATE_SQ: self._create_sq,
            spec.ADMIN_DELETE_SQ: self._delete_sq,
            spec.ADMIN_DELETE_CQ: self._delete_cq,
            spec.ADMIN_SET_FEATURES: self._set_features,
            spec.ADMIN_GET_FEATURES: self._get_features,
            spec.ADMIN_GET_LOG_PAGE: self._get_log_page,
            spec.ADMIN_ABORT: lambda c: (spec.SC_SUCCESS, 1),  # nothing is ever outstanding
        }
        handler = handlers.get(cmd.opcode)
        if handler is None:
            return spec.SC_INVALID_OPCODE, 0
        return handler(cmd)

    def _to_host(self, cmd: spec.Command, data: bytes, domain: QueueDomain | None = None) -> int:
        try:
            pieces = prp_pieces(
                cmd.prp1, cmd.prp2, len(data), lambda a, n: self.dma.read(self._iova(domain, a), n)
            )
            pos = 0
            for address, n in pieces:
                self.dma.write(self._iova(domain, address), data[pos : pos + n])
                pos += n
        except PrpError as e:
            return e.status
        except GuardRejection as e:
            return e.status
        except DmaFault as e:
            self._fault(e)
            return spec.SC_DATA_TRANSFER_ERROR
        return spec.SC_SUCCESS

    def _identify(self, cmd: spec.Command) -> tuple[int, int]:
        cns = cmd.cdw10 & 0xFF
        if cns == spec.CNS_CONTROLLER:
            data = identify_controller(self.config, len(self.namespaces))
        elif cns == spec.CNS_NAMESPACE:
            ns = self.namespaces.get(cmd.nsid)
            if ns is None:
                return spec.SC_INVALID_NAMESPACE, 0
            data = identify_namespace(ns.blocks, ns.lba_shift)
        elif cns == spec.CNS_ACTIVE_NSIDS:
            data = active_nsids([n for n in sorted(self.namespaces) if n > cmd.nsid])
        else:
            return spec.SC_INVALID_FIELD, 0
        return self._to_host(cmd, data), 0

    def _queue_args(self, cmd: spec.Command) -> tuple[int, int, int]:
        qid, size = cmd.cdw10 & 0xFFFF, (cmd.cdw10 >> 16) + 1
        if not 1 <= qid <= self._queues_allocated:
            return qid, size, spec.SC_INVALID_QID
        if not 2 <= size <= self.config.entries:
            return qid, size, spec.SC_INVALID_QUEUE_SIZE
        if not cmd.cdw11 & spec.QUEUE_PHYS_CONTIG or cmd.prp1 % spec.PAGE:
            return qid, size, spec.SC_INVALID_FIELD
        return qid, size, spec.SC_SUCCESS

    def _create_cq(self, cmd: spec.Command) -> tuple[int, int]:
        qid, size, status = self._queue_args(cmd)
        if status:
            return status, 0
        if qid in self._cqs:
            return spec.SC_INVALID_QID, 0
        vector = cmd.cdw11 >> 16
        if vector >= self.config.vectors:
            return spec.SC_INVALID_VECTOR, 0
        self._cqs[qid] = _Cq(
            qid,
            cmd.prp1,
            size,
            self._domains.get(qid),
            vector=vector,
            irq=bool(cmd.cdw11 & spec.CQ_IRQ_ENABLED),
        )
        return spec.SC_SUCCESS, 0

    def _create_sq(self, cmd: spec.Command) -> tuple[int, int]:
        qid, size, status = self._queue_args(cmd)
        if status:
            return status, 0
        if qid in self._sqs:
            return spec.SC_INVALID_QID, 0
        cqid = cmd.cdw11 >> 16
        cq = self._cqs.get(cqid)
        if cqid == 0 or cq is None:
            return spec.SC_CQ_INVALID, 0
        domain = self._domains.get(qid)
        if cq.domain != domain:
            return spec.SC_CQ_INVALID, 0  # a queue pair has one owner
        self._sqs[qid] = _Sq(qid, cmd.prp1, size, domain, cqid=cqid)
        return spec.SC_SUCCESS, 0

    def _delete_sq(self, cmd: spec.Command) -> tuple[int, int]:
        qid = cmd.cdw10 & 0xFFFF
        if qid == 0 or qid not in self._sqs:
            return spec.SC_INVALID_QID, 0
        del self._sqs[qid]
        return spec.SC_SUCCESS, 0

    def _delete_cq(self, cmd: spec.Command) -> tuple[int, int]:
        qid = cmd.cdw10 & 0xFFFF
        if qid == 0 or qid not in self._cqs:
            return spec.SC_INVALID_QID, 0
        if any(sq.cqid == qid for sq in self._sqs.values()):
            return spec.SC_INVALID_QUEUE_DELETION, 0
        del self._cqs[qid]
        return spec.SC_SUCCESS, 0

    def _num_queues_result(self) -> int:
        n = self._queues_allocated - 1
        return n | n << 16

    def _set_features(self, cmd: spec.Command) -> tuple[int, int]:
        if cmd.cdw10 & 0xFF != spec.FEATURE_NUM_QUEUES:
            return spec.SC_INVALID_FIELD, 0
        nsq, ncq = (cmd.cdw11 & 0xFFFF) + 1, (cmd.cdw11 >> 16) + 1
        if nsq > 0xFFFF or ncq > 0xFFFF:
            return spec.SC_INVALID_FIELD, 0
        self._queues_allocated = max(
            max(q for q in (*self._sqs, *self._cqs, 0)),
            min(max(nsq, ncq), self.config.queue_pairs),
        )
        return spec.SC_SUCCESS, self._num_queues_result()

    def _get_features(self, cmd: spec.Command) -> tuple[int, int]:
        if cmd.cdw10 & 0xFF != spec.FEATURE_NUM_QUEUES:
            return spec.SC_INVALID_FIELD, 0
        return spec.SC_SUCCESS, self._num_queues_result()

    def _get_log_page(self, cmd: spec.Command) -> tuple[int, int]:
        dwords = ((cmd.cdw10 >> 16) & 0xFFF) + 1
        return self._to_host(cmd, bytes(4 * dwords)), 0  # every log reads empty

    # --- I/O commands ----------------------------------------------------------------------
    def _io(self, cmd: spec.Command, domain: QueueDomain | None) -> tuple[int, int]:
        if cmd.opcode not in (spec.IO_READ, spec.IO_WRITE, spec.IO_FLUSH):
            return spec.SC_INVALID_OPCODE, 0
        try:
            ns, lba = self._locate(cmd, domain)
        except GuardRejection as e:
            if domain is not None:
                self.stats.rejections[domain.owner] = self.stats.rejections.get(domain.owner, 0) + 1
            log.info("NVMe guard: %s", e)
            return e.status, 0
        if cmd.opcode == spec.IO_FLUSH:
            ns.flush()
            return spec.SC_SUCCESS, 0
        length = cmd.blocks * ns.block_size
        if length > spec.PAGE << MDTS:
            return spec.SC_INVALID_FIELD, 0
        if cmd.opcode == spec.IO_READ:
            return self._to_host(cmd, ns.read(lba, cmd.blocks), domain), 0
        try:
            pieces = prp_pieces(
                cmd.prp1, cmd.prp2, length, lambda a, n: self.dma.read(self._iova(domain, a), n)
            )
            data = b"".join(self.dma.read(self._iova(domain, a), n) for a, n in pieces)
        except (PrpError, GuardRejection) as e:
            return e.status, 0
        except DmaFault as e:
            self._fault(e)
            return spec.SC_DATA_TRANSFER_ERROR, 0
        ns.write(lba, data)
        return spec.SC_SUCCESS, 0

    def _locate(self, cmd: spec.Command, domain: QueueDomain | None) -> tuple[Namespace, int]:
        flush = cmd.opcode == spec.IO_FLUSH
        if domain is not None:
            if flush:
                if cmd.nsid not in (domain.view_nsid, 0xFFFFFFFF):
                    raise GuardRejection(
                        spec.SC_INVALID_NAMESPACE, f"{domain.owner} flush of {cmd.nsid}"
                    )
                return self.namespaces[domain.nsid], 0
            return self.namespaces[domain.nsid], domain.translate(cmd.nsid, cmd.slba, cmd.blocks)
        ns = self.namespaces.get(cmd.nsid)
        if ns is None:
            if flush and cmd.nsid == 0xFFFFFFFF and self.namespaces:
                return next(iter(self.namespaces.values())), 0
            raise GuardRejection(spec.SC_INVALID_NAMESPACE, f"no namespace {cmd.nsid}")
        if not flush and cmd.slba + cmd.blocks > ns.blocks:
            raise GuardRejection(
                spec.SC_LBA_OUT_OF_RANGE, f"LBAs {cmd.slba}+{cmd.blocks} beyond namespace"
            )
        return ns, cmd.slba
