"""The mdev child's peer-to-peer files (docs/smartio-contract.md section 8), as text: pure.

``guest_bars`` (r) is where the guest decodes the child's memory BARs now::

    1 0x9000000000 0x800000000

``p2p`` (rw) is what vmlend writes to a source's child: the hold's token, then one line per
BAR of another device of the VM that the source must reach (``<target fdid> <bar> <gpa>
<size>``); the driver reads it back normalised. ``p2p_state`` (r) is what the driver mapped:
the same four words, then the case (``vmlend.p2p``'s names), the source lender's adapter and
the segments the map uses (both ``-`` for ``same-lender``).

Nothing here reads or writes a file; ``compare_maps`` says in one line each what differs
between ``p2p_state`` and what ``plan_p2p`` computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import msgspec

from vmlend.errors import P2PError, SysfsAttributeError
from vmlend.kernel.dmafiles import CHECK, MAX_WRITE, word_number
from vmlend.p2p import BORROWER_LOCAL, OTHER_LENDER, SAME_LENDER, GuestBar, P2PMap
from vmlend.topology.parse import MAX_ADDRESS

GUEST_BARS_FILE = "guest_bars"
P2P_FILE = "p2p"
P2P_STATE_FILE = "p2p_state"
#: The most maps one ``p2p`` write may carry (they fit one page).
MAX_MAPS = 64
CASES = (SAME_LENDER, BORROWER_LOCAL, OTHER_LENDER)
#: BAR indexes a type-0 config header has.
BAR_INDEXES = range(6)



class P2PLine(msgspec.Struct, frozen=True, order=True):
    """One line of ``p2p``: the source reaches BAR ``bar`` of ``target`` at IOVA ``gpa``."""

    target: int
    bar: int
    gpa: int
    size: int

    @property
    def key(self) -> str:
        """As ``P2PMap.key``: one per target BAR."""
        return f"{self.target:#x}/bar{self.bar}"

    def describe(self) -> str:
        return f"{self.key} at {self.gpa:#x}+{self.size:#x}"


class WrittenP2P(msgspec.Struct, frozen=True):
    """``p2p`` as read back: the token it was written under and the maps in place."""

    token: int
    lines: tuple[P2PLine, ...]


class MapState(msgspec.Struct, frozen=True):
    """One line of ``p2p_state``. ``adapter`` and ``segments`` are None for ``same-lender``."""

    line: P2PLine
    case: str
    adapter: int | None
    segments: tuple[int, ...] | None

    def describe(self) -> str:
        where = "" if self.adapter is None else f" adapter {self.adapter} segments {self.segments}"
        return f"{self.line.describe()} {self.case}{where}"


# --- what vmlend writes -------------------------------------------------------------------------
def lines_for(maps: Sequence[P2PMap]) -> tuple[P2PLine, ...]:
    """The ``p2p`` lines of one source's planned maps, by target and BAR."""
    return tuple(sorted(P2PLine(m.target, m.bar, m.iova, m.size) for m in maps))


def format_p2p(token: int, lines: Sequence[P2PLine]) -> str:
    """The text of a ``p2p`` write; ``P2PError`` for more than 64 maps (the driver's
    ``E2BIG``). The token line alone removes every map."""
    if token < 0:
        raise ValueError(f"a fencing token is not negative, got {token}")
    if len(lines) > MAX_MAPS:
        raise P2PError(
            f"{len(lines)} peer-to-peer maps for one device; a SmartIO driver takes at most"
            f" {MAX_MAPS} (docs/smartio-contract.md section 8): give the VM fewer devices"
        )
    out = [f"token {token}"]
    out += [f"{ln.target:#x} {ln.bar} {ln.gpa:#x} {ln.size:#x}" for ln in lines]
    text = "\n".join(out) + "\n"
    if len(text) > MAX_WRITE:  # 64 lines of the longest numbers fit: a bug if reached
        raise P2PError(f"the peer-to-peer maps take {len(text)} bytes, over one page")
    return text


# --- what the driver says -----------------------------------------------------------------------
def _bar_index(path: Path, word: str, n: int) -> int:
    if not word.isdigit() or int(word) not in BAR_INDEXES:
        raise SysfsAttributeError(path, f"line {n}: expected a BAR index 0-5, got {word!r}", CHECK)
    return int(word)


def _range(path: Path, gpa_word: str, size_word: str, n: int) -> tuple[int, int]:
    gpa = word_number(path, gpa_word, "an address")
    size = word_number(path, size_word, "a size")
    if size <= 0 or gpa + size > MAX_ADDRESS:
        raise SysfsAttributeError(
            path, f"line {n}: BAR {gpa_word}+{size_word} is empty or past 2^52", CHECK
        )
    return gpa, size


def _words(text: str) -> list[list[str]]:
    return [w for w in (ln.split() for ln in text.splitlines()) if w]


def parse_guest_bars(text: str, fdid: int, path: Path) -> tuple[GuestBar, ...]:
    """``guest_bars`` of device ``fdid``'s child: one ``<index> <gpa> <size>`` per memory BAR
    the guest decodes, in index order; empty while nothing is decoded."""
    out: list[GuestBar] = []
    for n, w in enumerate(_words(text), 1):
        if len(w) != 3:
            raise SysfsAttributeError(path, f"line {n}: expected '<index> <gpa> <size>'", CHECK)
        index = _bar_index(path, w[0], n)
        if out and index <= out[-1].index:
            raise SysfsAttributeError(path, f"line {n}: BAR {index} out of order or twice", CHECK)
        gpa, size = _range(path, w[1], w[2], n)
        out.append(GuestBar(fdid, index, gpa, size))
    return tuple(out)


