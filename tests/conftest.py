"""Shared fixtures. Fixtures for daemons live in their own conftest modules/plugins."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

MACHINE_CONFIG = Path("/etc/vmlend/vmlend.toml")
#: The machine's hook action log (beside the default state, /var/lib/vmlend as root).
MACHINE_ACTION_LOG = Path("/var/lib/vmlend/hook.log")
#: tests/kernel needs the real VFIO/mdev kernel of the kernel tier's guest (make test-kernel,
#: kernel-tier/): its init sets VMLEND_KERNEL_GUEST. Anywhere else the tree is not collected.
collect_ignore = [] if os.environ.get("VMLEND_KERNEL_GUEST") else ["kernel"]


@pytest.fixture(autouse=True)
def _private_config(tmp_path, monkeypatch):
    """Every test's configuration file is its own (absent until a test writes it): nothing
    reads or writes the machine's /etc/vmlend/vmlend.toml. Tests of the file under --root
    unset VMLEND_CONFIG; a subprocess given a cleaned environment must keep it. A test that
    wrote the machine's file anyway fails."""
    monkeypatch.setenv("VMLEND_CONFIG", str(tmp_path / "vmlend.toml"))
    # Nor the machine's state directory: a process given only a registry URL keeps its
    # action log and simulated nodes beside the default state (/var/lib/vmlend as root).
    monkeypatch.setenv("VMLEND_STATE", str(tmp_path / "default-state" / "state.db"))
    existed = MACHINE_CONFIG.exists()
    logged = _size(MACHINE_ACTION_LOG)
    yield
    if not existed and MACHINE_CONFIG.exists():
        MACHINE_CONFIG.unlink()
        with contextlib.suppress(OSError):
            MACHINE_CONFIG.parent.rmdir()
        pytest.fail(f"the test wrote the machine's {MACHINE_CONFIG} (removed again)")
    if _size(MACHINE_ACTION_LOG) > logged:
        pytest.fail(
            f"the test appended to the machine's {MACHINE_ACTION_LOG}: a hook ran without"
            " VMLEND_STATE in the environment it was given"
        )


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


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
    "tests.support.libvirt_daemon",
    "tests.support.etcd_daemon",
    "tests.support.cli_cluster",
]
