"""A node's own places decided by one process at a time (etcd layout 6,
``vmlend.registry.decider``), explored at random on a real etcd.

Three nodes with small adapters: ``a`` and ``b`` lend and borrow, ``c`` only borrows, so
every adapter's LUT entries and window segments are shared by its node's own VMs (decided
by count within the node's extents) and by other hosts' VMs borrowing its devices (unit
blocks). Four processes (each with its own decider state) reserve and release for the VMs
of their node, one landing inside another's commit where drawn (the worst interleaving,
forced): two processes of ``a`` take the node over from each other, a process's own
attempts count each other in flight. After every step the stored records agree
(``ledgers_agree_with_blocks``: no unit in two blocks, each node's claims within its
extents, the epoch keys list the extents) and no adapter or switch port holds more claims
than it has room for."""

from __future__ import annotations

import contextlib
import threading
import uuid

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from tests.support.etcd_units import (
    ledgers_agree_with_blocks,
    unit_blocks_held,
    unit_keys_held,
)
from tests.support.hypothesis_tiers import examples
from tests.support.landing import landing_first
from tests.support.tight_clusters import (
    _close,
    _node,
    _open,
    _sized,
    _text,
    _url,
    _within_capacity,
)
from vmlend.errors import ResourceExhaustedError, VmlendError
from vmlend.registry.decider import Deciders
from vmlend.topology.model import GiB, Holder
from vmlend.wiring.fabric import init_fabric, open_fabric

TOPOLOGY = (
    'name = "tight"\n'
    + _node("a", 1, 3)
    + _node("b", 2, 3)
    + _node("c", 3, 0)
    + '\n[[switch]]\nname = "sw"\nports = ["a:0", "b:0", "c:0"]\n'
)

#: For the exploration, b's third device has a 2 GiB BAR: a VM borrowing it takes 2 of its
#: node's 4 window segments at once, more than the slack a node's extents keep (1 here).
RACING = TOPOLOGY.replace(
    'fdid = 514\n  bdf = "0000:03:00.0"\n  kind = "nic"\n  vendor = 0x8086\n  device = 0x1521\n'
    '  class = 0x020000\n  bars = [ { index = 0, size = "16MiB" } ]',
    'fdid = 514\n  bdf = "0000:03:00.0"\n  kind = "nic"\n  vendor = 0x8086\n  device = 0x1521\n'
    '  class = 0x020000\n  bars = [ { index = 0, size = "2GiB" } ]',
)
assert RACING != TOPOLOGY

#: The processes: a node each, two of ``a`` (which take it over from each other).
PROCESSES = {"a0": "a", "a1": "a", "b0": "b", "c0": "c"}
DEVICES = (0x100, 0x101, 0x102, 0x200, 0x201, 0x202)

ops = st.tuples(
    st.sampled_from(sorted(PROCESSES)),
    # an unlend (refused while held) gives a device's lent entries back; a lend after it
    # lets its next borrow set them aside again (layout 7)
    st.sampled_from(["reserve", "release", "reserve", "release", "unlend", "lend"]),
    st.integers(0, 2),  # the VM of the process's node
    st.sampled_from(DEVICES),
)
#: A step: an operation, perhaps another landing inside it (just before its commit is sent,
#: or in its admission, between what the attempt read and what it decides), and whether its
#: process first forgets what its commits knew (its attempt then reads everything fresh).
#: ``lost``: in its admission, and the other's commit lands but its answer is lost.
steps = st.tuples(
    ops, st.none() | ops, st.booleans(), st.sampled_from(["commit", "admission", "lost"])
)


def _run(fabrics, op) -> str:
    proc, kind, vm, fdid = op
    holder = Holder(PROCESSES[proc], f"vm{vm}")
    try:
        if kind == "reserve":
            fabrics[proc].reserve(fdid, holder, guest_ram=GiB)
            return "reserved"
        if kind == "unlend":
            fabrics[proc].unlend(fdid)
            return "unlent"
        if kind == "lend":
            fabrics[proc].lend(fdid)
            return "lent"
        return "released" if fabrics[proc].release(fdid, holder) else "not held"
    except VmlendError as e:
        return type(e).__name__


