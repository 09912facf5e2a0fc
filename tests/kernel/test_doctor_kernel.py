"""``vmlend doctor`` on a host that really has an IOMMU, VFIO, the mdev core and (the tier's
stand-in for) the SmartIO driver."""

from __future__ import annotations

import json
import subprocess

from click.testing import CliRunner

from tests.support.kernel_guest import MODULES, NODE_ID, REAL, STUB
from vmlend.cli import main


def doctor(*args):
    r = CliRunner().invoke(main, ["--root", "/", "doctor", "--json", *args])
    return r, {c["check"]: c for c in json.loads(r.stdout)["checks"]}


def test_doctor_sees_the_real_iommu_vfio_mdev_and_smartio_stack(fabric_devices):
    _, checks = doctor()
    assert checks["mdev parents"]["status"] == "warn"  # nothing borrowed yet
    STUB.command("borrow", "0x12")
    _, checks = doctor("--smartio")
    for name in ("iommu", "vfio module", "mdev module", "vfio device", "mdev parents"):
        assert checks[name]["status"] == "ok", checks[name]
    groups = len(list((REAL.sys / "kernel" / "iommu_groups").iterdir()))
    assert checks["iommu"]["detail"].startswith(f"{groups} IOMMU groups, 1 IOMMU units")
    assert checks["mdev module"]["detail"] == "mdev loaded"
    assert checks["mdev parents"]["detail"] == "1: smartio-12 (smartio-1/smartio-lend)"
    n = len(fabric_devices.devices)
    smartio = checks["smartio driver"]
    assert smartio["status"] == "ok", checks
    assert smartio["detail"] == f"node {NODE_ID}: {n} devices, {n} available, 1 mdev parents here"


def test_doctor_notices_the_parent_driver_unloaded(fabric_devices):
    STUB.command("borrow", "0x12")
    subprocess.run(["rmmod", "smartio_mdev"], check=True)
    try:
        _, checks = doctor()
        assert checks["mdev parents"]["status"] == "warn", checks["mdev parents"]
        assert checks["smartio driver"]["detail"].endswith(" 0 mdev parents here")
    finally:
        subprocess.run(["insmod", str(MODULES / "smartio_mdev.ko")], check=True)
    # The driver still wanted the parent: it is registered again as soon as it can be.
    _, checks = doctor()
    assert checks["mdev parents"]["status"] == "ok"
