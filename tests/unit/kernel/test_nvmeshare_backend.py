"""Queue-level NVMe shares on the kernel backend (docs/smartio-contract.md section 7, "Per
share"), against ``FakeSmartio``: acquiring a share creates its ``smartio-nvme_share`` child and
writes the registry's values with the share's epoch; release clears exactly that child's share
and removes it; the driver's refusals and a missing driver refuse the start in one line."""

# ruff: noqa: F811 (the imported fixtures are parameters of the tests)

from __future__ import annotations

import errno
import uuid as uuidlib

import pytest

from tests.support.fake_nvmeshare import Run
from tests.support.smartio_host import (  # noqa: F401
    NVME,
    PARENT,
    U1,
    U2,
    WEB,
    fabric,
    fake,
    state,
)
from vmlend.domain import NvmeShareRequest
from vmlend.errors import (
    FabricError,
    HostError,
    NvmeShareError,
    SharingUnsupportedError,
    StaleTokenError,
)
from vmlend.ledger import nvmeshares as ledger
from vmlend.lending.devices import UndoJournal
from vmlend.lending.shares import SHARE_MDEV_TYPE, acquire_share, return_shares
from vmlend.registry import SqliteRegistry
from vmlend.sim.nvmedrive import drive_geometry
from vmlend.topology.model import Holder, MiB

DB = Holder("gamma", "db", "22222222-2222-2222-2222-222222222222")


@pytest.fixture
def shared(fabric, fake, state):
    """0x12 lent for sharing: the driver can run its manager, the registry has its geometry."""
    fake.smartio.share_drive(NVME, queue_pairs=511, vectors=32)
    with SqliteRegistry.open(state) as reg:
        ledger.lend_shared(reg, NVME, drive_geometry(fabric.topology().device(NVME), 1 << 20))
    return fake.smartio


def acquire(fabric, holder=WEB, mdev=U1, queues=2, size=64 * MiB, journal=None):
    journal = journal if journal is not None else UndoJournal()
    acquire_share(fabric, holder, NVME, mdev, NvmeShareRequest(queues, size), journal)
    return journal


def written(share, epoch=0) -> str:
    """The contract's text for ``share`` (section 7), spelt out here, not by vmlend."""
    return (
        f"epoch {epoch}\nqueues {share.qid_base + 1} {share.queue_pairs}\n"
        f"vectors {share.vector_base} {share.queue_pairs}\n"
        f"lba {share.lba_offset:#x} {share.blocks:#x}\nasid {share.asid}\n"
    )


def test_acquire_writes_the_registrys_share_release_clears_exactly_it(fabric, shared):
    acquire(fabric, DB, U2, queues=1)
    acquire(fabric)
    web, db = fabric.share_of(NVME, WEB), fabric.share_of(NVME, DB)
    assert shared.share_writes[U1] == [written(web)]
    assert shared.runs[NVME][U1] == Run(
        0, web.qid_base + 1, 2, web.vector_base, 2, web.lba_offset, web.blocks, web.asid
    )
    run = fabric.share_state(U1)
    assert run is not None and run.values is not None and run.values.first_qid == web.qid_base + 1
    (child,) = [m for m in fabric.mdevs() if m.uuid == U1]
    assert (child.type_id, child.parent, child.vm) == (SHARE_MDEV_TYPE, PARENT, "web")
    acquire(fabric)  # the prepare hook again: the same values, nothing new at the driver
    assert shared.share_writes[U1] == [written(web)] * 2

    assert return_shares(fabric, WEB, [U1]) == []
    # the share's own epoch alone, then the child went; the other VM's share is untouched
    assert shared.share_writes[U1] == [written(web)] * 2 + ["epoch 0\n"]
    assert U1 not in shared.runs[NVME] and shared.share_writes[U2] == [written(db)]
    assert set(shared.runs[NVME]) == {U2}
    assert [m.uuid for m in fabric.mdevs()] == [U2]
    assert fabric.shares_held(WEB) == [] and fabric.shares_held(DB) == [NVME]
    listed = (shared._dir(NVME) / "nvme_shares").read_text()
    assert listed.split()[0] == U2 and U1 not in listed
    assert fabric.bus.parent_names() == [PARENT]  # the other VM's child is under it
    assert return_shares(fabric, DB, [U2]) == []
    assert fabric.bus.parent_names() == [] and shared.runs[NVME] == {}  # unborrow written
    with fabric.registry.read() as tx:
        assert tx.parent("gamma", NVME) is None


def test_a_foreign_share_child_is_left_alone(fabric, fake, shared):
    acquire(fabric)
    foreign = str(uuidlib.uuid4())
    fabric.bus.create(PARENT, SHARE_MDEV_TYPE, foreign)  # made by hand, not vmlend's
    theirs = "epoch 9\nqueues 400 1\nvectors 30 1\nlba 0xf0000 0x10\nasid 30\n"
    fake.write(fake.env.mdev_devices / foreign / "smartio" / "nvme_share", theirs)
    return_shares(fabric, WEB, [U1, foreign])
    assert shared.share_writes[foreign] == [theirs]
    assert set(shared.runs[NVME]) == {foreign}


