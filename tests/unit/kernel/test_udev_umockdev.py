"""The pyudev adapter against real uevents: umockdev's testbed fakes a device and sends its
uevents through the netlink path libudev reads, and ``PyudevSource`` (a real pyudev monitor)
must hand them over as ``Uevent`` values without blocking.

umockdev works by preloading a library into the process, and its testbed API is reached through
GObject introspection, which only the system interpreter has; so the scenario runs in a child
``umockdev-run -- /usr/bin/python3`` with this checkout and the venv's pyudev on its path.
"""

from __future__ import annotations

import json
import shutil
import site
import subprocess
from pathlib import Path

from tests.support.paths import REPO
from vmlend.kernel.udev import ParentChange, Uevent, classify

SYSTEM_PYTHON = Path("/usr/bin/python3")

SCENARIO = r"""
import json, select, sys
sys.path[:0] = sys.argv[1:]
import gi
gi.require_version("UMockdev", "1.0")
from gi.repository import UMockdev
from vmlend.kernel.udev import PyudevSource

bed = UMockdev.Testbed.new()
source = PyudevSource()  # the real adapter, on a real pyudev netlink monitor
assert source.receive() is None  # nothing yet, and it must not block
path = bed.add_device("smartio", "smartio-12", None, ["availability", "available"], [])
bed.set_property(path, "MDEV_STATE", "registered")
bed.uevent(path, "change")
bed.uevent(path, "remove")
seen = []
while len(seen) < 3:
    ready, _, _ = select.select([source.fileno()], [], [], 5)
    if not ready:
        break
    while (ev := source.receive()) is not None:
        seen.append([ev.action, ev.sys_name, ev.subsystem, ev.properties.get("MDEV_STATE")])
print(json.dumps(seen))
"""


def _have_umockdev() -> bool:
    if shutil.which("umockdev-run") is None or not SYSTEM_PYTHON.exists():
        return False
    probe = "import gi; gi.require_version('UMockdev', '1.0'); from gi.repository import UMockdev"
    return subprocess.run([SYSTEM_PYTHON, "-c", probe], capture_output=True).returncode == 0


def test_pyudev_source_delivers_umockdev_uevents(tmp_path):
    # Not a skip: CI installs these (Makefile APT_PKGS), and a skipped test proves nothing.
    assert _have_umockdev(), (
        "needs umockdev-run, python3-gi and gir1.2-umockdev-1.0: run 'make sysdeps'"
    )
    script = tmp_path / "scenario.py"
    script.write_text(SCENARIO)
    paths = [str(REPO), *site.getsitepackages()]
    r = subprocess.run(
        ["umockdev-run", "--", str(SYSTEM_PYTHON), str(script), *paths],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen == [
        ["add", "smartio-12", "smartio", None],  # added before the property was set
        ["change", "smartio-12", "smartio", "registered"],
        ["remove", "smartio-12", "smartio", "registered"],
    ]
    # What the watcher would make of the change it received.
    change = Uevent(*seen[1][:3], {"MDEV_STATE": seen[1][3]})
    assert classify(change, is_parent_now=True, was_parent=False) is ParentChange.APPEARED
