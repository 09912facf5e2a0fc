"""A lent device's requester entries, its lender's lent entries (etcd layout 7), against
what a fifth review found (each test failed on the first version of the layout)."""

from __future__ import annotations

import time

import pytest

from tests.support.etcd_units import (
    ledgers_agree_with_blocks,
    lent_entries_held,
    unit_blocks_held,
)
from tests.support.simfabric import star_topology
from tests.support.tight_clusters import (
    _close,
    _open,
    _sized,
    _text,
    _url,
    _within_capacity,
    amend_text,
)
from vmlend.errors import FabricError, ResourceExhaustedError
from vmlend.ledger.handover import claim_destination, hand_over
from vmlend.registry import parse_location
from vmlend.registry.etcd_gateway import prefix_end
from vmlend.registry.etcd_keys import Keys, lent_share
from vmlend.topology.model import Holder
from vmlend.wiring.fabric import init_fabric, open_fabric


def test_a_lent_entry_taken_after_a_nodes_slack_is_given_back_stays_a_lent_entry(etcd_url):
    """a's VM borrows through a's adapter (a's extents there); other hosts' VMs borrow a's
    devices until its entries run short: the first borrow's lent entry comes from a's
    slack, and is a lent entry still (not a VM's block on the acting host's lease); the
    adapter never holds more requesters than its room, and the next is refused."""
    url = _url(etcd_url)
    bare = _sized("b", 2, 1, 16).replace('bars = [ { index = 0, size = "16MiB" } ]', "bars = []")
    text = _text("slack", _sized("a", 1, 10, 16, lut=10), bare, _sized("c", 3, 0, 16))
    fabrics = _open(url, text, {"a": "a"})
    a = fabrics["a"]
    try:
        a.reserve(0x200, Holder("a", "vm0"))
        for i in range(7):
            a.reserve(0x100 + i, Holder("c", f"vm{i}"))
        assert a.release(0x200, Holder("a", "vm0"))
        with pytest.raises(ResourceExhaustedError, match="requester LUT on a:0"):
            for i in range(7, 10):
                a.reserve(0x100 + i, Holder("c", f"vm{i}"))
        assert len(lent_entries_held(url)["a:0"]) == len(unit_blocks_held(url)[("a:0", "lut")])
        _within_capacity(a)
        ledgers_agree_with_blocks(url)
    finally:
        _close(fabrics)


def test_a_hot_moves_admission_counts_the_lent_entries_no_hold_uses(etcd_url):
    """b's three devices were borrowed once and released: b's adapter's three usable entries
    are their lent entries. A VM's hot move onto b (whose admission reads every claim) is
    refused there, not admitted beyond the room."""
    url = _url(etcd_url)
    text = _text("idle", _sized("a", 1, 1, 16), _sized("b", 2, 3, 16, lut=5), _sized("c", 3, 0, 16))
    fabrics = _open(url, text, {"p": "c"})
    p = fabrics["p"]
    try:
        for f in (0x200, 0x201, 0x202):
            p.reserve(f, Holder("c", f"v{f:x}"))
            assert p.release(f, Holder("c", f"v{f:x}"))
        src, dst = Holder("c", "mig"), Holder("b", "mig")
        p.reserve(0x100, src)
        with pytest.raises(FabricError, match="requester LUT on b:0"):
            claim_destination(p.registry, [0x100], src, dst, 0)
        for f in (0x200, 0x201, 0x202):
            p.reserve(f, Holder("c", f"w{f:x}"))
        _within_capacity(p)
        ledgers_agree_with_blocks(url)
    finally:
        _close(fabrics)


