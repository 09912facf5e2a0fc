"""Commits from what earlier commits knew (``vmlend.registry.etcd_warm``), on a real etcd:
what another host changed since is never decided on (a stale commit fails its compares and
runs again on fresh reads), a refusal or an answer without writes is only ever taken from
fresh reads, and the adapter units a stale view thought free are guarded from the revision
that view was read at."""

from __future__ import annotations

import pytest

from tests.support.etcd_units import (
    last_capacity,
    lent_entries_held,
    own_units_fit,
    unit_keys_held,
)
from tests.support.simfabric import make_fabric, star_topology
from vmlend.errors import DeviceHeldError, ResourceExhaustedError
from vmlend.registry.etcd_gateway import KeyValue
from vmlend.registry.etcd_warm import WarmCache
from vmlend.topology.model import GiB, Holder
from vmlend.wiring.fabric import init_fabric, open_fabric

WEB, DB = Holder("gamma", "web"), Holder("gamma", "db")


def _cycle(fabric, fdid: int, holder: Holder, ram: int = 0) -> None:
    fabric.reserve(fdid, holder, guest_ram=ram)
    assert fabric.release(fdid, holder)


def test_a_device_taken_by_another_host_since_is_refused_from_fresh_reads(etcd_url):
    """gamma's process remembers 0x10 free (its last cycle); another process holds it
    since: the remembered commit fails, the fresh one refuses (the other keeps it)."""
    with make_fabric(etcd_url) as mine, open_fabric(etcd_url, "gamma") as other:
        _cycle(mine, 0x10, WEB, 4 * GiB)
        other.reserve(0x10, DB, guest_ram=4 * GiB)
        with pytest.raises(DeviceHeldError):
            mine.reserve(0x10, WEB, guest_ram=4 * GiB)
        assert mine.registry.stale == 1
        assert mine.device(0x10).holder == other.device(0x10).holder == DB


def test_a_refusal_from_remembered_reads_is_asked_again_fresh(etcd_url):
    """gamma's process remembers 0x10 held by web (it reserved it); another process
    releases it since: db's reserve is not refused on what was remembered."""
    with make_fabric(etcd_url) as mine, open_fabric(etcd_url, "gamma") as other:
        mine.reserve(0x10, WEB)
        assert other.release(0x10, WEB)
        assert mine.reserve(0x10, DB).created  # the old view says "held by web"
        assert mine.registry.stale == 1
        assert other.device(0x10).holder == DB


def test_an_answer_without_writes_is_taken_from_fresh_reads(etcd_url):
    """A release of a device its VM does not hold writes nothing, and etcd checks nothing
    without writes: gamma's process remembers 0x10 free (its last cycle), another process
    has reserved it for web since, so web's release through gamma's process must release
    it, not answer "not held" from memory."""
    with make_fabric(etcd_url) as mine, open_fabric(etcd_url, "gamma") as other:
        _cycle(mine, 0x10, WEB)
        other.reserve(0x10, WEB)
        assert mine.release(0x10, WEB) is True
        assert other.device(0x10).holder is None


def test_units_remembered_free_but_taken_since_are_not_taken_twice(etcd_url):
    """l's adapter has room for one reservation's DMA window. h0's process cycled 0x100 (so
    it remembers the adapter's segments free); h1 takes the room since: h0's reserve from
    what it remembered meets h1's units (its guards compare from the revision they were
    read at), runs again on fresh reads and is refused. No unit is taken twice. (The LUT
    entries there are the lender's lent entries: the next test.)"""
    text, ram = last_capacity("segments", 0)
    init_fabric(etcd_url, text, "star.toml")
    with open_fabric(etcd_url, "h0") as first, open_fabric(etcd_url, "h1") as second:
        _cycle(first, 0x100, Holder("h0", "vm1"), ram)
        second.reserve(0x101, Holder("h1", "vm2"), guest_ram=ram)
        with pytest.raises(ResourceExhaustedError):
            first.reserve(0x100, Holder("h0", "vm1"), guest_ram=ram)
        assert first.registry.stale == 1
        # (``unit_keys_held`` fails on a unit taken twice)
        own_units_fit(etcd_url, first)
        assert set(first.holds()) == {0x101}


