"""A share's window onto its CMB extent takes segments of its VM's adapter (mechanism 15,
issue 40 point 2): claimed at share reserve with the extent, refused in one line naming the
adapter when its window is full (nothing claimed), returned at release."""

from __future__ import annotations

import pytest

from tests.support.simfabric import make_fabric
from vmlend.errors import ResourceExhaustedError
from vmlend.ledger import nvmeshares as ledger
from vmlend.ledger.nvmeadmit import CMB_SUFFIX, DOORBELL_SUFFIX, share_window_key
from vmlend.registry import ClaimKind
from vmlend.sim.nvmedrive import drive_geometry
from vmlend.topology.model import GiB, Holder

NVME = 0x12
BLOCKS = 1 << 20
CMB = 128 * 1024  # two 64 KiB extents of one queue pair each


@pytest.fixture
def fab(state_path):
    f = make_fabric(state_path)
    yield f
    f.close()


def bar_claims(fab) -> list[tuple[int, str, str, int]]:
    with fab.registry.read() as tx:
        return sorted(
            (f, c.adapter, c.share, c.segments) for f, c in tx.claims() if c.kind is ClaimKind.BAR
        )


def lend(fab, cmb: int = CMB) -> None:
    ledger.lend_shared(fab.registry, NVME, drive_geometry(fab.topology().device(NVME), BLOCKS, cmb))


def test_a_cmb_share_claims_its_window_on_its_adapter_and_returns_it(fab):
    lend(fab)
    a, b = Holder("gamma", "a"), Holder("alpha", "local")
    share = ledger.reserve_share(fab.registry, NVME, a, 1, 10, guest_ram=GiB)
    assert share.cmb_extent == (0, 64 * 1024)
    key = share_window_key(NVME, a) + CMB_SUFFIX
    assert bar_claims(fab) == [(NVME, "gamma:0", key, 1)]  # 64 KiB: one 4 GiB segment
    # a VM on the lender reaches the CMB without the NTB: an extent, no window claimed
    assert ledger.reserve_share(fab.registry, NVME, b, 1, 10, guest_ram=GiB).cmb_extent
    assert bar_claims(fab) == [(NVME, "gamma:0", key, 1)]
    assert ledger.release_share(fab.registry, NVME, a)
    assert bar_claims(fab) == []


def test_a_share_without_an_extent_claims_no_window(fab):
    lend(fab, cmb=0)
    ledger.reserve_share(fab.registry, NVME, Holder("gamma", "a"), 1, 10, guest_ram=GiB)
    assert bar_claims(fab) == []


def test_a_full_adapter_window_refuses_the_cmb_share_in_one_line_claiming_nothing(fab):
    lend(fab)
    # three GPUs (10 segments each) and the NIC (2) fill gamma:0's 32 segments with BAR windows
    for i, fdid in enumerate((0x10, 0x11, 0x20, 0x21)):
        fab.reserve(fdid, Holder("gamma", f"vm{i}"), guest_ram=GiB)
    assert fab.usage()["gamma:0"].segments_free == 0
    with fab.registry.read() as tx:
        before = sorted(map(str, tx.claims()))
    with pytest.raises(ResourceExhaustedError) as e:
        ledger.reserve_share(fab.registry, NVME, Holder("gamma", "a"), 1, 10, guest_ram=GiB)
    assert str(e.value) == (
        "NTB window segments for the CMB window of gamma/a's share of 0x12 on gamma:0 is short"
        " by 1 segment (need 1 segment, have 0 segments)"
    )
    with fab.registry.read() as tx:
        assert sorted(map(str, tx.claims())) == before
    assert ledger.shared_drives(fab.registry)[NVME][2] == []
    # beta's adapter has room: the same share from there is claimed
    ledger.reserve_share(fab.registry, NVME, Holder("beta", "a"), 1, 10, guest_ram=GiB)
    assert [c[1] for c in bar_claims(fab) if c[2].endswith(CMB_SUFFIX)] == ["beta:0"]


def test_a_page_mode_share_claims_its_doorbell_window(state_path):
    from vmlend.sim.nvmetopology import SHARED_NVME, sharing_topology

    with make_fabric(state_path, sharing_topology(2), "b1") as f:
        geometry = drive_geometry(f.topology().device(SHARED_NVME), BLOCKS)
        ledger.lend_shared(f.registry, SHARED_NVME, geometry)
        holder = Holder("b1", "a")
        share = ledger.reserve_share(f.registry, SHARED_NVME, holder, 1, 10, guest_ram=GiB)
        assert share.page is not None
        key = share_window_key(SHARED_NVME, holder) + DOORBELL_SUFFIX
        assert bar_claims(f) == [(SHARED_NVME, "b1:0", key, 1)]
        assert ledger.release_share(f.registry, SHARED_NVME, holder)
        assert bar_claims(f) == []


def test_a_borrowers_full_window_refuses_a_device_in_one_line_claiming_nothing(fab):
    from vmlend.errors import VmlendError

    # three GPUs (10 segments of BAR windows each) and the NIC (2) fill gamma:0
    for i, fdid in enumerate((0x10, 0x11, 0x20, 0x21)):
        fab.reserve(fdid, Holder("gamma", f"vm{i}"), guest_ram=GiB)
    before = fab.usage()
    with pytest.raises(VmlendError) as e:  # a VF: two 16 KiB BARs, one segment each
        fab.reserve(0x22, Holder("gamma", "vm9"), guest_ram=GiB)
    assert "gamma:0" in str(e.value) and "\n" not in str(e.value)
    assert fab.usage() == before
