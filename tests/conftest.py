"""Shared fixtures. Fixtures for daemons live in their own conftest modules/plugins."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _private_config(tmp_path, monkeypatch):
    """Every test's configuration file is its own (absent until a test writes it): nothing
    reads or writes the machine's /etc/vmlend/vmlend.toml. Tests of the file under --root
    unset VMLEND_CONFIG."""
    monkeypatch.setenv("VMLEND_CONFIG", str(tmp_path / "vmlend.toml"))


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
