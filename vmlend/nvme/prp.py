"""PRP walking (pure): the memory pieces a command's PRP1/PRP2 describe.

PRP1 may start anywhere in a page (dword aligned); every later entry must be page aligned. A
transfer that fits in PRP1's page uses PRP1 alone; one that ends in the next page uses PRP2 as
that page; a longer one makes PRP2 point at a PRP list, whose last entry chains to the next
list page when more entries remain than fit. List pages are read through ``read_list`` (the
controller's DMA), so they honour the same windows and faults as the data.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from vmlend.nvme import spec

ReadMemory = Callable[[int, int], bytes]


class PrpError(ValueError):
    """A PRP entry the controller must refuse; ``status`` is the completion status."""

    def __init__(self, status: int, why: str) -> None:
        self.status = status
        super().__init__(why)


def prp_pieces(
    prp1: int, prp2: int, length: int, read_list: ReadMemory, page: int = spec.PAGE
) -> list[tuple[int, int]]:
    """(address, bytes) pieces in transfer order for ``length`` bytes."""
    if length <= 0:
        return []
    if prp1 % 4:
        raise PrpError(spec.SC_PRP_OFFSET_INVALID, f"PRP1 {prp1:#x} is not dword aligned")
    first = min(length, page - prp1 % page)
    pieces = [(prp1, first)]
    left = length - first
    if left == 0:
        return pieces
    if left <= page:
        _require_page(prp2, "PRP2", page)
        return [*pieces, (prp2, left)]
    if prp2 % 8:
        raise PrpError(spec.SC_PRP_OFFSET_INVALID, f"PRP list pointer {prp2:#x} not qword aligned")
    pages_left = -(-left // page)
    entry_at = prp2
    while left > 0:
        # entries that fit from entry_at to the end of its page
        room = (page - entry_at % page) // 8
        take = min(room, pages_left)
        chain = pages_left > room  # last slot of this list page points to the next one
        n = room if chain else take
        entries = struct.unpack(f"<{n}Q", read_list(entry_at, 8 * n))
        data = entries[:-1] if chain else entries
        for address in data:
            _require_page(address, "PRP list entry", page)
            piece = min(left, page)
            pieces.append((address, piece))
            left -= piece
            pages_left -= 1
        if chain:
            entry_at = entries[-1]
            _require_page(entry_at, "PRP list chain pointer", page)
    return pieces


def _require_page(address: int, what: str, page: int) -> None:
    if address % page:
        raise PrpError(spec.SC_PRP_OFFSET_INVALID, f"{what} {address:#x} is not page aligned")


def build_prp_list(
    pages: list[int], list_pages: list[int], page: int = spec.PAGE
) -> dict[int, bytes]:
    """What a driver writes for the data ``pages`` after the first (PRP1): the PRP list
    contents per list page address (chaining through ``list_pages`` in order). Returns
    {address of list page: bytes}."""
    per = page // 8
    out: dict[int, bytes] = {}
    rest = list(pages)
    pool = list(list_pages)
    while rest:
        if not pool:
            raise ValueError("not enough PRP list pages for the transfer")
        at = pool.pop(0)
        if len(rest) <= per:
            out[at] = struct.pack(f"<{len(rest)}Q", *rest)
            rest = []
        else:
            if not pool:
                raise ValueError("not enough PRP list pages for the transfer")
            out[at] = struct.pack(f"<{per}Q", *rest[: per - 1], pool[0])
            rest = rest[per - 1 :]
    return out


def list_pages_needed(data_pages: int, page: int = spec.PAGE) -> int:
    """PRP list pages a transfer of ``data_pages`` pages needs (0 for one or two pages)."""
    if data_pages <= 2:
        return 0
    entries = data_pages - 1
    per = page // 8
    n = 1
    while entries > per:
        entries -= per - 1
        n += 1
    return n
