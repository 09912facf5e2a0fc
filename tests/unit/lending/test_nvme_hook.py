"""The hook with a domain that asks for an NVMe share: prepare claims the share and creates an
mdev of the share type, all or nothing; release returns both; a drive not lent for sharing
refuses the start."""

from __future__ import annotations

import io
import uuid

import pytest

from tests.support.simfabric import make_fabric
from vmlend.domain import (
    DeviceRequest,
    DomainSpec,
    NvmeShareRequest,
    TemplateSet,
    new_domain,
    read_domain,
)
from vmlend.errors import HookError, MdevOwnedError
from vmlend.hook.actionlog import ActionLog, NullLog, log_path_for_state
from vmlend.hook.main import run
from vmlend.hook.ops import HookOps
from vmlend.ledger import nvmeshares as ledger
from vmlend.lending.devices import UndoJournal
from vmlend.lending.shares import SHARE_MDEV_TYPE, acquire_share
from vmlend.registry import SqliteRegistry
from vmlend.sim.backend import SimFabric
from vmlend.sim.nvmedrive import drive_geometry
from vmlend.topology.model import Holder, MiB

NVME = 0x12


def domain(name: str, queues: int = 2, size: int = 64 * MiB, extra=(), paths: int = 1):
    spec = DomainSpec(
        name=name,
        memory_bytes=256 * MiB,
        uuid=uuid.uuid5(uuid.NAMESPACE_DNS, name),
        devices=[DeviceRequest(NVME, share=NvmeShareRequest(queues, size, paths)), *extra],
    )
    return read_domain(new_domain(spec, templates=TemplateSet()).to_bytes())


@pytest.fixture
def env(state_path):
    make_fabric(state_path).close()
    reg = SqliteRegistry.open(state_path)
    fabrics: dict[str, SimFabric] = {}

    def fabric(node="gamma"):
        if node not in fabrics:
            fabrics[node] = SimFabric(SqliteRegistry.open(state_path), node)
        return fabrics[node]

    geometry = drive_geometry(fabric().topology().device(NVME), 1 << 20)
    yield reg, fabric, geometry
    for f in fabrics.values():
        f.close()
    reg.close()


def test_prepare_claims_the_share_and_its_mdev_release_returns_them(env):
    reg, fabric, geometry = env
    ledger.lend_shared(reg, NVME, geometry)
    a, b = domain("vm-a"), domain("vm-b", queues=1)
    HookOps(fabric("gamma"), NullLog()).prepare(a)
    HookOps(fabric("beta"), NullLog()).prepare(b)
    HookOps(fabric("gamma"), NullLog()).prepare(a)  # a re-run changes nothing
    (m,) = fabric("gamma").mdevs()
    assert m.type_id == SHARE_MDEV_TYPE and m.uuid == str(a.devices[0].mdev) and m.vm == "vm-a"
    entries = {str(e.holder): e.share for e in ledger.shared_drives(reg)[NVME][2]}
    assert entries["gamma/vm-a"].queue_pairs == 2 and entries["gamma/vm-a"].blocks == 131072
    assert entries["beta/vm-b"].queue_pairs == 1
    # the shares' DMA windows (the domain's RAM) and their interrupt windows are claimed on
    # the lender's adapter
    with reg.read() as tx:
        share_windows = {c.share: c.segments for _f, c in tx.claims() if c.kind == "dma"}
    assert share_windows == {
        "nvme:0x12:gamma/vm-a": 1,
        "nvme:0x12:beta/vm-b": 1,
        "msi:gamma/vm-a": 1,
        "msi:beta/vm-b": 1,
    }
    HookOps(fabric("gamma"), NullLog()).release(a)
    assert fabric("gamma").mdevs() == []
    with reg.read() as tx:
        assert "nvme:0x12:gamma/vm-a" not in {c.share for _f, c in tx.claims()}
    assert [str(e.holder) for e in ledger.shared_drives(reg)[NVME][2]] == ["beta/vm-b"]
    HookOps(fabric("gamma"), NullLog()).release(a)  # idempotent


