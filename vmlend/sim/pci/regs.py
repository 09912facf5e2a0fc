"""Type-0 configuration space registers and bits, named as in Linux's pci_regs.h.

Only what vmlend reads or the simulator implements. Offsets inside a capability are relative to
the capability's own offset.
"""

from __future__ import annotations

CONFIG_SIZE = 4096  # PCIe extended configuration space
LEGACY_SIZE = 256  # the part reachable through classic config cycles; caps live in 0x40..0xff

# --- header -------------------------------------------------------------------------------
VENDOR_ID = 0x00
DEVICE_ID = 0x02
COMMAND = 0x04
STATUS = 0x06
REVISION_ID = 0x08
CLASS_PROG = 0x09  # 3 bytes: prog-if, subclass, base class
CACHE_LINE_SIZE = 0x0C
LATENCY_TIMER = 0x0D
HEADER_TYPE = 0x0E
BIST = 0x0F
BASE_ADDRESS_0 = 0x10
BAR_COUNT = 6
SUBSYSTEM_VENDOR_ID = 0x2C
SUBSYSTEM_ID = 0x2E
ROM_ADDRESS = 0x30
CAPABILITY_LIST = 0x34
INTERRUPT_LINE = 0x3C
INTERRUPT_PIN = 0x3D

# --- command / status ----------------------------------------------------------------------
COMMAND_IO = 0x1
COMMAND_MEMORY = 0x2
COMMAND_MASTER = 0x4
COMMAND_PARITY = 0x40
COMMAND_SERR = 0x100
COMMAND_INTX_DISABLE = 0x400

STATUS_INTERRUPT = 0x08  # INTx asserted (read-only, device driven)
STATUS_CAP_LIST = 0x10
STATUS_PARITY = 0x100  # master data parity error
STATUS_SIG_TARGET_ABORT = 0x800
STATUS_REC_TARGET_ABORT = 0x1000
STATUS_REC_MASTER_ABORT = 0x2000
STATUS_SIG_SYSTEM_ERROR = 0x4000
STATUS_DETECTED_PARITY = 0x8000
#: Error bits: set by the device, cleared by software writing 1 (RW1C).
STATUS_RW1C = (
    STATUS_PARITY
    | STATUS_SIG_TARGET_ABORT
    | STATUS_REC_TARGET_ABORT
    | STATUS_REC_MASTER_ABORT
    | STATUS_SIG_SYSTEM_ERROR
    | STATUS_DETECTED_PARITY
)

# --- BARs ----------------------------------------------------------------------------------
BAR_SPACE_IO = 0x1
BAR_MEM_TYPE_MASK = 0x6
BAR_MEM_TYPE_32 = 0x0
BAR_MEM_TYPE_64 = 0x4
BAR_MEM_PREFETCH = 0x8
BAR_MEM_FLAGS = 0xF  # low bits of a memory BAR that are not address
BAR_IO_FLAGS = 0x3

# --- capability ids ------------------------------------------------------------------------
CAP_ID_PM = 0x01
CAP_ID_MSI = 0x05
CAP_ID_EXP = 0x10
CAP_ID_MSIX = 0x11

CAP_ID = 0  # within a capability: its id byte
CAP_NEXT = 1  # and the pointer to the next one (0 ends the list)

# --- MSI (cap id 0x05) -----------------------------------------------------------------------
MSI_FLAGS = 2
MSI_FLAGS_ENABLE = 0x1
MSI_FLAGS_QMASK = 0xE  # log2 of vectors the function supports (read-only)
MSI_FLAGS_QSIZE = 0x70  # log2 of vectors software enabled
MSI_FLAGS_64BIT = 0x80
MSI_FLAGS_MASKBIT = 0x100
MSI_ADDRESS_LO = 4
MSI_ADDRESS_HI = 8  # 64-bit only
MSI_DATA_32 = 8
MSI_DATA_64 = 12
MSI_MASK_32 = 12
MSI_MASK_64 = 16
MSI_PENDING_32 = 16
MSI_PENDING_64 = 20

# --- MSI-X (cap id 0x11) ---------------------------------------------------------------------
MSIX_FLAGS = 2
MSIX_FLAGS_QSIZE = 0x7FF  # table size - 1 (read-only)
MSIX_FLAGS_MASKALL = 0x4000
MSIX_FLAGS_ENABLE = 0x8000
MSIX_TABLE = 4
MSIX_PBA = 8
MSIX_BIR = 0x7
MSIX_OFFSET_MASK = ~0x7 & 0xFFFFFFFF
MSIX_CAP_SIZE = 12
MSIX_ENTRY_SIZE = 16
MSIX_ENTRY_LOWER_ADDR = 0
MSIX_ENTRY_UPPER_ADDR = 4
MSIX_ENTRY_DATA = 8
MSIX_ENTRY_VECTOR_CTRL = 12
MSIX_ENTRY_CTRL_MASKBIT = 0x1

# --- PCI Express (cap id 0x10), endpoint, capability version 2 -----------------------------
EXP_FLAGS = 2
EXP_FLAGS_VERSION_2 = 0x2
EXP_TYPE_ENDPOINT = 0x0  # device/port type in bits 7:4
EXP_DEVCAP = 4
EXP_DEVCAP_FLR = 0x10000000
EXP_DEVCTL = 8
EXP_DEVCTL_BCR_FLR = 0x8000  # initiate function level reset; always reads 0
EXP_DEVCTL_RW = 0x7FFF  # error reporting, payload/read-request sizes, relaxed ordering...
EXP_DEVSTA = 10
EXP_DEVSTA_RW1C = 0xF  # correctable/non-fatal/fatal/unsupported request detected
EXP_LNKCAP = 12
EXP_LNKSTA = 18
EXP_CAP_SIZE = 0x3C
