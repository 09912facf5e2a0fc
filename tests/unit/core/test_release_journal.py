"""The host's journal of releases that could not reach the registry (``release_journal``):
durable, merged per VM, landed by whoever comes first and never after the VM started again;
it returns only what it names, only of a VM that does not run here, only the holds the stopped
run had (by fencing token, else by time), only entries of this node, keeps what still fails,
reads its directory like the agent's pause marks, and says in one line when it cannot record.
Registry cases run on a real etcd (``etcd_url``, ``private_etcd``)."""

from __future__ import annotations

import io
import json
import os
import threading
import time
import uuid
from pathlib import Path

import msgspec
import pytest

from tests.support.etcd_daemon import free_port, host_lease
from tests.support.simfabric import make_fabric
from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, mdev_uuid, new_domain
from vmlend.errors import MdevError, RegistryUnreachableError, ReleaseJournalError
from vmlend.hook.main import run
from vmlend.hostenv import HostEnv
from vmlend.lending.devices import UndoJournal, acquire_device
from vmlend.release_journal import (
    MAX_ENTRY_BYTES,
    PendingDevice,
    PendingRelease,
    ReleaseJournal,
    running_here,
)
from vmlend.topology.model import Holder, MiB
from vmlend.wiring.fabric import open_fabric

VM_UUID = "6f1c5a2e-0000-4000-8000-0000000000aa"
WEB = Holder("gamma", "web", VM_UUID)
DB = Holder("beta", "db", "22222222-2222-2222-2222-222222222222")


def _xml(fdids: tuple[int, ...]) -> bytes:
    spec = DomainSpec(
        name="web",
        memory_bytes=512 * MiB,
        uuid=uuid.UUID(VM_UUID),
        devices=[DeviceRequest(f) for f in fdids],
    )
    return new_domain(spec, templates=TemplateSet()).to_bytes()


def _mdev(fdid: int, holder: Holder = WEB) -> str:
    return str(mdev_uuid(holder.vm_uuid, fdid))


def _take(fabric, fdid: int, holder: Holder = WEB) -> int:
    """``holder`` takes ``fdid`` as its prepare would (hold and mdev); the hold's token."""
    acquire_device(fabric, holder, fdid, _mdev(fdid, holder), UndoJournal())
    return fabric.holds_of(holder)[fdid].token


def _entry(*devices: PendingDevice, holder: Holder = WEB) -> PendingRelease:
    return PendingRelease(holder.node, holder.vm, holder.vm_uuid, list(devices))


def _pending(fdid: int, token: int = 0, at: float | None = None) -> PendingDevice:
    return PendingDevice(fdid, _mdev(fdid), token, time.time() if at is None else at)


def running(_holder: Holder) -> bool:
    return True


def stopped(_holder: Holder) -> bool:
    return False


def unsure(_holder: Holder) -> None:
    return None


@pytest.fixture
def journal() -> ReleaseJournal:
    return ReleaseJournal.for_host(HostEnv.from_env())


def test_a_vm_started_again_lands_its_pending_release_before_taking_devices(tmp_path, monkeypatch):
    """web stopped while etcd was away (0x10 stayed held, its release pending) and starts
    again with the same device. Its prepare lands the pending release first and reserves
    0x10 anew, so a later retry by the agent finds nothing to do: it must never return the
    device web runs with now."""
    monkeypatch.setenv("VMLEND_ROOT", str(tmp_path / "root"))
    state = tmp_path / "state.db"
    fabric = make_fabric(state)
    token = _take(fabric, 0x10)
    journal = ReleaseJournal.for_host(HostEnv.from_env())
    path, added = journal.record(_entry(_pending(0x10, token)))
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
    assert journal.settle(fabric, runs=stopped) == []  # the agent's retry: nothing pending
    assert fabric.device(0x10).holder == WEB


