"""A kernel-backend host for tests: a default-fabric state (``state``), a fake sysfs with the
SmartIO driver offering the fabric's devices (``fake``), the SmartIO fabric over both
(``fabric``), another process's view of the same state (``other_view``), and a VM's start
(``start_vm``). Test modules import the fixtures they use."""

from __future__ import annotations

import pytest

from tests.support.fake_sysfs import FakeSmartio, FakeSysfs, populate_smartio
from vmlend.kernel.backend import SmartioFabric
from vmlend.registry import SqliteRegistry
from vmlend.sim.backend import SimFabric
from vmlend.topology.model import Holder
from vmlend.wiring.fabric import default_topology_text, init_fabric

WEB = Holder("gamma", "web", "11111111-1111-1111-1111-111111111111")
U1 = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1001"
U2 = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1002"
NVME = 0x12
PARENT = "smartio-12"


@pytest.fixture
def state(tmp_path):
    path = tmp_path / "state.db"
    text, source = default_topology_text()
    init_fabric(path, text, source, node="gamma")
    return path


@pytest.fixture
def fake(tmp_path, state):
    fake = FakeSysfs(tmp_path / "root")
    topo = SimFabric(SqliteRegistry.open(state)).topology()
    smartio = FakeSmartio(fake, node_id=12)
    populate_smartio(smartio, topo)
    fake.smartio = smartio  # type: ignore[attr-defined]
    return fake


@pytest.fixture
def fabric(state, fake):
    with SmartioFabric(SqliteRegistry.open(state), fake.env, writer=fake) as fab:
        yield fab


@pytest.fixture
def other_view(state):
    """Another process on the same state that knows nothing of the kernel."""
    with SimFabric(SqliteRegistry.open(state)) as sim:
        yield sim


def start_vm(fabric) -> None:
    fabric.reserve(NVME, WEB)
    fabric.ensure_mdev_parent(NVME)
    fabric.create_mdev(NVME, U1, WEB)
