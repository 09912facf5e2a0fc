"""A share child's files (docs/smartio-contract.md section 7, "Per share"), as text: pure.

``smartio/nvme_share`` (rw) of a ``smartio-nvme_share`` child is what vmlend writes after it
creates the child: the share's epoch (its fencing token), then what the registry allocated
it (``vmlend.nvme.shares.Share``)::

    epoch 0
    queues 2 4
    vectors 1 4
    lba 0x0 0x200000
    asid 1

``queues <first> <count>``: the real I/O queue ids ``first`` .. ``first + count - 1``
(``Share.real_qid(1)`` onwards); ``vectors <first> <count>``: the real MSI-X vectors;
``lba <start> <blocks>``: the share's LBA window on namespace 1; ``asid <tag>``: the address
space its DMA is tagged with; ``cmb <offset> <bytes>`` (only for a share with one): its extent
of the drive's controller memory buffer. The ``epoch`` line alone clears the share.

``smartio/nvme_share_state`` (r) is what the driver runs for the child: ``none``, or
``active`` followed by the same lines as the driver holds them and ``msi <mapped> <target>``.
The device's ``nvme_shares`` (r) lists every share the drive's manager runs, one line each.

Nothing here reads or writes a file: ``vmlend.kernel.nvmeshare`` does.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from vmlend.errors import SysfsAttributeError

if TYPE_CHECKING:
    from vmlend.nvme.shares import Share

#: The share child's files, in its ``smartio/`` group (section 8's group).
SHARE_FILE = "nvme_share"
SHARE_STATE_FILE = "nvme_share_state"
#: The device's list of the shares its manager runs (in ``smartio-<fdid>/``).
SHARES_FILE = "nvme_shares"
#: Whom a malformed file blames.
CHECK = "the SmartIO driver against docs/smartio-contract.md section 7 ('dmesg')"

_NUMBER = re.compile(r"0[xX][0-9a-fA-F]+|[0-9]+")
#: Line names of a share, in the order they are written.
_FIELDS = ("queues", "vectors", "lba", "asid", "cmb")


class ShareValues(msgspec.Struct, frozen=True):
    """What one share child's ``nvme_share`` says: the share's epoch and its allocation."""

    epoch: int
    first_qid: int
    queue_pairs: int
    vector_base: int
    vectors: int
    lba_start: int
    blocks: int
    asid: int
    cmb: tuple[int, int] | None = None  # (offset, bytes)


class ShareState(msgspec.Struct, frozen=True):
    """``nvme_share_state``: None values for ``none``; else what runs and how many of its
    vectors reach the VM as MSI across the NTB (``msi_target`` None while none does)."""

    values: ShareValues | None
    msi_mapped: int = 0
    msi_target: int | None = None

    @property
    def active(self) -> bool:
        return self.values is not None


def share_values(share: Share, epoch: int) -> ShareValues:
    """What vmlend writes for ``share`` under ``epoch``. A share of one path only: a backup
    path's relay rings live in its VM's host memory (refused before, by the backend)."""
    if share.paths != 1:
        raise ValueError(f"share {share.name!r} has {share.paths} paths; the driver runs one")
    return ShareValues(
        epoch,
        share.real_qid(1),
        share.queue_pairs,
        share.vector_base,
        share.queue_pairs,
        share.lba_offset,
        share.blocks,
        share.asid,
        share.cmb_extent,
    )


def format_share(v: ShareValues) -> str:
    lines = [
        f"epoch {v.epoch}",
        f"queues {v.first_qid} {v.queue_pairs}",
        f"vectors {v.vector_base} {v.vectors}",
        f"lba {v.lba_start:#x} {v.blocks:#x}",
        f"asid {v.asid}",
    ]
    if v.cmb is not None:
        lines.append(f"cmb {v.cmb[0]:#x} {v.cmb[1]:#x}")
    return "\n".join(lines) + "\n"


def format_clear(epoch: int) -> str:
    """The write that ends a share's run at the driver (its queues deleted, its guard and
    MSI unprogrammed): the epoch alone."""
    return f"epoch {epoch}\n"


def _bad(where: Path | str, problem: str) -> SysfsAttributeError:
    return SysfsAttributeError(where, problem, CHECK)


def _number(word: str, where: Path | str) -> int:
    if not _NUMBER.fullmatch(word):
        raise _bad(where, f"{word!r} is not a number")
    return int(word, 0)


def _parse_lines(lines: list[str], where: Path | str) -> ShareValues | None:
    """``epoch`` then the share's lines (None: the epoch alone, a cleared share)."""
    if not lines or lines[0].split()[:1] != ["epoch"] or len(lines[0].split()) != 2:
        raise _bad(where, "the first line is not 'epoch <number>'")
    epoch = _number(lines[0].split()[1], where)
    if len(lines) == 1:
        return None
    got: dict[str, tuple[int, ...]] = {}
    for line in lines[1:]:
        words = line.split()
        name = words[0] if words else ""
        want = 1 if name == "asid" else 2
        if name not in _FIELDS or len(words) != want + 1:
            raise _bad(where, f"line {line!r} is not a share line")
        if name in got or any(f in got for f in _FIELDS[_FIELDS.index(name) + 1 :]):
            raise _bad(where, f"line {line!r} is repeated or out of order")
        got[name] = tuple(_number(w, where) for w in words[1:])
    missing = [f for f in _FIELDS[:4] if f not in got]
    if missing:
        raise _bad(where, f"no {', '.join(missing)} line")
    cmb = got.get("cmb")
    (first, pairs), (vbase, vectors), (lba, blocks) = got["queues"], got["vectors"], got["lba"]
    return ShareValues(
        epoch,
        first,
        pairs,
        vbase,
        vectors,
        lba,
        blocks,
        got["asid"][0],
        None if cmb is None else (cmb[0], cmb[1]),
    )