def test_what_cannot_land_at_a_new_start_is_left_to_that_run(tmp_path, monkeypatch):
    """The pending release of web's last run cannot land whole at its new start (0x10's mdev
    cannot be removed). The new run takes 0x10 again; the entry must let go of it, or the
    agent would end the hold of the VM starting now (its QEMU not running yet)."""
    monkeypatch.setenv("VMLEND_ROOT", str(tmp_path / "root"))
    fabric = make_fabric(tmp_path / "state.db")
    tokens = [_take(fabric, f) for f in (0x10, 0x11)]
    journal = ReleaseJournal.for_host(HostEnv.from_env())
    journal.record(_entry(_pending(0x10, tokens[0]), _pending(0x11, tokens[1])))

    def stuck(uuid: str) -> bool:
        raise MdevError(f"mdev {uuid} is busy")

    fabric.remove_mdev = stuck  # type: ignore[method-assign]
    notes: list[str] = []
    from vmlend.release_journal import settle_own

    settle_own(fabric, WEB, notes.append, [(0x10, _mdev(0x10))])
    [left] = journal.pending()
    assert [d.fdid for d in left.devices] == [0x11]  # 0x10 is the new run's now
    assert any("pending release of 0x10 left to this start" in n for n in notes), notes
    assert fabric.device(0x10).holder == WEB


def test_a_release_recorded_twice_is_reported_once_and_merged(tmp_path):
    journal = ReleaseJournal(tmp_path / "pending")
    path, added = journal.record(_entry(_pending(0x10)))
    assert added
    assert journal.record(_entry(_pending(0x10)))[1] is False  # libvirt's second call: silent
    _path, added = journal.record(_entry(_pending(0x11, token=7)))
    assert added
    [p] = journal.pending()
    assert [(d.fdid, d.token) for d in p.devices] == [(0x10, 0), (0x11, 7)]
    assert list(path.parent.glob(".*.tmp")) == []  # written by rename, nothing half-written


def test_an_entry_returns_nothing_of_a_running_vm_and_only_what_it_names(etcd_url, journal):
    """Issue 35: an entry naming a running VM and a device it does not hold (0x99) released
    every device the VM held, and another VM then started on one of them. Now a VM that runs
    here, or whose state nobody can tell, keeps everything; a stopped one is returned only
    what the entry names."""
    fabric = make_fabric(etcd_url)
    _take(fabric, 0x10)
    _take(fabric, 0x11)
    journal.record(_entry(_pending(0x99)))

    [line] = journal.settle(fabric, runs=running)
    assert "pending release of VM 'web' (0x99) waits: it runs here" in line
    assert journal.settle(fabric, runs=running) == []  # said once, not at every renewal
    [line] = journal.settle(fabric, runs=unsure)
    assert "nobody can tell whether it runs here" in line
    assert {fabric.device(f).holder for f in (0x10, 0x11)} == {WEB}
    assert len(journal.pending()) == 1

    journal.settle(fabric, runs=stopped)
    assert {fabric.device(f).holder for f in (0x10, 0x11)} == {WEB}  # not named: kept
    assert {m.fdid for m in fabric.mdev_records()} == {0x10, 0x11}
    assert journal.pending() == []


def test_a_newer_hold_of_the_same_vm_or_another_vms_hold_is_never_ended(
    etcd, etcd_url, journal, tmp_path, monkeypatch
):
    """The entry carries the fencing token of each hold the stopped run had. web has taken
    0x10 again since (a new hold, a new token), and 0x20 is db's now: landing the old entry
    ends neither, nor removes web's new mdev."""
    fabric = make_fabric(etcd_url)
    old_10 = _take(fabric, 0x10)
    old_20 = _take(fabric, 0x20)
    journal.record(_entry(_pending(0x10, old_10), _pending(0x20, old_20)))
    for fdid in (0x10, 0x20):
        fabric.remove_mdev(_mdev(fdid))
        assert fabric.release(fdid, WEB)
    new_10 = _take(fabric, 0x10)
    assert new_10 != old_10
    root = Path(os.environ["VMLEND_ROOT"])
    host_lease(etcd, tmp_path / "beta", node="beta")
    monkeypatch.setenv("VMLEND_ROOT", str(tmp_path / "beta"))
    with open_fabric(etcd_url, "beta") as beta:
        _take(beta, 0x20, DB)
    monkeypatch.setenv("VMLEND_ROOT", str(root))

    notes: list[str] = []
    journal.settle(fabric, runs=stopped, record=notes.append)
    assert fabric.device(0x10).holder == WEB
    assert fabric.holds_of(WEB)[0x10].token == new_10
    assert _mdev(0x10) in {m.uuid for m in fabric.mdev_records()}
    assert fabric.device(0x20).holder == DB
    assert any("newer hold" in n for n in notes), notes
    assert journal.pending() == []  # neither is this release's to return any more


