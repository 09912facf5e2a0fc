"""vmlend doctor against fake host roots: everything present, and each thing missing."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
from click.testing import CliRunner

from tests.support.doctor_host import PID, checks, healthy
from vmlend.cli import main
from vmlend.doctor import Status, blocking, check_libvirt, libvirt_library_version
from vmlend.hostenv import HostEnv


def test_healthy_host_passes_every_check(tmp_path):
    fake = healthy(tmp_path)
    found = checks(fake.env)
    assert {n: f.status for n, f in found.items() if f.status is not Status.OK} == {}
    assert "node 12: 1 devices, 1 available, 1 mdev parents here" in found["smartio driver"].detail
    assert "smartio-12 (smartio-lend)" in found["mdev parents"].detail
    assert found["libvirt"].detail == "libvirt 9.0.0"


def test_empty_root_blocks_use(tmp_path):
    found = checks(HostEnv(tmp_path))
    fails = {n for n, f in found.items() if f.status is Status.FAIL}
    assert fails == {"iommu", "vfio module", "mdev module", "vfio device", "libvirt hook"}
    assert found["smartio driver"].status is Status.WARN
    assert found["libvirtd"].status is Status.WARN
    assert blocking(list(found.values()))


def test_smartio_required_turns_missing_driver_into_failure(tmp_path):
    assert checks(HostEnv(tmp_path), smartio_required=True)["smartio driver"].status is (
        Status.FAIL
    )


@pytest.mark.parametrize(
    ("remove", "check", "words"),
    [
        (lambda e: e.iommu_groups / "0", "iommu", "intel_iommu=on"),
        (lambda e: e.module("vfio"), "vfio module", "modprobe vfio-pci"),
        (lambda e: e.module("mdev"), "mdev module", "modprobe mdev"),
        (lambda e: e.vfio_container, "vfio device", "vfio/vfio missing"),
        (lambda e: e.libvirt_hooks / "qemu.d" / "vmlend", "libvirt hook", "vmlend hook install"),
    ],
)
def test_each_missing_piece_is_named_with_a_fix(tmp_path, remove, check, words):
    fake = healthy(tmp_path)
    path = remove(fake.env)
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    f = checks(fake.env)[check]
    assert f.status is Status.FAIL
    assert words in f.detail


def test_old_kernel_vfio_mdev_module_counts(tmp_path):
    fake = healthy(tmp_path)
    fake.env.module("mdev").rmdir()
    fake.env.module("vfio_mdev").mkdir()
    assert checks(fake.env)["mdev module"].status is Status.OK


def test_libvirtd_started_before_hook_must_restart(tmp_path):
    fake = healthy(tmp_path)
    hook = fake.env.libvirt_hooks / "qemu.d" / "vmlend"
    os.utime(fake.env.libvirtd_pidfiles[0], (time.time() - 500, time.time() - 500))
    os.utime(hook, (time.time(), time.time()))
    f = checks(fake.env)["libvirtd"]
    assert f.status is Status.FAIL and "restart libvirtd" in f.detail


def test_an_older_hook_enables_hooks_for_a_newer_vmlend_one(tmp_path):
    # qemu.d files added after start are picked up once any hook existed at start (docs/hooks.md).
    fake = healthy(tmp_path)
    old = fake.env.libvirt_hooks / "qemu"
    old.write_text("#!/bin/sh\nexit 0\n")
    old.chmod(0o755)
    os.utime(old, (time.time() - 1000, time.time() - 1000))
    os.utime(fake.env.libvirtd_pidfiles[0], (time.time() - 500, time.time() - 500))
    assert checks(fake.env)["libvirtd"].status is Status.OK


def test_stale_pid_file_means_not_running(tmp_path):
    fake = healthy(tmp_path)
    fake.env.process(PID).rmdir()
    assert checks(fake.env)["libvirtd"].status is Status.WARN


def test_hook_not_executable(tmp_path):
    fake = healthy(tmp_path)
    (fake.env.libvirt_hooks / "qemu.d" / "vmlend").chmod(0o644)
    f = checks(fake.env)["libvirt hook"]
    assert f.status is Status.FAIL and "chmod +x" in f.detail


def test_foreign_hook_is_not_ours(tmp_path):
    fake = healthy(tmp_path)
    hook = fake.env.libvirt_hooks / "qemu.d" / "vmlend"
    hook.write_text("#!/bin/sh\nexit 0\n")
    assert checks(fake.env)["libvirt hook"].status is Status.FAIL


def test_broken_smartio_attribute_is_reported_not_raised(tmp_path):
    fake = healthy(tmp_path)
    (fake.env.smartio / "smartio-12" / "bars").write_text("zero 0x4000 mem64\n")
    f = checks(fake.env)["smartio driver"]
    assert f.status is Status.FAIL and "bars" in f.detail


def test_libvirt_check_reports_missing_binding():
    def missing() -> str:
        raise ImportError("no libvirt")

    assert check_libvirt(missing).status is Status.FAIL
    assert check_libvirt(libvirt_library_version).status is Status.OK  # the real library


def test_cli_doctor_exit_codes_and_json(tmp_path):
    healthy(tmp_path / "good")
    r = CliRunner().invoke(main, ["--root", str(tmp_path / "good"), "doctor"])
    assert r.exit_code == 0, r.output
    # 10 host checks, the hook's ownership, its pins vs the CLI's, whether an agent serves it
    assert len(r.output.splitlines()) == 13
    r = CliRunner().invoke(main, ["doctor", "--json"], env={"VMLEND_ROOT": str(tmp_path)})
    assert r.exit_code == 1
    data = json.loads(r.output)
    assert data["ok"] is False and data["root"] == str(tmp_path)
    assert {c["check"] for c in data["checks"] if c["status"] == "fail"} >= {"iommu"}
