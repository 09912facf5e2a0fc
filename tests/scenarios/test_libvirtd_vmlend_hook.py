"""vmlend's real hook under a real private libvirtd with real TCG guests.

Installed with vmlend's own installer into the daemon's hooks/qemu.d (picked up without a
restart, since the daemon started with hooks enabled). Here libvirt refuses mdev guests after
prepare (no VFIO on this machine), which is exactly what shows the hook returns everything.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import libvirt
import pytest

from tests.support.libvirt_daemon import needs_no_vfio
from tests.support.simfabric import make_fabric
from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, new_domain
from vmlend.hook.actionlog import ActionLog, log_path_for_state
from vmlend.hook.install import install_hook, uninstall_hook
from vmlend.topology.model import Holder, MiB
from vmlend.wiring.fabric import open_fabric

pytestmark = pytest.mark.libvirtd


@pytest.fixture
def vmlend_hook(libvirtd, state_path):
    """The fabric's state, and vmlend's hook installed into the daemon's config dir."""
    fabric = make_fabric(state_path)
    libvirt_dir = libvirtd.hooks_dir.parent
    # backend = "sim" chosen: else the hook itself refuses a VM on simulated devices
    # (vmlend.hook.simulated), and these tests watch libvirt's own refusal after prepare
    result = install_hook(libvirt_dir, state_path, "gamma", backend="sim")
    assert not result.restart_needed  # the daemon's hooks are already enabled
    yield fabric
    uninstall_hook(libvirt_dir)


def vmlend_guest(conn, fdids, names):
    name = f"vl-{uuid.uuid4().hex[:8]}"
    spec = DomainSpec(
        name=name,
        memory_bytes=64 * MiB,
        machine="pc",
        virt_type="qemu",
        devices=[DeviceRequest(f) for f in fdids],
    )
    xml = new_domain(spec, templates=TemplateSet()).to_bytes()
    dom = conn.defineXML(xml.decode())
    names.append(name)
    return dom


@pytest.fixture
def guests(libvirt_conn):
    names: list[str] = []
    yield names
    for name in names:
        try:
            dom = libvirt_conn.lookupByName(name)
        except libvirt.libvirtError:
            continue
        if dom.isActive():
            dom.destroy()
        dom.undefine()


def state_of(state_path):
    f = open_fabric(state_path)
    return (
        sorted((d.fdid, d.state, d.holder) for d in f.devices()),
        sorted((m.uuid, m.fdid) for m in f.mdevs()),
    )


@needs_no_vfio
def test_vmlend_guest_passes_prepare_then_release_returns_every_device(
    vmlend_hook, libvirt_conn, guests, state_path
):
    before = state_of(state_path)
    dom = vmlend_guest(libvirt_conn, [0x10, 0x12, 0x21, 0x22], guests)
    with pytest.raises(libvirt.libvirtError) as exc:
        dom.create()
    assert exc.value.get_error_code() == libvirt.VIR_ERR_CONFIG_UNSUPPORTED
    log = "\n".join(ActionLog(log_path_for_state(state_path)).tail(50))
    for fd in ("0x10", "0x12", "0x21", "0x22"):
        assert f"prepare: reserve {fd}: ok" in log
        assert f"release: device {fd}: returned" in log
    assert "prepare: 4 devices ready" in log
    assert state_of(state_path) == before
    assert not dom.isActive()


@needs_no_vfio
def test_vmlend_does_nothing_at_stopped_and_releases_at_release_end(
    vmlend_hook, libvirt_conn, guests, state_path, hook_recorder
):
    """Issue 36: removing the mdevs at 'stopped end' made libvirt, whose own teardown comes
    after that call, log an error at every stop. libvirtd runs its main hook (the recorder)
    before vmlend's in qemu.d, so the action log as each call finds it shows what vmlend did
    up to the call before: nothing at 'stopped end', everything at 'release end'."""
    actions = log_path_for_state(state_path)
    hook_recorder.install(snapshot=actions)
    before = state_of(state_path)
    dom = vmlend_guest(libvirt_conn, [0x10, 0x12], guests)
    name = dom.name()
    with pytest.raises(libvirt.libvirtError) as exc:
        dom.create()  # refused after prepare (no VFIO here): libvirt runs stopped and release
    assert exc.value.get_error_code() == libvirt.VIR_ERR_CONFIG_UNSUPPORTED

    def lines(text: str | None) -> list[str]:
        mine = [ln for ln in (text or "").splitlines() if f" vm={name} " in ln]
        return [ln.split(f" vm={name} ", 1)[1] for ln in mine]

    calls = hook_recorder.calls(name)
    ops = [c.op[:2] for c in calls]
    assert ops == [("prepare", "begin"), ("stopped", "end"), ("release", "end")]
    prepared, stopped = lines(calls[1].snapshot), lines(calls[2].snapshot)
    assert prepared[-1] == "prepare: 2 devices ready"
    assert stopped == prepared  # vmlend's 'stopped end' did nothing
    released = lines(actions.read_text())[len(stopped) :]
    assert released and all(ln.startswith("release: ") for ln in released)
    assert "release: device 0x10: returned" in released
    assert "release: device 0x12: returned" in released
    assert state_of(state_path) == before