def test_without_a_token_only_a_hold_older_than_the_release_is_ended(etcd_url, journal):
    """A release that could not read its tokens (the registry was away from its first call)
    records when it was recorded: a hold made before is the stopped run's and ends, one made
    after is a newer run's and stays."""
    fabric = make_fabric(etcd_url)
    _take(fabric, 0x10)
    at = time.time()
    _take(fabric, 0x11)
    journal.record(_entry(_pending(0x10, at=at), _pending(0x11, at=at)))

    [line] = journal.settle(fabric, runs=stopped)
    assert "landed: 0x10, 0x11" in line  # nothing more to do for either
    assert fabric.device(0x10).holder is None
    assert fabric.device(0x11).holder == WEB
    assert {m.fdid for m in fabric.mdev_records()} == {0x11}


def test_an_older_vmlends_entry_lands_only_older_holds_of_a_stopped_vm(etcd_url, journal):
    """Entries written before tokens existed (``[fdid, mdev]`` pairs, a ``since`` to the
    second) are read as recorded at their ``since``: only what the VM held before then ends,
    and only once the VM does not run here."""
    fabric = make_fabric(etcd_url)
    _take(fabric, 0x10)
    time.sleep(1.1)
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    time.sleep(1.1)
    _take(fabric, 0x11)
    journal.dir.mkdir(parents=True)
    old = {
        "node": "gamma",
        "vm": "web",
        "vm_uuid": VM_UUID,
        "devices": [[0x10, _mdev(0x10)], [0x11, _mdev(0x11)]],
        "shares": [],
        "since": since,
        "why": "etcd at 127.0.0.1:2379 does not answer",
    }
    (journal.dir / f"{VM_UUID}.json").write_text(json.dumps(old))

    [line] = journal.settle(fabric, runs=running)
    assert "waits: it runs here" in line
    journal.settle(fabric, runs=stopped)
    assert fabric.device(0x10).holder is None
    assert fabric.device(0x11).holder == WEB
    assert journal.pending() == []


def test_an_entry_another_node_wrote_is_never_landed(
    etcd, etcd_url, journal, tmp_path, monkeypatch
):
    fabric = make_fabric(etcd_url)
    root = os.environ["VMLEND_ROOT"]
    host_lease(etcd, tmp_path / "beta", node="beta")
    monkeypatch.setenv("VMLEND_ROOT", str(tmp_path / "beta"))
    with open_fabric(etcd_url, "beta") as beta:
        token = _take(beta, 0x20, DB)
    monkeypatch.setenv("VMLEND_ROOT", root)
    entry = _entry(PendingDevice(0x20, _mdev(0x20, DB), token, time.time()), holder=DB)
    journal.record(entry)

    [line] = journal.settle(fabric, runs=stopped)
    assert "is node 'beta''s, not this node's ('gamma'); left alone" in line
    assert fabric.device(0x20).holder == DB
    assert journal.pending() == [entry]


def test_an_entry_whose_release_still_fails_is_kept(private_etcd, tmp_path, monkeypatch):
    """A device whose mdev cannot be removed keeps its hold and stays pending (the other
    lands); with the registry away again, every entry stays as it was."""
    monkeypatch.setenv("VMLEND_ROOT", str(tmp_path / "root"))
    host_lease(private_etcd, tmp_path / "root", node="gamma")
    fabric = make_fabric(private_etcd.url("kept"))
    journal = ReleaseJournal.for_host(HostEnv.from_env())
    tokens = [_take(fabric, f) for f in (0x10, 0x11)]
    journal.record(_entry(_pending(0x10, tokens[0]), _pending(0x11, tokens[1])))
    remove = fabric.remove_mdev

    def stuck(uuid: str) -> bool:
        if uuid == _mdev(0x10):
            raise MdevError(f"mdev {uuid} is busy")
        return remove(uuid)

    fabric.remove_mdev = stuck  # type: ignore[method-assign]
    [line] = journal.settle(fabric, runs=stopped)
    assert "release of VM 'web' still incomplete (landed: 0x11): mdev" in line, line
    assert "is busy" in line
    assert fabric.device(0x10).holder == WEB
    assert fabric.device(0x11).holder is None
    [left] = journal.pending()
    assert [d.fdid for d in left.devices] == [0x10]

    private_etcd.stop()
    fabric.remove_mdev = remove  # type: ignore[method-assign]
    with pytest.raises(RegistryUnreachableError):
        journal.settle(fabric, runs=stopped)
    assert journal.pending() == [left]


