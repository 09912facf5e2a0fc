"""Shares of a drive in the registry: claimed at reserve, returned at release, exclusive and
shared use of one drive excluding each other, refusals leaving nothing behind."""

from __future__ import annotations

import pytest

from tests.support.daemon_marks import REGISTRIES
from tests.support.etcd_units import set_aside_lut
from tests.support.simfabric import make_fabric
from vmlend.errors import (
    CmbFullError,
    DeviceHeldError,
    LenderIommuOffError,
    NotSharedError,
    ResourceExhaustedError,
    SharesActiveError,
    SharingUnsupportedError,
)
from vmlend.ledger import nvmeshares as ledger
from vmlend.registry.etcd_store import EtcdRegistry
from vmlend.sim.nvmedrive import drive_geometry
from vmlend.topology.model import Holder
from vmlend.topology.requesters import is_port

NVME = 0x12
BLOCKS = 1 << 20


@pytest.fixture(params=REGISTRIES)
def fab(request, state_path):
    """The ledger on both registry backends (etcd: a private server, this host's lease)."""
    where = state_path if request.param == "sqlite" else request.getfixturevalue("etcd_url")
    f = make_fabric(where)
    yield f
    f.close()


@pytest.fixture
def reg(fab):
    return fab.registry


def geometry(fab):
    return drive_geometry(fab.topology().device(NVME), BLOCKS)


def test_geometry_of_the_default_drive_and_refusals_for_other_devices(fab):
    g = geometry(fab)
    assert (g.queue_pairs, g.vectors, g.mode) == (511, 32, "trap")
    with pytest.raises(SharingUnsupportedError, match="gpu"):
        drive_geometry(fab.topology().device(0x10), BLOCKS)


def test_a_drive_of_a_lender_with_its_iommu_off_is_not_shared(state_path):
    from vmlend.wiring.fabric import default_topology_text

    text = default_topology_text()[0].replace('name = "alpha"\n', 'name = "alpha"\niommu = false\n')
    with make_fabric(state_path, text) as f:
        before = (f.devices(), f.usage())
        with pytest.raises(LenderIommuOffError, match="its lender alpha has its IOMMU off"):
            ledger.lend_shared(f.registry, NVME, geometry(f))
        assert (f.devices(), f.usage()) == before


def test_shares_are_claimed_at_reserve_and_returned_at_release(fab, reg):
    ledger.lend_shared(reg, NVME, geometry(fab))
    ledger.lend_shared(reg, NVME, geometry(fab))  # idempotent
    a, b = Holder("gamma", "a"), Holder("beta", "b")
    sa = ledger.reserve_share(reg, NVME, a, 4, 1000)
    assert ledger.reserve_share(reg, NVME, a, 4, 1000) == sa  # the same VM again
    sb = ledger.reserve_share(reg, NVME, b, 2, 500)
    assert sa.lba_offset + 1000 <= sb.lba_offset and sa.asid != sb.asid
    assert {sa.vector_base, sb.vector_base} == {1, 5}
    (holder, geo, entries) = ledger.shared_drives(reg)[NVME]
    assert holder.vm == ledger.MANAGER_VM and geo.queue_pairs == 511
    assert sorted(str(e.holder) for e in entries) == ["beta/b", "gamma/a"]
    assert ledger.release_share(reg, NVME, a)
    assert not ledger.release_share(reg, NVME, a)
    # a's space is free again
    assert ledger.reserve_share(reg, NVME, Holder("gamma", "c"), 4, 1000).lba_offset == 0


def test_the_controller_refuses_more_than_it_has_and_claims_nothing(fab, reg):
    ledger.lend_shared(reg, NVME, geometry(fab))
    ledger.reserve_share(reg, NVME, Holder("gamma", "a"), 30, 10)
    with pytest.raises(ResourceExhaustedError, match="vectors"):
        ledger.reserve_share(reg, NVME, Holder("gamma", "b"), 2, 10)  # 31 I/O vectors in all
    with pytest.raises(ResourceExhaustedError, match="LBA"):
        ledger.reserve_share(reg, NVME, Holder("gamma", "b"), 1, BLOCKS)
    assert len(ledger.shared_drives(reg)[NVME][2]) == 1


