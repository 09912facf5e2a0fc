"""vmlend's Debian package, built by ``make deb`` and installed as an operator would into a clean
bookworm root made by debootstrap from the archive (tests/support/debroot.py), where:

- the package's dependencies come from the archive (``apt install ./vmlend_*.deb``, as the
  first line of docs/real-hardware.md's walkthrough);
- ``vmlend doctor`` runs and reports exactly this machine's missing hardware as failures
  (no IOMMU groups, no VFIO or mdev modules, no SmartIO driver for the walkthrough's
  ``backend = "smartio"``) while the package's own checks pass (the hook, its ownership,
  libvirt's library);
- ``systemd-analyze verify`` accepts the installed units *with* its man-page check (their
  ``Documentation=man:`` pages are installed);
- ``vmlend hook install`` finds the packaged hook to be the very hook it would write (python
  -IS over the package's virtualenv), and that hook runs as libvirtd would run it;
- the walkthrough runs as written but for what needs systemd as PID 1 or the SmartIO driver
  (below);
- ``apt-get remove --purge vmlend`` leaves nothing of the package in the root.

Nothing runs on the host's /etc or libvirt: every vmlend command runs inside the root. The
times (the package's build, the root, the whole test) are printed; docs/testing.md keeps them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.debroot import DebRoot
from tests.support.needs import need
from tests.support.paths import REPO
from tests.support.walkthrough_doc import walkthrough_commands
from vmlend import __version__

pytestmark = [pytest.mark.slow, pytest.mark.package]

BUILD = REPO / "build"
#: doctor's checks that fail on a host without the hardware: this machine lacks all of them.
HARDWARE_CHECKS = {"backend", "kvm", "iommu", "vfio module", "mdev module", "vfio device"}
#: What a root holds that is not the package's: apt's and dpkg's records and caches, logs,
#: man-db's cache of the pages the man check formatted, systemd-analyze's runtime files, and
#: the test's own files.
NOT_THE_PACKAGE = (
    "/var/lib/dpkg", "/var/lib/apt", "/var/cache", "/var/log", "/run/systemd", "/tmp", "/root",
)


def build_deb() -> Path:
    run = subprocess.run(
        ["make", "-s", "deb"], cwd=REPO, capture_output=True, text=True, timeout=900, check=False
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    # the issue's "the build prints no setuptools warning" (vmlend.data.systemd "would be
    # ignored" once)
    assert not re.search(r"would be ignored|SetuptoolsDeprecationWarning", run.stdout + run.stderr)
    (deb,) = (BUILD / "deb").glob(f"vmlend_{__version__}_*.deb")
    return deb


def doctor(root: DebRoot) -> dict[str, str]:
    """``vmlend doctor --json`` in the root: each check's name -> its status."""
    run = root.run("vmlend doctor --json")
    assert run.returncode in (0, 1), run.stdout + run.stderr
    return {c["check"]: c["status"] for c in json.loads(run.stdout)["checks"]}


