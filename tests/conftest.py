"""Shared fixtures. Fixtures for daemons live in their own conftest modules/plugins."""

from __future__ import annotations

import os

import pytest

#: tests/kernel needs the real VFIO/mdev kernel of the kernel tier's guest (make test-kernel,
#: kernel-tier/): its init sets VMLEND_KERNEL_GUEST. Anywhere else the tree is not collected.
collect_ignore = [] if os.environ.get("VMLEND_KERNEL_GUEST") else ["kernel"]


@pytest.fixture
def state_path(tmp_path, monkeypatch):
    """A private state database path; also exported as VMLEND_STATE for the CLI."""
    path = tmp_path / "state.db"
    monkeypatch.setenv("VMLEND_STATE", str(path))
    return path


# The real private libvirtd (fixtures libvirtd, libvirt_conn, hook_recorder, libvirt_guests),
# a private etcd (fixtures etcd, etcd_url, private_etcd),
# and the simulated CLI cluster (fixture cluster; modules with their own cluster override it).
pytest_plugins = [
    "tests.support.libvirt_daemon",
    "tests.support.etcd_daemon",
    "tests.support.cli_cluster",
]
