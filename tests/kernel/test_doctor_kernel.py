"""``vmlend doctor`` on a host that really has an IOMMU, VFIO and the mdev core."""

from __future__ import annotations

import json
import subprocess

from click.testing import CliRunner

from tests.support.kernel_guest import MTTY, REAL
from vmlend.cli import main


def doctor(*args):
    r = CliRunner().invoke(main, ["--root", "/", "doctor", "--json", *args])
    return r, {c["check"]: c for c in json.loads(r.stdout)["checks"]}


def test_doctor_sees_the_real_iommu_vfio_and_mdev_stack():
    r, checks = doctor()
    for name in ("iommu", "vfio module", "mdev module", "vfio device", "mdev parents"):
        assert checks[name]["status"] == "ok", checks[name]
    groups = len(list((REAL.sys / "kernel" / "iommu_groups").iterdir()))
    assert checks["iommu"]["detail"].startswith(f"{groups} IOMMU groups, 1 IOMMU units")
    assert checks["mdev module"]["detail"] == "mdev loaded"
    assert checks["mdev parents"]["detail"] == f"1: {MTTY} (mtty-1/mtty-2)"
    # No SmartIO driver in this kernel: a warning, and blocking only with --smartio.
    assert checks["smartio driver"]["status"] == "warn"
    r, checks = doctor("--smartio")
    assert r.exit_code == 1 and checks["smartio driver"]["status"] == "fail"


def test_doctor_notices_the_parent_driver_unloaded():
    subprocess.run(["rmmod", "mtty"], check=True)
    try:
        _, checks = doctor()
        assert checks["mdev parents"]["status"] == "warn", checks["mdev parents"]
        assert checks["mdev module"]["status"] == "ok"
    finally:
        subprocess.run(["insmod", "/lib/modules/vmlend/mtty.ko"], check=True)
    _, checks = doctor()
    assert checks["mdev parents"]["status"] == "ok"