def test_start_refused_when_a_device_is_held_elsewhere_leaves_nothing(
    vmlend_hook, libvirt_conn, guests, state_path
):
    vmlend_hook.reserve(0x12, Holder("gamma", "other-vm", str(uuid.uuid4())))
    before = state_of(state_path)
    dom = vmlend_guest(libvirt_conn, [0x10, 0x12], guests)
    with pytest.raises(libvirt.libvirtError) as exc:
        dom.create()
    assert exc.value.get_error_code() == libvirt.VIR_ERR_HOOK_SCRIPT_FAILED
    message = str(exc.value)
    assert "device 0x12" in message and "held by gamma/other-vm" in message
    assert state_of(state_path) == before
    assert not dom.isActive()


def test_start_of_simulated_devices_nobody_chose_ends_with_vmlends_line(
    libvirtd, libvirt_conn, guests, state_path, tmp_path
):
    """What ``virsh start`` shows on a host without the SmartIO driver when nobody chose the
    simulator: libvirt's hook failure, ending with vmlend's one line, and nothing reserved."""
    make_fabric(state_path).close()
    libvirt_dir = libvirtd.hooks_dir.parent
    # no backend: sim only by default (a file of its own: the daemon's says backend = "sim")
    install_hook(libvirt_dir, state_path, "gamma", config_file=tmp_path / "vmlend.toml")
    try:
        before = state_of(state_path)
        dom = vmlend_guest(libvirt_conn, [0x10, 0x12], guests)
        with pytest.raises(libvirt.libvirtError) as exc:
            dom.create()
        assert exc.value.get_error_code() == libvirt.VIR_ERR_HOOK_SCRIPT_FAILED
        message = str(exc.value).rstrip()
        line = f"vmlend: cannot start VM '{dom.name()}' on this host's libvirtd: its remote"
        assert line in message and message.endswith("(docs/real-hardware.md)"), message
        assert state_of(state_path) == before
        assert not dom.isActive()
    finally:
        uninstall_hook(libvirt_dir)


def test_domain_without_vmlend_devices_boots_untouched(vmlend_hook, libvirt_guests, state_path):
    before = state_of(state_path)
    log = ActionLog(log_path_for_state(state_path))
    dom = libvirt_guests.define()
    dom.create()
    assert dom.isActive()
    dom.destroy()
    assert state_of(state_path) == before
    assert [line for line in log.tail(100) if dom.name() in line] == []


@needs_no_vfio
def test_the_agent_serves_libvirtds_hook_calls_without_deadlock(
    libvirtd, libvirt_conn, guests, state_path, tmp_path
):
    # libvirtd holds the domain's job while its hook runs, and the hook now waits for the
    # agent: prepare and release must go through the agent (whose pid writes the action log)
    # and leave the fabric as it was, as in-process.
    make_fabric(state_path).close()
    sock = tmp_path / "hook.sock"
    libvirt_dir = libvirtd.hooks_dir.parent
    install_hook(libvirt_dir, state_path, "gamma", hook_socket=sock, backend="sim")
    env = {
        k: v
        for k, v in os.environ.items()
        # never the machine's config nor host root: the test's own, as the hook has them pinned
        if not k.startswith("VMLEND_") or k in ("VMLEND_CONFIG", "VMLEND_ROOT")
    }
    env |= {"VMLEND_STATE": str(state_path), "VMLEND_NODE": "gamma"}
    agent = subprocess.Popen(
        [str(Path(sys.executable).parent / "vmlend"), "agent", "--hook-socket", str(sock)],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            assert agent.poll() is None and time.monotonic() < deadline, "agent never served"
            time.sleep(0.05)
        before = state_of(state_path)
        dom = vmlend_guest(libvirt_conn, [0x10, 0x12, 0x21, 0x22], guests)
        with pytest.raises(libvirt.libvirtError) as exc:
            dom.create()
        assert exc.value.get_error_code() == libvirt.VIR_ERR_CONFIG_UNSUPPORTED
        lines = ActionLog(log_path_for_state(state_path)).tail(50)
        log = "\n".join(lines)
        assert "prepare: 4 devices ready" in log and "release: device 0x22: returned" in log
        assert {int(p) for p in re.findall(r" pid=(\d+) ", log)} == {agent.pid}
        assert state_of(state_path) == before
    finally:
        agent.terminate()
        agent.wait(30)
        uninstall_hook(libvirt_dir)
