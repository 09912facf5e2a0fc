"""The mdev child's DMA-window files (docs/smartio-contract.md section 8), as text: pure.

``dma_windows`` (rw) is what vmlend writes after it creates a ``smartio-lend`` child: the hold's
fencing token, then the guest's RAM as windows (``window_groups`` of its layout with the lender
adapter's segment size)::

    token 42
    low 0x0 0x80000000
    high 0x100000000 0x180000000

``dma_state`` (r) is what the driver mapped at the guest's Bus Master enable: ``none``,
``mapped`` / ``partial`` with one line per window, or ``refused <ERRNO> <reason>``.

Nothing here reads or writes a file: the driver module does that, the backend decides when,
and ``compare_windows`` (for ``vmlend reconcile`` and ``vmlend doctor``) says in one line
what differs.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from vmlend.errors import LayoutError, SysfsAttributeError
from vmlend.memory.dmarecords import refusal_record, window_record
from vmlend.memory.layout import merge_ranges
from vmlend.memory.windows import window_groups
from vmlend.topology.model import GuestRange
from vmlend.topology.parse import MAX_ADDRESS

#: The child's attribute group, and its files.
GROUP = "smartio"
WINDOWS_FILE = "dma_windows"
STATE_FILE = "dma_state"
#: The most a write may hold: sysfs hands a longer write to the driver in pieces.
MAX_WRITE = 4096
#: The most ranges one write may name (64 lines of the longest numbers fit one page).
MAX_RANGES = 64
WINDOW_NAMES = ("low", "high", "low+high")
#: The legacy window below 1 MiB: a page there that does not pin is left out of a mapping.
LEGACY = GuestRange(0xA_0000, 0x10_0000)
#: Whom a malformed file blames.
CHECK = "the SmartIO driver against docs/smartio-contract.md section 8 ('dmesg')"

_NUMBER = re.compile(r"0[xX][0-9a-fA-F]+|[0-9]+")
_ERRNO = re.compile(r"E[A-Z0-9]+")


class Window(msgspec.Struct, frozen=True):
    """One DMA window: its name and the guest-physical ranges it exposes, ascending."""

    name: str
    ranges: tuple[GuestRange, ...]


class WrittenWindows(msgspec.Struct, frozen=True):
    """``dma_windows`` as read back: the token it was written under and the windows."""

    token: int
    windows: tuple[Window, ...]


class DmaWord(enum.StrEnum):
    NONE = "none"
    MAPPED = "mapped"
    PARTIAL = "partial"
    REFUSED = "refused"


class MappedWindow(msgspec.Struct, frozen=True):
    """One line of ``dma_state``: what the device reaches of a window now. ``adapter`` and
    ``segments`` are None for a device lent by the VM's own node (no NTB crossed)."""

    name: str
    adapter: int | None
    segments: tuple[int, ...] | None
    ranges: tuple[GuestRange, ...]


class DmaState(msgspec.Struct, frozen=True):
    word: DmaWord
    windows: tuple[MappedWindow, ...] = ()
    #: For ``refused``: the errno's name (``ENODATA``...) and the driver's one-line reason.
    error: str = ""
    reason: str = ""

    def summary(self) -> str:
        """One line for ``vmlend status`` and messages."""
        if self.word is DmaWord.REFUSED:
            return f"refused {self.error}: {self.reason}"
        if not self.windows:
            return self.word.value
        return f"{self.word.value} " + "; ".join(
            f"{w.name} {format_ranges(w.ranges)}" for w in self.windows
        )


def format_ranges(ranges: Sequence[GuestRange]) -> str:
    return ",".join(f"{r.start:#x}-{r.end:#x}" for r in ranges)


# --- what vmlend writes -------------------------------------------------------------------------
def windows_for(ram: Sequence[GuestRange], segment_size: int) -> tuple[Window, ...]:
    """The windows of a guest with RAM ``ram`` behind an adapter of ``segment_size``: exactly
    the planner's (``window_groups``), so the driver maps what admission counted."""
    return tuple(Window(name, tuple(g)) for name, g in window_groups(ram, segment_size))


