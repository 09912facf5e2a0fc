"""``vmlend reconcile`` on the kernel backend compares each share child's ``nvme_share`` and
``nvme_share_state`` (docs/smartio-contract.md section 7, "Per share") with the registry's
shares of this node, against ``FakeSmartio``: a running VM's child whose share differs under
the same epoch is written again, another epoch is left to the operator, a child whose share
the registry no longer has is cleared and removed, and a share without its child is reported,
never made."""

# ruff: noqa: F811 (the tests take the imported fixtures as parameters)

from __future__ import annotations

import uuid

import pytest

from tests.support.fake_nvmeshare import Run
from tests.support.smartio_host import NVME, PARENT, WEB, fake, state  # noqa: F401
from vmlend.domain import (
    DeviceRequest,
    DomainSpec,
    NvmeShareRequest,
    TemplateSet,
    mdev_uuid,
    new_domain,
)
from vmlend.errors import NvmeShareError
from vmlend.kernel.backend import SmartioFabric
from vmlend.ledger import nvmeshares as ledger
from vmlend.lending.devices import UndoJournal
from vmlend.lending.shares import SHARE_MDEV_TYPE, acquire_share
from vmlend.ops.reconcile import DriftKind, find_drift, fix, look
from vmlend.registry import SqliteRegistry
from vmlend.sim.hypervisor.node import SimHypervisor
from vmlend.sim.nvmedrive import drive_geometry
from vmlend.topology.model import Holder, MiB

VID = uuid.UUID(WEB.vm_uuid)
MDEV = str(mdev_uuid(VID, NVME))
REQUEST = NvmeShareRequest(2, 64 * MiB)


@pytest.fixture
def running(tmp_path, state, fake):
    """web runs here with a share of 0x12, prepared as the hook does."""
    fake.smartio.share_drive(NVME, queue_pairs=511, vectors=32)
    hv = SimHypervisor("gamma", tmp_path / "hv", None)
    device = DeviceRequest(NVME, share=REQUEST)
    spec = DomainSpec(name="web", memory_bytes=1 << 30, uuid=VID, devices=[device])
    hv.define(new_domain(spec, templates=TemplateSet()).to_bytes())
    hv.start("web")
    with SmartioFabric(SqliteRegistry.open(state), fake.env, writer=fake) as fabric:
        ledger.lend_shared(
            fabric.registry, NVME, drive_geometry(fabric.topology().device(NVME), 1 << 20)
        )
        acquire_share(fabric, WEB, NVME, MDEV, REQUEST, UndoJournal())
        yield hv, fabric


def _shares(hv, fabric):
    return [d for d in find_drift(look(hv, fabric)) if d.kind == "nvme-share"]


def _share_file(fake, uuid=MDEV):
    return fake.env.mdev_devices / uuid / "smartio" / "nvme_share"


def _registrys_run(fabric) -> Run:
    s = fabric.share_of(NVME, WEB)
    return Run(0, s.qid_base + 1, 2, s.vector_base, 2, s.lba_offset, s.blocks, s.asid)


def test_a_share_as_the_registry_has_it_is_no_drift(running):
    hv, fabric = running
    assert find_drift(look(hv, fabric)) == []


def test_a_child_running_other_values_under_the_same_epoch_is_written_again(running, fake):
    """Other queues, LBA window and tag at the driver than the registry's share (written by
    hand, or a driver that lost them): one line naming both; --fix clears and writes the
    registry's share under the same epoch."""
    hv, fabric = running
    fake.write(_share_file(fake), "epoch 0\n")
    fake.write(_share_file(fake), "epoch 0\nqueues 100 2\nvectors 20 2\nlba 0x90000 0x8\nasid 9\n")
    (d,) = _shares(hv, fabric)
    assert d.fixable and d.vm == "web" and d.mdev == MDEV
    assert "its nvme_share says epoch 0; queues 100 2; vectors 20 2; lba 0x90000 0x8" in d.cause
    assert "the registry's share is epoch 0; queues " in d.cause and "\n" not in d.cause
    assert d.to_json()["kind"] == "nvme-share" and d.to_json()["fdid"] == "0x12"
    lines: list[str] = []
    assert fix(hv, fabric, [d], lines.append).failed == []
    assert lines == [f"mdev {MDEV}: the registry's share of 0x12 written again"]
    assert fake.smartio.runs[NVME][MDEV] == _registrys_run(fabric)
    assert fake.smartio.share_writes[MDEV][-2] == "epoch 0\n"  # the other values ended first
    assert find_drift(look(hv, fabric)) == []


