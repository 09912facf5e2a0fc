"""Choosing devices by what they are, as Nova and KubeVirt users ask for them: ``gpu``,
``gpu:2``, ``nvme,lender=alpha``, ``vendor=10de,product=1db4``, an alias of the configuration
file (the selectors: ``vmlend.topology.selectors``). Pure: over the topology and the devices'
states.

Among the available devices that match (kind or vendor/product, and lender), the choice
prefers the cheapest PCIe path from the VM's node (the device's DMA into the VM's RAM: its
latency over every element, the papers' figures in ``vmlend.topology.chips``, then hops, then
root complexes); for several devices in one request it also prefers the set whose
peer-to-peer paths between them cost least, in the same order (devices under one lender turn
below its root complex instead of crossing the NTB twice). Ties go to the lowest fdids, so
the same state always gives the same choice.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence

import msgspec

from vmlend.errors import ConfigError, NoDeviceToChooseError
from vmlend.topology.model import DeviceState, DeviceStatus, Topology, format_fdid
from vmlend.topology.pcie import PciePath, device_to_device, device_to_ram
from vmlend.topology.selectors import Alias, Criteria, DeviceWish, resolve

#: Larger requests are chosen greedily instead of by comparing every set.
MAX_SETS = 20_000


class Choice(msgspec.Struct, frozen=True):
    """One chosen device and the cost of its DMA path into the VM's RAM."""

    fdid: int
    kind: str
    lender: str
    path: PciePath

    def describe(self) -> str:
        p = self.path
        return (
            f"{format_fdid(self.fdid)} ({self.kind} on {self.lender}): {p.latency_ns} ns,"
            f" {p.hops} hops, {p.roots} root complex(es)"
        )

    def to_json(self) -> dict[str, object]:
        return {
            "fdid": format_fdid(self.fdid),
            "kind": self.kind,
            "lender": self.lender,
            "latency_ns": self.path.latency_ns,
            "hops": self.path.hops,
            "roots": self.path.roots,
            "added_ns": self.path.added_ns,
        }


def _choice(topology: Topology, st: DeviceStatus, node: str) -> Choice:
    return Choice(st.fdid, st.spec.kind, st.spec.lender, device_to_ram(topology, st.fdid, node))


def _cost(path: PciePath) -> tuple[int, int, int]:
    """What a path costs, compared in this order: latency, hops, root complexes."""
    return (path.latency_ns, path.hops, path.roots)


def _p2p_cost(topology: Topology, fdids: Sequence[int]) -> tuple[int, ...]:
    paths = [device_to_device(topology, a, b) for a, b in itertools.combinations(fdids, 2)]
    return tuple(map(sum, zip(*(_cost(p) for p in paths), strict=True))) if paths else (0, 0, 0)


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
                tuple(map(sum, zip(*(_cost(x.path) for x in c), strict=True))),
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
            key=lambda c: (_cost(c.path), _p2p_cost(topology, [c.fdid, *have]), c.fdid),
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
    aliases: Mapping[str, Alias] | None = None,
) -> list[Choice]:
    """Devices for every wish, for a VM on ``node``, none of ``exclude`` and none twice; a
    wish's name is one of the fabric's kinds or one of ``aliases``. ``NoDeviceToChooseError``
    names what is missing and why (held, lent by nobody); ``ConfigError`` a wish that no
    device of the fabric could ever meet."""
    topology.node(node)
    statuses = list(statuses)
    taken = list(exclude)
    out: list[Choice] = []
    kinds = {st.spec.kind for st in statuses}
    for wish in wishes:
        criteria = resolve(wish, aliases or {}, kinds)
        if criteria.lender is not None:
            topology.node(criteria.lender)
        matching = [st for st in statuses if criteria.matches(st.spec)]
        if not matching and criteria.vendor is not None:
            raise ConfigError(_no_such_ids(wish, criteria))
        free = [st for st in matching if st.state is DeviceState.AVAILABLE and st.fdid not in taken]
        if len(free) < wish.count:
            busy = [
                f"{format_fdid(st.fdid)} {st.state}" + (f" by {st.holder}" if st.holder else "")
                for st in matching
                if st not in free
            ]
            raise NoDeviceToChooseError(str(wish), node, len(free), busy)
        candidates = sorted(
            (_choice(topology, st, node) for st in free),
            key=lambda c: (_cost(c.path), c.fdid),
        )
        picked = _pick(topology, wish, candidates, taken)
        out += picked
        taken += [c.fdid for c in picked]
    return out


def _no_such_ids(wish: DeviceWish, criteria: Criteria) -> str:
    assert criteria.vendor is not None and criteria.product is not None
    ids = f"{criteria.vendor:04x}:{criteria.product:04x}"
    where = f" lent by {criteria.lender}" if criteria.lender else ""
    return (
        f"no device{where} in the fabric is {ids} (vendor:product), as {str(wish)!r} asks;"
        " 'vmlend devices --json' shows each device's vendor and device ids"
    )


def rank_shared(
    topology: Topology,
    shared: Iterable[int],
    wish: DeviceWish,
    node: str,
    *,
    aliases: Mapping[str, Alias] | None = None,
    mine: Iterable[int] = (),
) -> list[Choice]:
    """The NVMe drives lent for sharing (``shared``, their fdids) that ``wish`` matches, best
    first for a VM on ``node``: those where the VM has a share already (a re-run finds its
    share again), then by the DMA path into the VM's RAM, then by fdid. A shared drive is held
    by its manager, so ``choose``'s "available" does not apply. ``ConfigError`` when no shared
    drive matches, naming those that are shared."""
    topology.node(node)
    criteria = resolve(wish, aliases or {}, {d.kind for d in topology.devices})
    if criteria.lender is not None:
        topology.node(criteria.lender)
    fdids = sorted(set(shared))
    matching = [s for s in map(topology.device, fdids) if criteria.matches(s)]
    if not matching:
        listed = ", ".join(map(format_fdid, fdids)) or "none"
        raise ConfigError(
            f"no drive lent for sharing is {str(wish)!r} (shared: {listed}); share one with"
            " 'vmlend nvme share FDID', or name the fdid"
        )
    have = set(mine)
    choices = [
        Choice(s.fdid, s.kind, s.lender, device_to_ram(topology, s.fdid, node)) for s in matching
    ]
    return sorted(choices, key=lambda c: (c.fdid not in have, _cost(c.path), c.fdid))
