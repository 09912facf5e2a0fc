"""The kernel backend acts on a child's ``SMARTIO_BARS`` and ``SMARTIO_P2P``
(docs/smartio-contract.md section 8): it writes each source's ``p2p`` as ``plan_p2p``
computes it, with the hold's token, keeps ``p2p_state`` as ``p2p-map`` records, waits on
``ENOTCONN``/``EAGAIN`` and refuses a plan that needs more than admission claimed."""

# ruff: noqa: F811 (the imported fixtures are parameters of the tests)

from __future__ import annotations

from tests.support.fake_sysfs import RacingWriter
from tests.support.p2p_host import (  # noqa: F401
    BARS_A,
    BARS_B,
    GPU_A,
    GPU_B,
    UA,
    UB,
    p2p,
    token,
    web,
)
from tests.support.smartio_host import WEB, fabric, fake, state  # noqa: F401
from vmlend.kernel.p2pfiles import lines_for
from vmlend.kernel.p2pio import P2PFiles
from vmlend.kernel.p2psync import P2PSync
from vmlend.kernel.udev import Uevent
from vmlend.p2p import RECORD_KIND, GuestBar, peer_device, plan_p2p
from vmlend.registry.records import ClaimKind


def _records(fabric, fdid):
    with fabric.registry.read() as tx:
        return {r.key: r.data for r in tx.runtime(fdid, RECORD_KIND)}


def _watch(fabric, fake):
    """The watcher ``vmlend mdev watch`` runs, hearing the fake's events as they come."""
    watcher = fabric.watcher()
    fake.listeners.append(watcher.handle)
    return watcher


def _expected(fabric, source):
    topo = fabric.topology()
    devs = [peer_device(topo.device(f), {b.index: 0 for b in topo.device(f).bars})
            for f in (GPU_A, GPU_B)]  # fmt: skip
    bars = [
        GuestBar(f, i, g, next(b.size for b in topo.device(f).bars if b.index == i))
        for f, where in ((GPU_A, BARS_A), (GPU_B, BARS_B))
        for i, g in where.items()
    ]
    return plan_p2p(topo, "gamma", devs, bars).from_source(source)


def test_smartio_bars_writes_every_sources_maps_with_its_holds_token(fabric, fake, web):
    _watch(fabric, fake)
    web.decode(UA, BARS_A)
    web.decode(UB, BARS_B)
    for source, uuid in ((GPU_A, UA), (GPU_B, UB)):
        planned = _expected(fabric, source)
        assert len(planned) == 3
        written = web.children[uuid]
        assert written.token == token(fabric, source)
        assert [(ln.target, ln.bar, ln.gpa, ln.size) for ln in web.written(uuid)] == [
            (ln.target, ln.bar, ln.gpa, ln.size) for ln in lines_for(planned)
        ]
        records = _records(fabric, source)
        assert sorted(records) == sorted(m.key for m in planned)
        m = planned[0]
        assert records[m.key]["case"] == "other-lender"
        assert records[m.key]["route"] == list(m.route)
        assert records[m.key]["adapter"] == m.path.src.ref
        assert records[m.key]["segments"]  # the driver's numbers, from p2p_state


def test_a_guest_decoding_one_device_maps_only_towards_it(fabric, fake, web):
    _watch(fabric, fake)
    web.decode(UB, BARS_B)
    assert {ln.target for ln in web.written(UA)} == {GPU_B}
    assert web.written(UB) == []  # nothing of 0x10 is decoded yet
    assert web.children[UB].writes == [f"token {token(fabric, GPU_B)}\n"]
    assert _records(fabric, GPU_B) == {}


def test_a_device_not_borrowed_yet_waits_for_the_next_event(fabric, fake, web, caplog):
    fake.smartio.guest_release(GPU_B)
    sync = P2PSync(fabric)
    web.decode(UB, BARS_B, announce=False)
    out = sync.handle(web.announce(UB, bars=True))
    assert out is not None and out.error == ""
    assert out.waiting == (GPU_A,)  # ENOTCONN: 0x20 is not borrowed now
    assert web.written(UA) == []
    assert _records(fabric, GPU_A) == {}
    fake.smartio.guest_enable(GPU_B)
    out = sync.handle(web.announce(UB, bars=True))
    assert out is not None and GPU_A in out.written
    assert len(web.written(UA)) == 3


