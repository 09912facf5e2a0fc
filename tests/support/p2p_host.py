"""A kernel-backend host whose VM ``web`` borrows two GPUs of the default fabric, 0x10 (lent
by alpha) and 0x20 (lent by beta), each with its DMA windows written and enabled by the guest,
and whose fake driver serves section 8's peer-to-peer files (``FakeP2P``). Test modules import
the fixtures they use, with ``smartio_host``'s ``state``, ``fake`` and ``fabric``."""

from __future__ import annotations

import contextlib
import uuid as uuidlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.fake_p2p import FakeP2P
from tests.support.smartio_host import WEB
from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, mdev_uuid, new_domain, read_domain
from vmlend.kernel.backend import SmartioFabric
from vmlend.kernel.p2psync import P2PSync
from vmlend.lending.devices import UndoJournal, acquire_device
from vmlend.memory.layout import MemoryConfig, compute_layout
from vmlend.registry import SqliteRegistry
from vmlend.sim.hypervisor.node import SimHypervisor
from vmlend.topology.model import GiB, GuestRam

RAM = GuestRam(tuple(compute_layout(MemoryConfig("q35", 8 * GiB)).ranges()))
GPU_A, GPU_B = 0x10, 0x20
UA = "83b8f4f2-509f-382f-3c1e-e6bfe0fa2001"
UB = "83b8f4f2-509f-382f-3c1e-e6bfe0fa2002"
CHILDREN = {GPU_A: UA, GPU_B: UB}
#: Where a guest with 8 GiB puts the GPUs' BARs (the 32-bit hole, then above its RAM).
BARS_A = {0: 0xC000_0000, 1: 0x80_0000_0000, 3: 0x88_0000_0000}
BARS_B = {0: 0xC100_0000, 1: 0x90_0000_0000, 3: 0x98_0000_0000}


@pytest.fixture
def p2p(fake):
    """The fake driver's peer-to-peer files (before any child exists, so every child has
    them)."""
    return FakeP2P(fake.smartio)


@pytest.fixture
def web(fabric, fake, p2p):
    """VM ``web`` running with both GPUs; returns the fake's files."""
    for fdid in CHILDREN:
        fabric.reserve(fdid, WEB, guest_ram=RAM)
    for fdid, uuid in CHILDREN.items():
        fabric.ensure_mdev_parent(fdid)
        fabric.create_mdev(fdid, uuid, WEB)
        fabric.write_dma_windows(fdid, uuid, RAM, holder=WEB)
        fake.smartio.guest_enable(fdid)
    return p2p


def token(fabric, fdid: int) -> int:
    return fabric._state.holds()[fdid].token


#: The children the prepare hook makes for ``web``'s GPUs (UUIDs from the domain's).
HOOK_CHILDREN = {f: str(mdev_uuid(uuidlib.UUID(WEB.vm_uuid), f)) for f in (GPU_A, GPU_B)}


@contextlib.contextmanager
def web_with_maps(
    root: Path, state: Path, fake, p2p: FakeP2P
) -> Iterator[tuple[SimHypervisor, SmartioFabric]]:
    """``web`` (q35, 8 GiB) defined and running on a simulated hypervisor under ``root``,
    both GPUs prepared as the hook does and enabled by the guest, their BARs decoded (``BARS_A``,
    ``BARS_B``) and the maps written as the watcher writes them."""
    hv = SimHypervisor("gamma", root / "hv", None)
    spec = DomainSpec(
        name="web",
        memory_bytes=8 << 30,
        uuid=uuidlib.UUID(WEB.vm_uuid),
        devices=[DeviceRequest(f) for f in HOOK_CHILDREN],
    )
    hv.define(new_domain(spec, templates=TemplateSet()).to_bytes())
    hv.start("web")
    ram = read_domain(hv.xml("web"), strict=False).guest_ram
    with SmartioFabric(SqliteRegistry.open(state), fake.env, writer=fake) as fabric:
        for f, u in HOOK_CHILDREN.items():
            acquire_device(fabric, WEB, f, u, UndoJournal(), guest_ram=ram)
            fake.smartio.guest_enable(f)
        sync = P2PSync(fabric)
        fake.listeners.append(sync.handle)
        p2p.decode(HOOK_CHILDREN[GPU_A], BARS_A)
        p2p.decode(HOOK_CHILDREN[GPU_B], BARS_B)
        fake.listeners.remove(sync.handle)
        yield hv, fabric