def format_windows(token: int, windows: Sequence[Window]) -> str:
    """The text of a ``dma_windows`` write; ``LayoutError`` when it cannot be one write (more
    than 64 ranges), as the driver would refuse it (``E2BIG``)."""
    if token < 0:
        raise ValueError(f"a fencing token is not negative, got {token}")
    count = sum(len(w.ranges) for w in windows)
    if count > MAX_RANGES:
        raise LayoutError(
            f"the guest's RAM is {count} ranges; a SmartIO driver takes at most {MAX_RANGES}"
            " (docs/smartio-contract.md section 8): use fewer memory devices"
        )
    lines = [f"token {token}"]
    for w in windows:
        lines.append(" ".join([w.name, *(f"{r.start:#x} {r.size:#x}" for r in w.ranges)]))
    text = "\n".join(lines) + "\n"
    if len(text) > MAX_WRITE:  # 64 ranges of the longest numbers fit: a bug if reached
        raise LayoutError(f"the DMA windows take {len(text)} bytes, over one page ({MAX_WRITE})")
    return text


# --- what the driver says -----------------------------------------------------------------------
def word_number(path: Path, text: str, what: str) -> int:
    """One number word of a section-8 file, decimal or 0x-hex (the driver's own format)."""
    if not _NUMBER.fullmatch(text):
        raise SysfsAttributeError(path, f"expected {what}, got {text[:40]!r}", CHECK)
    return int(text, 0) if text[:2].lower() == "0x" else int(text, 10)


def _ranges(path: Path, words: Sequence[str], n: int) -> tuple[GuestRange, ...]:
    if not words or len(words) % 2:
        raise SysfsAttributeError(path, f"line {n}: expected '<gpa> <size>' pairs", CHECK)
    out: list[GuestRange] = []
    for i in range(0, len(words), 2):
        start = word_number(path, words[i], "an address")
        size = word_number(path, words[i + 1], "a size")
        if size <= 0 or start + size > MAX_ADDRESS:
            raise SysfsAttributeError(
                path, f"line {n}: range {words[i]}+{words[i + 1]} is empty or past 2^52", CHECK
            )
        if out and start <= out[-1].end:
            raise SysfsAttributeError(
                path, f"line {n}: ranges out of order, overlapping or touching", CHECK
            )
        out.append(GuestRange(start, start + size))
    return tuple(out)


def _window_name(path: Path, name: str, n: int, seen: set[str]) -> str:
    if name not in WINDOW_NAMES:
        raise SysfsAttributeError(
            path, f"line {n}: unknown window {name[:20]!r} (low, high or low+high)", CHECK
        )
    if name in seen:
        raise SysfsAttributeError(path, f"line {n}: window {name} twice", CHECK)
    seen.add(name)
    return name


def parse_windows(text: str, path: Path) -> WrittenWindows | None:
    """``dma_windows`` as the driver reads it back; None while none are written (empty)."""
    lines = [ln.split() for ln in text.splitlines()]
    lines = [w for w in lines if w]
    if not lines:
        return None
    head = lines[0]
    if len(head) != 2 or head[0] != "token":
        raise SysfsAttributeError(path, "line 1: expected 'token <decimal>'", CHECK)
    if not head[1].isdigit():
        raise SysfsAttributeError(path, f"line 1: expected a token, got {head[1][:40]!r}", CHECK)
    seen: set[str] = set()
    windows = tuple(
        Window(_window_name(path, w[0], n, seen), _ranges(path, w[1:], n))
        for n, w in enumerate(lines[1:], 2)
    )
    return WrittenWindows(int(head[1]), windows)


def _segments(path: Path, text: str, n: int) -> tuple[int, ...] | None:
    if text == "-":
        return None
    try:
        return tuple(word_number(path, s, "a segment index") for s in text.split(","))
    except SysfsAttributeError:
        raise SysfsAttributeError(
            path, f"line {n}: expected comma-separated segment indices or '-'", CHECK
        ) from None