def test_an_older_epoch_is_refused_and_the_newer_share_runs_on(fabric, fake, shared):
    acquire(fabric)
    web = fabric.share_of(NVME, WEB)
    # the share moved hot and its destination wrote epoch 1 (same queues, same tag)
    path = fake.env.mdev_devices / U1 / "smartio" / "nvme_share"
    fake.write(path, written(web, epoch=1))
    with pytest.raises(StaleTokenError, match="NVMe share of mdev"):
        acquire(fabric)  # a prepare still holding epoch 0
    assert shared.runs[NVME][U1].epoch == 1
    assert U1 in {m.uuid for m in fabric.mdevs()}  # not this call's child: it stays


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("queues 1 2\n", "EINVAL"),
        ("epoch 0\nqueues 0 2\nvectors 1 2\nlba 0 8\nasid 1\n", "EINVAL"),
        ("epoch 0\nqueues 510 4\nvectors 1 2\nlba 0 8\nasid 1\n", "ERANGE"),
        ("epoch 0\nqueues 3 2\nvectors 1 2\nlba 0 8\nasid 1\n", "EEXIST"),
        ("epoch 0\nqueues 100 2\nvectors 20 2\nlba 0x90000 8\nasid 9\n", "EBUSY"),
    ],
)
def test_bad_values_are_refused_by_the_driver(fabric, fake, shared, text, code):
    acquire(fabric)
    other = str(uuidlib.uuid4())
    child = other if code != "EBUSY" else U1
    if child == other:
        fabric.bus.create(PARENT, SHARE_MDEV_TYPE, other)
    with pytest.raises(OSError) as e:
        fake.write(fake.env.mdev_devices / child / "smartio" / "nvme_share", text)
    assert e.value.errno == getattr(errno, code)
    assert set(shared.runs[NVME]) == {U1}


def test_a_write_the_driver_does_not_take_is_einval_and_undone(fabric, fake, shared):
    """A driver that reads the file otherwise than vmlend writes it: one line naming the file
    and EINVAL; the child, its record and the share go."""

    def refuse(child) -> None:
        path = (child.path / "smartio" / "nvme_share").resolve()
        fake.handlers[path] = lambda text: (_ for _ in ()).throw(OSError(22, "Invalid", path))

    fake.child_hooks.append(refuse)
    journal = UndoJournal()
    with pytest.raises(FabricError, match=r"smartio/nvme_share \(EINVAL\)") as e:
        acquire(fabric, journal=journal)
    assert "\n" not in str(e.value)
    assert journal.rollback() == []
    assert fabric.mdevs() == [] and fabric.mdev_records() == [] and fabric.shares_held(WEB) == []


def test_a_driver_refusal_undoes_the_share_and_its_child(fabric, shared, state):
    """vmlend's values refused (here: the driver's controller is smaller than the registry's
    geometry, ERANGE): no child, no record, no share left."""
    shared.shareable[NVME] = (1, 32)
    journal = UndoJournal()
    with pytest.raises(NvmeShareError, match="ERANGE"):
        acquire(fabric, journal=journal)
    assert journal.rollback() == []
    assert fabric.mdevs() == [] and fabric.mdev_records() == []
    assert fabric.shares_held(WEB) == [] and shared.runs[NVME] == {}


def test_a_driver_without_sharing_refuses_in_one_line(fabric, fake, state):
    with SqliteRegistry.open(state) as reg:
        ledger.lend_shared(reg, NVME, drive_geometry(fabric.topology().device(NVME), 1 << 20))
    with pytest.raises(SharingUnsupportedError, match=r"no queue-level sharing.*no nvme_share"):
        acquire(fabric)
    assert fabric.shares_held(WEB) == []


def test_a_driver_without_the_share_files_names_them(fabric, shared):
    shared.share_files = False
    journal = UndoJournal()
    with pytest.raises(
        SharingUnsupportedError, match="no smartio/nvme_share and smartio/nvme_share_state"
    ) as e:
        acquire(fabric, journal=journal)
    assert "\n" not in str(e.value)
    assert journal.rollback() == []
    assert fabric.mdevs() == [] and fabric.shares_held(WEB) == []


def test_a_parent_without_the_share_type_names_it(fabric, fake, shared):
    shared.shareable.pop(NVME)  # registers parents with smartio-lend only
    (shared._dir(NVME) / "nvme_share").write_text("supported 511 32 0\n")
    shared.runs[NVME] = {}
    with pytest.raises(SharingUnsupportedError, match="offers no smartio-nvme_share type"):
        acquire(fabric)


def test_two_paths_are_refused_before_anything_is_claimed(fabric, shared):
    with pytest.raises(SharingUnsupportedError, match="backup path"):
        acquire_share(
            fabric, WEB, NVME, U1, NvmeShareRequest(1, 64 * MiB, paths=2), UndoJournal()
        )
    assert fabric.shares_held(WEB) == []