def test_prepare_is_all_or_nothing(env):
    reg, fabric, geometry = env
    ledger.lend_shared(reg, NVME, geometry)
    # the share is fine, the GPU after it is held by someone else: nothing stays
    fabric().reserve(0x10, Holder("gamma", "other"))
    dom = domain("vm-a", extra=[DeviceRequest(0x10)])
    with pytest.raises(HookError, match="0x10"):
        HookOps(fabric(), NullLog()).prepare(dom)
    assert ledger.shared_drives(reg)[NVME][2] == []
    assert fabric().mdevs() == []


def test_a_domain_asking_for_a_backup_path_claims_both_paths(env):
    reg, fabric, geometry = env
    ledger.lend_shared(reg, NVME, geometry)
    HookOps(fabric("gamma"), NullLog()).prepare(domain("vm-a", queues=1, paths=2))
    (entry,) = ledger.shared_drives(reg)[NVME][2]
    assert entry.share.paths == 2
    with reg.read() as tx:
        share_windows = {c.share: c.segments for _f, c in tx.claims() if c.kind == "dma"}
        luts = {c.adapter for _f, c in tx.claims() if c.kind == "lut"}
    # each path's windows and its relay rings' segment
    assert share_windows == {
        "nvme:0x12:gamma/vm-a": 2,
        "nvme:0x12:gamma/vm-a#backup": 2,
        "msi:gamma/vm-a": 1,
        "msi:gamma/vm-a#backup": 1,
    }
    assert {"gamma:0", "gamma:1", "alpha:0"} <= luts
    # a VM on a node with one adapter cannot have one: the start fails, nothing stays
    with pytest.raises(HookError, match="no backup path for beta's share"):
        HookOps(fabric("beta"), NullLog()).prepare(domain("vm-b", queues=1, paths=2))
    assert [str(e.holder) for e in ledger.shared_drives(reg)[NVME][2]] == ["gamma/vm-a"]
    assert fabric("beta").mdevs() == []


def test_a_drive_not_lent_for_sharing_refuses_the_start(env):
    _reg, fabric, _geometry = env
    with pytest.raises(HookError, match="not lent for sharing"):
        HookOps(fabric(), NullLog()).prepare(domain("vm-a"))
    assert fabric().mdevs() == []


def test_too_big_a_share_refuses_the_start(env):
    reg, fabric, geometry = env
    ledger.lend_shared(reg, NVME, geometry)
    with pytest.raises(HookError, match="vectors"):
        HookOps(fabric(), NullLog()).prepare(domain("vm-a", queues=40))
    assert ledger.shared_drives(reg)[NVME][2] == []


def test_a_backend_without_shares_says_so():
    from vmlend.errors import SharingUnsupportedError

    with pytest.raises(SharingUnsupportedError, match="doctor"):
        acquire_share(
            object(), Holder("g", "v"), NVME, uuid.uuid4(), NvmeShareRequest(1, 512), UndoJournal()
        )


# --- a domain naming another VM's mdevs (a copied or forged XML) ---------------------------


def forged_copy(original: DomainSpec, name: str) -> bytes:
    """``original``'s XML under another name and domain UUID, its metadata still naming the
    original's mdev UUIDs (what a copied XML edited by hand looks like)."""
    xml = new_domain(original, templates=TemplateSet()).to_bytes()
    xml = xml.replace(original.name.encode(), name.encode())
    forged_uuid = uuid.uuid5(uuid.NAMESPACE_DNS, name)
    return xml.replace(str(original.uuid).encode(), str(forged_uuid).encode())


def hook(state_path, name: str, *argv: str, xml: bytes) -> tuple[int, str]:
    err = io.StringIO()
    env = {"VMLEND_STATE": str(state_path), "VMLEND_NODE": "gamma"}
    code = run([name, *argv], stdin=io.BytesIO(xml), stdout=io.BytesIO(), stderr=err, environ=env)
    return code, err.getvalue()


def start_vm_a(env, state_path, devices=(0x10,)):
    """VM vm-a started on gamma by the hook, with a share of the drive and ``devices``."""
    reg, _fabric, geometry = env
    ledger.lend_shared(reg, NVME, geometry)
    spec = DomainSpec(
        name="vm-a",
        memory_bytes=256 * MiB,
        uuid=uuid.uuid5(uuid.NAMESPACE_DNS, "vm-a"),
        devices=[
            DeviceRequest(NVME, share=NvmeShareRequest(2, 64 * MiB)),
            *(DeviceRequest(f) for f in devices),
        ],
    )
    xml = new_domain(spec, templates=TemplateSet()).to_bytes()
    assert hook(state_path, "vm-a", "prepare", "begin", "-", xml=xml) == (0, "")
    return spec, read_domain(xml)