def test_exclusive_and_shared_exclude_each_other(fab, reg):
    fab.reserve(NVME, Holder("gamma", "solo"))
    with pytest.raises(DeviceHeldError):
        ledger.lend_shared(reg, NVME, geometry(fab))
    with pytest.raises(DeviceHeldError):
        ledger.reserve_share(reg, NVME, Holder("gamma", "a"), 1, 10)
    fab.release(NVME, Holder("gamma", "solo"))
    with pytest.raises(NotSharedError):
        ledger.reserve_share(reg, NVME, Holder("gamma", "a"), 1, 10)
    ledger.lend_shared(reg, NVME, geometry(fab))
    with pytest.raises(DeviceHeldError):
        fab.reserve(NVME, Holder("gamma", "solo"))


def test_unshare_waits_for_the_shares_to_go(fab, reg):
    ledger.lend_shared(reg, NVME, geometry(fab))
    a = Holder("gamma", "a")
    ledger.reserve_share(reg, NVME, a, 1, 10)
    with pytest.raises(SharesActiveError):
        ledger.unshare(reg, NVME)
    ledger.release_share(reg, NVME, a)
    assert ledger.unshare(reg, NVME)
    assert not ledger.unshare(reg, NVME)
    fab.reserve(NVME, Holder("gamma", "solo"))  # exclusive use is possible again


def test_usage_recorded_by_the_data_path_shows_in_the_entries(fab, reg):
    ledger.lend_shared(reg, NVME, geometry(fab))
    share = ledger.reserve_share(reg, NVME, Holder("gamma", "a"), 2, 10)
    ledger.record_usage(reg, NVME, share.name, [share.real_qid(1)], 3)
    (entry,) = ledger.shared_drives(reg)[NVME][2]
    assert entry.rejections == 3 and entry.real_queues == (share.real_qid(1),)
    assert entry.to_json()["guard_rejections"] == 3


def test_the_data_path_uses_the_reserved_share_and_status_sees_its_rejections(fab, reg, tmp_path):
    from tests.support.nvme_guest import guest_driver
    from vmlend.nvme import spec
    from vmlend.sim.hardware import SimHardware
    from vmlend.sim.nvmeshare import SharedNvmeDrive
    from vmlend.topology.model import GuestRange, MiB

    ledger.lend_shared(reg, NVME, geometry(fab))
    holder = Holder("gamma", "a")
    share = ledger.reserve_share(reg, NVME, holder, 1, 64)
    hw = SimHardware.from_topology(fab.topology(), seed=2)
    drive = SharedNvmeDrive(hw, NVME, tmp_path, blocks=BLOCKS)
    try:
        guest = hw.create_guest("gamma", "a", [GuestRange(0, 64 * MiB)])
        vms = drive.open_share("gamma", "a", share=share)
        vms.set_master()
        drv = guest_driver(vms.bar0, guest)
        (qp,) = drv.start(queues=1)
        assert drv.identify_namespace(1) == (64, 512)
        assert drv.write(qp, 64, b"x" * 512).status == spec.SC_LBA_OUT_OF_RANGE
        drive.record(reg)
        (entry,) = ledger.shared_drives(reg)[NVME][2]
        assert entry.rejections == 1 and entry.real_queues == (share.real_qid(1),)
    finally:
        drive.close()


def _use(fab):
    return {ref: (u.lut_used, u.segments_used) for ref, u in fab.usage().items()}


def _returned_but_set_aside(fab, before, lender: str) -> None:
    """What a share used is all returned, but for the drive's requester entry its lender
    sets aside on etcd (layout 7), which ``vmlend usage`` shows used."""
    aside = {ref: n for ref, n in set_aside_lut(fab).items() if not is_port(ref)}
    assert aside == ({lender: 1} if isinstance(fab.registry, EtcdRegistry) else {})
    expected = {ref: (lut + aside.get(ref, 0), seg) for ref, (lut, seg) in before.items()}
    assert _use(fab) == expected


