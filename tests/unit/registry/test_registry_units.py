"""Reserves on one adapter compare the units they take, not every claim on it (issue 20,
defect 6). On a real etcd: another VM's reserve through the same adapters landing between a
reserve's reads and its commit does not make it run again; two reserves that together need
more than an adapter has left still cannot both commit; the unit keys always add up to what
the claims use; and ten borrowers
reserving and releasing distinct devices through one adapter pair at once never fail."""

from __future__ import annotations

import threading

import msgspec
import pytest

from tests.support.cluster_hosts import check_never_two_holders, history
from tests.support.etcd_daemon import host_lease
from tests.support.etcd_units import (
    last_capacity,
    ledgers_agree_with_blocks,
    lent_entries_held,
    own_units_fit,
    taking,
    unit_blocks_held,
    unit_keys_held,
)
from tests.support.landing import landing_first
from tests.support.simfabric import make_fabric, star_topology
from vmlend.errors import ResourceExhaustedError, VmlendError
from vmlend.registry import open_registry, parse_location
from vmlend.registry.decider import EXTENT_CHUNK, Deciders
from vmlend.registry.etcd_gateway import EtcdGateway, b64, prefix_end
from vmlend.registry.etcd_keys import Keys
from vmlend.registry.etcd_store import EtcdRegistry
from vmlend.registry.etcd_txn import EtcdTxn
from vmlend.registry.records import Claim, ClaimKind, HoldRecord, Phase
from vmlend.topology.model import GiB, Holder
from vmlend.wiring.fabric import default_topology_text, init_fabric, open_fabric


def test_another_hosts_reserve_through_the_same_lender_does_not_conflict(etcd_url):
    init_fabric(etcd_url, star_topology(2, 4), "star.toml")
    mine, other = open_fabric(etcd_url, "h0"), open_fabric(etcd_url, "h1")
    try:
        landing_first(mine, lambda: other.reserve(0x101, Holder("h1", "vm2")))
        assert mine.reserve(0x100, Holder("h0", "vm1")).created
        assert mine.registry.conflicts == 0  # the old code re-ran: a new claim on l:0
        assert other.device(0x101).holder == Holder("h1", "vm2")
        # the lender's side: each device's requester entry is its lender's lent entry (on its
        # adapter and on the port toward it), none a VM's block; each borrower's own side is
        # its node's extents (``vmlend.registry.decider``), none of a VM
        assert unit_keys_held(etcd_url, extents=False) == {}
        lent = lent_entries_held(etcd_url)
        assert {k: len(v) for k, v in lent.items()} == {"l:0": 2, "sw/l:0": 2}
        own = unit_keys_held(etcd_url, extents=True)
        assert set(own) == {
            (a, u) for n in ("h0", "h1") for a, u in ((f"{n}:0", "lut"), (f"{n}:0", "seg"))
        } | {("sw/h0:0", "lut"), ("sw/h1:0", "lut")}
        own_units_fit(etcd_url, mine)
    finally:
        mine.close()
        other.close()


def test_two_vms_of_one_node_reserved_at_once_by_one_process_do_not_conflict(etcd_url):
    """The process deciding a node's own places counts what its attempts in flight claim:
    a reserve landing inside another's commit fits the extents without a conflict."""
    init_fabric(etcd_url, star_topology(1, 4), "star.toml")
    mine = open_fabric(etcd_url, "h0")
    try:
        mine.reserve(0x102, Holder("h0", "vm0"))  # takes h0 over: its extents, its epoch
        assert mine.release(0x102, Holder("h0", "vm0"))
        landing_first(mine, lambda: mine.reserve(0x101, Holder("h0", "vm2")))
        assert mine.reserve(0x100, Holder("h0", "vm1")).created
        assert mine.registry.conflicts == 0
        assert set(mine.holds()) == {0x100, 0x101}
        own_units_fit(etcd_url, mine)
    finally:
        mine.close()


