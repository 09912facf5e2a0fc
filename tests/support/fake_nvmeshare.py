"""The fake SmartIO driver's side of a share child's ``nvme_share`` (docs/smartio-contract.md
section 7, "Per share"): the checks a write passes or the errno it fails with, and what the
drive's manager runs.

Written from the contract, not from vmlend's parser (``vmlend.kernel.sharefiles``), so a test
of vmlend against it checks the two against each other.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

from tests.support.fake_dmawin import Refused, number

ORDER = ("queues", "vectors", "lba", "asid", "cmb")


@dataclass(frozen=True)
class Run:
    """One share the manager runs (what ``nvme_shares`` lists)."""

    epoch: int
    first_qid: int
    queue_pairs: int
    vector_base: int
    vectors: int
    lba: int
    blocks: int
    asid: int
    cmb: tuple[int, int] | None = None

    def lines(self) -> list[str]:
        out = [
            f"queues {self.first_qid} {self.queue_pairs}",
            f"vectors {self.vector_base} {self.vectors}",
            f"lba {self.lba:#x} {self.blocks:#x}",
            f"asid {self.asid}",
        ]
        if self.cmb is not None:
            out.append(f"cmb {self.cmb[0]:#x} {self.cmb[1]:#x}")
        return out

    def same_share(self, other: Run) -> bool:
        """The same allocation (a newer epoch of it is a hot move, not another share)."""
        return self.lines() == other.lines()

    def listed(self, uuid: str) -> str:
        return (
            f"{uuid} {self.epoch} {self.first_qid} {self.queue_pairs} {self.vector_base}"
            f" {self.vectors} {self.lba:#x} {self.blocks:#x} {self.asid}"
        )


def parse(text: str) -> tuple[int, Run | None]:
    """A write: its epoch, and the share (None: the epoch alone, a clear); ``EINVAL``."""
    lines = text.splitlines()
    if not lines:
        raise Refused(errno.EINVAL, "empty")
    head = lines[0].split(" ")
    if len(head) != 2 or head[0] != "epoch":
        raise Refused(errno.EINVAL, "no epoch line first")
    epoch = number(head[1])
    if len(lines) == 1:
        return epoch, None
    seen: dict[str, list[int]] = {}
    at = 0
    for line in lines[1:]:
        words = line.split(" ")
        if words[0] not in ORDER[at:]:
            raise Refused(errno.EINVAL, f"line out of order or unknown: {line!r}")
        at = ORDER.index(words[0]) + 1
        if len(words) != (2 if words[0] == "asid" else 3):
            raise Refused(errno.EINVAL, f"wrong number of words: {line!r}")
        seen[words[0]] = [number(w) for w in words[1:]]
    if any(k not in seen for k in ORDER[:4]):
        raise Refused(errno.EINVAL, "a line is missing")
    (q, p), (vb, v), (lba, blocks), (asid,) = (seen[k] for k in ORDER[:4])
    if not p or not v or not blocks or not asid or not q or not vb:
        raise Refused(errno.EINVAL, "a count, the first queue id, vector or tag is 0")
    if lba + blocks > 1 << 64:
        raise Refused(errno.EINVAL, "the LBA window ends past 2^64")
    cmb = seen.get("cmb")
    return epoch, Run(
        epoch, q, p, vb, v, lba, blocks, asid, None if cmb is None else (cmb[0], cmb[1])
    )


def _overlap(a: int, alen: int, b: int, blen: int) -> bool:
    return a < b + blen and b < a + alen


def check(run: Run, uuid: str, runs: dict[str, Run], queue_pairs: int, vectors: int) -> None:
    """A share against the controller (``ERANGE``), the other shares (``EEXIST``) and this
    child's own running share (``EBUSY`` for other values)."""
    if run.first_qid + run.queue_pairs - 1 > queue_pairs or run.vector_base + run.vectors > vectors:
        raise Refused(errno.ERANGE, "beyond the controller's queue ids or vectors")
    mine = runs.get(uuid)
    if mine is not None and not mine.same_share(run):
        raise Refused(errno.EBUSY, "the child runs another share")
    for other_uuid, o in runs.items():
        if other_uuid == uuid:
            continue
        if (
            _overlap(run.first_qid, run.queue_pairs, o.first_qid, o.queue_pairs)
            or _overlap(run.vector_base, run.vectors, o.vector_base, o.vectors)
            or _overlap(run.lba, run.blocks, o.lba, o.blocks)
            or run.asid == o.asid
        ):
            raise Refused(errno.EEXIST, f"overlaps the share of {other_uuid}")