def test_a_hot_move_counts_the_lent_entries_on_a_switch_port_too(etcd_url):
    """As above on the switch port toward b, whose 3 requester entries are b's devices'
    idle lent entries (a sixth review: the entries set aside were read with a port's name
    cut at its "/", so a hot move was admitted there and b's devices borrowed again from
    another node made 4 requesters in use on a port of 3)."""
    url = _url(etcd_url)
    nodes = (_sized("a", 1, 1, 16), _sized("b", 2, 3, 16), _sized("c", 3, 0, 16))
    text = _text("ports", *nodes, _sized("d", 4, 0, 16)).replace(
        'name = "sw"\nports = ["a:0", "b:0", "c:0"]',
        'name = "sw"\nrequester_entries = 3\nports = ["a:0", "b:0", "c:0", "d:0"]',
    )
    fabrics = _open(url, text, {"p": "c"})
    p = fabrics["p"]
    try:
        for f in (0x200, 0x201, 0x202):
            p.reserve(f, Holder("c", f"v{f:x}"))
            assert p.release(f, Holder("c", f"v{f:x}"))
        with p.registry.read() as tx:
            assert {c.adapter for _f, c in tx.set_aside()} == {"b:0", "sw/b:0"}
        assert [(u.port, u.used) for u in p.port_usage() if u.port == "sw/b:0"] == [("sw/b:0", 3)]
        src, dst = Holder("c", "mig"), Holder("b", "mig")
        p.reserve(0x100, src)
        with pytest.raises(FabricError, match="sw/b:0"):
            claim_destination(p.registry, [0x100], src, dst, 0)
        for f in (0x200, 0x201, 0x202):  # from d: the port toward c has a's requester
            p.reserve(f, Holder("d", f"w{f:x}"))
        _within_capacity(p)
        ledgers_agree_with_blocks(url)
    finally:
        _close(fabrics)


def test_a_function_an_amend_adds_uses_its_devices_listed_entry(etcd_url):
    """A topology amend adds function 1 to a device whose function 0 was borrowed once (its
    requester's lent entry listed in function 0's record only): a borrow of the new function
    uses that entry, and unlending both gives it back (review 5, finding 4)."""
    text = star_topology(2, 3, lut_entries=10)
    init_fabric(etcd_url, text, "star.toml")
    with open_fabric(etcd_url, "h0") as f:
        f.reserve(0x100, Holder("h0", "vm1"))
        assert f.release(0x100, Holder("h0", "vm1"))
    assert lent_entries_held(etcd_url)["l:0"] == ["req:l/0000:01:00"]
    added = (
        '\n  [[node.device]]\n  fdid = 0x103\n  bdf = "0000:01:00.1"\n  kind = "nic"\n'
        "  vendor = 0x8086\n  device = 0x1521\n  class = 0x020000\n"
        '  bars = [ { index = 0, size = "16MiB" } ]\n'
    )
    amend_text(
        etcd_url, text.replace('\n[[node]]\nname = "h0"', added + '\n[[node]]\nname = "h0"', 1)
    )
    with open_fabric(etcd_url, "h1") as f, open_fabric(etcd_url, "l") as lender:
        f.reserve(0x103, Holder("h1", "vm2"))
        assert lent_entries_held(etcd_url)["l:0"] == ["req:l/0000:01:00"]
        _within_capacity(f)
        assert f.release(0x103, Holder("h1", "vm2"))
        lender.unlend(0x100)
        assert lent_entries_held(etcd_url)["l:0"] == ["req:l/0000:01:00"]  # 0x103 is lent
        lender.unlend(0x103)
    assert "l:0" not in lent_entries_held(etcd_url)


@pytest.mark.parametrize("borrowed_again", [True, False], ids=["borrowed-again", "unlent"])
def test_a_device_renumbered_while_lent_and_idle_leaves_no_entry_behind(etcd_url, borrowed_again):
    """An amend gives an idle lent device another address (``fabric discover`` may: it is
    not held), so its listed entry is of a requester no device has now. Its next borrow
    makes that entry its new requester's (no second one), and its unlend gives it back,
    with or without that borrow; another device's entry stays (a sixth review found the
    old entry left for good)."""
    text = star_topology(2, 3, lut_entries=10)
    init_fabric(etcd_url, text, "star.toml")
    with open_fabric(etcd_url, "h0") as f:
        for fdid in (0x100, 0x101):
            f.reserve(fdid, Holder("h0", "vm1"))
            assert f.release(fdid, Holder("h0", "vm1"))
    amend_text(etcd_url, text.replace('bdf = "0000:01:00.0"', 'bdf = "0000:01:07.0"'))
    with open_fabric(etcd_url, "h0") as f, open_fabric(etcd_url, "l") as lender:
        if borrowed_again:
            f.reserve(0x100, Holder("h0", "vm1"))
            assert sorted(lent_entries_held(etcd_url)["l:0"]) == [
                "req:l/0000:01:01",
                "req:l/0000:01:07",
            ]
            _within_capacity(f)
            ledgers_agree_with_blocks(etcd_url)
            assert f.release(0x100, Holder("h0", "vm1"))
        lender.unlend(0x100)
    assert lent_entries_held(etcd_url)["l:0"] == ["req:l/0000:01:01"]


