"""The host's journal of releases that could not reach the registry (``release_journal``):
durable, merged per VM, landed by whoever comes first, and never after the VM started again."""

from __future__ import annotations

import io
import uuid

from tests.support.simfabric import make_fabric
from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, mdev_uuid, new_domain
from vmlend.hook.main import run
from vmlend.hostenv import HostEnv
from vmlend.lending.devices import UndoJournal, acquire_device
from vmlend.release_journal import PendingRelease, ReleaseJournal
from vmlend.topology.model import Holder, MiB

VM_UUID = "6f1c5a2e-0000-4000-8000-0000000000aa"
WEB = Holder("gamma", "web", VM_UUID)


def _xml(fdids: tuple[int, ...]) -> bytes:
    spec = DomainSpec(
        name="web",
        memory_bytes=512 * MiB,
        uuid=uuid.UUID(VM_UUID),
        devices=[DeviceRequest(f) for f in fdids],
    )
    return new_domain(spec, templates=TemplateSet()).to_bytes()


def _pending(fdids: tuple[int, ...]) -> PendingRelease:
    mdevs = [(f, str(uuid.uuid5(uuid.UUID(VM_UUID), str(f)))) for f in fdids]
    return PendingRelease("gamma", "web", VM_UUID, mdevs)


def test_a_vm_started_again_lands_its_pending_release_before_taking_devices(tmp_path, monkeypatch):
    """web stopped while etcd was away (0x10 stayed held, its release pending) and starts
    again with the same device. Its prepare lands the pending release first and reserves
    0x10 anew, so a later retry by the agent finds nothing to do: it must never return the
    device web runs with now."""
    monkeypatch.setenv("VMLEND_ROOT", str(tmp_path / "root"))
    state = tmp_path / "state.db"
    fabric = make_fabric(state)
    mdev = str(mdev_uuid(uuid.UUID(VM_UUID), 0x10))  # what the VM's XML names
    acquire_device(fabric, WEB, 0x10, mdev, UndoJournal())
    journal = ReleaseJournal.for_host(HostEnv.from_env())
    path, added = journal.record(PendingRelease("gamma", "web", VM_UUID, [(0x10, mdev)]))
    assert added and path.exists()

    err = io.StringIO()
    code = run(
        ["web", "prepare", "begin", "-"],
        stdin=io.BytesIO(_xml((0x10,))),
        stdout=io.BytesIO(),
        stderr=err,
        environ={"VMLEND_STATE": str(state), "VMLEND_NODE": "gamma"},
    )
    assert code == 0, err.getvalue()
    assert journal.pending() == []
    assert fabric.device(0x10).holder == WEB
    assert journal.settle(fabric) == []  # the agent's retry: nothing pending, nothing returned
    assert fabric.device(0x10).holder == WEB


def test_a_release_recorded_twice_is_reported_once_and_merged(tmp_path):
    journal = ReleaseJournal(tmp_path / "pending")
    path, added = journal.record(_pending((0x10,)))
    assert added
    assert journal.record(_pending((0x10,)))[1] is False  # libvirt's second call: silent
    _path, added = journal.record(_pending((0x11,)))
    assert added
    [p] = journal.pending()
    assert sorted(f for f, _m in p.devices) == [0x10, 0x11]
    assert list(path.parent.glob(".*.tmp")) == []  # written by rename, nothing half-written