def test_a_fifo_a_link_or_a_huge_file_in_the_journal_is_not_an_entry(etcd_url, journal, tmp_path):
    """Issue 35: a FIFO in the directory froze the agent's loop (its VMs paused, its lease
    lost). Entries are read like the pause marks: regular files of bounded size, opened
    without following links and without blocking."""
    fabric = make_fabric(etcd_url)
    token = _take(fabric, 0x10)
    journal.record(_entry(_pending(0x10, token)))
    fifo = journal.dir / "fifo.json"
    os.mkfifo(fifo)
    elsewhere = tmp_path / "planted.json"
    elsewhere.write_bytes(msgspec.json.encode(_entry(_pending(0x11), holder=WEB)))
    (journal.dir / "link.json").symlink_to(elsewhere)
    (journal.dir / "huge.json").write_bytes(b" " * (MAX_ENTRY_BYTES + 1))
    _take(fabric, 0x11)

    done: list[list[str]] = []
    lander = threading.Thread(target=lambda: done.append(journal.settle(fabric, runs=stopped)))
    lander.start()
    try:
        lander.join(10)
        assert done, "landing blocked on the FIFO"
    finally:
        if lander.is_alive():  # today's code: let the blocked open return, then end
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            lander.join(10)
    assert fabric.device(0x10).holder is None  # the real entry landed
    assert fabric.device(0x11).holder == WEB  # the link's target was never read
    assert {p.name for p in journal.dir.iterdir()} >= {"fifo.json", "link.json", "huge.json"}


def test_a_journal_directory_others_may_write_is_neither_read_nor_written(etcd_url, journal):
    """An entry makes root return devices: a directory another user could write to is not
    trusted (nothing landed, one line), nor written to (one line naming what to do)."""
    fabric = make_fabric(etcd_url)
    token = _take(fabric, 0x10)
    journal.record(_entry(_pending(0x10, token)))
    journal.dir.chmod(0o777)
    [line] = journal.settle(fabric, runs=stopped)
    assert "cannot be used" in line and "another user owns it or may write to it" in line
    assert fabric.device(0x10).holder == WEB
    with pytest.raises(ReleaseJournalError) as e:
        journal.record(_entry(_pending(0x11)))
    assert "its devices stay held" in str(e.value) and "reconcile --fix" in str(e.value)


def test_an_unusable_journal_is_one_line_and_the_hold_stays(etcd_url, journal):
    """Issue 35: an unusable journal directory gave 'internal error: FileExistsError' and
    recorded nothing. Now the release hook says in one line what happened and what to do,
    and the VM keeps its hold (nothing else can take the device while it is unsure)."""
    fabric = make_fabric(etcd_url)
    _take(fabric, 0x10)
    journal.dir.parent.mkdir(parents=True, exist_ok=True)
    journal.dir.write_text("not a directory")
    unreachable = f"etcd://127.0.0.1:{free_port()}/gone"

    err = io.StringIO()
    code = run(
        ["web", "release", "end", "-"],
        stdin=io.BytesIO(_xml((0x10,))),
        stdout=io.BytesIO(),
        stderr=err,
        environ={**os.environ, "VMLEND_REGISTRY": unreachable, "VMLEND_NODE": "gamma"},
    )
    assert code == 1
    [line] = err.getvalue().splitlines()
    assert "internal error" not in line, line
    assert "release of VM 'web' (0x10) could not reach the registry, nor be recorded in" in line
    assert "it is not a directory" in line and "its devices stay held" in line, line
    assert fabric.device(0x10).holder == WEB