def test_a_share_claims_the_ntb_resources_of_its_dma_path_and_returns_them(fab, reg):
    from vmlend.ledger.admission import guest_ram_of
    from vmlend.memory.windows import window_segments
    from vmlend.topology.model import GiB
    from vmlend.topology.paths import route

    ledger.lend_shared(reg, NVME, geometry(fab))
    before = _use(fab)
    topo = fab.topology()
    path = route(topo, topo.device(NVME).lender, "gamma")
    lender, borrower = path.src.ref, path.dst.ref
    segs = window_segments(guest_ram_of(8 * GiB).ranges, path.src.segment_size)
    assert segs >= 2  # low and high windows

    a, a2 = Holder("gamma", "a"), Holder("gamma", "a2")
    ledger.reserve_share(reg, NVME, a, 1, 10, guest_ram=8 * GiB)
    after_a = _use(fab)
    # its DMA windows and one segment for its interrupt window (MSI over the NTB)
    assert after_a[lender] == (before[lender][0] + 1, before[lender][1] + segs + 1)
    assert after_a[borrower] == (before[borrower][0] + 1, before[borrower][1])
    # a second VM on the same node shares the drive's LUT entries, not its windows
    ledger.reserve_share(reg, NVME, a2, 1, 10, guest_ram=8 * GiB)
    assert _use(fab)[lender] == (before[lender][0] + 1, before[lender][1] + 2 * segs + 2)
    assert _use(fab)[borrower] == after_a[borrower]
    assert ledger.release_share(reg, NVME, a)
    assert _use(fab) == after_a  # a2's windows and the crossing it still uses remain
    assert ledger.release_share(reg, NVME, a2)
    # all returned; on etcd the lender keeps the drive's requester entry aside while it lends
    # it (layout 7: its next share needs no entry more)
    _returned_but_set_aside(fab, before, lender)


def test_a_share_whose_windows_do_not_fit_is_refused_claiming_nothing(fab, reg):
    from vmlend.errors import WindowExhaustedError
    from vmlend.topology.model import GiB

    ledger.lend_shared(reg, NVME, geometry(fab))
    before = _use(fab)
    with pytest.raises(WindowExhaustedError) as e:
        ledger.reserve_share(reg, NVME, Holder("gamma", "big"), 1, 10, guest_ram=200 * GiB)
    assert "share of 0x12" in str(e.value) and "\n" not in str(e.value)
    assert _use(fab) == before and ledger.shared_drives(reg)[NVME][2] == []
    # a VM on the lender crosses no NTB: nothing to claim, whatever its size
    lender = fab.topology().device(NVME).lender
    ledger.reserve_share(reg, NVME, Holder(lender, "local"), 1, 10, guest_ram=200 * GiB)
    assert _use(fab) == before


def test_a_share_with_a_backup_path_claims_both_paths_and_returns_them(fab, reg):
    from vmlend.ledger.admission import guest_ram_of
    from vmlend.ledger.nvmeadmit import RING_SEGMENTS
    from vmlend.memory.windows import window_segments
    from vmlend.topology.model import GiB

    ledger.lend_shared(reg, NVME, geometry(fab))
    before = _use(fab)
    segs = window_segments(guest_ram_of(8 * GiB).ranges, 4 * GiB)
    share = ledger.reserve_share(reg, NVME, Holder("gamma", "a"), 1, 10, guest_ram=8 * GiB, paths=2)
    assert share.paths == 2 and len(share.asids) == 2
    after = _use(fab)
    # both routes leave alpha:0: one LUT entry there, both paths' windows, each with its rings
    # and its interrupt window
    assert RING_SEGMENTS == 1
    assert after["alpha:0"] == (before["alpha:0"][0] + 1, before["alpha:0"][1] + 2 * segs + 4)
    # one LUT entry on each of gamma's adapters: the primary's and the backup's
    assert after["gamma:0"][0] == before["gamma:0"][0] + 1
    assert after["gamma:1"][0] == before["gamma:1"][0] + 1
    assert ledger.shared_drives(reg)[NVME][2][0].to_json()["paths"] == 2
    assert ledger.release_share(reg, NVME, Holder("gamma", "a"))
    _returned_but_set_aside(fab, before, "alpha:0")


