"""Racing unit-block takes, explored at random (issue 38 follow-up). The etcd registry keeps an
adapter's used units as aligned power-of-two blocks, or runs that are such a block less its
last units (``EtcdTxn._take_units``); two transactions that read one snapshot and take
blocks sharing a unit must not both commit,
and ones whose blocks share none must (reserves of distinct devices must not conflict).
tests/unit/registry/test_registry_units.py holds hand-picked pairs; here hypothesis draws the
adapter's earlier state and the two takes, on a real etcd. And what a VM's unit ledger asks
for (``EtcdTxn._units_needed``) must stay what admission counts (``admission.usage`` and
``admission.port_usage``): drawn claims, both ways of counting them compared."""

from __future__ import annotations

import functools
import uuid

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from tests.support.etcd_units import taking, unit_blocks_held
from tests.support.hypothesis_tiers import examples
from tests.support.simfabric import star_topology
from vmlend.ledger.admission import port_usage, usage
from vmlend.registry.etcd_gateway import b64
from vmlend.registry.etcd_keys import Keys, aligned_size, unit_span
from vmlend.registry.etcd_txn import MAX_BLOCK, EtcdTxn
from vmlend.registry.records import Claim, ClaimKind
from vmlend.topology.model import Topology
from vmlend.topology.parse import parse_topology
from vmlend.wiring.fabric import init_fabric, open_fabric

#: The adapter's usable segments in the race (``EtcdTxn._capacity`` patched): blocks of up
#: to ``MAX_BLOCK`` (16) in 32 units, so a take's blocks can hold, sit inside or run next to
#: another's, and a take of more than 16 units takes several blocks of 16 (no block of 32
#: exists, so none is compared).
CAPACITY = 32

#: One take: ``(units asked for, hint)``, the hint being where the search for free units starts.
takes = st.tuples(st.integers(1, 20), st.integers(0, CAPACITY - 1))


def _units(blocks: list[tuple[int, int]]) -> set[int]:
    return {i for start, size in blocks for i in range(start, start + size)}


