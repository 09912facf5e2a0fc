"""A share's interrupt window (MSI over the NTB, docs/nvme-sharing.md): admitted with the share
like a borrowed device's (``msi:<node>/<vm>``, one segment per lender adapter and VM, counted
once with the VM's borrowed devices through that adapter), never a refusal, returned with the
share, and following the share when it moves."""

from __future__ import annotations

import pytest

from tests.support.simfabric import make_fabric
from vmlend.ledger import nvmeshares as ledger
from vmlend.ledger import shareunplug
from vmlend.ledger.admission import guest_ram_of
from vmlend.ledger.msiadmit import msi_share
from vmlend.ledger.nvmeadmit import BACKUP_SUFFIX
from vmlend.memory.windows import window_segments
from vmlend.registry import ClaimKind
from vmlend.sim.nvmedrive import drive_geometry
from vmlend.topology.model import GiB, Holder
from vmlend.topology.paths import route

NVME = 0x12
GPU = 0x10
WEB = Holder("gamma", "web", "9b2e0f4c-61d4-4c1e-9a57-8f2d3c1b0a11")


@pytest.fixture
def fab(state_path):
    f = make_fabric(state_path)
    ledger.lend_shared(f.registry, NVME, drive_geometry(f.topology().device(NVME), 1 << 20))
    yield f
    f.close()


def lender_adapter(fab, node: str = "gamma") -> str:  # type: ignore[no-untyped-def]
    topo = fab.topology()
    path = route(topo, topo.device(NVME).lender, node)
    assert path is not None
    return path.src.ref


def msi_claims(fab) -> list[tuple[int, str, str]]:  # type: ignore[no-untyped-def]
    with fab.registry.read() as tx:
        return sorted(
            (f, c.adapter, c.share)
            for f, c in tx.claims()
            if c.kind is ClaimKind.DMA and c.share.startswith("msi:")
        )


def segments_used(fab, ref: str) -> int:  # type: ignore[no-untyped-def]
    return fab.usage()[ref].segments_used


def test_a_share_claims_its_interrupt_window_and_returns_it_with_the_share(fab):
    ref = lender_adapter(fab)
    ledger.reserve_share(fab.registry, NVME, WEB, 1, 64, guest_ram=GiB)
    assert msi_claims(fab) == [(NVME, ref, msi_share(WEB))]
    windows = fab.share_interrupt_windows(NVME, WEB)
    assert [(c.adapter, c.segments) for c in windows] == [(ref, 1)]
    assert ledger.release_share(fab.registry, NVME, WEB)
    assert msi_claims(fab) == [] and fab.share_interrupt_windows(NVME, WEB) == []


def test_the_window_is_one_per_adapter_and_vm_shared_with_its_borrowed_devices(fab):
    ref = lender_adapter(fab)
    fab.reserve(GPU, WEB, msi_over_ntb=True)
    assert msi_claims(fab) == [(GPU, ref, msi_share(WEB))]
    with_gpu = segments_used(fab, ref)
    ledger.reserve_share(fab.registry, NVME, WEB, 1, 64)  # no RAM given: no DMA windows
    # claimed by both holds, counted once: the share takes no second segment for it
    assert msi_claims(fab) == [(GPU, ref, msi_share(WEB)), (NVME, ref, msi_share(WEB))]
    assert segments_used(fab, ref) == with_gpu
    # the share's release leaves the device's window
    assert ledger.release_share(fab.registry, NVME, WEB)
    assert msi_claims(fab) == [(GPU, ref, msi_share(WEB))]
    assert segments_used(fab, ref) == with_gpu
    # another VM of the same node gets its own window
    ledger.reserve_share(fab.registry, NVME, Holder("gamma", "db"), 1, 64)
    assert segments_used(fab, ref) == with_gpu + 1


def test_a_full_window_admits_the_share_with_its_interrupts_relayed(fab):
    ref = lender_adapter(fab)
    free = fab.usage()[ref].segments_free
    seg = fab.topology().adapter(ref).segment_size
    # a share whose DMA windows take every segment left: none for its interrupt window
    ram = next(
        n * seg
        for n in range(free, 0, -1)
        if window_segments(guest_ram_of(n * seg).ranges, seg) == free
    )
    share = ledger.reserve_share(fab.registry, NVME, WEB, 1, 64, guest_ram=ram)
    assert share is not None and fab.usage()[ref].segments_free == 0
    assert msi_claims(fab) == [] and fab.share_interrupt_windows(NVME, WEB) == []


def test_a_local_vm_claims_no_interrupt_window(fab):
    lender = fab.topology().device(NVME).lender
    ledger.reserve_share(fab.registry, NVME, Holder(lender, "local"), 1, 64, guest_ram=GiB)
    assert msi_claims(fab) == []


def test_a_two_path_share_claims_a_window_on_each_path(fab):
    ledger.reserve_share(fab.registry, NVME, WEB, 1, 64, guest_ram=GiB, paths=2)
    keys = sorted(c.share for c in fab.share_interrupt_windows(NVME, WEB))
    assert keys == [msi_share(WEB), msi_share(WEB) + BACKUP_SUFFIX]
    assert ledger.release_share(fab.registry, NVME, WEB)
    assert msi_claims(fab) == []


def test_the_window_follows_the_share_when_it_moves(fab):
    dst = Holder("beta", WEB.vm, WEB.vm_uuid)
    ledger.reserve_share(fab.registry, NVME, WEB, 1, 64, guest_ram=GiB)
    shareunplug.claim(fab.registry, [NVME], WEB, dst, GiB)
    # both while it moves: the destination's beside the source's
    assert [s for _f, _a, s in msi_claims(fab)] == [msi_share(dst), msi_share(WEB)]
    shareunplug.hand_over(fab.registry, [NVME], WEB, dst, 0.0)
    assert [s for _f, _a, s in msi_claims(fab)] == [msi_share(dst), msi_share(WEB)]
    assert fab.share_interrupt_windows(NVME, dst)[0].share == msi_share(dst)
    shareunplug.finish(fab.registry, [NVME], WEB, dst, 0.0)
    assert msi_claims(fab) == [(NVME, lender_adapter(fab, "beta"), msi_share(dst))]


def test_a_move_given_back_keeps_the_sources_window_only(fab):
    dst = Holder("beta", WEB.vm, WEB.vm_uuid)
    ledger.reserve_share(fab.registry, NVME, WEB, 1, 64, guest_ram=GiB)
    was = msi_claims(fab)
    shareunplug.claim(fab.registry, [NVME], WEB, dst, GiB)
    shareunplug.hand_over(fab.registry, [NVME], WEB, dst, 0.0)
    shareunplug.give_back(fab.registry, [NVME], WEB, dst, 0.0)
    assert msi_claims(fab) == was
    assert fab.share_interrupt_windows(NVME, WEB)[0].share == msi_share(WEB)
