"""The fencing token is checked where the device is (docs/cluster.md, rule 3): every step that
acts on a device for a hold carries that hold's token, and the device refuses a step of a hold
older than one it has already served. A partitioned or frozen holder whose hold ended cannot
borrow the device again, and a late take-back never ends a newer holder's borrow."""

from __future__ import annotations

import pytest

from tests.support.simcluster import Cluster, domain_xml
from tests.support.simfabric import make_fabric
from vmlend.errors import StaleTokenError
from vmlend.registry import FenceRecord
from vmlend.topology.model import GiB, Holder

GPU = 0x10


def _token(c: Cluster, fdid: int) -> int:
    return c.fabric().holds()[fdid].token


def _release_behind(c: Cluster, fdid: int, holder: Holder) -> None:
    """What ends a hold behind its VM (its host's lease ran out): the hold and its mdev go."""
    fabric = c.fabric(holder.node)
    assert fabric.release(fdid, holder)
    for m in fabric.mdevs():
        if m.fdid == fdid and m.vm == holder.vm:
            fabric.remove_mdev(m.uuid)


def test_a_stale_holders_late_borrow_is_refused_by_the_device(cluster):
    a = cluster.start(domain_xml("a", 1 * GiB, fdids=(GPU,)))
    a.enable_device(GPU)
    stale = _token(cluster, GPU)
    assert cluster.hw.token(GPU) == stale > 0
    # a's hold ends behind it (its host's lease ran out); b takes the device and stops again
    _release_behind(cluster, GPU, a.holder)
    xb = domain_xml("b", 1 * GiB, fdids=(GPU,))
    b = cluster.start(xb)
    b.enable_device(GPU)
    assert cluster.hw.token(GPU) > stale
    b.stop()
    cluster.release(xb)
    assert cluster.hw.borrowed(GPU) is None
    # a's host, cut off, still believes in its hold: its late borrow reaches the device
    with pytest.raises(StaleTokenError, match="fencing token"):
        cluster.hw.borrow(GPU, "gamma", "a", token=stale)
    assert cluster.hw.borrowed(GPU) is None
    a.stop()


def test_a_taken_back_holders_borrow_is_refused_before_any_newer_hold_comes(cluster):
    """Found by the protocol model (take-back-forgets-token): the lender took the device back
    for a's ended hold, and nobody holds it yet. a's host, cut off, still believes in its hold
    and borrows again with its token, still the device's newest: the device refuses it."""
    a = cluster.start(domain_xml("a", 1 * GiB, fdids=(GPU,)))
    a.enable_device(GPU)
    stale = _token(cluster, GPU)
    fence = FenceRecord(GPU, a.holder, stale)
    _release_behind(cluster, GPU, a.holder)
    # the lender's take-back (SQLite keeps no fence record to clear, so it answers False; the
    # device is reset and the token spent all the same)
    cluster.fabric("alpha").take_back(fence)
    assert cluster.hw.token(GPU) == stale  # no newer hold yet
    with pytest.raises(StaleTokenError, match="fencing token"):
        cluster.hw.borrow(GPU, "gamma", "a", token=stale)
    assert cluster.hw.borrowed(GPU) is None
    a.stop()


def test_a_late_take_back_never_ends_a_newer_holders_borrow(cluster):
    a = cluster.start(domain_xml("a", 1 * GiB, fdids=(GPU,)))
    a.enable_device(GPU)
    fence = FenceRecord(GPU, a.holder, _token(cluster, GPU))  # what a's ended hold left
    _release_behind(cluster, GPU, a.holder)
    a.stop()
    b = cluster.start(domain_xml("b", 1 * GiB, fdids=(GPU,)))
    b.enable_device(GPU)
    lender = cluster.fabric("alpha")
    assert lender.take_back(fence) is False  # the lender's slow scan acts on an old fence
    assert cluster.hw.borrowed(GPU).vm == "b"
    (t,) = cluster.hw.dma_write(GPU, 0x1000, b"b's")
    assert (t.kind, t.owner) == ("ram", "b")
    b.stop()


def test_the_token_is_recorded_once_and_only_grows(cluster):
    fabric = cluster.fabric()
    holder = Holder("gamma", "x")
    fabric.reserve(GPU, holder)
    first = _token(cluster, GPU)
    fabric.borrow(GPU, holder)
    assert cluster.hw.token(GPU) == first
    fabric.borrow(GPU, holder)  # idempotent: the same hold, the same token
    fabric.give_back(GPU, holder)
    assert cluster.hw.token(GPU) == first
    fabric.release(GPU, holder)
    fabric.reserve(GPU, holder)
    assert _token(cluster, GPU) > first


def test_the_fence_carries_the_token_of_the_hold_that_left_it(etcd_url):
    fabric = make_fabric(etcd_url)
    try:
        fabric.reserve(GPU, Holder("gamma", "web"))
        with fabric.registry.read() as tx:
            hold, fence = tx.hold(GPU), tx.fence(GPU)
        assert fence is not None and hold is not None
        assert fence.token == hold.token > 0
    finally:
        fabric.close()


def test_taking_back_a_fenced_device_cuts_the_vanished_holders_open_mdev(cluster):
    """The holder's lease ended before its guest enabled the device: nothing was borrowed,
    but its VM still has the mdev open; the take-back cuts it, so the next holder's VM can
    open its own."""
    a = cluster.start(domain_xml("a", 1 * GiB, fdids=(GPU,)))
    fence = FenceRecord(GPU, a.holder, _token(cluster, GPU))
    _release_behind(cluster, GPU, a.holder)
    cluster.hw.open_mdev("22222222-0000-0000-0000-000000000001", GPU, "gamma", "a")
    assert cluster.fabric("alpha").take_back(fence) is False  # SQLite keeps no fences
    assert cluster.hw.open_mdevs() == []
    b = cluster.start(domain_xml("b", 1 * GiB, fdids=(GPU,)))
    assert b.devices() == [GPU]
    b.enable_device(GPU)
    a.stop()
    b.stop()
