"""Shared fixtures. Fixtures for daemons live in their own conftest modules/plugins."""

from __future__ import annotations

import os

import pytest

from tests.support.hypothesis_tiers import register_profiles

#: tests/kernel needs the real VFIO/mdev kernel of the kernel tier's guest (make test-kernel,
#: kernel-tier/): its init sets VMLEND_KERNEL_GUEST. Anywhere else the tree is not collected.
collect_ignore = [] if os.environ.get("VMLEND_KERNEL_GUEST") else ["kernel"]

# Before hypothesis's plugin reads --hypothesis-profile (make test-fast passes ``fast``).
register_profiles()


@pytest.fixture(autouse=True, scope="session")
def _private_session_config(tmp_path_factory):
    """The same for what runs before any test's own fixture: module- and session-scoped
    fixtures (a demo run once per module, a daemon once per session)."""
    base = tmp_path_factory.mktemp("session-config")
    (base / "vmlend.toml").touch()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VMLEND_CONFIG", str(base / "vmlend.toml"))
        mp.setenv("VMLEND_STATE", str(base / "default-state" / "state.db"))
        mp.setenv("VMLEND_ROOT", str(base))
        yield


@pytest.fixture(autouse=True)
def _private_config(tmp_path, monkeypatch):
    """Every test's configuration file is its own (empty: a file $VMLEND_CONFIG names must
    exist): nothing reads or writes the machine's /etc/vmlend/vmlend.toml. Tests of the file
    under --root unset VMLEND_CONFIG; a subprocess given a cleaned environment must keep it.
    The machine's files are watched, never touched (``tests/support/machine_files.py``)."""
    # Beside the test's directory, not in it: tests list what they wrote there.
    config = tmp_path.with_name(f"{tmp_path.name}-vmlend.toml")
    config.touch()
    monkeypatch.setenv("VMLEND_CONFIG", str(config))
    # Nor the machine's state directory: a process given only a registry URL keeps its
    # action log and simulated nodes beside the default state (/var/lib/vmlend as root).
    monkeypatch.setenv("VMLEND_STATE", str(tmp_path / "default-state" / "state.db"))
    # Nor the machine's host files (etc/vmlend/node, run/vmlend): a host root of its own, the
    # test's own directory, so that the paths a test makes there (its state) lie under the
    # root, where 'hook install' can pin them (vmlend.config.over_root).
    monkeypatch.setenv("VMLEND_ROOT", str(tmp_path))


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
    "tests.support.daemon_marks",
    "tests.support.machine_files",
    "tests.support.libvirt_daemon",
    "tests.support.etcd_daemon",
    "tests.support.cli_cluster",
]
