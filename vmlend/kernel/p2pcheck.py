"""``vmlend doctor``'s look at the children's peer-to-peer files (docs/smartio-contract.md
section 8), for themselves: readable, ``p2p`` reading back what ``p2p_state`` maps, and every
map leading to a BAR some child of its target decodes there now. Whether the maps are the
ones the VM needs is ``vmlend reconcile``'s check (it knows the VMs and their claims)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from vmlend.hostenv import HostEnv
from vmlend.kernel.driver import MDEV_TYPE, fdid_of
from vmlend.kernel.mdev import MdevBus
from vmlend.kernel.p2pfiles import P2PReport
from vmlend.kernel.p2pio import P2PFiles
from vmlend.topology.model import format_fdid


class P2PFindings(msgspec.Struct, frozen=True):
    children: int  # children with the peer-to-peer files
    maps: int  # maps in place
    problems: tuple[str, ...]


def judge(reports: Mapping[str, tuple[int, P2PReport]]) -> P2PFindings:
    """``reports``: child uuid -> (its device, its report). Pure."""
    decoded: set[tuple[int, int, int, int]] = set()  # (fdid, bar, gpa, size)
    for fdid, r in reports.values():
        decoded |= {(fdid, b.index, b.gpa, b.size) for b in r.bars}
    problems: list[str] = []
    maps = 0
    for uuid, (fdid, r) in sorted(reports.items()):
        where = f"mdev {uuid} (device {format_fdid(fdid)})"
        if r.damaged:
            problems.append(f"{where}: {r.damaged}")
            continue
        maps += len(r.state)
        written = () if r.written is None else r.written.lines
        if sorted(written) != sorted(s.line for s in r.state):
            problems.append(
                f"{where}: p2p reads back {len(written)} map(s), p2p_state lists"
                f" {len(r.state)}: the driver's files disagree; check 'dmesg'"
            )
        for s in r.state:
            ln = s.line
            if (ln.target, ln.bar, ln.gpa, ln.size) not in decoded:
                problems.append(
                    f"{where} keeps a peer-to-peer map to {ln.describe()}, which no child of"
                    f" {format_fdid(ln.target)} decodes there: the driver should have removed"
                    " it; run 'vmlend reconcile --fix'"
                )
    return P2PFindings(len(reports), maps, tuple(problems))


def look(env: HostEnv) -> P2PFindings | None:
    """The findings over this host's ``smartio-lend`` children; None when none has the
    peer-to-peer files (no child, or a driver from before them: the data path check says)."""
    files = P2PFiles(env)
    reports: dict[str, tuple[int, P2PReport]] = {}
    for d in MdevBus(env).devices():
        fdid = fdid_of(d.parent)
        if d.type_id != MDEV_TYPE or fdid is None:
            continue
        report = files.report(d.uuid, fdid)
        if report is not None:
            reports[d.uuid] = (fdid, report)
    return judge(reports) if reports else None


def summary(f: P2PFindings) -> str:
    return f"{f.children} children: {f.maps} peer-to-peer map(s), each to a BAR the guest decodes"


def first(problems: Sequence[str]) -> str:
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return problems[0] + more
