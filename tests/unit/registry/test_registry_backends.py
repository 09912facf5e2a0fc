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
