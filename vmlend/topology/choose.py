"""Choosing devices by what they are, as Nova and KubeVirt users ask for them: ``gpu``,
``gpu:2``, ``nvme,lender=alpha``. Pure: over the topology and the devices' states.

Among the available devices of the wanted kind (and lender), the choice prefers the shortest
PCIe path from the VM's node (the device's DMA into the VM's RAM: hops, then root complexes,
then NTB latency); for several devices in one request it also prefers the set whose
peer-to-peer paths between them are shortest (devices under one lender turn below its root
complex instead of crossing the NTB twice). Ties go to the lowest fdids, so the same state
always gives the same choice.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Sequence

import msgspec

from vmlend.errors import ConfigError, NoDeviceToChooseError
from vmlend.topology.model import DeviceState, DeviceStatus, Topology, format_fdid
from vmlend.topology.pcie import PciePath, device_to_device, device_to_ram

#: Larger requests are chosen greedily instead of by comparing every set.
MAX_SETS = 20_000

_WISH = re.compile(r"^(?P<kind>[a-z][a-z0-9_-]*)(?::(?P<count>\d+))?(?P<attrs>(?:,[^,]+)*)$")


class DeviceWish(msgspec.Struct, frozen=True):
    """``count`` available devices of ``kind`` (from ``lender`` when given)."""

    kind: str
    count: int = 1
    lender: str | None = None

    def __str__(self) -> str:
        lender = f",lender={self.lender}" if self.lender else ""
        return f"{self.kind}:{self.count}{lender}"


class Choice(msgspec.Struct, frozen=True):
    """One chosen device and the cost of its DMA path into the VM's RAM."""

    fdid: int
    kind: str
    lender: str
    path: PciePath

    def describe(self) -> str:
        p = self.path
        return (
            f"{format_fdid(self.fdid)} ({self.kind} on {self.lender}): {p.hops} hops,"
            f" {p.roots} root complex(es), +{p.added_ns} ns"
        )

    def to_json(self) -> dict[str, object]:
        return {
            "fdid": format_fdid(self.fdid),
            "kind": self.kind,
            "lender": self.lender,
            "hops": self.path.hops,
            "roots": self.path.roots,
            "added_ns": self.path.added_ns,
        }


def parse_wish(text: str) -> DeviceWish | None:
    """``gpu``, ``gpu:2``, ``nvme,lender=alpha`` -> a wish; None for anything that starts like
    a device id (a digit), which the caller parses as one. ``ConfigError`` for a bad wish."""
    text = text.strip()
    if not text or text[0].isdigit():
        return None
    m = _WISH.match(text.lower())
    if not m:
        raise ConfigError(
            f"bad device {text!r}: give an fdid (0x10) or a kind with an optional count and"
            " lender (gpu, gpu:2, nvme,lender=alpha)"
        )
    count = int(m["count"] or 1)
    if not 1 <= count <= 64:
        raise ConfigError(f"bad device {text!r}: ask for 1 to 64 devices of a kind")
    lender = None
    for attr in filter(None, m["attrs"].split(",")):
        key, eq, value = attr.partition("=")
        if key != "lender" or not eq or not value:
            raise ConfigError(
                f"bad device {text!r}: {attr!r} is not an attribute vmlend chooses by (lender=NODE)"
            )
        lender = value
    return DeviceWish(m["kind"], count, lender)


def _choice(topology: Topology, st: DeviceStatus, node: str) -> Choice:
    return Choice(st.fdid, st.spec.kind, st.spec.lender, device_to_ram(topology, st.fdid, node))


def _ram_cost(path: PciePath) -> tuple[int, int, int]:
    return (path.hops, path.roots, path.added_ns)


def _p2p_cost(topology: Topology, fdids: Sequence[int]) -> tuple[int, int]:
    hops = roots = 0
    for a, b in itertools.combinations(fdids, 2):
        p = device_to_device(topology, a, b)
        hops += p.hops
        roots += p.roots
    return (hops, roots)


def _pick(
    topology: Topology, wish: DeviceWish, candidates: list[Choice], taken: Sequence[int]
) -> list[Choice]:
    """The best ``wish.count`` of ``candidates`` (sorted by RAM path, then fdid)."""
    n = wish.count
    sets = 1
    for i in range(n):
        sets = sets * (len(candidates) - i) // (i + 1)
    if sets <= MAX_SETS:
        best = min(
            itertools.combinations(candidates, n),
            key=lambda c: (
                tuple(map(sum, zip(*(_ram_cost(x.path) for x in c), strict=True))),
                _p2p_cost(topology, [x.fdid for x in (*c,)] + list(taken)),
                [x.fdid for x in c],
            ),
        )
        return list(best)
    chosen: list[Choice] = []
    pool = list(candidates)
    while len(chosen) < n:
        have = [c.fdid for c in chosen] + list(taken)
        nxt = min(
            pool,
            key=lambda c: (_ram_cost(c.path), _p2p_cost(topology, [c.fdid, *have]), c.fdid),
        )
        chosen.append(nxt)
        pool.remove(nxt)
    return chosen


def choose(
    topology: Topology,
    statuses: Iterable[DeviceStatus],
    wishes: Sequence[DeviceWish],
    node: str,
    *,
    exclude: Iterable[int] = (),
) -> list[Choice]:
    """Devices for every wish, for a VM on ``node``, none of ``exclude`` and none twice.
    ``NoDeviceToChooseError`` names what is missing and why (held, lent by nobody)."""
    topology.node(node)
    statuses = list(statuses)
    taken = list(exclude)
    out: list[Choice] = []
    kinds = sorted({st.spec.kind for st in statuses})
    for wish in wishes:
        if wish.kind not in kinds:
            raise ConfigError(
                f"no device of kind {wish.kind!r} in the fabric (its kinds: {', '.join(kinds)})"
            )
        if wish.lender is not None:
            topology.node(wish.lender)
        same_kind = [
            st
            for st in statuses
            if st.spec.kind == wish.kind and wish.lender in (None, st.spec.lender)
        ]
        free = [
            st for st in same_kind if st.state is DeviceState.AVAILABLE and st.fdid not in taken
        ]
        if len(free) < wish.count:
            busy = [
                f"{format_fdid(st.fdid)} {st.state}" + (f" by {st.holder}" if st.holder else "")
                for st in same_kind
                if st not in free
            ]
            raise NoDeviceToChooseError(str(wish), node, len(free), busy)
        candidates = sorted(
            (_choice(topology, st, node) for st in free),
            key=lambda c: (_ram_cost(c.path), c.fdid),
        )
        picked = _pick(topology, wish, candidates, taken)
        out += picked
        taken += [c.fdid for c in picked]
    return out
