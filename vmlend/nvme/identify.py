"""Identify data structures (pure): what the controller returns for Identify controller,
namespace and active namespace list, and what a driver reads back from them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vmlend.nvme import spec

if TYPE_CHECKING:
    from vmlend.sim.nvme.controller import ControllerConfig

#: Maximum data transfer: 2**MDTS pages.
MDTS = 5


def _ascii(text: str, size: int) -> bytes:
    return text.encode("ascii", "replace")[:size].ljust(size, b" ")


def identify_controller(
    config: ControllerConfig, namespaces: int, cntlid: int = 0, oacs: int = 0
) -> bytes:
    """``oacs``: the optional admin commands supported (``spec.OACS_DBBUF``)."""
    data = bytearray(spec.IDENTIFY_SIZE)
    data[0:2] = config.vendor_id.to_bytes(2, "little")
    data[2:4] = config.vendor_id.to_bytes(2, "little")
    data[4:24] = _ascii(config.serial, 20)
    data[24:64] = _ascii(config.model, 40)
    data[64:72] = _ascii("1.0", 8)
    data[77] = MDTS
    data[78:80] = cntlid.to_bytes(2, "little")
    data[80:84] = spec.VERSION_1_4.to_bytes(4, "little")
    data[256:258] = oacs.to_bytes(2, "little")
    data[512] = spec.SQES_LOG2 | spec.SQES_LOG2 << 4
    data[513] = spec.CQES_LOG2 | spec.CQES_LOG2 << 4
    data[516:520] = namespaces.to_bytes(4, "little")
    return bytes(data)


def identify_namespace(blocks: int, lba_shift: int) -> bytes:
    data = bytearray(spec.IDENTIFY_SIZE)
    for at in (0, 8, 16):  # NSZE, NCAP, NUSE
        data[at : at + 8] = blocks.to_bytes(8, "little")
    data[25] = 0  # NLBAF: one format (zero-based)
    data[26] = 0  # FLBAS: format 0
    data[128:132] = (lba_shift << 16).to_bytes(4, "little")  # LBAF0: LBADS
    return bytes(data)


def active_nsids(nsids: list[int]) -> bytes:
    data = bytearray(spec.IDENTIFY_SIZE)
    for i, nsid in enumerate(nsids[:1024]):
        data[4 * i : 4 * i + 4] = nsid.to_bytes(4, "little")
    return bytes(data)


def parse_identify_controller(data: bytes) -> dict[str, object]:
    return {
        "vendor_id": int.from_bytes(data[0:2], "little"),
        "serial": data[4:24].decode("ascii").strip(),
        "model": data[24:64].decode("ascii").strip(),
        "mdts": data[77],
        "oacs": int.from_bytes(data[256:258], "little"),
        "namespaces": int.from_bytes(data[516:520], "little"),
    }


def parse_identify_namespace(data: bytes) -> tuple[int, int]:
    """(blocks, block size)."""
    fmt = data[26] & 0xF
    lbaf = int.from_bytes(data[128 + 4 * fmt : 132 + 4 * fmt], "little")
    return int.from_bytes(data[0:8], "little"), 1 << (lbaf >> 16 & 0xFF)


def parse_active_nsids(data: bytes) -> list[int]:
    out = []
    for i in range(0, len(data), 4):
        nsid = int.from_bytes(data[i : i + 4], "little")
        if nsid == 0:
            break
        out.append(nsid)
    return out