def _runs(blocks: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of adjacent blocks (what ``_take_units`` guards as one)."""
    out: list[tuple[int, int]] = []
    for start, size in sorted(blocks):
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], start + size)
        else:
            out.append((start, start + size))
    return out


def _meeting(first: list[tuple[int, int]], second: list[tuple[int, int]]) -> str:
    """How the second take's compares must see the first's blocks (for the statistics: both
    ways are explored): a block holding one of its own that starts before its run (compared
    on its own), or one starting inside its run (the run's range compare)."""
    if not _units(first) & _units(second):
        return "apart"
    for lo, _end in _runs(second):
        for start, size in first:
            if start < lo and start + size > lo:
                return "a block holding the second's, before its run"
    return "a block inside the second's run"


def _fresh_cluster(etcd_url: str) -> str:
    """A registry URL on ``etcd_url``'s etcd with a cluster (key prefix) of its own: one per
    example, so no example sees another's blocks."""
    server, _cluster = etcd_url.rsplit("/", 1)
    return f"{server}/race-{uuid.uuid4().hex[:12]}"


def _free(committed: list[tuple[int, int]]) -> int:
    return CAPACITY - len({u for u in _units(committed) if u < CAPACITY})


def _attempt(registry, take: tuple[int, int], free: int) -> tuple[EtcdTxn, list[tuple[int, int]]]:
    """``taking``, checked: exactly the units asked for, in blocks of at most ``MAX_BLOCK``,
    below the capacity all of them or every one that was ``free`` there, and no key range
    compared twice."""
    tx, picked = taking(registry, take)
    assert sum(size for _s, size in picked) == take[0]
    assert max(size for _s, size in picked) <= MAX_BLOCK
    below = sum(size for start, size in picked if start < CAPACITY)
    assert below == min(take[0], free)
    assert all(start + size <= CAPACITY for start, size in picked if start < CAPACITY)
    # each holding block compared once (from its first block's unit: the widest range)
    firsts = [c["key"] for c in tx.compares()]
    assert len(firsts) == len(set(firsts)), "a key range compared twice"
    return tx, picked


@settings(
    max_examples=examples(300),
    deadline=None,
    derandomize=True,  # CI explores the same examples every run
    database=None,
    # etcd_url's host lease and the patched capacity are the same for every example; each
    # example makes its own cluster (``_fresh_cluster``)
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    earlier=st.lists(takes, max_size=4),
    first=takes,
    second=takes,
    released=st.none() | st.integers(0, 7),
)
# always: a block of the first holding the second's and starting before its run (compared on
# its own, not by the run's range), and two single units side by side (both commit)
@example(earlier=[], first=(4, 1), second=(1, 5), released=None)
@example(earlier=[], first=(1, 1), second=(1, 0), released=None)
# a run (5 units of the aligned block 16..23) and a unit inside it: they meet only through the
# range of the runs the block names that reach the unit (an exact compare of that block's key
# missed the run: both committed); a unit after the run in that block: both commit
@example(earlier=[], first=(5, 9), second=(1, 17), released=None)
@example(earlier=[], first=(5, 9), second=(1, 21), released=None)
# a release seen by the second only: the first goes beyond the capacity, the second takes
# the unit released (a review found them both committing: three entries on two)
@example(earlier=[(16, 0), (16, 16)], first=(1, 0), second=(1, 0), released=0)
def test_two_takes_from_one_snapshot_both_commit_iff_their_blocks_share_no_unit(
    etcd_url, monkeypatch, earlier, first, second, released
):
    """After 0-4 takes committed one by one (each may go beyond the capacity: ``_beyond``),
    two transactions take blocks and commit, first then second, the second from the same
    snapshot or (``released``) from one where an earlier block was given back since: each
    takes what is free below the capacity and the rest beyond it; the first always commits,
    the second exactly when its blocks share no unit with the first's, the first went not
    beyond the capacity, and the second did not decide on the whole adapter (it goes beyond
    the capacity, or units are there already), so two that together need more than is free
    never both commit; and the blocks left in etcd are those of the committed takes and
    releases, none overlapping another."""
    monkeypatch.setattr(EtcdTxn, "_capacity", lambda self, adapter, unit: CAPACITY)
    url = _fresh_cluster(etcd_url)
    init_fabric(url, star_topology(1, 2), "star.toml")
    committed: list[tuple[int, int]] = []
    with open_fabric(url, "h0") as f:
        gw = f.registry.gateway
        for take in earlier:
            tx, picked = _attempt(f.registry, take, _free(committed))
            assert gw.txn(tx.compares(), tx.operations())[0] is True
            assert sum(size for _s, size in picked) == take[0]
            committed += picked
        free = _free(committed)
        a, picked_a = _attempt(f.registry, first, free)
        assert not _units(picked_a) & _units(committed)
        if released is not None and committed:  # a release the second sees, the first not
            gone = committed.pop(released % len(committed))
            key = f.registry.keys.unit_block("l:0", "seg", *gone)
            assert gw.txn([], [{"request_delete_range": {"key": b64(key)}}])[0] is True
            event("a block released between the two reads")
        b, picked_b = _attempt(f.registry, second, _free(committed))
        assert not _units(picked_b) & _units(committed)
        assert gw.txn(a.compares(), a.operations())[0] is True
        apart = not _units(picked_a) & _units(picked_b)
        beyond = first[0] > free  # the first took units beyond the capacity
        # beyond the capacity, or with units there already: decided on the whole adapter
        whole = second[0] > _free(committed) or any(s + z > CAPACITY for s, z in committed)
        event(f"the second and the first: {_meeting(picked_a, picked_b)}")
        if whole:
            event("the second decided on the whole adapter")
        if beyond and not whole:
            event("the first went beyond the capacity, the second not")
        both = apart and not whole and not beyond
        assert gw.txn(b.compares(), b.operations())[0] is both
    committed += picked_a + (picked_b if both else [])
    held = unit_blocks_held(url).get(("l:0", "seg"), [])
    assert held == sorted(committed)
    assert len(_units(held)) == sum(size for _s, size in held)  # no unit in two blocks


#: Claims are drawn on these adapters and switch ports of ``_topology``, with these shares
#: (few, so that claims share).
ADAPTERS = ("l:0", "h0:0", "h1:0")
PORTS = ("sw/l:0", "sw/h0:0", "sw/h1:0")
SHARES = ("dev:0x100", "req:l/0000:01:00", "req:l/0000:02:00", "vm:h0/a")


@functools.cache
def _topology() -> Topology:
    return parse_topology(star_topology(2, 1))


amounts = st.integers(0, 4)
adapter_claims = st.builds(
    Claim,
    st.sampled_from(ADAPTERS),
    st.sampled_from(ClaimKind),
    st.sampled_from(SHARES),
    amounts,
    amounts,
)
# as admission writes them: a requester's entry on a port it crosses, by a crossing (LUT) or
# peer-to-peer (P2P), one entry each (vmlend/ledger/admission.py, linkfaults.py and
# nvmeadmit.py write no other claim on a port)
port_claims = st.builds(
    Claim,
    st.sampled_from(PORTS),
    st.sampled_from([ClaimKind.LUT, ClaimKind.P2P]),
    st.sampled_from(SHARES),
    st.just(1),
)


@settings(max_examples=examples(300), deadline=None)
@given(claims=st.lists(st.one_of(adapter_claims, port_claims), max_size=12))
def test_the_units_a_ledger_needs_are_what_admission_counts(claims):
    """``_units_needed`` (what a VM's unit ledger takes) counts claims as admission does: per
    adapter what ``usage`` says its LUT entries and segments are, per switch port the
    requester entries ``port_usage`` says."""
    fdids = list(enumerate(claims))
    counted: dict[tuple[str, str], int] = {}
    for ref, u in usage(_topology(), fdids, ADAPTERS).items():
        for unit, n in (("lut", u.lut_used), ("seg", u.segments_used)):
            if n:
                counted[(ref, unit)] = n
    for port, n in port_usage(fdids, PORTS).items():
        if n:
            counted[(port, "lut")] = n
    rows = [[c.adapter, c.kind.value, c.share, c.entries, c.segments] for c in claims]
    assert EtcdTxn._units_needed(rows) == counted


@settings(max_examples=examples(300), deadline=None)
@given(start_in=st.integers(0, 64), size=st.integers(1, MAX_BLOCK))
def test_a_block_or_runs_key_reads_back_as_its_span(start_in, size):
    """Every span ``_take_units`` writes (aligned to its size rounded up to a power of two)
    reads back from its key as itself."""
    start = start_in * aligned_size(size)
    key = Keys("c").unit_block("sw/l:0", "seg", start, size)
    assert unit_span(key.rpartition("-blocks/")[2]) == (start, size)


@pytest.mark.parametrize("tail", ["000008/8/00", "000008/8/08", "000008/8/09", "000008/8/-3",
                                  "000008/8/01/02"])  # fmt: skip
def test_a_runs_damaged_free_count_reads_as_its_whole_block_used(tail):
    """Damage is never room: a free count out of 1 to the size less 1 (or a key of more
    parts) counts the whole aligned block as used."""
    assert unit_span(tail) == (8, 8)
