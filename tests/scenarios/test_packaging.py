"""``pip install .`` from the source gives a working ``vmlend``: the wheel holds every data file
git has under vmlend/data (the default topology, the XML templates, systemd units), and,
installed into a fresh venv, ``vmlend --version`` and ``vmlend fabric init`` (the built-in
topology) work from it. The wheel is built as ``pip install .`` builds it (its build backend
from the package index pip is set up with), and the fresh venv borrows only the dependencies
(lxml, msgspec, click...) from this one: nothing is compiled."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from tests.support.paths import REPO

pytestmark = pytest.mark.slow


def _run(argv: list[str], **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False, **kw)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, str]:
    """The wheel, and what its build printed (-v: the backend's warnings too)."""
    out = tmp_path_factory.mktemp("wheel")
    build = tmp_path_factory.mktemp("build")
    r = _run(
        # in build isolation: pip brings the build backend (setuptools, from the local index)
        [sys.executable, "-m", "pip", "wheel", "-v", str(REPO), "--no-deps", "-w", str(out)],
        cwd=build,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (found,) = out.glob("vmlend-*.whl")
    return found, r.stdout + r.stderr


@pytest.fixture(scope="module")
def wheel(built) -> Path:
    return built[0]


def test_the_build_warns_of_nothing(built):
    """setuptools once warned that vmlend.data.systemd "would be ignored" (an importable
    directory missing from ``packages``): a warning an operator building the package reads as
    a broken build."""
    warnings = [
        line.strip()
        for line in built[1].splitlines()
        if "Warning:" in line or "would be ignored" in line
    ]
    assert warnings == []


def test_the_wheel_holds_every_data_file(wheel):
    listed = _run(["git", "ls-files", "vmlend/data"], cwd=REPO)
    assert listed.returncode == 0, listed.stderr
    data = {p for p in listed.stdout.split() if not p.endswith(".py")}
    assert "vmlend/data/default-topology.toml" in data
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    assert data <= names, sorted(data - names)
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


def test_installed_into_a_fresh_venv_it_runs(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    site = Path(
        _run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
        ).stdout.strip()
    )
    r = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(py),
            "install",
            "--no-deps",
            "--no-index",
            str(wheel),
        ]
    )
    assert r.returncode == 0, r.stdout + r.stderr
    # The dependencies only, from this environment (appended: vmlend itself must come from
    # the wheel; a .pth line adds the directory without running the editable install's hooks).
    (site / "zz-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    vmlend = env_dir / "bin" / "vmlend"
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("VMLEND_") or k == "VMLEND_CONFIG"  # never the machine's
    }
    where = _run([str(py), "-c", "import vmlend; print(vmlend.__file__)"], cwd=tmp_path, env=clean)
    assert where.stdout.strip().startswith(str(site)), where.stdout + where.stderr
    version = _run([str(vmlend), "--version"], cwd=tmp_path, env=clean)
    assert version.returncode == 0 and version.stdout.startswith("vmlend, version "), version
    state = tmp_path / "state.db"
    init = _run([str(vmlend), "--state", str(state), "fabric", "init"], cwd=tmp_path, env=clean)
    assert init.returncode == 0, init.stdout + init.stderr
    assert "holds topology 'default' (3 nodes, 9 devices)" in init.stdout
    shown = _run([str(vmlend), "--state", str(state), "devices"], cwd=tmp_path, env=clean)
    assert shown.returncode == 0 and "0x10" in shown.stdout, shown
