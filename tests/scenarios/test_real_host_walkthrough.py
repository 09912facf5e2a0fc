"""docs/real-hardware.md's set-up of a host, followed as written on a fake host root: the
SmartIO driver's attributes in a fake sysfs, IOMMU groups, VFIO and /dev/kvm. ``VMLEND_ROOT``
points every vmlend command there, and vmlend takes the absolute paths of the walkthrough's
configuration file under it (the test writes the file as the page says);
``systemctl`` (systemd is not PID 1 here) is stood in for by systemd-analyze verify and the
installed unit's ExecStart under a NOTIFY_SOCKET this test owns."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import machine_files
from tests.support.doctor_host import loads_modules
from tests.support.fake_sysfs import FakeSmartio, FakeSysfs, populate_smartio
from tests.support.paths import REPO
from tests.support.systemd import WAIT, NotifySocket, exec_start, verify_units
from tests.support.walkthrough_doc import walkthrough_lines
from vmlend.topology.parse import parse_topology
from vmlend.wiring.fabric import default_topology_text

VMLEND = str(Path(sys.executable).parent / "vmlend")


def fake_host(root: Path) -> FakeSysfs:
    """A host with the SmartIO driver offering the shipped fabric's devices, seen as gamma."""
    fake = FakeSysfs(root)
    env = fake.env
    (env.iommu_groups / "0" / "devices").mkdir(parents=True)
    (env.iommu_class / "dmar0").mkdir(parents=True)
    for module in ("vfio", "vfio_pci", "mdev"):
        env.module(module).mkdir(parents=True)
    env.vfio_container.parent.mkdir(parents=True)
    env.vfio_container.write_text("")
    (env.dev / "kvm").write_text("")
    loads_modules(env)
    smartio = FakeSmartio(fake, node_id=12)
    populate_smartio(smartio, parse_topology(*default_topology_text()))
    return fake


class Steps:
    """Runs the walkthrough's lines: vmlend commands for real, the shell's file steps under
    the root, systemctl by its stand-ins."""

    def __init__(self, root: Path, tmp: Path) -> None:
        self.root, self.tmp = root, tmp
        self.env = {**os.environ, "VMLEND_ROOT": str(root)}
        for name in ("VMLEND_CONFIG", "VMLEND_STATE", "VMLEND_REGISTRY", "VMLEND_NODE"):
            self.env.pop(name, None)  # the walkthrough's file says it all
        self.env["VMLEND_CONFIG"] = str(root / "etc" / "vmlend" / "vmlend.toml")
        self.agent: subprocess.Popen | None = None
        self.outputs: dict[str, str] = {}

    def under_root(self, path: str) -> Path:
        assert path.startswith("/"), path
        return self.root / path.lstrip("/")

    def run(self, lines: list[str]) -> None:
        i = 0
        while i < len(lines):
            line = lines[i].strip()
            i += 1
            if not line or line.startswith("#"):
                continue
            words = shlex.split(line)
            if words[0] == "vmlend":
                self.vmlend(line, words[1:])
            elif words[:2] == ["apt", "install"]:
                self.package()
            elif words[:2] == ["install", "-d"]:
                for d in (w for w in words[2:] if w.startswith("/")):
                    self.under_root(d).mkdir(parents=True, exist_ok=True)
            elif words[0] == "cat" and "<<'EOF'" in line:
                body = []
                while lines[i].strip() != "EOF":
                    body.append(lines[i])
                    i += 1
                i += 1
                # as written: vmlend takes the file's absolute paths under the root itself
                text = "\n".join(body) + "\n"
                self.under_root(words[words.index(">") + 1]).write_text(text)
            elif words[0] == "systemctl":
                self.systemctl()
            else:
                raise AssertionError(f"a walkthrough step this test does not know: {line}")

    def vmlend(self, line: str, args: list[str]) -> None:
        run = subprocess.run(
            [VMLEND, *args], env=self.env, capture_output=True, text=True, stdin=subprocess.DEVNULL
        )
        assert run.returncode == 0, (line, run.stdout, run.stderr)
        self.outputs[line] = run.stdout

    def package(self) -> None:
        """``apt install ./vmlend_*.deb``, stood in for by what the package ships that the
        later steps use: its configuration file, and the units in the systemd unit directory
        around this venv's vmlend
        (tests/scenarios/test_debian_package.py installs the package itself)."""
        config = self.under_root("/etc/vmlend/vmlend.toml")
        config.parent.mkdir(parents=True)
        config.write_text((REPO / "debian" / "vmlend.toml").read_text())  # the conffile
        units = self.under_root("/lib/systemd/system")
        self.vmlend("units install", ["units", "install", "--dir", str(units)])

    def systemctl(self) -> None:
        """``daemon-reload && enable --now vmlend-agent``: verify the unit, then start its
        ExecStart as systemd would and wait until it says it is ready."""
        unit = self.under_root("/lib/systemd/system/vmlend-agent.service")
        verify_units(unit)
        notify = NotifySocket(self.tmp / "notify")
        log = self.tmp / "agent.log"
        with log.open("ab") as out:
            self.agent = subprocess.Popen(
                exec_start(unit),
                env={**self.env, "NOTIFY_SOCKET": str(notify.path)},
                stdout=out,
                stderr=out,
                stdin=subprocess.DEVNULL,
            )
        try:
            assert notify.wait_for("READY", self.agent, log)["READY"] == "1"
        finally:
            notify.close()

    def stop(self) -> None:
        if self.agent is not None and self.agent.poll() is None:
            self.agent.send_signal(signal.SIGTERM)
            assert self.agent.wait(WAIT) == 0


@pytest.mark.slow
@pytest.mark.daemon
def test_the_real_host_walkthrough_runs_as_written(tmp_path):
    root = tmp_path / "root"
    fake_host(root)
    machine = machine_files.snapshot()
    steps = Steps(root, tmp_path)
    try:
        steps.run(walkthrough_lines())
        # what the steps left: the hook, the units, the state, and a serving agent
        assert (root / "etc" / "libvirt" / "hooks" / "qemu.d" / "vmlend").is_file()
        assert (root / "var" / "lib" / "vmlend" / "state.db").is_file()
        assert (root / "run" / "vmlend" / "hook.sock").exists()
        devices = steps.outputs["vmlend devices"]
        assert "0x10" in devices and "alpha" in devices  # the driver's devices, via smartio
        assert "smartio" in steps.outputs["vmlend doctor"]
        assert machine_files.snapshot() == machine  # nothing outside the root
    finally:
        steps.stop()