def _landing_first(fabric, action) -> None:
    """``action`` runs just before ``fabric``'s next commit is sent."""
    fabric._restore = landing_first(fabric, action)


def _landing_in_admission(fabric, action) -> None:
    """``action`` runs in ``fabric``'s next admission: after its attempt read what it
    decides on (a node's plan made), before it decides (a release admits nothing: then it
    does not run)."""
    from vmlend.ledger import ledger

    admit = ledger.admit
    landed: list[bool] = []

    def admitting(*args, **kwargs):
        if not landed:
            landed.append(True)
            action()
        return admit(*args, **kwargs)

    ledger.admit = admitting

    def restore() -> None:
        ledger.admit = admit

    fabric._restore = restore


@contextlib.contextmanager
def _answer_lost(fabric):
    """``fabric``'s next commit lands, but its answer is lost (an error instead)."""
    from vmlend.registry.etcd_gateway import RegistryUnreachableError

    gateway = fabric.registry.gateway
    commit = gateway.txn

    def txn(compare, success):
        gateway.txn = commit
        commit(compare, success)
        raise RegistryUnreachableError("etcd", "the answer was lost")

    gateway.txn = txn
    try:
        yield
    finally:
        gateway.txn = commit


@settings(
    max_examples=examples(60),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(script=st.lists(steps, min_size=1, max_size=14))
# a's second process takes a over inside the first's commit, which then runs again
@example(
    script=[
        (("a0", "reserve", 0, 0x200), None, False, "commit"),
        (("a0", "reserve", 1, 0x201), ("a1", "reserve", 2, 0x202), False, "commit"),
    ]
)
# a process's own attempt lands inside another of its own: counted in flight, no conflict
@example(script=[(("c0", "reserve", 0, 0x100), ("c0", "reserve", 1, 0x101), False, "commit")])
# ... for the last LUT entry of c's adapter: the one landing inside is refused, seeing the
# other in flight (the 4th requester on 3 usable entries)
@example(
    script=[
        (("c0", "reserve", 0, 0x100), None, False, "commit"),
        (("c0", "reserve", 0, 0x101), None, False, "commit"),
        (("c0", "reserve", 1, 0x102), ("c0", "reserve", 2, 0x200), True, "commit"),
    ]
)
# b's VM takes a's last window segments for its DMA windows while a's VM takes BAR segments
@example(
    script=[
        (("a0", "reserve", 0, 0x200), None, False, "commit"),
        (("a0", "reserve", 1, 0x201), ("b0", "reserve", 0, 0x100), True, "commit"),
        (("b0", "reserve", 1, 0x101), ("a0", "reserve", 2, 0x202), False, "commit"),
    ]
)
# c's VM borrows the 2 GiB BAR while, in its admission, another VM of c releases, which
# gives an extent unit back: the reserve decides on the extents as that left them
@example(
    script=[
        (("c0", "reserve", 0, 0x100), None, False, "commit"),
        (("c0", "reserve", 1, 0x101), None, False, "commit"),
        (("c0", "reserve", 2, 0x102), None, False, "commit"),
        (("c0", "release", 1, 0x101), None, False, "commit"),
        (("c0", "reserve", 0, 0x202), ("c0", "release", 2, 0x102), False, "admission"),
    ]
)
def test_racing_reserves_keep_every_place_within_its_room(etcd_url, script):
    server, _cluster = etcd_url.rsplit("/", 1)
    url = f"{server}/deciders-{uuid.uuid4().hex[:12]}"
    init_fabric(url, RACING, "tight.toml")
    fabrics = {p: open_fabric(url, n) for p, n in PROCESSES.items()}
    for f in fabrics.values():
        f.registry.deciders = Deciders()  # each its own process
    try:
        for first, inner, cold, where in script:
            if cold:
                fabrics[first[0]].registry.forget()
            if inner is not None:
                land = _landing_first if where == "commit" else _landing_in_admission

                def other(inner=inner, lost=where == "lost") -> None:
                    if lost:
                        with _answer_lost(fabrics[inner[0]]):
                            event(f"answer lost: {_run(fabrics, inner)}")
                    else:
                        event(_run(fabrics, inner))

                land(fabrics[first[0]], other)
            outcome = _run(fabrics, first)
            event(f"{first[1]}: {outcome}")
            if inner is not None:
                fabrics[first[0]]._restore()
            ledgers_agree_with_blocks(url)
            unit_keys_held(url)  # fails on a unit two blocks hold
            _within_capacity(fabrics["c0"])
        conflicts = sum(f.registry.conflicts + f.registry.stale for f in fabrics.values())
        event(f"attempts run again: {min(conflicts, 5)}{'+' if conflicts > 5 else ''}")
    finally:
        for f in fabrics.values():
            f.close()


# --- hand-picked: what a review found (each failed on the first version) ----------------------


def _cluster(etcd_url: str, *nodes: str) -> tuple[str, dict[str, object]]:
    """A cluster of ``TOPOLOGY`` of its own, and a fabric (process) per node of ``nodes``."""
    url = _url(etcd_url)
    return url, _open(url, TOPOLOGY, {n: n for n in nodes})


def test_a_commit_sent_twice_and_refused_makes_the_node_read_again(etcd_url, monkeypatch):
    """The gateway sends a commit again after a member timed out (it may have applied it):
    the second answer is "compares failed" although the first landed. The attempt is then
    not known to have failed, so its node is taken over again from what is stored: the last
    LUT entry of c's adapter is not given twice."""
    from vmlend.registry.etcd_gateway import EtcdGateway

    url, fabrics = _cluster(etcd_url, "c")
    c = fabrics["c"]
    try:
        c.reserve(0x100, Holder("c", "vm0"), guest_ram=GiB)
        c.reserve(0x101, Holder("c", "vm1"), guest_ram=GiB)
        real = EtcdGateway.call
        twice: list[bool] = []

        def call(self, path, body):
            if path == "kv/txn" and body.get("success") and body.get("compare") and not twice:
                twice.append(True)
                real(self, path, body)  # lands; its answer is lost
                self._posts.n = 2  # what ``_call_any`` counts when it posts again
            return real(self, path, body)

        monkeypatch.setattr(EtcdGateway, "call", call)
        c.reserve(0x102, Holder("c", "vm2"), guest_ram=GiB)  # landed on the first send
        monkeypatch.setattr(EtcdGateway, "call", real)
        assert twice
        with pytest.raises(ResourceExhaustedError):
            c.reserve(0x200, Holder("c", "vm3"), guest_ram=GiB)  # a 4th requester on c:0
        ledgers_agree_with_blocks(url)
        _within_capacity(c)
    finally:
        _close(fabrics)


def test_settles_out_of_order_keep_the_later_claims(etcd_url):
    """A release commits; before its thread settles, another thread of the process reserves
    for the same VM (commit and settle). The release's late settle must not lay the VM's
    older claims over the newer ones: the 4th requester on c's adapter is refused."""
    url, fabrics = _cluster(etcd_url, "c")
    c = fabrics["c"]
    try:
        c.reserve(0x100, Holder("c", "vm0"), guest_ram=GiB)
        c.reserve(0x101, Holder("c", "vm0"), guest_ram=GiB)
        gateway = c.registry.gateway
        commit = gateway.txn

        def txn(compare, success):
            out = commit(compare, success)
            gateway.txn = commit
            c.reserve(0x102, Holder("c", "vm0"), guest_ram=GiB)  # after the release's commit
            return out

        gateway.txn = txn
        assert c.release(0x100, Holder("c", "vm0"))
        c.reserve(0x200, Holder("c", "vm1"), guest_ram=GiB)  # 0x101, 0x102, 0x200: 3 of 3
        with pytest.raises(ResourceExhaustedError):
            c.reserve(0x100, Holder("c", "vm2"), guest_ram=GiB)
        ledgers_agree_with_blocks(url)
        _within_capacity(c)
    finally:
        _close(fabrics)


def test_another_hosts_vm_never_goes_beyond_the_capacity_of_a_nodes_extents(etcd_url):
    """While b's decider admits within b's extents, c's VM borrowing b's devices takes its
    requester entries on b's adapter as blocks: where the room outside b's extents runs out
    it is refused, never given units beyond the capacity (which b's decider would not meet)."""
    url, fabrics = _cluster(etcd_url, "b", "c")
    b, c = fabrics["b"], fabrics["c"]
    try:
        b.reserve(0x100, Holder("b", "vm0"), guest_ram=GiB)  # b's extent on b:0: 1 entry
        c.reserve(0x200, Holder("c", "vm0"), guest_ram=GiB)
        c.reserve(0x201, Holder("c", "vm1"), guest_ram=GiB)  # b:0: 3 of 3
        with pytest.raises(ResourceExhaustedError):
            c.reserve(0x202, Holder("c", "vm2"), guest_ram=GiB)
        with pytest.raises(ResourceExhaustedError):
            b.reserve(0x101, Holder("b", "vm1"), guest_ram=GiB)
        ledgers_agree_with_blocks(url)
        _within_capacity(c)
    finally:
        _close(fabrics)


def test_a_replaced_topology_leaves_no_epoch_nor_extents(etcd_url):
    """``fabric init --replace`` (nothing held) deletes the nodes' epochs and extents with
    the unit blocks: a decider that ran before takes its node over again, from nothing."""
    url, fabrics = _cluster(etcd_url, "b", "c")
    b, c = fabrics["b"], fabrics["c"]
    try:
        b.reserve(0x100, Holder("b", "vm0"), guest_ram=GiB)
        assert b.release(0x100, Holder("b", "vm0"))
        assert unit_keys_held(url, extents=True)
        again = TOPOLOGY.replace('window = "4GiB"', 'window = "8GiB"')
        assert init_fabric(url, again, "again.toml", replace=True).action == "replaced"
        assert unit_keys_held(url, extents=True) == {}
        b.reserve(0x100, Holder("b", "vm0"), guest_ram=GiB)
        for i, fdid in enumerate((0x200, 0x201)):
            c.reserve(fdid, Holder("c", f"vm{i}"), guest_ram=GiB)
        ledgers_agree_with_blocks(url)
        _within_capacity(c)
    finally:
        _close(fabrics)


def test_a_nodes_first_extent_leaves_other_hosts_room(etcd_url):
    """An extent is padded to fewer growths, but never to more than half of what is free:
    one VM of b using one of b's 4 window segments leaves c's VM room for its DMA window
    there (it borrows b's device)."""
    url, fabrics = _cluster(etcd_url, "b", "c")
    b, c = fabrics["b"], fabrics["c"]
    try:
        b.reserve(0x100, Holder("b", "vm0"), guest_ram=GiB)
        assert c.reserve(0x200, Holder("c", "vm0"), guest_ram=GiB).created
        ledgers_agree_with_blocks(url)
    finally:
        _close(fabrics)


def test_a_move_into_a_node_racing_its_decider_never_overcommits_its_adapter(etcd_url):
    """A hot move's admission reads every claim (``claims()``), not the node's extents, and
    the move holds its destination's units under its source VM (on c) until it hands over:
    those are blocks on b's adapter, b's own place. Landing inside a reserve that b's decider
    admits within its extents, the move must not take units beyond b's adapter's capacity
    (which b's decider would not meet): it is refused there instead."""
    from vmlend.ledger import handover

    url = _url(etcd_url)
    text = _text("move", _sized("a", 1, 4, 16), _node("b", 2, 0), _sized("c", 3, 0, 16))
    fabrics = _open(url, text, {"b": "b", "c": "c", "mover": "c"})
    b, c, mover = fabrics["b"], fabrics["c"], fabrics["mover"]
    try:
        b.reserve(0x100, Holder("b", "vm0"), guest_ram=GiB)
        b.reserve(0x101, Holder("b", "vm1"), guest_ram=GiB)
        assert b.release(0x101, Holder("b", "vm1"))  # b's extents stay: 1 of them used
        c.reserve(0x102, Holder("c", "vm0"), guest_ram=GiB)
        c.reserve(0x103, Holder("c", "vm0"), guest_ram=GiB)
        outcome: list[str] = []

        def move() -> None:
            src, dst = Holder("c", "vm0"), Holder("b", "vmx")
            try:
                handover.claim_destination(mover.registry, [0x102, 0x103], src, dst, GiB)
                outcome.append("moved")
            except VmlendError as e:
                outcome.append(type(e).__name__)

        _landing_first(b, move)
        with contextlib.suppress(VmlendError):  # refused or not: the room is what is checked
            b.reserve(0x101, Holder("b", "vm1"), guest_ram=GiB)
        b._restore()
        assert outcome
        ledgers_agree_with_blocks(url)
        _within_capacity(c)
    finally:
        _close(fabrics)


def test_a_hot_move_from_a_node_whose_adapter_is_full_switches_over(etcd_url):
    """A hot move's switch-over re-makes the moving VM's claims on its source node's own
    adapter (within that node's extents, no block) as its destination VM's blocks there.
    With every other unit of the adapter taken, the source's give-back in the same
    transaction leaves the node's extents slack, which it gives back for those blocks: the
    move completes, and nothing exceeds its room."""
    import time

    from vmlend.ledger import handover

    url = _url(etcd_url)
    text = _text("switch", _sized("a", 1, 4, 16), _sized("b", 2, 0, 16), _node("c", 3, 4))
    fabrics = _open(url, text, {"a": "a", "c": "c", "mover": "b"})
    a, c, mover = fabrics["a"], fabrics["c"], fabrics["mover"]
    try:
        c.reserve(0x100, Holder("c", "vm0"), guest_ram=GiB)
        for i, fdid in enumerate((0x300, 0x301, 0x302)):  # a's VMs borrow c's devices
            with contextlib.suppress(VmlendError):  # as many as c's adapter has room for
                a.reserve(fdid, Holder("a", f"vm{i}"), guest_ram=GiB)
        src, dst = Holder("c", "vm0"), Holder("b", "vmx")
        claimed = handover.claim_destination(mover.registry, [0x100], src, dst, GiB)
        handover.hand_over(mover.registry, claimed, {}, time.time())
        handover.release_source(mover.registry, claimed)
        assert mover.device(0x100).holder == dst
        ledgers_agree_with_blocks(url)
        _within_capacity(c)
    finally:
        _close(fabrics)


def test_a_decision_sees_the_extents_another_thread_gave_back_since_its_admission(
    etcd_url, monkeypatch
):
    """c's VMs use 8 of c's 16 window segments for BARs, within extents of 12. A reserve for
    an 8 GiB BAR is admitted; meanwhile another thread of the process releases a VM, which
    gives 4 units of extent back, and a's VM takes them and 4 more for its DMA window. The
    reserve must decide on the extents as they are now (8, which it must grow, and cannot),
    not as its admission saw them (12, which a decision within them compares no block of)."""
    from vmlend.ledger import ledger

    url = _url(etcd_url)
    bars = "".join(
        f'\n  [[node.device]]\n  fdid = {0x200 + i}\n  bdf = "0000:{i + 1:02x}:00.0"\n'
        f'  kind = "nic"\n  vendor = 0x8086\n  device = 0x1521\n  class = 0x020000\n'
        f'  bars = [ {{ index = 0, size = "{size}", kind = "mem64" }} ]\n'
        for i, size in enumerate(("4GiB", "4GiB", "4GiB", "8GiB"))
    )
    text = _text(
        "stale", _sized("a", 1, 0, 16), _sized("b", 2, 0, 16) + bars, _sized("c", 3, 1, 16)
    )
    fabrics = _open(url, text, {"a": "a", "c": "c"})
    a, c = fabrics["a"], fabrics["c"]
    try:
        for i in range(3):
            c.reserve(0x200 + i, Holder("c", f"vm{i}"), guest_ram=GiB)
        assert c.release(0x201, Holder("c", "vm1"))
        real = ledger.admit
        landed: list[str] = []

        def admit(*args, **kwargs):
            if not landed:
                landed.append("")

                def other() -> None:
                    assert c.release(0x202, Holder("c", "vm2"))
                    a.reserve(0x300, Holder("a", "vm0"), guest_ram=8 * GiB)
                    landed.append("a's DMA window on c:0")

                thread = threading.Thread(target=other)
                thread.start()
                thread.join()
            return real(*args, **kwargs)

        monkeypatch.setattr(ledger, "admit", admit)
        with contextlib.suppress(ResourceExhaustedError):
            c.reserve(0x203, Holder("c", "vm3"), guest_ram=GiB)
        monkeypatch.setattr(ledger, "admit", real)
        assert landed[-1] == "a's DMA window on c:0"
        ledgers_agree_with_blocks(url)
        _within_capacity(c)
    finally:
        _close(fabrics)


def test_a_vm_leaving_a_shared_entry_for_one_of_its_own_grows_its_node(etcd_url):
    """Six VMs of c each claim a requester entry on c's adapter; a recount makes them one
    share, then six again. Each VM's own count there never changes (1), but the node's does
    (6, 1, 6): the growth is per share, so the node's extents grow back with it."""
    from vmlend.registry.records import Claim, ClaimKind

    url = _url(etcd_url)
    text = _text("share", _sized("a", 1, 0, 16), _sized("b", 2, 6, 16), _sized("c", 3, 0, 16, 10))
    fabrics = _open(url, text, {"c": "c"})
    c = fabrics["c"]

    def relabel(fdid: int, share: str) -> None:
        def body(tx) -> None:
            mine = [cl for f, cl in tx.claims() if f == fdid and cl.kind is ClaimKind.LUT]
            tx.replace_claims(
                ClaimKind.LUT,
                [fdid],
                [
                    (
                        fdid,
                        Claim(
                            cl.adapter,
                            cl.kind,
                            share if cl.adapter == "c:0" else cl.share,
                            entries=cl.entries,
                        ),
                    )
                    for cl in mine
                ],
            )

        c.registry.transact(body)

    try:
        for i in range(6):
            c.reserve(0x200 + i, Holder("c", f"v{i}"), guest_ram=GiB)
        for i in range(6):
            relabel(0x200 + i, "req:b/shared")
        for i in range(6):
            relabel(0x200 + i, f"req:b/own{i}")
        ledgers_agree_with_blocks(url)
        _within_capacity(c)
    finally:
        _close(fabrics)


def test_a_nodes_slack_is_given_back_to_another_host_short_of_units(etcd_url):
    """b's extents keep a chunk of slack after its last VM released (so a reserve and
    release cycle does not take and give back every time). Another host's VM short of units
    there is not refused for it: its take makes b give the slack back. Where b still uses
    part of a block, the block is cut to what b uses."""
    url = _url(etcd_url)
    fabrics = _open(url, TOPOLOGY, {"b": "b", "c": "c"})
    b, c = fabrics["b"], fabrics["c"]
    try:
        b.reserve(0x100, Holder("b", "vm0"), guest_ram=GiB)
        assert b.release(0x100, Holder("b", "vm0"))
        assert unit_keys_held(url, extents=True)[("b:0", "seg")] == 1  # b holds nothing
        c.reserve(0x200, Holder("c", "vm0"), guest_ram=4 * GiB)  # all 4 of b:0's segments
        ledgers_agree_with_blocks(url)
        _within_capacity(c)
    finally:
        _close(fabrics)
    url = _url(etcd_url)
    text = _text("cut", _node("a", 1, 2), _sized("b", 2, 1, 8), _node("c", 3, 0))
    fabrics = _open(url, text, {"b": "b", "c": "c"})
    b, c = fabrics["b"], fabrics["c"]
    try:
        b.reserve(0x100, Holder("b", "vm0"), guest_ram=GiB)  # 1 segment, in an extent of 2
        assert unit_blocks_held(url, extents=True)[("b:0", "seg")] == [(0, 2)]
        c.reserve(0x200, Holder("c", "vm0"), guest_ram=7 * GiB)  # the other 7 of 8
        assert unit_blocks_held(url, extents=True)[("b:0", "seg")] == [(0, 1)]
        with pytest.raises(ResourceExhaustedError):
            b.reserve(0x101, Holder("b", "vm1"), guest_ram=GiB)
        ledgers_agree_with_blocks(url)
        _within_capacity(c)
    finally:
        _close(fabrics)


def test_a_release_by_a_process_not_deciding_meets_no_change_to_other_vms(etcd_url):
    """A hook without the agent releases c's VM in a process that does not decide for c:
    it takes nothing over, so a reserve for another VM of c committed meanwhile (by the
    deciding process) does not make it run again."""
    url = _url(etcd_url)
    fabrics = _open(url, TOPOLOGY, {"c": "c", "hook": "c"})
    c, hook = fabrics["c"], fabrics["hook"]
    try:
        c.reserve(0x100, Holder("c", "vm0"), guest_ram=GiB)
        _landing_first(hook, lambda: c.reserve(0x101, Holder("c", "vm1"), guest_ram=GiB))
        assert hook.release(0x100, Holder("c", "vm0"))
        hook._restore()
        assert (hook.registry.conflicts, hook.registry.stale) == (0, 0)
        ledgers_agree_with_blocks(url)
    finally:
        _close(fabrics)


def test_a_commit_left_unanswered_makes_another_threads_decision_run_again(etcd_url, monkeypatch):
    """b's VMs use 2 of b's adapter's 3 usable entries. A reserve for a third VM of b is
    admitted; meanwhile another thread of the process releases a VM and its commit's answer
    is lost, which drops the process's tally (the node is to be taken over again), and c's
    VM takes the last free entry. The reserve must not decide on what is left of the tally
    (its attempts in flight, none of the committed claims): it runs again, takes b over,
    and is refused; b's adapter never holds more than its room."""
    from vmlend.ledger import ledger
    from vmlend.registry.etcd_gateway import RegistryUnreachableError

    url = _url(etcd_url)
    fabrics = _open(url, TOPOLOGY, {"b": "b", "c": "c"})
    b, c = fabrics["b"], fabrics["c"]
    try:
        b.reserve(0x100, Holder("b", "vm0"), guest_ram=GiB)
        b.reserve(0x101, Holder("b", "vm1"), guest_ram=GiB)
        gateway = b.registry.gateway
        commit = gateway.txn

        def lost(compare, success):
            gateway.txn = commit
            raise RegistryUnreachableError("etcd", "the answer was lost")

        admit = ledger.admit
        landed: list[str] = []

        def admitting(*args, **kwargs):
            if not landed:
                landed.append("admission")
                gateway.txn = lost
                with contextlib.suppress(VmlendError, RegistryUnreachableError):
                    b.release(0x101, Holder("b", "vm1"))
                _landing_first(
                    b, lambda: landed.append(str(c.reserve(0x200, Holder("c", "vm0")).created))
                )
            return admit(*args, **kwargs)

        monkeypatch.setattr(ledger, "admit", admitting)
        with contextlib.suppress(VmlendError):
            b.reserve(0x102, Holder("b", "vm2"), guest_ram=GiB)
        monkeypatch.setattr(ledger, "admit", admit)
        b._restore()
        assert landed == ["admission", "True"]
        _within_capacity(c)
        ledgers_agree_with_blocks(url)
    finally:
        _close(fabrics)
