"""``virsh start`` of a VM whose devices only the simulator has: libvirtd's prepare hook
refuses it with vmlend's own line (libvirt ends its error with a failed hook's stderr), and
reserves nothing. The hook runs as a subprocess, the way libvirtd runs it (an environment of its
own: the script pins the configuration file and the host root); no libvirtd here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.hostroot import identify
from tests.support.simfabric import make_fabric
from vmlend.config import hook_environment
from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, new_domain
from vmlend.hook.actionlog import ActionLog, log_path_for_state
from vmlend.hook.entry import CALLER_ENV, LIBVIRTD
from vmlend.hook.install import install_hook, read_script_pins
from vmlend.hook.server import HookServer, identity_of
from vmlend.hook.simulated import simulated_only_by_default
from vmlend.hostenv import HostEnv
from vmlend.registry import hostlease
from vmlend.topology.model import MiB
from vmlend.wiring.fabric import open_fabric

PREPARE = ["vm1", "prepare", "begin", "-"]
REFUSAL = (
    "vmlend: cannot start VM 'vm1' on this host's libvirtd: its remote devices exist only in"
    " vmlend's simulator"
)


def vm_xml(fdids: tuple[int, ...] = (0x10, 0x12)) -> bytes:
    spec = DomainSpec(
        name="vm1",
        memory_bytes=512 * MiB,
        uuid=uuid.UUID("6f1c5a2e-0000-4000-8000-00000000005e"),
        devices=[DeviceRequest(f) for f in fdids],
    )
    return new_domain(spec, templates=TemplateSet()).to_bytes()


class Host:
    """A host root of its own without the SmartIO driver (so the backend defaults to sim), a
    simulated fabric's state under it, and vmlend's hook installed for its libvirtd."""

    def __init__(self, base: Path, backend: str | None = None) -> None:
        self.root = base / "root"
        identify(self.root)
        self.state = self.root / "state.db"
        make_fabric(self.state).close()
        self.socket = hostlease.hook_socket_path(HostEnv(self.root))
        self.hook = install_hook(
            base / "libvirt", self.state, "gamma", backend=backend, root=self.root
        ).path

    def run(self, argv: list[str], xml: bytes, **env: str) -> subprocess.CompletedProcess[str]:
        """The installed hook as libvirtd runs it: its environment holds nothing of ours."""
        return subprocess.run(
            [str(self.hook), *argv],
            input=xml,
            capture_output=True,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env},
            timeout=120,
        )

    def holds(self) -> dict[int, str]:
        with open_fabric(self.state, "gamma") as f:
            return {d.fdid: str(d.holder) for d in f.devices() if d.holder}

    def actions(self) -> str:
        return "\n".join(ActionLog(log_path_for_state(self.state)).tail(50))


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short directory: the agent's socket path must stay within 108 bytes."""
    base = Path(tempfile.mkdtemp(prefix="vhs"))
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _one_line(stderr: bytes) -> str:
    lines = stderr.decode().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_libvirtds_prepare_of_simulated_devices_fails_with_vmlends_line(short_tmp):
    host = Host(short_tmp)
    done = host.run(PREPARE, vm_xml())
    assert done.returncode == 1, done.stderr
    line = _one_line(done.stderr)
    assert line.startswith(REFUSAL), line
    # what to do: the simulated node, the driver, or choosing the backend
    assert "sim:///<node>" in line and "SmartIO driver" in line and 'backend = "sim"' in line
    assert host.holds() == {}  # refused before anything was reserved
    assert "prepare begin: FAILED: cannot start VM 'vm1'" in host.actions()
    # libvirt runs release after the failed prepare: it finds nothing and succeeds
    done = host.run(["vm1", "release", "end", "-"], vm_xml())
    assert (done.returncode, done.stderr) == (0, b"")


def test_a_chosen_backend_lets_libvirt_try(short_tmp):
    """``backend = "sim"`` in the hook's file: somebody chose the simulator (as the real-libvirtd
    tests do), so the prepare reserves the devices and libvirt fails later, its own way."""
    host = Host(short_tmp, backend="sim")
    done = host.run(PREPARE, vm_xml())
    assert (done.returncode, done.stderr) == (0, b"")
    assert host.holds() == {0x10: "gamma/vm1", 0x12: "gamma/vm1"}


def test_a_vm_without_remote_devices_and_other_operations_pass(short_tmp):
    host = Host(short_tmp)
    done = host.run(PREPARE, vm_xml(fdids=()))
    assert (done.returncode, done.stderr) == (0, b"")
    done = host.run(["vm1", "migrate", "begin", "-"], vm_xml())  # rewrites, reserves nothing
    assert done.returncode == 0 and done.stdout.rstrip().endswith(b"</domain>"), done.stderr


def test_a_simulated_nodes_hook_is_never_taken_for_libvirtds(short_tmp):
    """``python -m vmlend.hook`` is what a simulated node runs: its VMs are the ones that can
    run simulated devices, even with the marker inherited from its caller."""
    host = Host(short_tmp)
    ours = {k: v for k, v in os.environ.items() if k != "VMLEND_BACKEND"}
    sim_hook = [sys.executable, "-m", "vmlend.hook", "--state", str(host.state), "--node", "gamma"]
    done = subprocess.run(
        [*sim_hook, *PREPARE],
        input=vm_xml(),
        capture_output=True,
        env={**ours, "VMLEND_ROOT": str(host.root), CALLER_ENV: LIBVIRTD},
        timeout=120,
    )
    assert (done.returncode, done.stderr) == (0, b"")
    assert host.holds() == {0x10: "gamma/vm1", 0x12: "gamma/vm1"}


def test_the_agent_serving_the_hook_refuses_it_the_same(short_tmp):
    """The marker travels with the forwarded call: the agent (here in-process) answers with the
    same line and exit code, and reserves nothing."""
    host = Host(short_tmp)
    # what the hook process has before it reads its file: the script's two pins
    config = read_script_pins(host.hook.read_text())["config"]
    settled = {"VMLEND_CONFIG": config, "VMLEND_ROOT": str(host.root)}
    hook_environment(settled)
    server = HookServer(host.socket, identity_of(settled))
    server.start()
    try:
        done = host.run(PREPARE, vm_xml())
    finally:
        server.stop()
    assert done.returncode == 1 and server.served == 1, done.stderr
    assert _one_line(done.stderr).startswith(REFUSAL)
    assert host.holds() == {}


@pytest.mark.parametrize(
    ("caller", "backend", "driver", "refused"),
    [
        (LIBVIRTD, None, False, True),
        (LIBVIRTD, "sim", False, False),  # chosen: libvirt may try
        (LIBVIRTD, None, True, False),  # the SmartIO driver is loaded: real devices
        (None, None, False, False),  # not libvirtd (a simulated node, 'run()' in a test)
        ("somebody", None, False, False),
    ],
)
def test_simulated_only_by_default(tmp_path, caller, backend, driver, refused):
    if driver:
        smartio = HostEnv(tmp_path).smartio
        smartio.mkdir(parents=True)
        (smartio / "node_id").write_text("8\n")
    env = {"VMLEND_ROOT": str(tmp_path)}
    if caller:
        env[CALLER_ENV] = caller
    if backend:
        env["VMLEND_BACKEND"] = backend
    assert simulated_only_by_default(env) is refused
