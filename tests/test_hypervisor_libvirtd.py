"""LibvirtHypervisor against a real, private libvirtd, and the simulator checked against it.

The daemon runs as root in its own mount namespace, with /etc/libvirt, /run/libvirt and
/var/{lib,log,cache}/libvirt bound to a temporary directory: its socket, hook and state are
private, and the host's libvirt is untouched. It is stopped by PID at the end of the module.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from lxml import etree

from vmlend.errors import (
    DomainStateError,
    ShutdownTimeoutError,
    UnsupportedOperationError,
)
from vmlend.hypervisor import DomainState, open_hypervisor
from vmlend.hypervisor.sim_hv import SimHypervisor

pytestmark = [pytest.mark.libvirtd, pytest.mark.slow]

DATA = Path(__file__).parent / "data" / "hypervisor"
DOMAIN_XML = (DATA / "domain.xml").read_bytes()
MDEV_XML = (DATA / "mdev-hostdev.xml").read_bytes()
SH = shutil.which("sh") or "sh"
# Directories the daemon uses, each replaced by a private one inside its mount namespace.
LIBVIRT_DIRS = {
    "etc": "/etc/libvirt",
    "run": "/run/libvirt",
    "lib": "/var/lib/libvirt",
    "log": "/var/log/libvirt",
    "cache": "/var/cache/libvirt",
}


def _can_run_private_libvirtd() -> str | None:
    if os.geteuid() != 0:
        return "needs root (the qemu driver in system mode)"
    for prog in ("unshare", "libvirtd", "virtlogd", "qemu-system-x86_64"):
        if shutil.which(prog) is None:
            return f"{prog} is not installed"
    for path in LIBVIRT_DIRS.values():
        if not os.path.isdir(path):
            return f"{path} is missing (libvirt-daemon-system not installed?)"
    if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        return "cannot create a mount namespace here"
    return None


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    why = _can_run_private_libvirtd()
    if why:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("libvirtd")
    shutil.copytree(LIBVIRT_DIRS["etc"], root / "etc", symlinks=True)
    for name in LIBVIRT_DIRS:
        (root / name).mkdir(exist_ok=True)
    # QEMU as root: /dev/kvm is root-only on this machine kind, and with the default user the
    # daemon finds its QEMU capability cache invalid and re-probes (~40 s) on every define.
    with (root / "etc" / "qemu.conf").open("a") as conf:
        conf.write('\nuser = "root"\ngroup = "root"\n')
    hooks = root / "etc" / "hooks"
    hooks.mkdir(exist_ok=True)
    hook_log = root / "hook.log"
    # libvirtd passes hooks only a minimal environment, so the log path is baked in here.
    (hooks / "qemu").write_text(
        f'#!{SH}\nHOOK_LOG={hook_log} exec {SH} {DATA / "recording-hook.sh"} "$@"\n'
    )
    (hooks / "qemu").chmod(0o755)
    mounts = "".join(f"mount --bind {root / n} {p}\n" for n, p in LIBVIRT_DIRS.items())
    script = (
        f"set -e\n{mounts}"
        f"virtlogd -p {root / 'virtlogd.pid'} &\n"
        f"libvirtd -p {root / 'libvirtd.pid'} &\n"
        "wait\n"
    )
    log = (root / "daemon.log").open("wb")
    proc = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "--", SH, "-c", script],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    sock = root / "run" / "libvirt-sock"
    deadline = time.monotonic() + 15
    while not sock.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        if not sock.exists():
            pytest.fail(f"private libvirtd did not start: {(root / 'daemon.log').read_text()}")
        yield f"qemu+unix:///system?socket={sock}", hook_log
    finally:
        for pidfile in ("libvirtd.pid", "virtlogd.pid"):
            with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
                os.kill(int((root / pidfile).read_text().strip()), signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
def hv(daemon, tmp_path):
    uri, hook_log = daemon
    h = open_hypervisor(uri, state_dir=tmp_path, hook_command=None)
    hook_log.write_text("")
    yield h
    for d in h.list_domains():
        if d.active:
            h.destroy(d.name)
        if d.persistent:
            h.undefine(d.name)
    h.close()


def _calls(log: Path) -> list[list[str]]:
    return [ln.split() for ln in log.read_text().splitlines()]


def _without_hostdevs(xml: bytes) -> bytes:
    root = etree.fromstring(xml)
    for h in root.findall("devices/hostdev"):
        h.getparent().remove(h)
    return etree.tostring(root)


def _hostdev(xml: bytes) -> etree._Element:
    return etree.fromstring(xml).find("devices/hostdev")


def test_libvirtd_and_the_simulator_run_the_hook_alike(daemon, hv, tmp_path, monkeypatch):
    _uri, hook_log = daemon
    plain = _without_hostdevs(DOMAIN_XML)
    hv.define(plain)
    hv.start("vm1")
    hv.destroy("vm1")
    real = _calls(hook_log)

    sim_log = tmp_path / "sim-hook.log"
    monkeypatch.setenv("HOOK_LOG", str(sim_log))
    # libvirt 9.0 passes "-" as release's extra argument; so does the simulator told so.
    sim = SimHypervisor(
        "gamma", tmp_path / "hv", [SH, str(DATA / "recording-hook.sh")], release_reasons=False
    )
    sim.define(plain)
    sim.start("vm1")
    sim.destroy("vm1")
    assert _calls(sim_log) == real
    assert [c[1] for c in real] == ["prepare", "start", "started", "stopped", "release"]


def test_mdev_defaults_on_define_match_the_simulator(hv, tmp_path):
    hv.define(DOMAIN_XML)
    real = _hostdev(hv.xml("vm1", inactive=True))
    sim = SimHypervisor("gamma", tmp_path / "hv", None)
    sim.define(DOMAIN_XML)
    simulated = _hostdev(sim.xml("vm1", inactive=True))
    for attr in ("managed", "display", "model", "type", "mode"):
        assert simulated.get(attr) == real.get(attr), attr


def test_mdev_start_is_refused_after_prepare_with_libvirts_reason(daemon, hv):
    _uri, hook_log = daemon
    hv.define(DOMAIN_XML)
    with pytest.raises(UnsupportedOperationError, match="requires VFIO support") as exc:
        hv.start("vm1")
    assert "\n" not in str(exc.value)
    assert [c[1] for c in _calls(hook_log)] == ["prepare", "stopped", "release"]
    assert hv.lookup("vm1").state is DomainState.SHUTOFF


def test_live_attach_refused_config_attach_works_on_a_running_domain(hv):
    hv.define(_without_hostdevs(DOMAIN_XML))
    hv.start("vm1")
    with pytest.raises(UnsupportedOperationError, match="requires VFIO support"):
        hv.attach_device("vm1", MDEV_XML, live=True, config=False)
    hv.attach_device("vm1", MDEV_XML, live=False, config=True)
    assert _hostdev(hv.xml("vm1", inactive=True)) is not None
    assert _hostdev(hv.xml("vm1")) is None
    with pytest.raises(DomainStateError, match="already in the domain configuration"):
        hv.attach_device("vm1", MDEV_XML, live=False, config=True)
    hv.detach_device("vm1", MDEV_XML, live=False, config=True)
    assert _hostdev(hv.xml("vm1", inactive=True)) is None


def test_guest_without_os_ignores_shutdown(hv):
    hv.define(_without_hostdevs(DOMAIN_XML))
    hv.start("vm1")
    with pytest.raises(ShutdownTimeoutError, match="destroy"):
        hv.shutdown("vm1", timeout=0.5)
    assert hv.lookup("vm1").state is DomainState.RUNNING
