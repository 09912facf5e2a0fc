"""The kernel tier: these tests run inside the guest that ``make test-kernel`` boots (Debian's
6.1 kernel under QEMU with an emulated Intel IOMMU, VFIO, the mdev core and the tier's SmartIO
stand-in loaded; kernel-tier/, docs/testing.md). Every test here is marked ``kernel`` and starts
and ends with no mdev, no registered SmartIO parent and no device in the stand-in's fabric."""

from __future__ import annotations

import os

import pytest

from tests.support.kernel_guest import STUB, clean_fabric
from tests.support.tier_shards import parse_shard, shard_of
from vmlend.topology.parse import load_topology


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.kernel)
    # Two configurations boot this directory: the main tier (Debian 12's kernel, QEMU and
    # libvirt) and the backports tier (6.12, QEMU 10, libvirt 11.3: `make
    # test-kernel-backports`). Each keeps its own tests: the backports ones carry its mark.
    tier = os.environ.get("VMLEND_KERNEL_TIER", "main")
    mine = tier == "backports"
    other = [i for i in items if (i.get_closest_marker("backports") is not None) != mine]
    if other:
        config.hook.pytest_deselected(items=other)
        items[:] = [i for i in items if i not in other]
    # Several guests side by side: each keeps its shard (tests/support/tier_shards.py).
    if shard := os.environ.get("VMLEND_TIER_SHARD"):
        keep = set(shard_of([i.nodeid for i in items], *parse_shard(shard)))
        config.hook.pytest_deselected(items=[i for i in items if i.nodeid not in keep])
        items[:] = [i for i in items if i.nodeid in keep]


@pytest.fixture(autouse=True)
def clean():
    clean_fabric()
    yield
    clean_fabric()


@pytest.fixture(autouse=True)
def host_root(tmp_path):
    """The host root tests/conftest.py gives every test ($VMLEND_ROOT, the test's directory),
    with the guest's real sys, dev and proc in it: vmlend sees the real kernel, while its own
    files (configuration, state, pending releases, run/) stay the test's."""
    for tree in ("sys", "dev", "proc"):
        (tmp_path / tree).symlink_to(f"/{tree}")
    return tmp_path


@pytest.fixture
def fabric_devices():
    """The stand-in lists every device of the default topology (this host is gamma, node 12)."""
    topology = load_topology()
    STUB.populate(topology)
    return topology