def test_a_lent_entry_remembered_but_given_back_since_is_not_used(etcd_url):
    """l's adapter has one usable LUT entry. h0's process cycled 0x100 (it remembers its
    lent entry there); another process unlends 0x100 (its entry goes), h1 borrows 0x101
    (its entry takes the unit) and 0x100 is lent again: h0's reserve of 0x100 from what it
    remembered reads again (0x100's record, which listed the entry, changed) and is
    refused, never given the unit 0x101's entry holds."""
    text, ram = last_capacity("lut", 0)
    init_fabric(etcd_url, text, "star.toml")
    with (
        open_fabric(etcd_url, "h0") as first,
        open_fabric(etcd_url, "h1") as second,
        open_fabric(etcd_url, "l") as lender,
    ):
        _cycle(first, 0x100, Holder("h0", "vm1"), ram)
        lender.unlend(0x100)
        second.reserve(0x101, Holder("h1", "vm2"), guest_ram=ram)
        lender.lend(0x100)
        with pytest.raises(ResourceExhaustedError, match="requester LUT on l:0"):
            first.reserve(0x100, Holder("h0", "vm1"), guest_ram=ram)
        assert first.registry.stale == 1
        own_units_fit(etcd_url, first)
        assert lent_entries_held(etcd_url)["l:0"] == ["req:l/0000:01:01"]


def test_ten_cycles_of_two_borrowers_through_one_adapter_pair_keep_the_units_exact(etcd_url):
    """Two processes of one host cycling distinct devices through one adapter pair, each
    from what it remembered, the other's commits landing in between: every commit after the
    first two is one request, and the units always add up to the claims."""
    init_fabric(etcd_url, star_topology(2, 4), "star.toml")
    with open_fabric(etcd_url, "h0") as a, open_fabric(etcd_url, "h0") as b:
        for _ in range(10):
            a.reserve(0x100, Holder("h0", "a"), guest_ram=2 * GiB)
            b.reserve(0x101, Holder("h0", "b"), guest_ram=2 * GiB)
            own_units_fit(etcd_url, a)
            assert a.release(0x100, Holder("h0", "a"))
            assert b.release(0x101, Holder("h0", "b"))
        assert unit_keys_held(etcd_url, extents=False) == {}
        assert a.registry.conflicts == b.registry.conflicts == 0


def test_hand_overs_from_remembered_reads_issue_newer_tokens(etcd_url):
    """A hand-over re-makes the hold under its key with a token of its own (``_reissue``:
    the revision after the one its hold and fence are known at). From what a process
    remembered, with other hosts' commits in between, each hand-over and hand-back still
    issues a token newer than the device's last one, carried by hold and fence alike."""
    from vmlend.ledger import handover

    src = Holder("gamma", "vm1", "11111111-1111-1111-1111-111111111111")
    dst = Holder("beta", "vm1", src.vm_uuid)
    with make_fabric(etcd_url) as mine, open_fabric(etcd_url, "beta") as other:
        mine.reserve(0x10, src, guest_ram=GiB)
        tokens = [mine.holds()[0x10].token]
        for _ in range(3):
            claimed = handover.claim_destination(mine.registry, [0x10], src, dst, GiB)
            _cycle(other, 0x20, Holder("beta", "busy"))  # revisions move on meanwhile
            tokens.append(handover.hand_over(mine.registry, claimed, {}, 0.0)[0x10])
            _cycle(other, 0x20, Holder("beta", "busy"))
            tokens.append(handover.hand_back(mine.registry, claimed, {}, 0.0)[0x10])
            with mine.registry.read() as tx:
                hold, fence = tx.hold(0x10), tx.fence(0x10)
            assert hold is not None and fence is not None
            assert hold.holder == src and hold.token == fence.token == tokens[-1]
        assert tokens == sorted(set(tokens)) and len(tokens) == 7
        assert mine.registry.stale == 0  # the hand-overs did commit from what was remembered


def _kv(key: str, value: bytes, mod: int, created: int, lease: int = 0) -> KeyValue:
    return KeyValue(key, value, mod, created, lease)