def test_a_process_remembering_old_units_takes_no_second_entry_for_a_requester(etcd_url):
    """h0's process remembers l's units from before another host's borrow of function 0 of
    a device took its lent entry: h0's borrow of function 1 uses that entry (it reads it
    again: its memory is older than the device's record), so unlending both leaves none."""
    text = star_topology(2, 3, lut_entries=10).replace('"0000:01:01.0"', '"0000:01:00.1"')
    init_fabric(etcd_url, text, "star.toml")
    with (
        open_fabric(etcd_url, "h0") as first,
        open_fabric(etcd_url, "h1") as second,
        open_fabric(etcd_url, "l") as lender,
    ):
        for _ in range(2):
            first.reserve(0x102, Holder("h0", "vm9"))
            assert first.release(0x102, Holder("h0", "vm9"))
        second.reserve(0x100, Holder("h1", "vm1"))
        first.reserve(0x101, Holder("h0", "vm9"))
        assert lent_entries_held(etcd_url)["l:0"].count("req:l/0000:01:00") == 1
        ledgers_agree_with_blocks(etcd_url)
        assert second.release(0x100, Holder("h1", "vm1"))
        assert first.release(0x101, Holder("h0", "vm9"))
        lender.unlend(0x100)
        lender.unlend(0x101)
        assert "req:l/0000:01:00" not in lent_entries_held(etcd_url).get("l:0", [])


def test_a_hot_move_onto_the_lender_switches_over_on_a_full_adapter(etcd_url):
    """A VM moves onto its device's lender, whose adapter's entries are all lent entries:
    its claims there stay covered by the lent entry (they are the lender's whichever node
    the VM is on), so the switch-over takes no entry more and completes."""
    url = _url(etcd_url)
    text = _text("onto", _sized("a", 1, 3, 16, lut=5), _sized("b", 2, 0, 16), _sized("c", 3, 0, 16))
    fabrics = _open(url, text, {"p": "c"})
    p = fabrics["p"]
    try:
        src, dst = Holder("c", "mig"), Holder("a", "mig")
        p.reserve(0x100, src)
        p.reserve(0x101, Holder("c", "v1"))
        p.reserve(0x102, Holder("c", "v2"))
        claimed = claim_destination(p.registry, [0x100], src, dst, 0)
        hand_over(p.registry, claimed, {}, time.time())
        assert p.device(0x100).holder == dst
        _within_capacity(p)
        ledgers_agree_with_blocks(url)
    finally:
        _close(fabrics)


def test_lent_entries_are_on_no_lease_and_of_their_lender(etcd_url):
    """A lent entry is the lender's: on no lease, named for the requester."""
    init_fabric(etcd_url, star_topology(2, 2), "star.toml")
    with open_fabric(etcd_url, "h0") as f:
        f.reserve(0x100, Holder("h0", "vm1"))
        assert f.release(0x100, Holder("h0", "vm1"))
        keys = Keys(parse_location(etcd_url).cluster)
        _rev, kvs = f.registry.gateway.range(keys.units, prefix_end(keys.units))
        lent = [kv for kv in kvs if lent_share(kv.value)]
        assert lent and all(kv.lease == 0 for kv in lent)
        assert {lent_share(kv.value) for kv in lent} == {"req:l/0000:01:00"}