def test_a_bar_moved_while_vmlend_planned_waits_eagain(fabric, fake, web):
    web.decode(UB, BARS_B, announce=False)
    moved = {**BARS_B, 1: 0xA0_0000_0000}
    racing = RacingWriter(fake, lambda: web.decode(UB, moved, announce=False))
    sync = P2PSync(fabric, P2PFiles(fake.env, racing))
    out = sync.handle(web.announce(UB, bars=True))
    assert out is not None and out.error == "" and GPU_A in out.waiting
    assert web.written(UA) == []
    out = sync.handle(web.announce(UB, bars=True))  # the event the move sends
    assert out is not None and GPU_A in out.written
    assert (1, 0xA0_0000_0000) in {(ln.bar, ln.gpa) for ln in web.written(UA)}


def test_an_older_token_is_refused_and_reported_not_raised(fabric, fake, web):
    newer = token(fabric, GPU_A) + 100  # a newer hold has the device
    fake.write(fake.env.smartio / "smartio-10" / "token", str(newer))
    sync = P2PSync(fabric)
    web.decode(UB, BARS_B, announce=False)
    out = sync.handle(web.announce(UB, bars=True))
    assert out is not None
    assert f"newer hold (token {newer})" in out.error
    assert web.written(UA) == []


def test_a_plan_beyond_the_claims_writes_nothing(fabric, fake, web):
    def drop(tx):
        tx.replace_claims(ClaimKind.P2P, [GPU_A, GPU_B], [])

    fabric.registry.transact(drop)
    sync = P2PSync(fabric)
    web.decode(UA, BARS_A, announce=False)
    web.decode(UB, BARS_B, announce=False)
    out = sync.handle(web.announce(UB, bars=True))
    assert out is not None
    assert "needs more than admission claimed" in out.error
    assert "admission claimed 0" in out.error
    assert web.children[UA].writes == [] and web.children[UB].writes == []


def test_the_drivers_own_removal_updates_the_records(fabric, fake, web):
    _watch(fabric, fake)
    web.decode(UA, BARS_A)
    web.decode(UB, BARS_B)
    assert len(_records(fabric, GPU_A)) == 3
    web.decode(UB, {})  # decoding off: the driver drops every map to 0x20, SMARTIO_P2P
    assert web.written(UA) == []
    assert _records(fabric, GPU_A) == {}
    assert len(_records(fabric, GPU_B)) == 3  # 0x10's BARs are still decoded


def test_a_smartio_p2p_keeps_the_records_of_maps_still_in_place(fabric, fake, web):
    _watch(fabric, fake)
    web.decode(UA, BARS_A)
    web.decode(UB, BARS_B)
    before = _records(fabric, GPU_A)
    web.decode(UB, {0: BARS_B[0], 3: BARS_B[3]})  # BAR 1 off
    after = _records(fabric, GPU_A)
    assert sorted(after) == ["0x20/bar0", "0x20/bar3"]
    assert after["0x20/bar0"] == before["0x20/bar0"]


def test_events_of_children_vmlend_did_not_make_are_ignored(fabric, fake, web):
    sync = P2PSync(fabric)
    ev = Uevent("change", "83b8f4f2-509f-382f-3c1e-e6bfe0fa9999", "mdev", {"SMARTIO_BARS": "1"})
    assert sync.handle(ev) is None
    assert sync.handle(Uevent("add", UA, "mdev", {})) is None
    assert web.children[UA].writes == []


def test_the_watcher_still_reacts_to_parents(fabric, fake, web):
    watcher = _watch(fabric, fake)
    watcher.discover()
    fake.smartio.set_availability(GPU_A, "unreachable")
    assert WEB.vm in {r.vm for r in watcher.reactions}


def test_records_read_under_a_hold_that_ended_meanwhile_are_not_kept(fabric, fake, web):
    """SMARTIO_P2P often comes while a borrow ends: the watcher found the child under one
    hold, and by the time it writes, that hold is gone and another took the device. The maps
    it read are the old VM's: nothing is kept under the new hold."""
    from vmlend.kernel.p2pevents import Child

    _watch(fabric, fake)
    web.decode(UA, BARS_A)
    web.decode(UB, BARS_B)
    assert _records(fabric, GPU_A)
    fabric.registry.transact(lambda tx: tx.clear_runtime(GPU_A, RECORD_KIND))
    stale = Child(UA, GPU_A, token(fabric, GPU_A) - 1)  # found under an older hold
    P2PSync(fabric)._record_state(stale)
    assert _records(fabric, GPU_A) == {}
    P2PSync(fabric)._record_state(Child(UA, GPU_A, token(fabric, GPU_A)))  # the hold of now
    assert len(_records(fabric, GPU_A)) == 3