def test_a_release_that_read_its_holds_records_their_tokens(etcd_url, journal):
    """The release hook reads the VM's holds before it changes anything: when the registry
    goes away after that, the entry carries each hold's token, and landing it later ends
    exactly those holds."""
    fabric = make_fabric(etcd_url)
    token = _take(fabric, 0x10)

    def away(_fdid: int, _holder: Holder, **_kw: object) -> bool:
        raise RegistryUnreachableError("127.0.0.1:2379", "etcd at 127.0.0.1:2379 went away")

    real_release = fabric.release
    fabric.release = away  # type: ignore[method-assign]
    err = io.StringIO()
    code = run(
        ["web", "release", "end", "-"],
        stdin=io.BytesIO(_xml((0x10,))),
        stdout=io.BytesIO(),
        stderr=err,
        environ={**os.environ, "VMLEND_REGISTRY": etcd_url, "VMLEND_NODE": "gamma"},
        open_fabric=lambda _where, _node: fabric,
    )
    assert code == 1
    assert "release of VM 'web' is pending (0x10)" in err.getvalue()
    [entry] = journal.pending()
    assert [(d.fdid, d.token) for d in entry.devices] == [(0x10, token)]

    fabric.release = real_release  # type: ignore[method-assign]
    journal.settle(fabric, runs=stopped)
    assert fabric.device(0x10).holder is None


def test_whether_a_vm_runs_here_comes_from_the_hypervisor_and_a_hung_one_is_unsure(tmp_path):
    from vmlend.hypervisor.base import DomainState
    from vmlend.wiring.hypervisor import open_hypervisor

    hv = open_hypervisor("sim:///gamma", state_dir=tmp_path, hook_command=None)
    hv.define(_xml(()))
    runs = running_here(hv)
    assert runs(WEB) is False  # defined, shut off
    hv.start("web")
    assert hv.lookup("web").state is DomainState.RUNNING
    assert runs(WEB) is True
    assert runs(Holder("gamma", "gone", "")) is False  # not defined here
    assert running_here(None)(WEB) is None  # no hypervisor: nobody can tell

    release = threading.Event()

    class Hung:
        def lookup(self, _name: str) -> object:
            release.wait(30)
            raise AssertionError("answered too late")

    hung = running_here(Hung(), timeout=0.2)  # type: ignore[arg-type]
    start = time.monotonic()
    assert hung(WEB) is None
    assert hung(Holder("gamma", "other", "")) is None  # not asked again this time
    assert time.monotonic() - start < 5
    release.set()


def test_a_pending_share_returns_that_share_only(state_path, journal):
    """A pending release of a VM's NVMe share (here written by the previous version: the
    share's mdev UUID only) removes that mdev and returns that share; another VM's share of
    the same drive on this node stays."""
    from vmlend.domain import NvmeShareRequest, read_domain
    from vmlend.hook.actionlog import NullLog
    from vmlend.hook.ops import HookOps
    from vmlend.ledger import nvmeshares
    from vmlend.registry import SqliteRegistry
    from vmlend.sim.backend import SimFabric
    from vmlend.sim.nvmedrive import drive_geometry

    nvme = 0x12
    make_fabric(state_path).close()
    reg = SqliteRegistry.open(state_path)
    gamma = SimFabric(SqliteRegistry.open(state_path), "gamma")
    nvmeshares.lend_shared(reg, nvme, drive_geometry(gamma.topology().device(nvme), 1 << 20))

    def domain(name: str):
        spec = DomainSpec(
            name=name,
            memory_bytes=256 * MiB,
            uuid=uuid.uuid5(uuid.NAMESPACE_DNS, name),
            devices=[DeviceRequest(nvme, share=NvmeShareRequest(1, 64 * MiB, 1))],
        )
        return read_domain(new_domain(spec, templates=TemplateSet()).to_bytes())

    a, c = domain("vm-a"), domain("vm-c")
    for dom in (a, c):
        HookOps(gamma, NullLog()).prepare(dom)
    holder_a = Holder("gamma", "vm-a", str(a.uuid))
    holder_c = Holder("gamma", "vm-c", str(c.uuid))
    journal.dir.mkdir(parents=True)
    old = {
        "node": "gamma",
        "vm": "vm-a",
        "vm_uuid": str(a.uuid),
        "devices": [],
        "shares": [str(a.devices[0].mdev)],
        "since": "2026-01-01T00:00:00Z",
        "why": "etcd away",
    }
    (journal.dir / f"{a.uuid}.json").write_text(json.dumps(old))
    try:
        [line] = journal.settle(gamma, runs=stopped)
        assert f"landed: share mdev {a.devices[0].mdev}" in line, line  # as the entry names it
        assert gamma.shares_held(holder_a) == []
        assert gamma.shares_held(holder_c) == [nvme]
        assert {m.vm for m in gamma.mdevs()} == {"vm-c"}
        assert journal.pending() == []
    finally:
        gamma.close()
        reg.close()
