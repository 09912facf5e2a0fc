"""A kernel-backend host whose VM ``web`` borrows two GPUs of the default fabric, 0x10 (lent
by alpha) and 0x20 (lent by beta), each with its DMA windows written and enabled by the guest,
and whose fake driver serves section 8's peer-to-peer files (``FakeP2P``). Test modules import
the fixtures they use, with ``smartio_host``'s ``state``, ``fake`` and ``fabric``."""

from __future__ import annotations

import pytest

from tests.support.fake_p2p import FakeP2P
from tests.support.smartio_host import WEB
from vmlend.memory.layout import MemoryConfig, compute_layout
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