def state_of_a(env):
    reg, fabric, _geometry = env
    return (
        sorted((m.uuid, m.fdid, m.vm) for m in fabric().mdevs()),
        fabric().device(0x10).holder,
        [(str(e.holder), e.share) for e in ledger.shared_drives(reg)[NVME][2]],
    )


def test_release_of_a_forged_domain_leaves_the_other_vms_mdevs(env, state_path):
    """libvirt runs release after every failed start: a domain whose metadata names vm-a's
    mdevs fails its prepare, and its release must leave vm-a's mdevs, hold and share; the
    action log names each foreign mdev."""
    spec, a = start_vm_a(env, state_path)
    before = state_of_a(env)
    assert len(before[0]) == 2 and before[1].vm == "vm-a" and len(before[2]) == 1
    b = forged_copy(spec, "vm-b")
    assert hook(state_path, "vm-b", "prepare", "begin", "-", xml=b)[0] == 1
    assert state_of_a(env) == before
    for _ in range(2):  # and a second release (a re-run) changes nothing either
        assert hook(state_path, "vm-b", "release", "end", "-", xml=b) == (0, "")
        assert state_of_a(env) == before
    log = "\n".join(ActionLog(log_path_for_state(state_path)).tail(20))
    for dev in a.devices:
        note = f"mdev {dev.mdev}: named by this domain but serves gamma/vm-a; left alone"
        assert f"vm=vm-b release: {note}" in log
    # vm-a's own release still returns everything
    xml_a = new_domain(spec, templates=TemplateSet()).to_bytes()
    assert hook(state_path, "vm-a", "release", "end", "-", xml=xml_a) == (0, "")
    assert state_of_a(env) == ([], None, [])


def test_a_forged_share_domain_cannot_take_the_other_vms_mdev(env, state_path):
    """Past the XML check (an attach, a lenient read): the share itself would be free to
    claim, but the mdev is vm-a's, so vm-b gets neither and vm-a keeps both."""
    _reg, fabric, _geometry = env
    spec, _a = start_vm_a(env, state_path, devices=())
    before = state_of_a(env)
    b = read_domain(forged_copy(spec, "vm-b"), strict=False)
    with pytest.raises(HookError, match="serves VM gamma/vm-a"):
        HookOps(fabric(), NullLog()).prepare(b)
    assert state_of_a(env) == before


def test_a_share_mdev_is_never_handed_to_another_share(env, state_path):
    """The fabric itself refuses, inside its transaction, to give vm-b vm-a's share mdev,
    even once vm-b has a share of the same drive."""
    _reg, fabric, _geometry = env
    _spec, a = start_vm_a(env, state_path, devices=())
    (share_mdev,) = (str(d.mdev) for d in a.devices)
    vm_b = Holder("gamma", "vm-b", str(uuid.uuid5(uuid.NAMESPACE_DNS, "vm-b")))
    fabric().reserve_share(NVME, vm_b, 1, 1024)
    with pytest.raises(MdevOwnedError, match=f"mdev {share_mdev} serves VM gamma/vm-a"):
        fabric().create_share_mdev(NVME, share_mdev, vm_b)
    assert [(m.uuid, m.vm) for m in fabric().mdevs()] == [(share_mdev, "vm-a")]


def test_reconnect_of_a_forged_domain_adopts_nothing(env, state_path):
    """A running domain whose metadata names vm-a's mdevs (libvirtd restarted): reconnect
    reports the foreign mdevs and neither takes them nor claims anything for vm-b."""
    spec, a = start_vm_a(env, state_path)
    before = state_of_a(env)
    b = forged_copy(spec, "vm-b")
    assert hook(state_path, "vm-b", "reconnect", "begin", "-", xml=b) == (0, "")
    assert state_of_a(env) == before
    log = "\n".join(ActionLog(log_path_for_state(state_path)).tail(20))
    share_mdev = next(d.mdev for d in a.devices if d.share is not None)
    problem = f"device 0x12: PROBLEM: mdev {share_mdev} serves VM gamma/vm-a"
    assert f"vm=vm-b reconnect: {problem}" in log
