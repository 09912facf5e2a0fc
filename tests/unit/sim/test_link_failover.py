"""An exclusive device across a link fault (issue 23 part 3): the fault is reported (a record
on the hold, shown by ``vmlend status``, and a line in the action log) and the device's
crossing is re-established over another route when one exists, with the hold's fencing token,
without the guest resetting the device. A link that comes back ends the report; one that
comes back without its mappings has them programmed again."""

from __future__ import annotations

import pytest

from tests.support.simcluster import assert_matches_registry, domain_xml
from vmlend.errors import StaleTokenError
from vmlend.ledger.linkfaults import LINK_FAULT
from vmlend.sim.invariants import check_hardware
from vmlend.topology.model import GiB

GPA = 64 * 4096
PRIMARY = "mxs824/gamma:0"
BACKUP = "mxs824b/gamma:1"
LENDER = "mxs824/alpha:0"


@pytest.fixture
def vm(cluster):
    vm = cluster.start(domain_xml("web", 1 * GiB, fdids=(0x12,)))
    vm.enable_device(0x12)
    vm.guest.write(GPA, b"guest data")
    return vm


def faults(cluster) -> dict[str, dict]:
    with cluster.registry.read() as tx:
        return {r.key: r.data for r in tx.runtime(kind=LINK_FAULT)}


def test_a_link_down_moves_the_crossing_without_resetting_the_device(cluster, vm):
    hw = cluster.hw
    config_before = [hw.device(0x12).config.read(o, 4) for o in range(0, 0x100, 4)]
    change = cluster.fabric().set_link_up(PRIMARY, False)
    (fault,) = change.faults
    assert (fault.fdid, fault.state) == (0x12, "rerouted")
    assert fault.path == "alpha:0 -> gamma:1 via mxs824, mxs824b"
    assert fault.was == "alpha:0 -> gamma:0 via mxs824"
    assert hw.borrowed(0x12).path.dst.ref == "gamma:1"
    # the guest's DMA goes on: same addresses, no reset (config space untouched)
    assert hw.dma_read(0x12, GPA, 10) == b"guest data"
    hw.dma_write(0x12, GPA, b"moved over")
    assert vm.guest.read(GPA, 10) == b"moved over"
    assert [hw.device(0x12).config.read(o, 4) for o in range(0, 0x100, 4)] == config_before
    # reported on the hold, and its claims followed it to gamma:1
    assert faults(cluster)[PRIMARY]["state"] == "rerouted"
    assert {c.adapter for f, c in cluster.claims() if f == 0x12} == {
        "alpha:0",
        "gamma:1",
        # and its switch port requester entries to the new route's ports
        "mxs824/alpha:0",
        "mxs824/mxs824b",
        "mxs824b/mxs824",
        "mxs824b/gamma:1",
    }
    assert_matches_registry(cluster)
    # the cable comes back: the report ends, the device stays where it works
    back = cluster.fabric().set_link_up(PRIMARY, True)
    assert [f.state for f in back.faults] == ["recovered"] and faults(cluster) == {}
    assert hw.dma_read(0x12, GPA, 10) == b"moved over"
    assert_matches_registry(cluster)


def hold_token(cluster, fdid: int) -> int:
    with cluster.registry.read() as tx:
        return tx.hold(fdid).token


def test_the_reroute_carries_the_holds_fencing_token(cluster, vm):
    """``set_link_up`` re-routes with the hold's token, so a device that has since served a
    newer hold refuses the step: the fault is reported failed and nothing moves. (Carried
    without a token, the step would be taken and the device moved for an ended hold.)"""
    hw = cluster.hw
    token = hold_token(cluster, 0x12)
    hw.reroute(0x12, token=token + 1)  # a newer hold's step: its route works, nothing moved
    assert hw.borrowed(0x12).path.dst.ref == "gamma:0"
    (fault,) = cluster.fabric().set_link_up(PRIMARY, False).faults
    assert fault.state == "failed", fault.line()
    assert f"(fencing token {token}) refused" in fault.detail
    assert hw.borrowed(0x12).path.dst.ref == "gamma:0"  # left on its dead route
    assert faults(cluster)[PRIMARY]["state"] == "failed"