def parse_state(text: str, path: Path) -> DmaState:
    """``dma_state``: its state word, then (``mapped``, ``partial``) one line per window
    ``<window> <adapter> <segments> <gpa> <size> ...``; ``refused <ERRNO> <reason>``."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise SysfsAttributeError(path, "empty; expected a state word first", CHECK)
    first = lines[0].split(maxsplit=2)
    try:
        word = DmaWord(first[0])
    except ValueError:
        raise SysfsAttributeError(
            path,
            f"unknown state {first[0][:40]!r} (expected {', '.join(w.value for w in DmaWord)})",
            CHECK,
        ) from None
    if word is DmaWord.REFUSED:
        if len(first) < 3 or not _ERRNO.fullmatch(first[1]):
            raise SysfsAttributeError(path, "line 1: expected 'refused <ERRNO> <reason>'", CHECK)
        if len(lines) > 1:
            raise SysfsAttributeError(path, "a refusal is one line", CHECK)
        return DmaState(word, error=first[1], reason=first[2].strip())
    if len(first) > 1:
        raise SysfsAttributeError(path, f"line 1: '{word.value}' stands alone", CHECK)
    if word is DmaWord.NONE:
        if len(lines) > 1:
            raise SysfsAttributeError(path, "'none' maps nothing, yet windows follow", CHECK)
        return DmaState(word)
    seen: set[str] = set()
    windows: list[MappedWindow] = []
    for n, ln in enumerate(lines[1:], 2):
        w = ln.split()
        if len(w) < 5:
            raise SysfsAttributeError(
                path, f"line {n}: expected '<window> <adapter> <segments> <gpa> <size> ...'", CHECK
            )
        name = _window_name(path, w[0], n, seen)
        adapter = None if w[1] == "-" else word_number(path, w[1], "an adapter index")
        segments = _segments(path, w[2], n)
        if (adapter is None) != (segments is None):
            raise SysfsAttributeError(
                path, f"line {n}: adapter and segments are both '-' or neither", CHECK
            )
        windows.append(MappedWindow(name, adapter, segments, _ranges(path, w[3:], n)))
    if not windows:
        raise SysfsAttributeError(path, f"'{word.value}' lists no window", CHECK)
    return DmaState(word, tuple(windows))


class DmaReport(msgspec.Struct, frozen=True):
    """What the driver says about one child: its written windows (None: none written) and its
    state; ``damaged``: why a file could not be read (then both are None)."""

    written: WrittenWindows | None = None
    state: DmaState | None = None
    damaged: str = ""


class Mismatch(msgspec.Struct, frozen=True):
    """One difference, as one line that says what to do. ``rewrite``: writing the windows
    again repairs it (the driver takes a write while nothing is mapped)."""

    line: str
    rewrite: bool = False


# --- comparing ----------------------------------------------------------------------------------
def _without_legacy(ranges: Sequence[GuestRange]) -> list[GuestRange]:
    """``ranges`` less the legacy window, whose pages the driver may leave out."""
    out: list[GuestRange] = []
    for r in merge_ranges(ranges):
        if r.end <= LEGACY.start or r.start >= LEGACY.end:
            out.append(r)
            continue
        if r.start < LEGACY.start:
            out.append(GuestRange(r.start, LEGACY.start))
        if r.end > LEGACY.end:
            out.append(GuestRange(LEGACY.end, r.end))
    return out


def _describe(windows: Sequence[Window | MappedWindow]) -> str:
    return "; ".join(f"{w.name} {format_ranges(w.ranges)}" for w in windows) or "none"


def compare_windows(
    expected: Sequence[Window] | None,
    token: int | None,
    written: WrittenWindows | None,
    state: DmaState | None,
) -> list[Mismatch]:
    """What differs between what vmlend computed for a child (``expected``, None: unknown
    here; ``token``: the hold's, None: unknown) and what the driver reports, each one line
    ending in what to do. Empty: they agree."""
    out: list[Mismatch] = []
    # while windows are mapped the driver refuses other ones (EBUSY): a stop and start fixes
    mapped = state is not None and state.word in (DmaWord.MAPPED, DmaWord.PARTIAL)
    rewrite = (
        "stop the VM and start it again (the driver keeps mapped windows until then)"
        if mapped
        else "'vmlend reconcile --fix' writes them again"
    )
    if written is None:
        if expected is not None:
            out.append(
                Mismatch(
                    f"no DMA windows written (vmlend computed {_describe(expected)}): a Bus"
                    f" Master enable would be refused (ENODATA); {rewrite}",
                    not mapped,
                )
            )
    else:
        if expected is not None and tuple(written.windows) != tuple(expected):
            out.append(
                Mismatch(
                    f"the driver has DMA windows {_describe(written.windows)}, vmlend computed"
                    f" {_describe(expected)} from the VM's layout; {rewrite}",
                    not mapped,
                )
            )
        if token is not None and written.token != token:
            out.append(
                Mismatch(
                    f"the DMA windows were written under fencing token {written.token}, the"
                    f" hold's is {token}; {rewrite}",
                    not mapped,
                )
            )
    if state is None:
        return out
    if state.word is DmaWord.REFUSED:
        # ENODATA (no windows) is the one a write repairs; the others need the host's look
        out.append(
            Mismatch(
                f"the driver refused the guest's Bus Master enable: {state.error}"
                f" {state.reason}; the device reaches no guest RAM until the guest enables it"
                " again (docs/smartio-contract.md section 8, 'dma_state')",
                state.error == "ENODATA",
            )
        )
    elif mapped and written is not None:
        reached = _without_legacy([r for w in state.windows for r in w.ranges])
        wanted = _without_legacy([r for w in written.windows for r in w.ranges])
        if reached != wanted:
            out.append(
                Mismatch(
                    f"the driver maps {_describe(state.windows)} ({state.word.value}), but its"
                    f" written DMA windows are {_describe(written.windows)}: the device reaches"
                    " other guest RAM than was written; stop the VM and start it again"
                )
            )
    return out


def compare_records(recorded: Sequence[Window], state: DmaState | None) -> str | None:
    """What differs between the ``dma-window`` records vmlend keeps for a child (as windows:
    name and ranges) and what its ``dma_state`` says is mapped now, as one line; None when
    they agree (nothing recorded while nothing is mapped included). A difference means a
    ``SMARTIO_DMA`` event was lost or not acted on (``vmlend mdev watch`` not running)."""
    if state is None:
        return None
    mapped = state.windows if state.word in (DmaWord.MAPPED, DmaWord.PARTIAL) else ()
    have = {w.name: tuple(w.ranges) for w in recorded}
    want = {w.name: tuple(w.ranges) for w in mapped}
    if have == want:
        return None
    return (
        f"vmlend records DMA windows {_describe(sorted(recorded, key=lambda w: w.name))},"
        f" the driver's dma_state says {state.word.value}"
        + (f" {_describe(mapped)}" if mapped else "")
        + " (a SMARTIO_DMA event was missed: is 'vmlend mdev watch' running?)"
    )


def window_lines(windows: Sequence[Window]) -> list[str]:
    """For display: one ``name ranges`` string per window."""
    return [f"{w.name} {format_ranges(w.ranges)}" for w in windows]


# --- what vmlend keeps of it --------------------------------------------------------------------
class DmaRecords(msgspec.Struct, frozen=True):
    """What the registry keeps of one ``dma_state``: the ``dma-window`` records by window
    name (none unless mapped or partial) and the ``dma-refusal`` record's data (None unless
    refused)."""

    windows: dict[str, dict[str, Any]]
    refusal: dict[str, Any] | None = None


def state_records(
    state: DmaState, mdev: str, lender: str, segment_size: Callable[[str], int | None]
) -> DmaRecords:
    """``state`` of child ``mdev`` as runtime records (pure). ``lender`` names the device's
    lender node, so the driver's adapter index becomes the topology's ref (``lender:index``),
    as the simulator's records name it; ``segment_size`` gives that adapter's (None: the
    topology does not declare it)."""
    if state.word is DmaWord.REFUSED:
        return DmaRecords({}, refusal_record(state.error, state.reason, mdev))
    windows: dict[str, dict[str, Any]] = {}
    for w in state.windows:
        ref = None if w.adapter is None else f"{lender}:{w.adapter}"
        windows[w.name] = window_record(
            w.ranges,
            ref,
            w.segments or (),
            None if ref is None else segment_size(ref),
            state.word.value,
        )
    return DmaRecords(windows)


def mapped_segments(state: DmaState | None, lender: str) -> dict[str, set[int]]:
    """The segments ``state``'s windows use, per lender adapter (``<lender>:<index>``); a
    window without adapter or segments (no NTB crossed, or a driver that does not say) adds
    nothing."""
    out: dict[str, set[int]] = {}
    if state is None or state.word is DmaWord.REFUSED:
        return out
    for w in state.windows:
        if w.adapter is not None and w.segments is not None:
            out.setdefault(f"{lender}:{w.adapter}", set()).update(w.segments)
    return out


def segment_drift(used: dict[str, set[int]], claimed: dict[str, int]) -> list[str]:
    """One line per lender adapter where a VM's mapped DMA windows use another number of
    segments than admission claimed for them (pure). They must be equal: admission counts
    with the planner that lays the windows out. Adapters the driver reports nothing for (no
    child enabled yet) are not compared."""
    return [
        f"the driver maps the VM's DMA windows on {ref} with {len(segs)} segment(s),"
        f" admission claimed {claimed.get(ref, 0)}"
        for ref, segs in sorted(used.items())
        if len(segs) != claimed.get(ref, 0)
    ]