def test_a_share_the_driver_no_longer_runs_is_written_again(running, fake):
    hv, fabric = running
    fake.smartio.runs[NVME].pop(MDEV)  # the manager lost it (the lender's driver reloaded)
    (_share_file(fake).parent / "nvme_share_state").write_text("none\n")
    (d,) = _shares(hv, fabric)
    assert d.fixable and "the driver runs no share for it" in d.cause
    assert fix(hv, fabric, [d]).failed == []
    assert fake.smartio.runs[NVME][MDEV] == _registrys_run(fabric)
    assert find_drift(look(hv, fabric)) == []


def test_another_epoch_is_left_to_the_operator(running, fake):
    hv, fabric = running
    written = _share_file(fake).read_text()
    fake.write(_share_file(fake), written.replace("epoch 0", "epoch 1"))  # the same share, newer
    (d,) = _shares(hv, fabric)
    assert not d.fixable and "its nvme_share has epoch 1, the registry's share epoch 0" in d.cause
    assert d.fix.startswith("stop VM 'web' and start it again")
    before = list(fake.smartio.share_writes[MDEV])
    assert fix(hv, fabric, [d]).left == [d]
    with pytest.raises(NvmeShareError, match="has epoch 1, the registry's share 0"):
        fabric.rewrite_share(NVME, MDEV, WEB)  # nor when asked directly
    assert fake.smartio.share_writes[MDEV] == before


def test_a_damaged_share_file_is_reported_not_raised(running, fake):
    hv, fabric = running
    (_share_file(fake).parent / "nvme_share_state").write_text("running\n")
    (d,) = _shares(hv, fabric)
    assert not d.fixable and "its share files are damaged" in d.cause and "dmesg" in d.fix


def test_a_child_whose_share_the_registry_no_longer_has_is_cleared_and_removed(running, fake):
    """web stopped and its share was returned, but its child stayed (the release was cut
    after the share's return): reported as a share child, and --fix ends its share at the
    driver before removing it, as a release does."""
    hv, fabric = running
    hv.destroy("web")
    assert ledger.release_share(fabric.registry, NVME, WEB)
    (d,) = [x for x in find_drift(look(hv, fabric)) if x.mdev == MDEV]
    assert d.kind == "nvme-share" and d.fixable
    assert d.cause.startswith(f"share mdev {MDEV} of NVMe drive 0x12 (VM 'web') runs a share")
    assert "the registry has no share of 0x12 for gamma/web" in d.cause
    assert d.fix == f"clear its share and remove mdev {MDEV}"
    lines: list[str] = []
    assert fix(hv, fabric, [d], lines.append).fixed == [d]
    assert lines == [f"mdev {MDEV}: share cleared, removed"]
    assert fake.smartio.share_writes[MDEV][-1] == "epoch 0\n" and fake.smartio.runs[NVME] == {}
    assert fabric.mdevs() == [] and fabric.mdev_records() == []


def test_a_running_vms_child_without_its_share_is_only_the_missing_share(running, fake):
    """The child is in use: never cleared under its VM; the VM's missing share is reported
    (not fixed) as on the simulator."""
    hv, fabric = running
    assert ledger.release_share(fabric.registry, NVME, WEB)
    (d,) = find_drift(look(hv, fabric))
    assert d.kind is DriftKind.MISSING_HOLD and not d.fixable
    assert MDEV in fake.smartio.runs[NVME]


def test_a_share_without_its_child_is_reported_never_made(running, fake):
    """db's share of this node with no child (its start in progress, or a release cut before
    the share's return), and web's child gone from under the running VM: each one line, both
    left to the operator; --fix makes no child and keeps the shares."""
    hv, fabric = running
    db = Holder("gamma", "db", "22222222-2222-2222-2222-222222222222")
    fabric.reserve_share(NVME, db, 1, 64 * MiB // 512)
    (d,) = _shares(hv, fabric)
    assert not d.fixable and d.vm == "db" and d.mdev is None
    assert "the state has a share of NVMe drive 0x12 for VM 'db' on gamma" in d.cause
    assert "'vmlend nvme release 0x12 db'" in d.fix
    fabric.bus.remove(MDEV)  # removed by hand under the running VM
    drift = _shares(hv, fabric)
    (w,) = [x for x in drift if x.vm == "web"]
    assert not w.fixable and w.mdev == MDEV
    assert w.cause.startswith("running VM 'web' has a share of NVMe drive 0x12 but this host")
    result = fix(hv, fabric, drift)
    assert sorted(x.vm for x in result.left) == ["db", "web"]
    assert fabric.shares_held(db) == [NVME] and fabric.shares_held(WEB) == [NVME]
    assert [m.uuid for m in fabric.mdevs() if m.type_id == SHARE_MDEV_TYPE] == []
    assert fabric.bus.parent_names() == [PARENT]