def test_the_link_back_carries_the_holds_fencing_token_too(cluster, vm):
    hw = cluster.hw
    token = hold_token(cluster, 0x12)
    cluster.fabric().set_link_up(PRIMARY, False)  # re-routed with the hold's own token
    assert hw.borrowed(0x12).path.dst.ref == "gamma:1" and hw.token(0x12) == token
    hw.reroute(0x12, token=token + 1)  # a newer hold's step
    (back,) = cluster.fabric().set_link_up(PRIMARY, True).faults
    assert back.state == "failed", back.line()
    assert f"(fencing token {token}) refused" in back.detail
    assert faults(cluster)[PRIMARY]["state"] == "failed"


def test_the_hardware_refuses_a_reroute_of_an_older_hold(cluster, vm):
    hw = cluster.hw
    token = hold_token(cluster, 0x12)
    hw.reroute(0x12, token=token + 1)  # a newer hold's step: its route works, nothing moved
    hw.link_down(PRIMARY)
    with pytest.raises(StaleTokenError):
        hw.reroute(0x12, token=token)
    assert hw.borrowed(0x12).path.dst.ref == "gamma:0"  # nothing moved
    hw.reroute(0x12, token=token + 1)  # the newer hold's step is taken
    assert hw.borrowed(0x12).path.dst.ref == "gamma:1"


def test_without_another_route_the_fault_is_reported_until_the_link_is_back(cluster, vm):
    hw = cluster.hw
    (fault,) = cluster.fabric().set_link_up(LENDER, False).faults
    assert fault.state == "down" and "no other route" in fault.detail
    assert hw.dma_read(0x12, GPA, 4) == b"\xff" * 4
    assert faults(cluster)[LENDER]["state"] == "down"
    assert_matches_registry(cluster)  # nothing to re-route to: not a violation
    (back,) = cluster.fabric().set_link_up(LENDER, True).faults
    assert back.state == "recovered" and faults(cluster) == {}
    assert hw.dma_read(0x12, GPA, 10) == b"guest data"


def test_a_link_back_without_its_mappings_has_them_programmed_again(cluster, vm):
    hw = cluster.hw
    cluster.fabric().set_link_up(LENDER, False)
    (back,) = cluster.fabric().set_link_up(LENDER, True, keep_mappings=False).faults
    assert back.state == "recovered"
    assert not hw.adapter("alpha:0").lost
    assert hw.dma_read(0x12, GPA, 10) == b"guest data"
    assert_matches_registry(cluster)
    # the borrower's side: gamma:0 reset while the device had moved to gamma:1
    cluster.fabric().set_link_up(PRIMARY, False)
    cluster.fabric().set_link_up(PRIMARY, True, keep_mappings=False)
    assert hw.borrowed(0x12).path.dst.ref == "gamma:1"
    assert hw.dma_read(0x12, GPA, 10) == b"guest data"
    assert_matches_registry(cluster)


def test_both_of_gammas_cables_down_then_one_back(cluster, vm):
    hw = cluster.hw
    cluster.fabric().set_link_up(PRIMARY, False)
    (second,) = cluster.fabric().set_link_up(BACKUP, False).faults
    assert second.state == "down"
    assert hw.dma_read(0x12, GPA, 4) == b"\xff" * 4
    (back,) = cluster.fabric().set_link_up(PRIMARY, True).faults
    assert back.state == "recovered" and hw.borrowed(0x12).path.dst.ref == "gamma:0"
    assert hw.dma_read(0x12, GPA, 10) == b"guest data" and faults(cluster) == {}
    assert_matches_registry(cluster)


def test_new_reservations_route_around_a_dead_cable(cluster):
    cluster.fabric().set_link_up(PRIMARY, False)
    vm = cluster.start(domain_xml("late", 1 * GiB, fdids=(0x11,)))
    vm.enable_device(0x11)
    assert cluster.hw.borrowed(0x11).path.dst.ref == "gamma:1"
    assert {c.adapter for f, c in cluster.claims() if f == 0x11} == {
        "alpha:0",
        "gamma:1",
        "mxs824/alpha:0",
        "mxs824/mxs824b",
        "mxs824b/mxs824",
        "mxs824b/gamma:1",
    }
    assert_matches_registry(cluster)


def test_the_checker_flags_a_device_left_on_a_dead_route(cluster, vm):
    cluster.hw.link_down(PRIMARY)  # the hardware alone: nobody re-routes the device
    found = check_hardware(cluster.hw)
    assert [(v.kind, v.where) for v in found] == [("link", "device 0x12")]
    assert "while alpha:0 -> gamma:1" in found[0].detail
    cluster.hw.link_up(PRIMARY)
    cluster.hw.link_down(LENDER)  # no other route from alpha:0: nothing to flag
    assert check_hardware(cluster.hw) == []