def test_what_a_commit_knew_is_known_at_its_revision():
    """Pure: keys compared and written are known at the commit's revision (a put over an
    existing key keeps its creation revision, a new key's is the commit's); a compared
    range takes the writes under it; a loose range keeps its read revision with the writes
    laid over; a remembered key written blind, and a remembered compared range written in,
    are forgotten."""
    warm = WarmCache()
    warm.learn(
        keys={"/k/a": _kv("/k/a", b"1", 5, 3), "/k/b": None, "/k/blind": None},
        ranges=[("/r/", {"/r/x": _kv("/r/x", b"x", 4, 4)})],
        loose=[("/u/", {"/u/1": _kv("/u/1", b"1", 2, 2)}, 6)],
        writes={"/k/a": (b"2", 7), "/k/b": (b"n", 0), "/r/y": (b"y", 0), "/u/2": (b"2", 9)},
        deleted=["/u/1"],
        revision=10,
    )
    assert warm.key("/k/a") == (_kv("/k/a", b"2", 10, 3, 7), 10)
    assert warm.key("/k/b") == (_kv("/k/b", b"n", 10, 10), 10)
    assert warm.key("/k/blind") == (None, 10)
    in_range = {"/r/x": _kv("/r/x", b"x", 4, 4), "/r/y": _kv("/r/y", b"y", 10, 10)}
    assert warm.range("/r/") == (in_range, 10)
    assert warm.loose("/u/") == ({"/u/2": _kv("/u/2", b"2", 10, 10, 9)}, 6)
    # a later commit that read none of them but wrote /k/a and under /r/ and /u/
    warm.learn(
        keys={},
        ranges=[],
        loose=[],
        writes={"/k/a": (b"3", 0), "/r/z": (b"z", 0), "/u/3": (b"3", 0)},
        deleted=[],
        revision=12,
    )
    assert warm.key("/k/a") is None
    assert warm.range("/r/") is None
    loose, read_at = warm.loose("/u/") or ({}, 0)
    assert (set(loose), read_at) == ({"/u/2", "/u/3"}, 6)


def test_a_prefix_deleted_whole_forgets_the_ranges_under_and_over_it():
    """Pure: a commit deleting a whole prefix forgets every remembered range, compared or
    loose, that lies under it or holds it, but not one that commit itself read (it knows
    that one at its revision) nor one elsewhere."""
    warm = WarmCache()
    x = _kv("/h/1/x", b"x", 2, 2)
    warm.learn(
        keys={},
        ranges=[("/h/1/", {"/h/1/x": x}), ("/h/", {"/h/1/x": x}), ("/o/", {})],
        loose=[("/h/1/a/", {}, 3), ("/p/", {}, 3)],
        writes={},
        deleted=[],
        revision=4,
    )
    warm.learn(
        keys={},
        ranges=[("/q/", {})],
        loose=[("/h/1/b/", {}, 5)],  # read by the deleting commit itself: kept
        writes={},
        deleted=["/h/1/", "/q/"],
        revision=6,
    )
    assert warm.range("/h/1/") is None  # the prefix itself
    assert warm.range("/h/") is None  # over it
    assert warm.loose("/h/1/a/") is None  # under it
    assert warm.range("/q/") == ({}, 6)
    assert warm.loose("/h/1/b/") == ({}, 5)
    assert warm.range("/o/") == ({}, 4) and warm.loose("/p/") == ({}, 3)


def test_a_bounded_memory_starts_over():
    warm = WarmCache(limit=3)
    for i in range(5):
        warm.learn({f"/k/{i}": None}, [], [], {}, [], revision=i + 1)
    assert len([i for i in range(5) if warm.key(f"/k/{i}") is not None]) <= 4
    assert warm.key("/k/4") == (None, 5)


def _p2p_claim_per_hold(adapter: str):
    """A body as ``linkfaults.follow_p2p`` is: for every hold it sees, rewrite its claims."""
    from vmlend.registry.records import Claim, ClaimKind

    def body(tx) -> None:
        for fdid in tx.holds():
            claim = Claim(adapter, ClaimKind.P2P, f"p2p:{fdid:#x}", entries=1)
            tx.replace_claims(ClaimKind.P2P, [fdid], [(fdid, claim)])

    return body


