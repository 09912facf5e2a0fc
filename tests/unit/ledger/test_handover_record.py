"""The hand-over record of a hot migration (``vmlend.ledger.handover_record``) and the claims
beside it (``vmlend.ledger.handover``): what a destination's prepare hook accepts as arriving
devices, and that claiming the destination's room and abandoning it leaves the source's
claims as they were."""

from __future__ import annotations

import pytest

from tests.support.simfabric import make_fabric
from vmlend.ledger import handover
from vmlend.ledger.handover_record import (
    KIND,
    HandOverRecord,
    HandOverRefusedError,
    arrival,
    read,
)
from vmlend.registry import HoldRecord, Phase
from vmlend.topology.model import GiB, Holder

U = "0e6b3a2c-7d84-4d0e-9a41-5f3e2b1c0d9e"
OTHER = "5b0c4c9e-3f4a-4e57-8d0b-2c1a9f6e7d11"
HERE = Holder("beta", "vm1", U)
REC = HandOverRecord("vm1", U, "gamma", "beta", {0x10: 7, 0x12: 8})


def hold(fdid: int, node: str = "gamma", vm_uuid: str = U, token: int = 0) -> HoldRecord:
    tokens = {0x10: 7, 0x12: 8}
    return HoldRecord(fdid, Holder(node, "vm1", vm_uuid), 0.0, Phase.RESERVED, 0,
                      token or tokens[fdid])


HOLDS = {0x10: hold(0x10), 0x12: hold(0x12)}
FOUND = {0x10: [REC], 0x12: [REC]}


SRC = Holder("gamma", "vm1", U)
#: The same VM with an NVMe share of drive 0x40 at epoch 3.
SREC = HandOverRecord("vm1", U, "gamma", "beta", {0x10: 7, 0x12: 8}, shares={0x40: 3})
SFOUND = {0x10: [SREC], 0x12: [SREC], 0x40: [SREC]}


def test_the_recorded_devices_of_the_recorded_vm_arrive():
    assert arrival(FOUND, HOLDS, HERE, [0x10, 0x12]) == REC


def test_the_recorded_share_of_the_recorded_vm_arrives_with_its_devices():
    assert arrival(SFOUND, HOLDS, HERE, [0x10, 0x12], {0x40: (SRC, 3)}) == SREC


@pytest.mark.parametrize(
    ("found", "holder"),
    [
        ({}, HERE),  # no record: a plain start
        (FOUND, Holder("alpha", "vm1", U)),  # the VM starts elsewhere than the record says
        (FOUND, Holder("beta", "vm2", OTHER)),  # another VM: its own prepare, as always
        (FOUND, Holder("beta", "vm1", "")),  # a holder without a UUID never arrives
    ],
)
def test_nothing_arrives_without_a_record_naming_this_vm_here(found, holder):
    assert arrival(found, HOLDS, holder, [0x10, 0x12]) is None


@pytest.mark.parametrize(
    ("found", "holds", "fdids", "shares", "why"),
    [
        (FOUND, HOLDS, [0x10], (), "the record names devices 0x10, 0x12, the VM's XML 0x10"),
        (FOUND, HOLDS, [0x10, 0x12, 0x11], (), "the VM's XML 0x10, 0x11, 0x12"),
        ({0x10: [REC]}, HOLDS, [0x10, 0x12], (), "device 0x12 carries no record of it"),
        (FOUND, {0x10: HOLDS[0x10], 0x12: None}, [0x10, 0x12], (), "0x12 is held by nobody"),
        (
            FOUND,
            {**HOLDS, 0x12: hold(0x12, vm_uuid=OTHER)},
            [0x10, 0x12],
            (),
            "device 0x12 is held by gamma/vm1, not by this VM on gamma",
        ),
        (
            FOUND,
            {**HOLDS, 0x12: hold(0x12, node="alpha")},
            [0x10, 0x12],
            (),
            "device 0x12 is held by alpha/vm1",
        ),
        (
            FOUND,
            {**HOLDS, 0x10: hold(0x10, token=9)},
            [0x10, 0x12],
            (),
            "device 0x10's hold has token 9, the record 7",
        ),
        (
            {0x10: [REC], 0x12: [HandOverRecord("vm1", U, "gamma", "beta", {0x12: 8})]},
            HOLDS,
            [0x10, 0x12],
            (),
            "its devices carry different hand-over records",
        ),
        (FOUND, HOLDS, [0x10, 0x12], {0x40: None}, "NVMe shares of none, the VM's XML of 0x40"),
        (SFOUND, HOLDS, [0x10, 0x12], {}, "NVMe shares of 0x40, the VM's XML of none"),
        (SFOUND, HOLDS, [0x10, 0x12], {0x40: None}, "no share of drive 0x40 on gamma"),
        (SFOUND, HOLDS, [0x10, 0x12], {0x40: (Holder("alpha", "vm1", U), 3)}, "no share of"),
        (SFOUND, HOLDS, [0x10, 0x12], {0x40: (Holder("gamma", "vm1", OTHER), 3)}, "no share of"),
        (SFOUND, HOLDS, [0x10, 0x12], {0x40: (SRC, 2)}, "at epoch 2, the record's 3"),
        (
            {0x10: [SREC], 0x12: [SREC]},
            HOLDS,
            [0x10, 0x12],
            {0x40: (SRC, 3)},
            "drive 0x40 carries no record of it",
        ),
    ],
)
def test_a_record_that_does_not_match_is_refused(found, holds, fdids, shares, why):
    with pytest.raises(HandOverRefusedError) as e:
        arrival(found, holds, HERE, fdids, shares)
    msg = str(e.value)
    assert msg.startswith(f"the hot migration of VM 'vm1' ({U}) from gamma does not match: ")
    assert why in msg and msg.endswith("nothing was borrowed")


def claims(fabric) -> list[object]:
    with fabric.registry.read() as tx:
        return sorted(map(repr, tx.claims()))


def test_claim_then_abandon_leaves_the_source_claims_and_no_record(state_path):
    fabric = make_fabric(state_path)
    src, dst = Holder("gamma", "vm1", U), Holder("beta", "vm1", U)
    for fdid in (0x10, 0x12):
        fabric.reserve(fdid, src, guest_ram=1 * GiB, msi_over_ntb=True)
    before = claims(fabric)
    claimed = handover.claim_destination(fabric.registry, [0x10, 0x12], src, dst, 1 * GiB)
    with fabric.registry.read() as tx:
        found = read(tx, [0x10, 0x12], U)
        assert {f: len(r) for f, r in found.items()} == {0x10: 1, 0x12: 1}
        assert found[0x10][0].devices == {f: h.token for f, h in tx.holds().items()}
    # the lender's LUT entry serves either borrower: claimed once, kept by the source
    assert all(c not in claimed.added[f] for f in (0x10, 0x12) for c in claimed.claims[f]
               if c.adapter == "alpha:0" and c.kind.value == "lut")
    # a second claim (a re-run after a kill) replaces the first with what it claimed
    again = handover.claim_destination(fabric.registry, [0x10, 0x12], src, dst, 1 * GiB)
    assert again == claimed
    handover.abandon(fabric.registry, again)
    handover.abandon(fabric.registry, again)  # idempotent
    assert claims(fabric) == before
    with fabric.registry.read() as tx:
        assert tx.runtime(kind=KIND) == []
    fabric.close()
