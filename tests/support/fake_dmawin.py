"""The fake SmartIO driver's side of a child's ``dma_windows`` (docs/smartio-contract.md
section 8): the checks a write passes or the errno it fails with, and the text the driver keeps.

Written from the contract, not from vmlend's parser (``vmlend.kernel.dmafiles``), so a test
of vmlend against it checks the two against each other.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

PAGE = 4096
FOUR_GIB = 4 << 30
TOP = 1 << 52
MAX_RANGES = 64
NAMES = ("low", "high", "low+high")


class Refused(Exception):
    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code


@dataclass(frozen=True)
class Accepted:
    token: int
    windows: tuple[tuple[str, tuple[tuple[int, int], ...]], ...]  # name, (start, end) ranges

    def text(self) -> str:
        """As the driver reads it back: the token line, then hex, one space."""
        lines = [f"token {self.token}"]
        for name, ranges in self.windows:
            lines.append(" ".join([name, *(f"{s:#x} {e - s:#x}" for s, e in ranges)]))
        return "\n".join(lines) + "\n"


def number(word: str) -> int:
    """A written number (decimal or 0x-hex), ``EINVAL`` for anything else or below zero."""
    try:
        value = int(word, 0)
    except ValueError:
        raise Refused(errno.EINVAL, f"not a number: {word!r}") from None
    if value < 0:
        raise Refused(errno.EINVAL, f"negative: {word!r}")
    return value


def check(
    text: str, device_token: int, spent: int, dma_bits: int, segment_size: int | None
) -> Accepted:
    """The write ``text`` as the driver takes it, or ``Refused`` with section 8's errno."""
    lines = [ln.split() for ln in text.splitlines() if ln.strip()]
    if not lines or len(lines[0]) != 2 or lines[0][0] != "token" or not lines[0][1].isdigit():
        raise Refused(errno.EINVAL, "no 'token <decimal>' line first")
    token = int(lines[0][1])
    windows: list[tuple[str, tuple[tuple[int, int], ...]]] = []
    count, last_end = 0, -1
    for words in lines[1:]:
        name, pairs = words[0], words[1:]
        if name not in NAMES or any(name == n for n, _ in windows):
            raise Refused(errno.EINVAL, f"window {name!r} unknown or named twice")
        if not pairs or len(pairs) % 2:
            raise Refused(errno.EINVAL, f"window {name}: no '<gpa> <size>' pairs")
        ranges: list[tuple[int, int]] = []
        for i in range(0, len(pairs), 2):
            start, size = number(pairs[i]), number(pairs[i + 1])
            end = start + size
            if start % PAGE or size % PAGE or size == 0 or end > TOP:
                raise Refused(errno.EINVAL, f"range {start:#x}+{size:#x} unaligned or empty")
            if start <= last_end:
                raise Refused(errno.EINVAL, f"range {start:#x} out of order or touching")
            if (name == "low" and end > FOUR_GIB) or (name == "high" and start < FOUR_GIB):
                raise Refused(errno.EINVAL, f"range {start:#x}-{end:#x} not in window {name}")
            ranges.append((start, end))
            last_end = end
        count += len(ranges)
        windows.append((name, tuple(ranges)))
    if len(windows) > 1 and any(n == "low+high" for n, _ in windows):
        raise Refused(errno.EINVAL, "low+high comes alone")
    if segment_size and len(windows) == 2:
        low_end, high_start = windows[0][1][-1][1], windows[1][1][0][0]
        if -(-low_end // segment_size) > high_start // segment_size:
            raise Refused(errno.EINVAL, "low and high would share a segment")
    if count > MAX_RANGES:
        raise Refused(errno.E2BIG, f"{count} ranges")
    if windows and last_end > 1 << dma_bits:
        raise Refused(errno.ERANGE, f"RAM ends at {last_end:#x}, past the device's reach")
    if token < device_token or token <= spent:
        raise Refused(errno.ESTALE, f"token {token} older than the device's {device_token}")
    return Accepted(token, tuple(windows))


def state_text(accepted: Accepted | None, adapter: int, segment_size: int) -> str:
    """``dma_state`` after a Bus Master enable the fake grants: every written range mapped,
    each window's segments numbered from 0 as a fresh adapter window would give them; or the
    refusal when nothing was written."""
    if accepted is None or not accepted.windows:
        return "refused ENODATA no DMA windows were written for this child\n"
    lines, next_segment = ["mapped"], 0
    for name, ranges in accepted.windows:
        first = ranges[0][0] // segment_size
        last = -(-ranges[-1][1] // segment_size)
        segments = list(range(next_segment, next_segment + last - first))
        next_segment += len(segments)
        pairs = " ".join(f"{s:#x} {e - s:#x}" for s, e in ranges)
        lines.append(f"{name} {adapter} {','.join(map(str, segments))} {pairs}")
    return "\n".join(lines) + "\n"
