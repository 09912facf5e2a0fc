"""NVMe base-spec constants and the wire format of queue entries (pure; the NVMe base spec).

Submission entries are 64 bytes, completion entries 16; both little-endian. Status values here
are the 15-bit Status Field without the phase tag: ``sct << 8 | sc``.
"""

from __future__ import annotations

import struct

import msgspec

# --- BAR0 registers --------------------------------------------------------------------------
REG_CAP = 0x00
REG_VS = 0x08
REG_INTMS = 0x0C
REG_INTMC = 0x10
REG_CC = 0x14
REG_CSTS = 0x1C
REG_AQA = 0x24
REG_ASQ = 0x28
REG_ACQ = 0x30
DOORBELL_BASE = 0x1000

CC_EN = 1 << 0
CC_SHN_MASK = 0x3 << 14
CC_IOSQES_SHIFT = 16
CC_IOCQES_SHIFT = 20
CSTS_RDY = 1 << 0
CSTS_CFS = 1 << 1
CSTS_SHST_COMPLETE = 0x2 << 2

CAP_DSTRD_SHIFT = 32
CAP_CSS_NVM = 1 << 37
CAP_MPSMIN_SHIFT = 48
CAP_MPSMAX_SHIFT = 52
CAP_TO_SHIFT = 24
CAP_CQR = 1 << 16

VERSION_1_4 = 0x0001_0400
SQE_SIZE = 64
CQE_SIZE = 16
SQES_LOG2 = 6
CQES_LOG2 = 4
PAGE = 4096
IDENTIFY_SIZE = 4096

# --- opcodes ---------------------------------------------------------------------------------
ADMIN_DELETE_SQ = 0x00
ADMIN_CREATE_SQ = 0x01
ADMIN_GET_LOG_PAGE = 0x02
ADMIN_DELETE_CQ = 0x04
ADMIN_CREATE_CQ = 0x05
ADMIN_IDENTIFY = 0x06
ADMIN_ABORT = 0x08
ADMIN_SET_FEATURES = 0x09
ADMIN_GET_FEATURES = 0x0A
#: Doorbell Buffer Config (NVMe 1.3): PRP1 the host's shadow doorbell page, PRP2 its EventIdx page
ADMIN_DBBUF_CONFIG = 0x7C
#: Identify controller's OACS bit: Doorbell Buffer Config is supported
OACS_DBBUF = 1 << 8

IO_FLUSH = 0x00
IO_WRITE = 0x01
IO_READ = 0x02

CNS_NAMESPACE = 0x00
CNS_CONTROLLER = 0x01
CNS_ACTIVE_NSIDS = 0x02

FEATURE_NUM_QUEUES = 0x07

# Create I/O SQ/CQ flag bits (CDW11)
QUEUE_PHYS_CONTIG = 1 << 0
CQ_IRQ_ENABLED = 1 << 1

# --- status (sct << 8 | sc) ------------------------------------------------------------------
SC_SUCCESS = 0x00
SC_INVALID_OPCODE = 0x01
SC_INVALID_FIELD = 0x02
SC_DATA_TRANSFER_ERROR = 0x04
SC_INVALID_NAMESPACE = 0x0B
SC_COMMAND_SEQUENCE_ERROR = 0x0C
SC_PRP_OFFSET_INVALID = 0x13
SC_LBA_OUT_OF_RANGE = 0x80
_SCT_COMMAND_SPECIFIC = 0x1 << 8
SC_CQ_INVALID = _SCT_COMMAND_SPECIFIC | 0x00
SC_INVALID_QID = _SCT_COMMAND_SPECIFIC | 0x01
SC_INVALID_QUEUE_SIZE = _SCT_COMMAND_SPECIFIC | 0x02
SC_INVALID_VECTOR = _SCT_COMMAND_SPECIFIC | 0x08
SC_INVALID_QUEUE_DELETION = _SCT_COMMAND_SPECIFIC | 0x0C

STATUS_NAMES = {
    SC_SUCCESS: "success",
    SC_INVALID_OPCODE: "invalid opcode",
    SC_INVALID_FIELD: "invalid field",
    SC_DATA_TRANSFER_ERROR: "data transfer error",
    SC_INVALID_NAMESPACE: "invalid namespace",
    SC_COMMAND_SEQUENCE_ERROR: "command sequence error",
    SC_PRP_OFFSET_INVALID: "PRP offset invalid",
    SC_LBA_OUT_OF_RANGE: "LBA out of range",
    SC_CQ_INVALID: "completion queue invalid",
    SC_INVALID_QID: "invalid queue identifier",
    SC_INVALID_QUEUE_SIZE: "invalid queue size",
    SC_INVALID_VECTOR: "invalid interrupt vector",
    SC_INVALID_QUEUE_DELETION: "invalid queue deletion",
}


