"""The hook offers a call to the agent before reading its configuration file
(``forward.forward_unconfigured``): the agent applies the file with the hook's own code and
runs the call only when the result is its own; otherwise nothing is done and the hook reads
the file itself (docs/hooks.md, "The agent serves the hook"). In-process agents
(``HookServer``), no daemons."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.hostroot import identify
from tests.support.simfabric import make_fabric
from vmlend.config import hook_environment
from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, new_domain
from vmlend.hook.forward import forward_unconfigured
from vmlend.hook.install import install_hook, read_script_pins
from vmlend.hook.server import HookServer, identity_of
from vmlend.hostenv import HostEnv
from vmlend.registry import hostlease
from vmlend.topology.model import MiB
from vmlend.wiring.fabric import open_fabric

PREPARE = ["vm1", "prepare", "begin", "-"]


def vm_xml() -> bytes:
    spec = DomainSpec(
        name="vm1",
        memory_bytes=512 * MiB,
        uuid=uuid.UUID("6f1c5a2e-0000-4000-8000-00000000000b"),
        devices=[DeviceRequest(0x10)],
    )
    return new_domain(spec, templates=TemplateSet()).to_bytes()


class Served:
    def __init__(self, base: Path) -> None:
        self.root = base / "root"
        identify(self.root)
        self.state = self.root / "state.db"
        make_fabric(self.state).close()
        self.socket = hostlease.hook_socket_path(HostEnv(self.root))
        installed = install_hook(base / "libvirt", self.state, "gamma", root=self.root)
        self.config = Path(read_script_pins(installed.path.read_text())["config"])
        #: What libvirtd's hook process has before it reads the file: the script's two pins.
        self.env = {"VMLEND_CONFIG": str(self.config), "VMLEND_ROOT": str(self.root)}
        settled = dict(self.env)
        hook_environment(settled)
        self.server = HookServer(self.socket, identity_of(settled))

    def holds(self) -> dict[int, str]:
        with open_fabric(self.state, "gamma") as f:
            return {d.fdid: str(d.holder) for d in f.devices() if d.holder}


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A directory with a short path: pytest's (under xdist, with the test's name) can make
    the socket's path longer than the 108 bytes a unix socket takes."""
    base = Path(tempfile.mkdtemp(prefix="vhu"))
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def served(short_tmp: Path) -> Iterator[Served]:
    host = Served(short_tmp)
    host.server.start()
    try:
        yield host
    finally:
        host.server.stop()


def test_the_agent_applies_the_hooks_file_and_runs_the_call(served):
    assert forward_unconfigured(PREPARE, vm_xml(), served.env) == 0
    assert served.holds() == {0x10: "gamma/vm1"} and served.server.served == 1


def test_a_file_that_names_another_socket_is_left_to_the_hook(served):
    # the file's paths are taken under the host root
    text = served.config.read_text()
    served.config.write_text(text.replace('"/run/vmlend/hook.sock"', '"/run/vmlend/other.sock"'))
    assert "other.sock" in served.config.read_text()
    assert forward_unconfigured(PREPARE, vm_xml(), served.env) is None
    assert served.holds() == {} and served.server.served == 0


def test_a_file_the_agent_cannot_use_is_left_to_the_hook_to_report(served):
    served.config.write_text("state = = broken\n")
    assert forward_unconfigured(PREPARE, vm_xml(), served.env) is None
    served.config.unlink()  # named by the script: it must exist
    assert forward_unconfigured(PREPARE, vm_xml(), served.env) is None
    assert served.holds() == {} and served.server.served == 0


def test_a_file_of_another_state_is_not_the_agents(served):
    text = served.config.read_text()
    served.config.write_text(text.replace('"/state.db"', '"/other.db"'))
    assert "other.db" in served.config.read_text()
    assert forward_unconfigured(PREPARE, vm_xml(), served.env) is None
    assert served.holds() == {} and served.server.served == 0


def test_without_an_agent_nothing_is_sent_and_the_hook_goes_on(short_tmp):
    host = Served(short_tmp)  # not started
    assert forward_unconfigured(PREPARE, vm_xml(), host.env) is None
