"""The hook with a domain that asks for an NVMe share: prepare claims the share and creates an
mdev of the share type, all or nothing; release returns both; a drive not lent for sharing
refuses the start."""

from __future__ import annotations

import uuid

import pytest

from tests.simfabric import make_fabric
from vmlend.domain import (
    DeviceRequest,
    DomainSpec,
    NvmeShareRequest,
    TemplateSet,
    new_domain,
    read_domain,
)
from vmlend.errors import HookError
from vmlend.fabric.model import Holder, MiB
from vmlend.fabric.sim.backend import SimFabric
from vmlend.fabric.sim.nvmedrive import drive_geometry
from vmlend.hook.actionlog import NullLog
from vmlend.hook.ops import HookOps
from vmlend.lending import UndoJournal
from vmlend.nvme import ledger
from vmlend.nvme.lending import SHARE_MDEV_TYPE, acquire_share
from vmlend.registry import SqliteRegistry

NVME = 0x12


def domain(name: str, queues: int = 2, size: int = 64 * MiB, extra=()):
    spec = DomainSpec(
        name=name,
        memory_bytes=256 * MiB,
        uuid=uuid.uuid5(uuid.NAMESPACE_DNS, name),
        devices=[DeviceRequest(NVME, share=NvmeShareRequest(queues, size)), *extra],
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
    # the shares' DMA windows (the domain's RAM) are claimed on the lender's adapter
    with reg.read() as tx:
        share_windows = {c.share: c.segments for _f, c in tx.claims() if c.kind == "dma"}
    assert share_windows == {"nvme:0x12:gamma/vm-a": 1, "nvme:0x12:beta/vm-b": 1}
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
        acquire_share(object(), Holder("g", "v"), NVME, uuid.uuid4(),
                      NvmeShareRequest(1, 512), UndoJournal())
