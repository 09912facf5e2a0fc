"""LibvirtHypervisor against a real, private libvirtd, and the simulator checked against it.

The daemon is the test session's private libvirtd (tests/support/libvirt_daemon.py: its own mount
namespace, stopped by PID); the recording hook is swapped in through its trampoline.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from lxml import etree

from tests.support.paths import DATA
from vmlend.errors import (
    DomainStateError,
    ShutdownTimeoutError,
    UnsupportedOperationError,
)
from vmlend.hypervisor import DomainState
from vmlend.sim.hypervisor.node import SimHypervisor
from vmlend.wiring.hypervisor import open_hypervisor

pytestmark = [pytest.mark.libvirtd, pytest.mark.slow]

DATA = DATA / "hypervisor"
DOMAIN_XML = (DATA / "domain.xml").read_bytes()
MDEV_XML = (DATA / "mdev-hostdev.xml").read_bytes()
SH = shutil.which("sh") or "sh"


@pytest.fixture
def daemon(libvirtd, tmp_path):
    """The session's private libvirtd (tests/support/libvirt_daemon.py) with the recording hook."""
    hook_log = tmp_path / "hook.log"
    hook_log.write_text("")
    # libvirtd passes hooks only a minimal environment: the trampoline exports HOOK_LOG.
    libvirtd.install_hook([SH, str(DATA / "recording-hook.sh")], env={"HOOK_LOG": str(hook_log)})
    yield libvirtd.uri, hook_log
    libvirtd.remove_hook()


@pytest.fixture
def hv(daemon, tmp_path):
    uri, _hook_log = daemon
    h = open_hypervisor(uri, state_dir=tmp_path, hook_command=None)
    yield h
    for d in h.list_domains():
        if d.name != "vm1":  # the session daemon is shared: only what these tests define
            continue
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
