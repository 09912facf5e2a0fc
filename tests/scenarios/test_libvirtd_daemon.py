"""The private libvirtd fixture itself: isolated from the host, started and stopped by PID."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.libvirt_daemon import (
    TRAMPOLINE,
    LibvirtDaemon,
    guest_xml,
    pid_alive,
    socket_accepts,
)

pytestmark = pytest.mark.libvirtd


def seen_by(pid: int, path: str) -> Path:
    """``path`` as process ``pid`` sees it (/proc/PID/root resolves in its mount namespace)."""
    return Path(f"/proc/{pid}/root") / path.lstrip("/")


def test_daemons_run_in_their_own_mount_namespace(libvirtd):
    ours = os.readlink("/proc/self/ns/mnt")
    assert set(libvirtd.pids) == {"virtlogd", "libvirtd", "reaper"}
    assert Path(f"/proc/{libvirtd.pids['libvirtd']}/exe").resolve().name == "libvirtd"
    for pid in libvirtd.pids.values():
        assert pid_alive(pid)
        assert os.readlink(f"/proc/{pid}/ns/mnt") != ours


def test_daemon_sees_private_dirs_where_the_host_keeps_its_own(libvirtd):
    pid = libvirtd.pids["libvirtd"]
    hook = seen_by(pid, "/etc/libvirt/hooks/qemu")
    assert hook.read_bytes() == TRAMPOLINE.read_bytes()
    assert hook.samefile(libvirtd.hooks_dir / "qemu")
    host_hook = Path("/etc/libvirt/hooks/qemu")
    assert not host_hook.exists() or not host_hook.samefile(libvirtd.hooks_dir / "qemu")
    assert seen_by(pid, "/run/libvirt/libvirt-sock").samefile(libvirtd.layout.socket)
    assert seen_by(pid, "/var/log/libvirt").samefile(libvirtd.log_dir)
    assert Path(libvirtd.uri.split("socket=", 1)[1]).is_relative_to(libvirtd.root)


def test_the_private_daemon_is_its_own_host_to_vmlend(libvirtd, libvirt_conn):
    from vmlend.hypervisor.libvirt_hv import LibvirtHypervisor

    hv = LibvirtHypervisor(libvirt_conn)  # not closed here: the fixture owns the connection
    assert hv.host_uuid() == libvirtd.layout.host_uuid


def test_connection_reaches_the_private_qemu_driver(libvirtd, libvirt_conn):
    assert libvirt_conn.getType() == "QEMU"
    assert libvirt_conn.getURI() == libvirtd.uri
    assert libvirt_conn.getLibVersion() >= 6_005_000  # qemu.d hooks need 6.5
    assert "libvirt version" in libvirtd.read_log()
    assert libvirtd.timings["qemu_probe"] > 0


def test_a_second_private_daemon_runs_beside_and_leaves_nothing_behind(
    libvirtd, libvirt_conn, libvirt_guests, tmp_path
):
    # Share the session daemon's QEMU capability cache so this one needs no new probe.
    other = LibvirtDaemon(tmp_path / "other", cache_dir=libvirtd.layout.private("cache"))
    try:
        other.start()
        conn = other.connect()
        try:
            mine = libvirt_guests.define()
            assert mine.name() not in conn.listDefinedDomains()
            assert conn.listAllDomains() == []
        finally:
            conn.close()
    finally:
        survivors = other.stop()
    assert survivors == []
    assert not any(pid_alive(pid) for pid in other.pids.values())
    assert not socket_accepts(other.layout.socket)
    # The session daemon did not notice.
    assert socket_accepts(libvirtd.layout.socket)
    assert mine.name() in libvirt_conn.listDefinedDomains()


def test_stop_destroys_guests_left_running_and_their_qemu_exits(libvirtd, tmp_path):
    other = LibvirtDaemon(tmp_path / "other", cache_dir=libvirtd.layout.private("cache"))
    try:
        other.start()
        conn = other.connect()
        try:
            dom = conn.defineXML(guest_xml("left-running", "5c0c0ffe-1d2b-4c3d-8e4f-a1b2c3d4e5f6"))
            dom.create()
        finally:
            conn.close()
        qemu = other.qemu_pids()["left-running"]
        assert pid_alive(qemu)
    finally:
        survivors = other.stop()
    assert survivors == []
    assert not pid_alive(qemu)
