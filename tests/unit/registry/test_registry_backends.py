"""What main's admission writes - peer-to-peer claims re-counted as a VM's devices come and
go, the interrupt window of MSI over the NTB - reads back the same from both registry
backends (SQLite and a real etcd)."""

from __future__ import annotations

import pytest

from tests.support.daemon_marks import REGISTRIES
from tests.support.simfabric import make_fabric
from vmlend.registry import ClaimKind
from vmlend.topology.model import GiB, Holder

VM1 = Holder("gamma", "vm1", "11111111-1111-1111-1111-111111111111")
GPU_ALPHA, GPU_BETA, NVME = 0x10, 0x20, 0x12


@pytest.fixture(params=REGISTRIES)
def fabric(request, state_path):
    where = state_path if request.param == "sqlite" else request.getfixturevalue("etcd_url")
    f = make_fabric(where)
    yield f
    f.close()


def claims_of(fabric, kind: ClaimKind) -> list[tuple[int, str, str, int, int]]:
    with fabric.registry.read() as tx:
        return sorted(
            (f, c.adapter, c.share, c.entries, c.segments) for f, c in tx.claims() if c.kind is kind
        )


def test_p2p_claims_come_with_a_second_lender_and_go_with_it(fabric):
    fabric.reserve(GPU_ALPHA, VM1, guest_ram=GiB)
    assert claims_of(fabric, ClaimKind.P2P) == []  # one device: nothing to reach
    fabric.reserve(GPU_BETA, VM1, guest_ram=GiB)
    p2p = claims_of(fabric, ClaimKind.P2P)
    # each GPU reaches the other's BARs through its own lender's adapter, with its requester
    # entry on the switch ports between the lenders (claimed by the target's hold)
    assert {a for _f, a, *_ in p2p} == {"alpha:0", "beta:0", "mxs824/alpha:0", "mxs824/beta:0"}
    assert {f for f, *_ in p2p} == {GPU_ALPHA, GPU_BETA}
    ports = {(f, a, share) for f, a, share, *_ in p2p if a.startswith("mxs824/")}
    assert ports == {
        (target, port, f"req:{source}")
        for target, source in ((GPU_BETA, "alpha/0000:41:00"), (GPU_ALPHA, "beta/0000:81:00"))
        for port in ("mxs824/alpha:0", "mxs824/beta:0")
    }
    fabric.reserve(GPU_BETA, VM1, guest_ram=GiB)  # again: the same claims, none doubled
    assert claims_of(fabric, ClaimKind.P2P) == p2p
    assert fabric.release(GPU_ALPHA, VM1)
    assert claims_of(fabric, ClaimKind.P2P) == []
    # the LUT entries on both adapters and on the two switch ports of its route
    assert [f for f, *_ in claims_of(fabric, ClaimKind.LUT)] == [GPU_BETA] * 4


def test_the_interrupt_window_is_a_claim_of_the_hold_on_both_backends(fabric):
    fabric.reserve(NVME, VM1, guest_ram=GiB, msi_over_ntb=True)
    window = fabric.interrupt_window(NVME)
    assert window is not None and window.share == "msi:gamma/vm1"
    assert fabric.release(NVME, VM1)
    assert fabric.interrupt_window(NVME) is None
    assert claims_of(fabric, ClaimKind.DMA) == []


def test_every_new_hold_gets_a_larger_fencing_token_on_both_backends(fabric):
    """The token orders holds (etcd: the hold key's creation revision; SQLite: a counter):
    a later hold of the same device, or of any device, has a larger one."""
    vm1, vm2 = Holder("gamma", "vm1"), Holder("gamma", "vm2")
    tokens = []
    for holder, fdid in ((vm1, 0x10), (vm2, 0x10), (vm1, 0x20)):
        fabric.reserve(fdid, holder)
        tokens.append(fabric.holds()[fdid].token)
        assert fabric.holds()[fdid].token == tokens[-1]  # stable while the hold lives
        if fdid == 0x10:
            assert fabric.release(fdid, holder)
    assert tokens[0] > 0 and tokens == sorted(tokens) and len(set(tokens)) == 3


def test_a_hand_over_and_back_issue_newer_tokens_on_both_backends(fabric):
    """A hot migration's hand-over replaces the source's hold by the destination's in one
    transaction, and a rollback's hand-back the other way: each new hold, and the fence it
    leaves, has a token newer than the one before, so the device's side refuses the old
    holder. On etcd the re-made hold keeps its key, whose creation revision would stay the
    old holder's: the records carry their token instead (``reissued``)."""
    from vmlend.ledger import handover
    from vmlend.registry.etcd_store import EtcdRegistry
    from vmlend.registry.records import Phase

    src, dst = Holder("gamma", "vm1", VM1.vm_uuid), Holder("beta", "vm1", VM1.vm_uuid)
    fabric.reserve(GPU_ALPHA, src, guest_ram=GiB)
    first = fabric.holds()[GPU_ALPHA].token
    claimed = handover.claim_destination(fabric.registry, [GPU_ALPHA], src, dst, GiB)
    moved = handover.hand_over(fabric.registry, claimed, {}, 0.0)
    with fabric.registry.read() as tx:
        hold, fence = tx.hold(GPU_ALPHA), tx.fence(GPU_ALPHA)
    assert hold is not None and hold.holder == dst
    assert moved[GPU_ALPHA] == hold.token > first
    if isinstance(fabric.registry, EtcdRegistry):  # a cluster's fence: what a lender takes
        assert fence is not None and fence.token == hold.token  # back by, after a lost lease
    # a rewrite of the record keeps its token
    fabric.registry.transact(lambda tx: tx.set_phase(GPU_ALPHA, Phase.BORROWED))
    assert fabric.holds()[GPU_ALPHA].token == moved[GPU_ALPHA]
    back = handover.hand_back(fabric.registry, claimed, {}, 0.0)
    assert back[GPU_ALPHA] == fabric.holds()[GPU_ALPHA].token > moved[GPU_ALPHA]
    assert fabric.release(GPU_ALPHA, src)
    fabric.reserve(GPU_ALPHA, Holder("gamma", "vm2"))  # a new hold as ever: newer again
    assert fabric.holds()[GPU_ALPHA].token > back[GPU_ALPHA]


def test_a_hand_over_gives_no_token_for_a_hold_that_changed_hands_since(fabric, monkeypatch):
    """The tokens are read once the hand-over committed; a hold released and taken by
    another VM in between is not reported as the destination's (the caller would re-point
    the lender to the destination under the other VM's token)."""
    from vmlend.ledger import handover

    src, dst = Holder("gamma", "vm1", VM1.vm_uuid), Holder("beta", "vm1", VM1.vm_uuid)
    fabric.reserve(GPU_ALPHA, src, guest_ram=GiB)
    claimed = handover.claim_destination(fabric.registry, [GPU_ALPHA], src, dst, GiB)
    registry = fabric.registry
    commit = registry.transact

    def then_taken(body):
        out = commit(body)
        monkeypatch.setattr(registry, "transact", commit)  # once
        assert fabric.release(GPU_ALPHA, dst)
        fabric.reserve(GPU_ALPHA, Holder("gamma", "vm2"))
        return out

    monkeypatch.setattr(registry, "transact", then_taken)
    assert handover.hand_over(registry, claimed, {}, 0.0) == {}
    assert fabric.holds()[GPU_ALPHA].holder == Holder("gamma", "vm2")
