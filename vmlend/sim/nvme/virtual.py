"""The controller a VM sees for its share of a shared drive (the mdev's BAR0, emulated).

Registers and the admin queue are software (what the hypervisor emulates in NVMePass): CAP
(the real MQES and DSTRD, so the guest's doorbell layout is the real one), VS, INTMS/INTMC, CC
and CSTS (enable just checks the admin queue the guest set up), AQA/ASQ/ACQ. The guest's admin
commands are read from and answered in guest memory (the hypervisor reaches guest RAM as any
device model does): Identify answers for the share (one namespace of its size, its number of
queues); Create/Delete I/O CQ/SQ are forwarded to the manager, which creates the real queues at
the guest's queue addresses. A two-path share's controller also advertises Doorbell Buffer
Config (OACS bit 8, NVMe 1.3's shadow doorbells) when the share can run in page mode, and hands
the guest's buffer to its queue relay (``vmlend.sim.nvme.relay``). I/O queues and their
doorbells are not here: see ``vmlend.nvme.shares`` for how doorbell writes reach the drive.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from vmlend.nvme import cmb, spec
from vmlend.nvme.identify import (
    active_nsids,
    identify_controller,
    identify_namespace,
)
from vmlend.nvme.prp import PrpError, prp_pieces
from vmlend.nvme.shares import Share
from vmlend.sim.nvme.controller import ControllerConfig

log = logging.getLogger(__name__)


class GuestMemory(Protocol):
    def read(self, gpa: int, length: int) -> bytes: ...

    def write(self, gpa: int, data: bytes) -> None: ...


class QueueForwarder(Protocol):
    """The manager's side: create and delete the share's real queues (statuses returned)."""

    def create_cq(
        self, share: Share, qid: int, gpa: int, entries: int, vector: int, irq: bool
    ) -> int: ...

    def create_sq(self, share: Share, qid: int, gpa: int, entries: int, cqid: int) -> int: ...

    def delete_sq(self, share: Share, qid: int) -> int: ...

    def delete_cq(self, share: Share, qid: int) -> int: ...


class DoorbellBuffer(Protocol):
    """Who keeps the guest's shadow doorbell buffer (a two-path share's relay)."""

    def configure_shadow(self, buffer: int, eventidx: int) -> int: ...

    def clear_shadow(self) -> None: ...


REGISTER_BYTES = spec.DOORBELL_BASE


class VirtualNvmeController:
    """Share ``share`` as a standard NVMe controller for one guest."""

    def __init__(
        self,
        share: Share,
        real: ControllerConfig,
        block_size: int,
        memory: GuestMemory,
        manager: QueueForwarder,
        interrupt: Callable[[int], object],
        doorbell_buffer: DoorbellBuffer | None = None,
    ) -> None:
        """``doorbell_buffer``: Doorbell Buffer Config is advertised and handed to it."""
        self.share = share
        self.real = real
        self.block_size = block_size
        self.memory = memory
        self.manager = manager
        self.interrupt = interrupt
        self.doorbell_buffer = doorbell_buffer
        self._regs = bytearray(REGISTER_BYTES)
        self._admin: tuple[int, int, int, int] | None = None  # sq, sq size, cq, cq size
        self._sq_head = 0
        self._cq_tail = 0
        self._cq_head = 0
        self._phase = 1
        self._granted = share.queue_pairs
        self._reset_registers()

    @property
    def config(self) -> ControllerConfig:
        """What the guest is told: the share's queue pairs, the real queue limits."""
        return ControllerConfig(
            queue_pairs=self.share.queue_pairs,
            entries=self.real.entries,
            dstrd=self.real.dstrd,
            vectors=self.share.queue_pairs + 1,
            serial=f"{self.real.serial[:12]}-{self.share.asid:03d}",
            model=f"{self.real.model} (share)",
            vendor_id=self.real.vendor_id,
        )

    def _put(self, offset: int, size: int, value: int) -> None:
        self._regs[offset : offset + size] = value.to_bytes(size, "little")

    def _get(self, offset: int, size: int) -> int:
        return int.from_bytes(self._regs[offset : offset + size], "little")

    def _reset_registers(self) -> None:
        cc = self._get(spec.REG_CC, 4)
        aqa, asq, acq = (
            self._get(spec.REG_AQA, 4),
            self._get(spec.REG_ASQ, 8),
            self._get(spec.REG_ACQ, 8),
        )
        self._regs[:] = bytes(REGISTER_BYTES)
        cap = spec.make_cap(mqes=self.real.entries - 1, dstrd=self.real.dstrd)
        if self.share.cmb_bytes:
            # its extent of the drive's CMB, as a CMB of its own: submission queues only
            cap |= cmb.CAP_CMBS
            self._put(cmb.REG_CMBLOC, 4, cmb.cmbloc(cmb.CMB_BAR, 0))
            self._put(cmb.REG_CMBSZ, 4, cmb.cmbsz(self.share.cmb_bytes))
        self._put(spec.REG_CAP, 8, cap)
        self._put(spec.REG_VS, 4, spec.VERSION_1_4)
        for off, size, value in (
            (spec.REG_CC, 4, cc & ~spec.CC_EN),
            (spec.REG_AQA, 4, aqa),
            (spec.REG_ASQ, 8, asq),
            (spec.REG_ACQ, 8, acq),
        ):
            self._put(off, size, value)

    # --- register access (trapped MMIO) -------------------------------------------------------
    def read(self, offset: int, size: int) -> int:
        if offset >= 0 and offset + size <= REGISTER_BYTES:
            return self._get(offset, size)
        return 0  # doorbells read as zero; anything else in the BAR too

    def write(self, offset: int, size: int, value: int) -> None:
        if offset >= spec.DOORBELL_BASE:
            raise ValueError(f"doorbell {offset:#x} is not the register block's")
        if offset <= spec.REG_INTMS < offset + size:
            self._put(spec.REG_INTMS, 4, self._get(spec.REG_INTMS, 4) | value)
            self._put(spec.REG_INTMC, 4, self._get(spec.REG_INTMS, 4))
            return
        if offset <= spec.REG_INTMC < offset + size:
            self._put(spec.REG_INTMS, 4, self._get(spec.REG_INTMS, 4) & ~value)
            self._put(spec.REG_INTMC, 4, self._get(spec.REG_INTMS, 4))
            return
        if offset < spec.REG_CC + 4 and offset + size > spec.REG_CC:
            self._put(offset, size, value)
            self._cc_written(self._get(spec.REG_CC, 4))
            return
        if offset in (spec.REG_AQA, spec.REG_ASQ, spec.REG_ASQ + 4, spec.REG_ACQ, spec.REG_ACQ + 4):
            self._put(offset, size, value)
        # CAP, VS, CSTS and reserved registers are read-only

    def _cc_written(self, cc: int) -> None:
        csts = self._get(spec.REG_CSTS, 4)
        if cc & spec.CC_SHN_MASK:
            csts |= spec.CSTS_SHST_COMPLETE
        if cc & spec.CC_EN and not csts & spec.CSTS_RDY:
            aqa = self._get(spec.REG_AQA, 4)
            asq, acq = self._get(spec.REG_ASQ, 8), self._get(spec.REG_ACQ, 8)
            sqs, cqs = (aqa & 0xFFF) + 1, (aqa >> 16 & 0xFFF) + 1
            if asq % spec.PAGE or acq % spec.PAGE or sqs < 2 or cqs < 2:
                csts = spec.CSTS_CFS
            else:
                self._admin = (asq, sqs, acq, cqs)
                self._sq_head = self._cq_tail = self._cq_head = 0
                self._phase = 1
                csts = spec.CSTS_RDY
        elif not cc & spec.CC_EN and csts & spec.CSTS_RDY:
            self.reset()
            csts = 0
        self._put(spec.REG_CSTS, 4, csts)

    def reset(self) -> None:
        """The guest reset its controller: its real queues go (the manager deletes them)."""
        for gqid in range(1, self.share.queue_pairs + 1):
            self.manager.delete_sq(self.share, gqid)
            self.manager.delete_cq(self.share, gqid)
        if self.doorbell_buffer is not None:
            self.doorbell_buffer.clear_shadow()
        self._admin = None
        self._granted = self.share.queue_pairs

    # --- the emulated admin queue -------------------------------------------------------------
    def admin_doorbell(self, completion: bool, value: int) -> None:
        """A write to the guest's admin SQ tail (or CQ head) doorbell."""
        if self._admin is None:
            return
        sq, sqs, cq, cqs = self._admin
        if completion:
            if value < cqs:
                self._cq_head = value
            return
        if value >= sqs:
            return
        posted = False
        while self._sq_head != value and (self._cq_tail + 1) % cqs != self._cq_head:
            cmd = spec.Command.decode(
                self.memory.read(sq + self._sq_head * spec.SQE_SIZE, spec.SQE_SIZE)
            )
            self._sq_head = (self._sq_head + 1) % sqs
            status, result = self._execute(cmd)
            entry = spec.Completion(cmd.cid, status, 0, self._sq_head, self._phase, result)
            self.memory.write(cq + self._cq_tail * spec.CQE_SIZE, entry.encode())
            self._cq_tail = (self._cq_tail + 1) % cqs
            if self._cq_tail == 0:
                self._phase ^= 1
            posted = True
        if posted:
            self.interrupt(0)

    def _execute(self, cmd: spec.Command) -> tuple[int, int]:
        op = cmd.opcode
        if op == spec.ADMIN_IDENTIFY:
            return self._identify(cmd), 0
        if op in (spec.ADMIN_SET_FEATURES, spec.ADMIN_GET_FEATURES):
            if cmd.cdw10 & 0xFF != spec.FEATURE_NUM_QUEUES:
                return spec.SC_INVALID_FIELD, 0
            if op == spec.ADMIN_SET_FEATURES:
                want = max(cmd.cdw11 & 0xFFFF, cmd.cdw11 >> 16) + 1
                self._granted = min(want, self.share.queue_pairs)
            n = self._granted - 1
            return spec.SC_SUCCESS, n | n << 16
        if op in (
            spec.ADMIN_CREATE_CQ,
            spec.ADMIN_CREATE_SQ,
            spec.ADMIN_DELETE_SQ,
            spec.ADMIN_DELETE_CQ,
        ):
            return self._queue_command(cmd), 0
        if op == spec.ADMIN_ABORT:
            return spec.SC_SUCCESS, 1
        if op == spec.ADMIN_DBBUF_CONFIG and self.doorbell_buffer is not None:
            return self.doorbell_buffer.configure_shadow(cmd.prp1, cmd.prp2), 0
        if op == spec.ADMIN_GET_LOG_PAGE:
            return self._to_guest(cmd, bytes(4 * (((cmd.cdw10 >> 16) & 0xFFF) + 1))), 0
        return spec.SC_INVALID_OPCODE, 0

    def _to_guest(self, cmd: spec.Command, data: bytes) -> int:
        try:
            pieces = prp_pieces(cmd.prp1, cmd.prp2, len(data), self.memory.read)
        except PrpError as e:
            return e.status
        pos = 0
        for gpa, n in pieces:
            self.memory.write(gpa, data[pos : pos + n])
            pos += n
        return spec.SC_SUCCESS

    def _identify(self, cmd: spec.Command) -> int:
        cns = cmd.cdw10 & 0xFF
        if cns == spec.CNS_CONTROLLER:
            oacs = spec.OACS_DBBUF if self.doorbell_buffer is not None else 0
            data = identify_controller(self.config, 1, cntlid=self.share.asid, oacs=oacs)
        elif cns == spec.CNS_NAMESPACE:
            if cmd.nsid != 1:
                return spec.SC_INVALID_NAMESPACE
            data = identify_namespace(self.share.blocks, self.block_size.bit_length() - 1)
        elif cns == spec.CNS_ACTIVE_NSIDS:
            data = active_nsids([1] if cmd.nsid < 1 else [])
        else:
            return spec.SC_INVALID_FIELD
        return self._to_guest(cmd, data)

    def _queue_command(self, cmd: spec.Command) -> int:
        gqid = cmd.cdw10 & 0xFFFF
        if not 1 <= gqid <= self._granted:
            return spec.SC_INVALID_QID
        entries = (cmd.cdw10 >> 16) + 1
        in_cmb = cmb.GUEST_CMB_BASE <= cmd.prp1 < cmb.GUEST_CMB_BASE + (1 << 40)
        if cmd.opcode == spec.ADMIN_CREATE_CQ:
            if in_cmb:
                return spec.SC_INVALID_FIELD  # CMBSZ.CQS is clear: completions go to RAM
            vector = cmd.cdw11 >> 16
            if not 1 <= vector <= self.share.queue_pairs:
                return spec.SC_INVALID_VECTOR  # vector 0 is the emulated admin queue's
            if not cmd.cdw11 & spec.QUEUE_PHYS_CONTIG:
                return spec.SC_INVALID_FIELD
            return self.manager.create_cq(
                self.share, gqid, cmd.prp1, entries, vector, bool(cmd.cdw11 & spec.CQ_IRQ_ENABLED)
            )
        if cmd.opcode == spec.ADMIN_CREATE_SQ:
            gcq = cmd.cdw11 >> 16
            if not 1 <= gcq <= self._granted:
                return spec.SC_CQ_INVALID
            if not cmd.cdw11 & spec.QUEUE_PHYS_CONTIG:
                return spec.SC_INVALID_FIELD
            end = cmd.prp1 + entries * spec.SQE_SIZE
            if in_cmb and end > cmb.GUEST_CMB_BASE + self.share.cmb_bytes:
                return spec.SC_INVALID_FIELD  # it would leave the share's CMB extent
            return self.manager.create_sq(self.share, gqid, cmd.prp1, entries, gcq)
        if cmd.opcode == spec.ADMIN_DELETE_SQ:
            return self.manager.delete_sq(self.share, gqid)
        return self.manager.delete_cq(self.share, gqid)