def test_a_second_process_for_a_node_takes_it_over_and_the_first_learns_it(etcd_url):
    """Another process reserving for the node's VMs takes the node over (its epoch key): the
    first one's next commit fails, reads the node's markers and takes it back; what the
    node's VMs use stays within its extents throughout."""
    init_fabric(etcd_url, star_topology(1, 6), "star.toml")
    first, second = open_fabric(etcd_url, "h0"), open_fabric(etcd_url, "h0")
    second.registry.deciders = Deciders()  # another process: its own state
    try:
        first.reserve(0x100, Holder("h0", "vm0"))
        landing_first(first, lambda: second.reserve(0x101, Holder("h0", "vm1")))
        assert first.reserve(0x102, Holder("h0", "vm2")).created
        # its epoch was no longer the key's: the attempt ran again (from memory, or after a pause)
        assert first.registry.conflicts + first.registry.stale == 1
        own_units_fit(etcd_url, first)
        second.reserve(0x103, Holder("h0", "vm3"))
        assert first.release(0x100, Holder("h0", "vm0"))
        first.reserve(0x104, Holder("h0", "vm4"))
        assert set(first.holds()) == {0x101, 0x102, 0x103, 0x104}
        own_units_fit(etcd_url, first)
        for f, vm in ((0x101, "vm1"), (0x102, "vm2"), (0x103, "vm3"), (0x104, "vm4")):
            assert second.release(f, Holder("h0", vm))
        second.reserve(0x105, Holder("h0", "vm5"))  # takes it over: the extents shrink
        own_units_fit(etcd_url, second)
        # one block per place: what the 6 VMs used at their most, trimmed to what one uses
        assert sum(unit_keys_held(etcd_url, extents=True).values()) <= 3 * EXTENT_CHUNK
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("limit", ["lut", "segments"])
def test_two_reserves_for_the_last_capacity_of_an_adapter_exactly_one_commits(etcd_url, limit):
    """h0 and h1 each reserve a device of ``l`` for a VM, and ``l``'s adapter has room for
    one of them: the one landing between the other's reads and its commit wins, the other
    runs again and is refused."""
    text, ram = last_capacity(limit, 0)
    init_fabric(etcd_url, text, "star.toml")
    first, second = open_fabric(etcd_url, "h0"), open_fabric(etcd_url, "h1")
    try:
        outcome: list[object] = []

        def land() -> None:
            try:
                outcome.append(second.reserve(0x101, Holder("h1", "vm2"), guest_ram=ram).created)
            except VmlendError as e:  # reported below, not lost in the other's commit
                outcome.append(e)

        landing_first(first, land)
        with pytest.raises(ResourceExhaustedError):
            first.reserve(0x100, Holder("h0", "vm1"), guest_ram=ram)
        assert outcome == [True]
        assert first.registry.conflicts == 1
        assert set(first.holds()) == {0x101}
        second.release(0x101, Holder("h1", "vm2"))
        assert unit_keys_held(etcd_url, extents=False) == {}  # every unit went with its claims
    finally:
        first.close()
        second.close()


def test_the_units_always_add_up_to_what_the_claims_use(etcd_url):
    """Shared claims (a VM's DMA windows through one lender adapter, its peer-to-peer claims,
    recounted as its devices come and go) have their units once; every release gives back
    what no remaining claim uses."""
    fabric = make_fabric(etcd_url)  # the default cluster: alpha and beta lend, gamma borrows
    web, db = Holder("gamma", "web"), Holder("gamma", "db")
    steps = [
        ("reserve", 0x10, web),  # GPU of alpha
        ("reserve", 0x11, web),  # a second one: DMA windows shared, peer-to-peer between them
        ("reserve", 0x20, web),  # GPU of beta: peer-to-peer across lenders
        ("reserve", 0x12, db),
        ("release", 0x10, web),
        ("release", 0x12, db),
        ("reserve", 0x10, db),
        ("release", 0x20, web),
        ("release", 0x11, web),
        ("release", 0x10, db),
    ]
    try:
        for what, fdid, holder in steps:
            if what == "reserve":
                fabric.reserve(fdid, holder, guest_ram=4 * GiB)
            else:
                assert fabric.release(fdid, holder)
            own_units_fit(etcd_url, fabric)
        assert unit_keys_held(etcd_url, extents=False) == {}
    finally:
        fabric.close()