def _line(path: Path, w: Sequence[str], n: int) -> P2PLine:
    target = word_number(path, w[0], "a target fdid")
    gpa, size = _range(path, w[2], w[3], n)
    return P2PLine(target, _bar_index(path, w[1], n), gpa, size)


def _unique(path: Path, lines: Sequence[P2PLine]) -> None:
    seen: set[str] = set()
    for n, ln in enumerate(lines, 1):
        if ln.key in seen:
            raise SysfsAttributeError(path, f"map {n}: {ln.key} listed twice", CHECK)
        seen.add(ln.key)


def parse_p2p(text: str, path: Path) -> WrittenP2P | None:
    """``p2p`` as the driver reads it back; None while nothing was written (empty)."""
    words = _words(text)
    if not words:
        return None
    head = words[0]
    if len(head) != 2 or head[0] != "token" or not head[1].isdigit():
        raise SysfsAttributeError(path, "line 1: expected 'token <decimal>'", CHECK)
    lines: list[P2PLine] = []
    for n, w in enumerate(words[1:], 2):
        if len(w) != 4:
            raise SysfsAttributeError(
                path, f"line {n}: expected '<target fdid> <bar> <gpa> <size>'", CHECK
            )
        lines.append(_line(path, w, n))
    _unique(path, lines)
    return WrittenP2P(int(head[1]), tuple(lines))


def parse_p2p_state(text: str, path: Path) -> tuple[MapState, ...]:
    """``p2p_state``: one ``<target fdid> <bar> <gpa> <size> <case> <adapter> <segments>``
    per map in place; empty when none is."""
    out: list[MapState] = []
    for n, w in enumerate(_words(text), 1):
        if len(w) != 7:
            raise SysfsAttributeError(
                path,
                f"line {n}: expected '<target fdid> <bar> <gpa> <size> <case> <adapter>"
                " <segments>'",
                CHECK,
            )
        line = _line(path, w, n)
        case = w[4]
        if case not in CASES:
            raise SysfsAttributeError(
                path, f"line {n}: unknown case {case[:20]!r} ({', '.join(CASES)})", CHECK
            )
        if (w[5] == "-") != (w[6] == "-"):
            raise SysfsAttributeError(
                path, f"line {n}: adapter and segments are both '-' or neither", CHECK
            )
        if (w[5] == "-") != (case == SAME_LENDER):
            raise SysfsAttributeError(
                path, f"line {n}: adapter and segments are '-' exactly for {SAME_LENDER}", CHECK
            )
        adapter = segments = None
        if w[5] != "-":
            adapter = word_number(path, w[5], "an adapter index")
            words = w[6].split(",")
            if not all(s.isdigit() for s in words):
                raise SysfsAttributeError(
                    path, f"line {n}: expected comma-separated segment indices or '-'", CHECK
                )
            segments = tuple(int(s) for s in words)
        out.append(MapState(line, case, adapter, segments))
    _unique(path, [s.line for s in out])
    return tuple(out)


class P2PReport(msgspec.Struct, frozen=True):
    """What the driver says about one child's peer-to-peer: where the guest decodes its BARs,
    the maps written (None: none) and in place; ``damaged``: why a file could not be read."""

    bars: tuple[GuestBar, ...] = ()
    written: WrittenP2P | None = None
    state: tuple[MapState, ...] = ()
    damaged: str = ""


# --- comparing ----------------------------------------------------------------------------------
class P2PDifference(msgspec.Struct, frozen=True):
    """One difference of one child of a running VM, as one line. ``rewrite``: planning and
    writing ``p2p`` again repairs it."""

    fdid: int
    mdev: str
    line: str
    rewrite: bool = False


def compare_maps(planned: Sequence[P2PMap], state: Sequence[MapState]) -> list[str]:
    """What differs between one source's planned maps and its ``p2p_state``, one line each
    (empty: they agree). Adapter and segments are the driver's to choose; the case is not."""
    want = {m.key: m for m in planned}
    have = {s.line.key: s for s in state}
    out: list[str] = []
    for key in sorted(want.keys() - have.keys()):
        m = want[key]
        out.append(
            f"no peer-to-peer map to {key} (the guest decodes it at {m.iova:#x}+{m.size:#x},"
            f" {m.case})"
        )
    for key in sorted(have.keys() - want.keys()):
        out.append(
            f"a peer-to-peer map to {have[key].line.describe()} that the guest's BARs do not"
            " call for"
        )
    for key in sorted(want.keys() & have.keys()):
        m, s = want[key], have[key]
        if (m.iova, m.size) != (s.line.gpa, s.line.size):
            out.append(
                f"the peer-to-peer map to {key} is at {s.line.gpa:#x}+{s.line.size:#x}, the"
                f" guest decodes it at {m.iova:#x}+{m.size:#x}"
            )
        if m.case != s.case:
            out.append(f"the peer-to-peer map to {key} is {s.case}, vmlend plans {m.case}")
    return out


def segments_by_adapter(state: Sequence[MapState]) -> dict[int, set[int]]:
    """The distinct segments each adapter's maps use (shared chunks counted once)."""
    out: dict[int, set[int]] = {}
    for s in state:
        if s.adapter is not None and s.segments is not None:
            out.setdefault(s.adapter, set()).update(s.segments)
    return out


def over_segments(used: dict[str, set[int]], claimed: dict[str, int]) -> list[str]:
    """Each adapter (ref) whose maps use more distinct segments than the VM's P2P claims
    there, one line each."""
    return [
        f"the peer-to-peer maps use {len(segs)} segment(s) of {ref}, the VM's P2P claims"
        f" {claimed.get(ref, 0)}"
        for ref, segs in sorted(used.items())
        if len(segs) > claimed.get(ref, 0)
    ]