def parse_share(text: str, where: Path | str) -> tuple[int, ShareValues | None]:
    """``nvme_share`` as read back: its epoch and the share (None: cleared). A file never
    written reads empty: epoch 0, no share."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return 0, None
    values = _parse_lines(lines, where)
    return (values.epoch if values is not None else _number(lines[0].split()[1], where)), values


def parse_share_state(text: str, where: Path | str) -> ShareState:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if lines == ["none"]:
        return ShareState(None)
    if not lines or lines[0] != "active":
        raise _bad(where, "the first line is neither 'none' nor 'active'")
    msi = lines[-1].split()
    if len(msi) != 3 or msi[0] != "msi":
        raise _bad(where, "the last line is not 'msi <mapped> <target>'")
    values = _parse_lines(lines[1:-1], where)
    if values is None:
        raise _bad(where, "'active' without the share's lines")
    mapped = _number(msi[1], where)
    target = None if msi[2] == "-" else _number(msi[2], where)
    return ShareState(values, mapped, target)


def compare_state(written: ShareValues, state: ShareState) -> str:
    """One line saying how what the driver runs differs from what vmlend wrote ("" equal)."""
    if state.values is None:
        return "the driver runs no share for it"
    if state.values != written:
        return f"the driver runs {summary(state.values)}, vmlend wrote {summary(written)}"
    return ""


def parse_shares(text: str, where: Path | str) -> dict[str, ShareValues]:
    """The device's ``nvme_shares``: per share child's UUID, what the drive's manager runs.
    One line each: ``<uuid> <epoch> <first qid> <queue pairs> <first vector> <vectors>
    <lba start> <blocks> <asid>``."""
    out: dict[str, ShareValues] = {}
    for line in text.splitlines():
        words = line.split()
        if not words:
            continue
        if len(words) != 9:
            raise _bad(where, f"line {line!r} is not '<uuid>' and 8 numbers")
        e, q, p, vb, v, lba, blocks, asid = (_number(w, where) for w in words[1:])
        out[words[0].lower()] = ShareValues(e, q, p, vb, v, lba, blocks, asid)
    return out


# --- reconcile: a share child's files against the registry's share --------------------------
class ShareReport(msgspec.Struct, frozen=True):
    """A share child's files as read: the epoch of its ``nvme_share`` and the share written
    there (None: cleared, or never written: epoch 0), what the driver runs (None: no
    ``nvme_share_state``), and, when a file is malformed, why (the rest is then unknown)."""

    epoch: int = 0
    written: ShareValues | None = None
    state: ShareState | None = None
    damaged: str = ""


class ShareDifference(msgspec.Struct, frozen=True):
    """How a share child differs from the registry's share, in one line; ``rewrite``: a write
    of the registry's share under the same epoch repairs it."""

    line: str
    rewrite: bool


def summary(v: ShareValues) -> str:
    """A share's values in one line, as ``nvme_share`` names them."""
    return "; ".join(format_share(v).strip().splitlines())


def runs(report: ShareReport) -> str:
    """What a child's files say it runs, in a few words (for a child the registry has no
    share for)."""
    if report.damaged:
        return f"has damaged share files ({report.damaged})"
    if report.state is not None and report.state.values is not None:
        return f"runs a share ({summary(report.state.values)})"
    if report.written is not None:
        return f"has a share written ({summary(report.written)}) that the driver does not run"
    return "runs no share"


def compare_share(expected: ShareValues, report: ShareReport) -> ShareDifference | None:
    """A running VM's share child against the registry's share (``share_values`` of it under
    its epoch): None when the child has it written and the driver runs it. Another epoch is
    not rewritten: a newer one at the child is refused by the driver, an older one means the
    registry's share moved on (a hot move's hand-over) and is the move's to finish."""
    if report.damaged:
        return ShareDifference(f"its share files are damaged: {report.damaged}", False)
    if report.epoch != expected.epoch and (report.written is not None or report.epoch):
        return ShareDifference(
            f"its nvme_share has epoch {report.epoch}, the registry's share epoch {expected.epoch}",
            False,
        )
    if report.written is None:
        return ShareDifference(
            f"its nvme_share has no share written, the registry's is {summary(expected)}", True
        )
    if report.written != expected:
        return ShareDifference(
            f"its nvme_share says {summary(report.written)}, the registry's share is"
            f" {summary(expected)}",
            True,
        )
    if report.state is not None and (line := compare_state(expected, report.state)):
        return ShareDifference(line, True)
    return None