def test_ten_borrowers_cycling_distinct_devices_through_one_adapter_pair_never_fail(etcd_url):
    """10 VMs of one host, each reserving and releasing its own device of one lender 20
    times, all at once (the cycle of ``bench/bench_cluster.py``): no cycle fails or even runs
    again, and no two holders ever had one device."""
    borrowers, cycles = 10, 20
    init_fabric(etcd_url, star_topology(1, borrowers), "star.toml")
    # the process takes h0 over and its extents grow to what the 10 VMs use together: each
    # of those two runs the node's other attempts in flight again, once (a hook or an agent
    # that has served the node's VMs before starts here)
    with open_fabric(etcd_url, "h0") as f:
        for i in range(borrowers):
            f.reserve(0x100 + i, Holder("h0", f"vm{i}"))
        for i in range(borrowers):
            f.release(0x100 + i, Holder("h0", f"vm{i}"))
    failures: list[str] = []
    conflicts: list[int] = []

    def borrower(i: int) -> None:
        with open_fabric(etcd_url, "h0") as f:
            holder = Holder("h0", f"vm{i}")
            for _ in range(cycles):
                try:
                    f.reserve(0x100 + i, holder)
                    f.release(0x100 + i, holder)
                except VmlendError as e:
                    failures.append(f"{holder}: {e}")
            conflicts.append(f.registry.conflicts)

    threads = [threading.Thread(target=borrower, args=(i,)) for i in range(borrowers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads)
    assert failures == []
    # every borrower ran to its end, and never ran a body twice: their reserves take distinct
    # units on the lender's side (each from its own fdid on), and on h0's own this process
    # decides, so they have nothing to conflict on
    assert conflicts == [0] * borrowers
    assert unit_keys_held(etcd_url, extents=False) == {}
    check_never_two_holders(history(etcd_url))


@pytest.mark.parametrize(
    "first,second",
    [
        ((2, 2), (1, 3)),
        ((1, 3), (2, 2)),
        ((4, 0), (1, 2)),
        ((1, 1), (4, 0)),
        ((2, 0), (2, 0)),
        ((3, 2), (2, 4)),
        ((2, 4), (3, 2)),
    ],
    ids=[
        "outer-first",
        "inner-first",
        "quad-then-one",
        "one-then-quad",
        "same-block",
        "run-then-its-tail's-holder",
        "a-run's-tail's-holder-first",
    ],
)
def test_blocks_that_overlap_cannot_both_commit(etcd_url, monkeypatch, first, second):
    """Aligned blocks overlap only when one holds the other: two transactions that read one
    snapshot and take overlapping blocks (the same, or one inside the other, whichever
    commits first) conflict; taking blocks that do not overlap does not."""
    init_fabric(etcd_url, star_topology(1, 2), "star.toml")
    monkeypatch.setattr(EtcdTxn, "_capacity", lambda self, adapter, unit: 8)
    with open_fabric(etcd_url, "h0") as f:
        gw = f.registry.gateway
        (a, _), (b, _) = taking(f.registry, first), taking(f.registry, second)
        assert gw.txn(a.compares(), a.operations())[0] is True
        assert gw.txn(b.compares(), b.operations())[0] is False
        c, _ = taking(f.registry, (4, 4))  # after a's commit: the other half is free
        assert gw.txn(c.compares(), c.operations())[0] is True
    assert sum(unit_keys_held(etcd_url).values()) == first[0] + 4


def test_a_fragmented_adapter_takes_smaller_blocks(etcd_url, monkeypatch):
    """Free units scattered so no aligned block of the size asked for is left: the request
    is split in halves down to single units, and takes exactly what is free."""
    init_fabric(etcd_url, star_topology(1, 2), "star.toml")
    monkeypatch.setattr(EtcdTxn, "_capacity", lambda self, adapter, unit: 8)
    with open_fabric(etcd_url, "h0") as f:
        gw = f.registry.gateway
        for start in (1, 4):  # taken: 1 and [4, 6); free: 0, 2, 3, 6, 7
            tx, _ = taking(f.registry, (1 if start == 1 else 2, start))
            assert gw.txn(tx.compares(), tx.operations())[0] is True
        tx = f.registry._txn(writable=True)
        picked = tx._take_units("l:0", "seg", 5, Holder("h0", "big"), 0)
        assert picked == [(0, 1), (2, 2), (6, 2)]
        assert gw.txn(tx.compares(), tx.operations())[0] is True
    assert unit_keys_held(etcd_url) == {("l:0", "seg"): 8}


def test_a_dma_window_is_one_run_of_its_vm_and_leaves_the_rest_of_its_block(etcd_url):
    """A GPU's DMA window with 16 GiB of guest RAM (5 of the lender's segments) is one key,
    a run of the aligned block of 8 less its last 3 units (layout 8; blocks took 4+1), so
    its hold is 4 keys: the hold, its fence, its VM's marker and the run. The units after it
    in that block are another VM's for the taking, with no conflict."""
    text, source = default_topology_text()
    init_fabric(etcd_url, text, source, node="gamma")
    with open_fabric(etcd_url, "gamma") as f:
        f.reserve(0x10, Holder("gamma", "a"), guest_ram=16 * GiB)
        segments = unit_blocks_held(etcd_url, extents=False)[("alpha:0", "seg")]
        assert [size for _start, size in segments] == [5]
        (start, _size), keys = segments[0], f.registry.keys
        assert keys.unit_block("alpha:0", "seg", start, 5).endswith(f"{start:06d}/8/03")
        ledgers_agree_with_blocks(etcd_url)
        tx = f.registry._txn(writable=True)
        after = tx._take_units("alpha:0", "seg", 1, Holder("gamma", "b"), start + 5)
        assert after == [(start + 5, 1)]
        assert f.registry.gateway.txn(tx.compares(), tx.operations())[0] is True
        f.release(0x10, Holder("gamma", "a"))
    assert unit_blocks_held(etcd_url, extents=False) == {("alpha:0", "seg"): [(start + 5, 1)]}


def test_a_run_that_shrinks_keeps_its_first_units_in_place(etcd_url):
    """A VM's window of 3 segments, one run its hold 0x100 took, shrinks to 2 for its hold
    0x107: its first 2 units stay where they are and nothing is taken anew, so another VM's
    take of the free units from 0x107 on, from a snapshot before the shrink, commits too (a
    seventh review: the run was given back whole and 2 units taken again from 0x107 on,
    where that take met them)."""
    init_fabric(etcd_url, star_topology(1, 8), "star.toml")
    vm = Holder("h0", "app")
    window = Claim("l:0", ClaimKind.DMA, "vm:h0/app", segments=3)
    with open_fabric(etcd_url, "h0") as f:
        reg = f.registry
        for fdid in (0x100, 0x107):  # one window, the VM's: 3 segments once
            hold = HoldRecord(fdid, vm, 1.0, Phase.BORROWED)
            reg.transact(lambda tx, hold=hold: tx.add_hold(hold, [window]))
        reg.transact(lambda tx: tx.delete_hold(0x100))
        [(start, size)] = unit_blocks_held(etcd_url, extents=False)[("l:0", "seg")]
        assert size == 3
        other = reg._txn(writable=True)
        after = other._take_units("l:0", "seg", 2, Holder("h0", "db"), 0x107)
        smaller = msgspec.structs.replace(window, segments=2)
        reg.transact(lambda tx: tx.replace_claims(ClaimKind.DMA, [0x107], [(0x107, smaller)]))
        assert unit_blocks_held(etcd_url, extents=False)[("l:0", "seg")] == [(start, 2)]
        assert reg.gateway.txn(other.compares(), other.operations())[0] is True
    assert unit_blocks_held(etcd_url)[("l:0", "seg")] == sorted([(start, 2), *after])


def test_a_requester_on_a_switch_port_is_one_unit_whichever_kind_claims_it():
    # a borrow's LUT claim and peer-to-peer's P2P claim of the same requester's entry on a
    # port: one entry in the port's table (admission.port_usage), so one unit
    rows = [
        ["sw/b:0", "lut", "req:l1/0000:41:00", 1, 0],
        ["sw/b:0", "p2p", "req:l1/0000:41:00", 1, 0],
        ["sw/b:0", "p2p", "req:l2/0000:41:00", 1, 0],
        ["b:0", "lut", "req:l1/0000:41:00", 1, 0],
        ["b:0", "p2p", "req:l1/0000:41:00", 1, 0],  # on an adapter the kinds stay apart
    ]
    assert EtcdTxn._units_needed(rows) == {("sw/b:0", "lut"): 2, ("b:0", "lut"): 2}


# --- units beyond the capacity (layout 5) -------------------------------------------------------
WINDOW = Claim("l:0", ClaimKind.DMA, "vm:h0/app", segments=10)


def _two_holds_sharing_a_window(url: str, monkeypatch):
    """``app`` on h0 holds two devices of ``l`` whose DMA windows share 10 of the 16 segments
    of ``l``'s adapter (one claim per hold, one window: counted once)."""
    monkeypatch.setattr(EtcdTxn, "_capacity", lambda self, adapter, unit: 16)
    init_fabric(url, star_topology(2, 4), "star.toml")
    reg = open_registry(url)
    app = Holder("h0", "app")

    def reserve(tx):
        for fdid in (0x100, 0x101):
            tx.add_hold(HoldRecord(fdid, app, 1.0, Phase.RESERVED), [WINDOW])

    reg.transact(reserve)
    return reg


def test_a_hand_over_one_device_at_a_time_takes_units_beyond_a_tight_capacity(
    etcd_url, monkeypatch
):
    """A hand-over made a hold at a time holds the window twice (the source VM's for the
    device not moved yet, the destination VM's), 20 units of 16: refused before, as "short by
    4 segments" (admission saw room: one window). The units the capacity has no room for are
    taken beyond it, so every claim keeps its units and head; and while any are beyond it, a
    take on that adapter decides on all of it (its units prefix compared)."""
    reg = _two_holds_sharing_a_window(etcd_url, monkeypatch)
    moved = Holder("h1", "app")
    try:

        def one_at_a_time(tx):
            for fdid in (0x100, 0x101):
                tx.delete_hold(fdid)
                tx.add_hold(HoldRecord(fdid, moved, 2.0, Phase.RESERVED), [WINDOW])

        reg.transact(one_at_a_time)
        ledgers_agree_with_blocks(etcd_url)
        held = unit_blocks_held(etcd_url)[("l:0", "seg")]
        assert sum(z for _s, z in held) == 10  # the source's went with its last hold
        with reg.read() as tx:
            assert sorted(f for f, _c in tx.claims_on(["l:0"])) == [0x100, 0x101]
        tx = reg._txn(writable=True)  # type: ignore[attr-defined]
        tx._take_units("l:0", "seg", 1, Holder("h0", "other"), 0)
        assert any(s + z > 16 for s, z in held)  # the destination's, taken while both held
        prefix = b64(reg.keys.units_of("l:0"))  # type: ignore[attr-defined]
        assert any(c["key"] == prefix and "range_end" in c for c in tx.compares())
    finally:
        reg.close()


def test_a_hand_over_gives_every_hold_back_before_it_makes_any(etcd_url, monkeypatch):
    """``handover.hand_over`` drops the source's holds first, so the destination's take
    the units they gave back: none beyond the capacity, none compared as a prefix after."""
    from vmlend.ledger import handover

    reg = _two_holds_sharing_a_window(etcd_url, monkeypatch)
    src, dst = Holder("h0", "app"), Holder("h1", "app")
    claimed = handover.Claimed(src, dst, {0x100: [WINDOW], 0x101: [WINDOW]})
    try:
        handover.hand_over(reg, claimed, {}, 2.0)
        ledgers_agree_with_blocks(etcd_url)
        held = unit_blocks_held(etcd_url)[("l:0", "seg")]
        assert sum(z for _s, z in held) == 10 and all(s + z <= 16 for s, z in held)
        with reg.read() as tx:
            assert {h.holder for h in tx.holds().values()} == {dst}
    finally:
        reg.close()


def test_a_vms_blocks_go_on_its_markers_lease_whoever_writes_them(etcd, etcd_url, tmp_path):
    """A recount after a link event (``replace_claims``) may run on any host: the blocks it
    takes for a VM go on that VM's marker's lease, not the writer's, so they lapse with the
    VM's ledger (a block that outlived it could be taken by another VM and then deleted by
    this VM's next change, its claims with it)."""
    init_fabric(etcd_url, star_topology(2, 4), "star.toml")
    mine = open_registry(etcd_url)
    app = Holder("h0", "app")
    lut = Claim("h0:0", ClaimKind.LUT, "req:a", entries=1)
    mine.transact(lambda tx: tx.add_hold(HoldRecord(0x100, app, 1.0, Phase.BORROWED), [lut]))
    loc = parse_location(etcd_url)
    other = host_lease(etcd, tmp_path / "other-host", "h1")
    theirs = EtcdRegistry.open(EtcdGateway(loc.endpoints), loc.cluster, host_lease=lambda: other)
    moved = Claim("l:0", ClaimKind.LUT, "req:a", entries=1)
    try:
        theirs.transact(lambda tx: tx.replace_claims(ClaimKind.LUT, [0x100], [(0x100, moved)]))
        keys = Keys(loc.cluster)
        gw = theirs.gateway
        marker = gw.range(keys.vm_holds("h0", "app"))[1][0]
        _rev, blocks = gw.range(keys.units_of("l:0"), prefix_end(keys.units_of("l:0")))
        assert blocks and {kv.lease for kv in blocks} == {marker.lease} != {other}
        ledgers_agree_with_blocks(etcd_url)
    finally:
        theirs.close()
        mine.close()


@pytest.mark.parametrize("where", ["sqlite", "etcd"])
def test_two_vms_sharing_a_devices_requester_entry_are_admitted_alike_on_both_registries(
    etcd_url, tmp_path, where
):
    """Functions 0 and 1 of one device (0x100, 0x101) borrowed by VMs on two hosts share the
    device's requester entry on the lender's adapter, whose one usable entry the first takes:
    admission counts it once, so the second is admitted, on SQLite as on etcd. On etcd the
    entry is the lender's lent entry, which both holds use (no unit beyond the capacity, as
    when each VM took a unit of its own); another device's entry is refused on both (the
    adapter is full); the lent entry stays while the device is lent."""
    text = star_topology(2, 3, lut_entries=3).replace(
        '"0000:01:01.0"', '"0000:01:00.1"'
    )  # 0x101: function 1 of 0x100's device
    url = etcd_url if where == "etcd" else str(tmp_path / "state.db")
    init_fabric(url, text, "star.toml")
    first, second = Holder("h0", "vm1"), Holder("h1", "vm2")
    with open_fabric(url, "h0") as f:
        assert f.reserve(0x100, first).created
        assert f.reserve(0x101, second).created
        with pytest.raises(ResourceExhaustedError, match="requester LUT on l:0"):
            f.reserve(0x102, Holder("h1", "vm3"))
        if where == "etcd":
            ledgers_agree_with_blocks(url)
            # one lent entry for the device's requester, which both holds use
            assert unit_blocks_held(url)[("l:0", "lut")] == [(0, 1)]
            assert lent_entries_held(url)["l:0"] == ["req:l/0000:01:00"]
        assert f.release(0x101, second)
        if where == "etcd":
            assert unit_blocks_held(url)[("l:0", "lut")] == [(0, 1)]  # lent: it stays
            ledgers_agree_with_blocks(url)