def test_a_vanished_driver(fabric, shared):
    """The module goes between two starts: the next start is refused in one line; a release
    after it returns the share in the registry (the children went with the driver)."""
    acquire(fabric)
    shared.unload()
    with pytest.raises(HostError, match="not loaded"):
        acquire(fabric, DB, U2)
    assert fabric.shares_held(DB) == []
    assert return_shares(fabric, WEB, [U1]) == []
    assert fabric.shares_held(WEB) == []


def test_a_child_gone_before_its_share_is_written(fabric, fake, shared):
    class LenderGoesBeforeTheShare:
        """The lender goes unreachable just before the share's write: the mdev core took the
        child with the parent."""

        def write(self, path, text):
            if path.name == "nvme_share":
                shared.set_availability(NVME, "unreachable")
            fake.write(path, text)

    fabric.driver.writer = LenderGoesBeforeTheShare()
    with pytest.raises(FabricError, match="went away before its share was written"):
        acquire(fabric)


def test_the_watcher_writes_a_re_created_share_childs_share_again(fabric, shared):
    """The lender goes away (the parent and the share child with it) and comes back: the
    watcher re-creates the child and writes the registry's share to it again; a VM whose
    share ended meanwhile gets no child back."""
    acquire(fabric)
    web = fabric.share_of(NVME, WEB)
    watcher = fabric.watcher()
    watcher.discover()
    shared.set_availability(NVME, "unreachable")
    watcher.discover()
    assert shared.runs[NVME] == {}  # the driver ended the share with its child
    shared.set_availability(NVME, "available")
    watcher.discover()
    assert [m.uuid for m in fabric.mdevs()] == [U1]
    assert shared.share_writes[U1] == [written(web)]  # the new child's only write
    assert shared.runs[NVME][U1].first_qid == web.qid_base + 1

    shared.set_availability(NVME, "unreachable")
    watcher.discover()
    fabric.release_share(NVME, WEB)  # its share returned while the lender was away
    shared.set_availability(NVME, "available")
    watcher.discover()
    assert fabric.mdevs() == [] and shared.runs[NVME] == {}


def test_a_refused_clear_still_removes_the_child(fabric, fake, shared):
    """A driver refusing the clear (here EIO) does not keep the VM's child: its removal ends
    the share at the driver too."""
    acquire(fabric)
    path = (fake.env.mdev_devices / U1 / "smartio" / "nvme_share").resolve()
    fake.handlers[path] = lambda text: (_ for _ in ()).throw(OSError(errno.EIO, "I/O", path))
    assert return_shares(fabric, WEB, [U1]) == []
    assert fabric.mdevs() == [] and shared.runs[NVME] == {} and fabric.shares_held(WEB) == []


def test_a_share_release_keeps_the_parent_another_vms_start_is_using(fabric, shared):
    """db's start reserved its share and registered the parent; web's release runs before
    db's child is made. The parent stays (no unborrow), db's child is made under it and its
    share written; db's own release then unborrows."""
    acquire(fabric)
    fabric.reserve_share(NVME, DB, 1, 64 * MiB // 512)
    fabric.ensure_mdev_parent(NVME)
    assert return_shares(fabric, WEB, [U1]) == []
    assert fabric.bus.parent_names() == [PARENT]
    with fabric.registry.read() as tx:
        assert tx.parent("gamma", NVME) is not None
    # a whole-device release of the drive here (another VM's failed start) keeps it too
    assert not fabric.release(NVME, Holder("gamma", "mail"))
    assert fabric.bus.parent_names() == [PARENT]
    fabric.create_share_mdev(NVME, U2, DB)
    assert shared.share_writes[U2] == [written(fabric.share_of(NVME, DB))]
    assert return_shares(fabric, DB, [U2]) == []
    assert fabric.bus.parent_names() == [] and shared.runs[NVME] == {}


def windows(state) -> list:  # type: ignore[no-untyped-def]
    """The interrupt windows the registry gives WEB's share of the drive."""
    with SqliteRegistry.open(state) as reg, reg.read() as tx:
        return ledger.interrupt_windows(tx, NVME, WEB)


def test_a_shares_interrupt_window_is_claimed_only_where_the_driver_maps_msi(
    fabric, fake, state, shared
):
    """As a borrowed device's (section 6): a driver without ``msi/capable`` relays a share's
    interrupts, so its reservation claims no window; one that says 1 gets it (section 7,
    "Share interrupts": one segment per lender adapter and VM, ``msi:<node>/<vm>``)."""
    fabric.reserve_share(NVME, WEB, 1, 64, guest_ram=64 * MiB)
    assert windows(state) == []
    assert fabric.release_share(NVME, WEB)
    msi = fake.env.smartio / "smartio-12" / "msi"
    msi.mkdir()
    (msi / "capable").write_text("1\n")
    fabric.reserve_share(NVME, WEB, 1, 64, guest_ram=64 * MiB)
    (window,) = windows(state)
    assert (window.adapter, window.share, window.segments) == ("alpha:0", "msi:gamma/web", 1)
    assert fabric.release_share(NVME, WEB)
    assert windows(state) == []