def test_a_backup_path_needs_a_second_adapter_and_claims_nothing_without(fab, reg):
    from vmlend.errors import NoBackupPathError, WindowExhaustedError
    from vmlend.topology.model import GiB

    ledger.lend_shared(reg, NVME, geometry(fab))
    before = _use(fab)
    with pytest.raises(NoBackupPathError) as e:  # beta has one adapter
        ledger.reserve_share(reg, NVME, Holder("beta", "b"), 1, 10, guest_ram=GiB, paths=2)
    assert str(e.value) == (
        "no backup path for beta's share of 0x12: beta has one NTB adapter (beta:0);"
        " a backup needs a second"
    )
    with pytest.raises(NoBackupPathError, match="is the drive's lender"):
        ledger.reserve_share(reg, NVME, Holder("alpha", "l"), 1, 10, guest_ram=GiB, paths=2)
    # all or nothing: the primary's windows fit, both paths' do not
    with pytest.raises(WindowExhaustedError):
        ledger.reserve_share(reg, NVME, Holder("gamma", "g"), 1, 10, guest_ram=64 * GiB, paths=2)
    assert _use(fab) == before and ledger.shared_drives(reg)[NVME][2] == []
    ledger.reserve_share(reg, NVME, Holder("gamma", "g"), 1, 10, guest_ram=64 * GiB)


def test_cmb_extents_are_claimed_with_the_share_refused_when_full_and_returned(fab, reg):
    ledger.lend_shared(reg, NVME, drive_geometry(fab.topology().device(NVME), BLOCKS, 128 * 1024))
    a = ledger.reserve_share(reg, NVME, Holder("gamma", "a"), 1, 10, guest_ram=1 << 30)
    b = ledger.reserve_share(reg, NVME, Holder("beta", "b"), 1, 10, guest_ram=1 << 30)
    assert (a.cmb_extent, b.cmb_extent) == ((0, 65536), (65536, 65536))
    with reg.read() as tx:
        claims = sorted(map(str, tx.claims()))
    with pytest.raises(CmbFullError, match="release a share of it"):
        ledger.reserve_share(reg, NVME, Holder("gamma", "c"), 1, 10, guest_ram=1 << 30)
    with reg.read() as tx:
        assert sorted(map(str, tx.claims())) == claims  # the refusal claimed nothing
    assert len(ledger.shared_drives(reg)[NVME][2]) == 2
    assert ledger.release_share(reg, NVME, Holder("gamma", "a"))
    c = ledger.reserve_share(reg, NVME, Holder("gamma", "c"), 1, 10, guest_ram=1 << 30)
    assert c.cmb_extent == (0, 65536)  # a's extent, returned at its release


def test_a_release_here_keeps_the_parent_a_share_here_still_needs(fab, reg):
    """db's start reserved its share and has the drive's parent, its child not made yet; a
    release of the drive on the same node meanwhile (another VM's failed start: the manager
    holds the drive) keeps the parent, so db's child can be made under it. The parent goes
    once no share of this node names it."""
    ledger.lend_shared(reg, NVME, geometry(fab))
    db = Holder("gamma", "db")
    fab.reserve_share(NVME, db, 1, 1000)
    parent = fab.ensure_mdev_parent(NVME)
    assert not fab.release(NVME, Holder("gamma", "web"))  # not web's: the manager's hold
    with reg.read() as tx:
        assert tx.parent("gamma", NVME) is not None
    child = fab.create_share_mdev(NVME, "83b8f4f2-509f-382f-3c1e-e6bfe0fa1002", db)
    assert child.parent == parent
    assert fab.remove_mdev(child.uuid) and fab.release_share(NVME, db)
    assert fab.forget_unused_parent(NVME)