def status_name(status: int) -> str:
    return STATUS_NAMES.get(status, f"status {status:#x}")


def doorbell_offset(qid: int, completion: bool, dstrd: int) -> int:
    """BAR0 offset of queue ``qid``'s SQ tail (or CQ head) doorbell."""
    return DOORBELL_BASE + (2 * qid + (1 if completion else 0)) * (4 << dstrd)


def doorbell_of(offset: int, dstrd: int) -> tuple[int, bool] | None:
    """(qid, is completion doorbell) for a BAR0 offset, None when it is no doorbell."""
    stride = 4 << dstrd
    rel = offset - DOORBELL_BASE
    if rel < 0 or rel % stride:
        return None
    slot = rel // stride
    return slot // 2, bool(slot % 2)


def make_cap(*, mqes: int, dstrd: int, timeout_500ms: int = 20) -> int:
    """CAP: ``mqes`` is the zero-based maximum queue size; 4 KiB pages only; NVM command set."""
    return (
        (mqes & 0xFFFF)
        | CAP_CQR
        | (timeout_500ms & 0xFF) << CAP_TO_SHIFT
        | (dstrd & 0xF) << CAP_DSTRD_SHIFT
        | CAP_CSS_NVM
    )


def cap_mqes(cap: int) -> int:
    return cap & 0xFFFF


def cap_dstrd(cap: int) -> int:
    return cap >> CAP_DSTRD_SHIFT & 0xF


_SQE = struct.Struct("<IIQQQQIIIIII")
_CQE = struct.Struct("<IIHHHH")


class Command(msgspec.Struct, frozen=True):
    """A submission queue entry."""

    opcode: int
    cid: int = 0
    nsid: int = 0
    prp1: int = 0
    prp2: int = 0
    cdw10: int = 0
    cdw11: int = 0
    cdw12: int = 0
    cdw13: int = 0
    cdw14: int = 0
    cdw15: int = 0
    mptr: int = 0

    def encode(self) -> bytes:
        return _SQE.pack(
            (self.opcode & 0xFF) | (self.cid & 0xFFFF) << 16,
            self.nsid,
            0,  # CDW2-3 reserved
            self.mptr,
            self.prp1,
            self.prp2,
            self.cdw10,
            self.cdw11,
            self.cdw12,
            self.cdw13,
            self.cdw14,
            self.cdw15,
        )

    @classmethod
    def decode(cls, raw: bytes) -> Command:
        if len(raw) != SQE_SIZE:
            raise ValueError(f"a submission entry is {SQE_SIZE} bytes, got {len(raw)}")
        cdw0, nsid, _, mptr, prp1, prp2, c10, c11, c12, c13, c14, c15 = _SQE.unpack(raw)
        return cls(cdw0 & 0xFF, cdw0 >> 16, nsid, prp1, prp2, c10, c11, c12, c13, c14, c15, mptr)

    # NVM command fields
    @property
    def slba(self) -> int:
        return self.cdw11 << 32 | self.cdw10

    @property
    def blocks(self) -> int:
        """Number of logical blocks (NLB is zero-based in the entry)."""
        return (self.cdw12 & 0xFFFF) + 1


def io_command(
    opcode: int, cid: int, nsid: int, slba: int, blocks: int, prp1: int = 0, prp2: int = 0
) -> Command:
    if not 1 <= blocks <= 0x10000:
        raise ValueError(f"an I/O command moves 1..65536 blocks, got {blocks}")
    return Command(opcode, cid, nsid, prp1, prp2, slba & 0xFFFFFFFF, slba >> 32, blocks - 1)


class Completion(msgspec.Struct, frozen=True):
    """A completion queue entry; ``status`` without the phase bit."""

    cid: int
    status: int
    sq_id: int
    sq_head: int
    phase: int = 0
    result: int = 0
    extra: int = 0  # DW1, command specific; left out of repr

    def __repr__(self) -> str:
        shown = (f"{f}={getattr(self, f)!r}" for f in self.__struct_fields__ if f != "extra")
        return f"Completion({', '.join(shown)})"

    @property
    def ok(self) -> bool:
        return self.status == SC_SUCCESS

    def encode(self) -> bytes:
        return _CQE.pack(
            self.result,
            self.extra,
            self.sq_head,
            self.sq_id,
            self.cid,
            (self.phase & 1) | (self.status & 0x7FFF) << 1,
        )

    @classmethod
    def decode(cls, raw: bytes) -> Completion:
        if len(raw) != CQE_SIZE:
            raise ValueError(f"a completion entry is {CQE_SIZE} bytes, got {len(raw)}")
        result, extra, head, sqid, cid, sf = _CQE.unpack(raw)
        return cls(cid, sf >> 1, sqid, head, sf & 1, result, extra)