def _remember_every_hold(tx) -> None:
    tx.holds()
    tx.set_meta("probe", "1")


def test_a_hold_released_since_is_not_made_again_from_a_remembered_range(etcd_url):
    """Found by review: gamma's process remembers the holds range with web's hold of 0x10;
    another process releases it since (deleting the hold, rewriting web's marker). A body
    that rewrites the claims of every hold it sees must not bring the hold back: a range
    compare does not see a deletion, and the marker, read fresh, no longer names the hold.
    Each key of a remembered range is compared too."""
    with make_fabric(etcd_url) as mine, open_fabric(etcd_url, "gamma") as other:
        other.reserve(0x10, WEB)
        with other.registry.read() as tx:
            adapter = next(c.adapter for f, c in tx.claims() if f == 0x10)
        mine.registry.transact(_remember_every_hold)
        assert other.release(0x10, WEB)
        mine.registry.transact(_p2p_claim_per_hold(adapter))
        with other.registry.read() as tx:
            assert tx.hold(0x10) is None
            assert [c for f, c in tx.claims() if f == 0x10] == []
        assert mine.registry.stale == 1


def test_a_late_learn_does_not_lay_an_older_commit_over_a_newer_read(etcd_url, monkeypatch):
    """Found by review: threads of one agent share the memory. Thread A's release commits,
    but its ``learn`` runs late, after another host took the same unit blocks and claim keys
    and thread B read them fresh and learned them: laying A's deletions over B's newer read
    would show those units free, and a reserve from memory would overcommit the adapter
    (its guards compare from B's read, after the other host's blocks were made)."""
    from vmlend.registry.etcd_txn import EtcdTxn

    text, ram = last_capacity("lut", 1)  # room for two reservations on l's adapter
    init_fabric(etcd_url, text, "star.toml")
    with open_fabric(etcd_url, "h0") as mine, open_fabric(etcd_url, "h1") as other:
        mine.reserve(0x100, Holder("h0", "a"), guest_ram=ram)
        late = []
        learn = EtcdTxn.learn
        monkeypatch.setattr(EtcdTxn, "learn", lambda tx, w, r: late.append((tx, w, r)))
        assert mine.release(0x100, Holder("h0", "a"))  # thread A: committed, learn pending
        monkeypatch.setattr(EtcdTxn, "learn", learn)
        other.reserve(0x100, Holder("h1", "p"), guest_ram=ram)  # the same keys again
        mine.registry.forget()  # (another thread's stale attempt cleared the memory)
        mine.reserve(0x102, Holder("h0", "b"), guest_ram=ram)  # thread B: reads, learns
        for tx, warm, revision in late:
            learn(tx, warm, revision)
        with pytest.raises(ResourceExhaustedError):
            mine.reserve(0x101, Holder("h0", "c"), guest_ram=ram)
        assert set(mine.holds()) == {0x100, 0x102}
        own_units_fit(etcd_url, mine)


def test_a_lost_answer_to_a_commit_from_memory_is_an_error_not_a_fresh_refusal(
    etcd_url, monkeypatch
):
    """Found by review: a hand-over from memory commits and its answer is lost. Asked again
    fresh, it would be refused ("held by" the destination itself), which its caller takes
    for "nothing changed". The commit's own error is raised, as from fresh reads."""
    from vmlend.errors import RegistryUnreachableError
    from vmlend.ledger import handover

    src = Holder("gamma", "vm1", "11111111-1111-1111-1111-111111111111")
    dst = Holder("beta", "vm1", src.vm_uuid)
    with make_fabric(etcd_url) as mine:
        mine.reserve(0x10, src)
        claimed = handover.claim_destination(mine.registry, [0x10], src, dst, 0)
        gateway = mine.registry.gateway
        commit = gateway.txn

        def answer_lost(compare, success):
            commit(compare, success)
            raise RegistryUnreachableError(gateway.where, "no answer (timed out)")

        monkeypatch.setattr(gateway, "txn", answer_lost)
        with pytest.raises(RegistryUnreachableError):
            handover.hand_over(mine.registry, claimed, {}, 0.0)
        monkeypatch.undo()
        assert mine.holds()[0x10].holder == dst  # it did land