def processes_in(path: Path) -> list[int]:
    """Processes whose root directory is ``path``: what a command left running there."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/root") == str(path):
                found.append(int(pid))
        except OSError:
            continue
    return found


def depends(deb: Path) -> str:
    return subprocess.run(
        ["dpkg-deb", "-f", str(deb), "Depends"], capture_output=True, text=True, check=True
    ).stdout.strip()


@pytest.fixture
def package():
    """``make deb``'s package, and how long making it took (a no-op when it is newer than
    every file it is made of)."""
    need(os.geteuid() == 0, "installing into a debootstrap root needs root (chroot, mount)")
    for tool in ("debootstrap", "dpkg-buildpackage", "dh_virtualenv", "chroot"):
        need(shutil.which(tool) is not None, f"{tool} is missing (make sysdeps installs it)")
    started = time.monotonic()
    return build_deb(), time.monotonic() - started


@pytest.fixture
def debroot(package):
    """A clean bookworm root holding the package's dependencies from the archive (so what
    the package itself leaves behind is measured against a root that already holds them)."""
    cache = BUILD / "debroot"
    root = DebRoot(cache / "root", cache, f"apt-get satisfy -q '{depends(package[0])}'")
    try:
        yield root
    finally:
        left = processes_in(root.path)
        root.close()
        root.remove()
        assert not left, f"left running in the root: {left}"


def test_the_package_installs_runs_the_walkthrough_and_purges_clean(package, debroot, capsys):
    started = time.monotonic()
    deb, built_in = package
    root = debroot
    before = root.files(NOT_THE_PACKAGE)
    shutil.copy(deb, root.path / "tmp" / deb.name)

    # the walkthrough, as written, in the root
    outcome: dict[str, subprocess.CompletedProcess[str]] = {}
    for command in walkthrough_commands():
        if command.startswith("systemctl"):
            # 'daemon-reload' and '--now' need systemd as PID 1 (not in a chroot, nor on our
            # test machines): enable alone is what systemctl does offline
            command = "systemctl enable vmlend-agent"
        outcome[command] = root.run(command, cwd="/tmp")
    for command, run in outcome.items():
        if command in ("vmlend doctor", "vmlend devices"):
            continue  # below: they report this machine's missing hardware
        assert run.returncode == 0, (command, run.stdout[-3000:], run.stderr[-3000:])
    assert "apt install ./vmlend_*.deb" in outcome  # the page starts from the package
    # no SmartIO driver here: the walkthrough's backend = "smartio" has no devices to list
    assert outcome["vmlend devices"].returncode == 1
    assert "SmartIO driver is not loaded" in outcome["vmlend devices"].stderr
    # the simulated fabric the walkthrough's 'fabric init' wrote lists through the package
    sim = root.run("vmlend --backend sim devices")
    assert sim.returncode == 0 and "alpha" in sim.stdout, sim.stdout + sim.stderr

    # doctor: this machine's hardware fails, the package's own checks pass
    checks = doctor(root)
    failed = {name for name, status in checks.items() if status == "fail"}
    assert failed <= HARDWARE_CHECKS, checks
    for name in ("libvirt", "libvirt hook", "hook ownership"):
        assert checks[name] == "ok", checks

    # the units, with man-page checking
    units = sorted(
        str(p.relative_to(root.path)) for p in root.path.glob("lib/systemd/system/vmlend-*")
    )
    assert len(units) == 3, units
    run = root.run("systemd-analyze verify --man=yes " + " ".join("/" + u for u in units))
    assert (run.returncode, run.stdout + run.stderr) == (0, "")
    assert not any("'vmlend units install'" in (root.path / u).read_text() for u in units)

    # the packaged hook is the one 'hook install' writes for this virtualenv, and it runs
    hook = root.path / "etc/libvirt/hooks/qemu.d/vmlend"
    assert os.readlink(hook) == "/usr/lib/vmlend/libvirt-hook"
    first = (root.path / "usr/lib/vmlend/libvirt-hook").read_text().splitlines()[0]
    assert first == "#!/opt/venvs/vmlend/bin/python -IS"
    run = root.run("vmlend hook install")
    assert run.returncode == 0 and "is already installed" in run.stdout, run.stdout + run.stderr
    assert os.path.islink(hook)  # not rewritten: the same text
    xml = "<domain type='kvm'><name>t</name></domain>"
    run = root.run(f'echo "{xml}" | /etc/libvirt/hooks/qemu.d/vmlend t prepare begin -')
    assert run.returncode == 0, run.stdout + run.stderr

    # completion and man pages where bash and man find them
    assert (root.path / "usr/share/bash-completion/completions/vmlend").is_file()
    assert root.run("man -w vmlend-agent").returncode == 0

    # purge: nothing of the package is left
    run = root.run("apt-get remove --purge -q vmlend")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert root.run("dpkg -s vmlend").returncode != 0
    left = sorted(root.files(NOT_THE_PACKAGE) - before)
    assert left == []
    for gone in ("/etc/vmlend", "/var/lib/vmlend", "/opt/venvs/vmlend", "/usr/bin/vmlend",
                 "/etc/libvirt/hooks/qemu.d/vmlend", "/lib/systemd/system/vmlend-agent.service",
                 "/etc/systemd/system/multi-user.target.wants/vmlend-agent.service"):
        assert not os.path.lexists(root.path / gone.lstrip("/")), gone

    done = time.monotonic()
    with capsys.disabled():
        print(
            f"\n[debian package] make deb {built_in:.0f} s; root {root.made_in:.0f} s (its"
            f" debootstrap tarball {root.tarball_in:.0f} s; {root.seeded} packages linked from"
            f" the host's apt cache); install, walkthrough, purge {done - started:.0f} s;"
            f" whole test {built_in + done - root.started:.0f} s"
        )
