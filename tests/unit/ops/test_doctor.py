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
    assert fails == {"kvm", "iommu", "vfio module", "mdev module", "vfio device", "libvirt hook"}
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
    # 12 host checks, the hook's ownership, its pins vs the CLI's, whether an agent serves it
    assert len(r.output.splitlines()) == 15
    r = CliRunner().invoke(main, ["doctor", "--json"], env={"VMLEND_ROOT": str(tmp_path)})
    assert r.exit_code == 1
    data = json.loads(r.output)
    assert data["ok"] is False and data["root"] == str(tmp_path)
    assert {c["check"] for c in data["checks"] if c["status"] == "fail"} >= {"iommu"}


def test_kvm_and_iommu_advice_fits_the_cpu(tmp_path):
    fake = healthy(tmp_path)
    (fake.env.dev / "kvm").unlink()
    shutil.rmtree(fake.env.iommu_groups / "0")
    (fake.env.proc / "cpuinfo").write_text("vendor_id\t: AuthenticAMD\n")
    found = checks(fake.env)
    assert found["kvm"].status is Status.FAIL
    assert "enable AMD-V in firmware" in found["kvm"].detail
    assert "'modprobe kvm_amd'" in found["kvm"].detail
    assert "AMD-Vi" in found["iommu"].detail and "intel_iommu" not in found["iommu"].detail
    (fake.env.proc / "cpuinfo").write_text("vendor_id\t: GenuineIntel\n")
    found = checks(fake.env)
    assert "enable VT-x" in found["kvm"].detail and "'modprobe kvm_intel'" in found["kvm"].detail
    assert "intel_iommu=on" in found["iommu"].detail


@pytest.mark.parametrize("gone", ["proc/modules", "lib/modules/6.1.0-test"])
def test_no_modprobe_advice_on_a_kernel_without_modules(tmp_path, gone):
    fake = healthy(tmp_path)
    shutil.rmtree(fake.env.module("vfio"))
    shutil.rmtree(fake.env.dev / "kvm", ignore_errors=True)
    (fake.env.dev / "kvm").unlink(missing_ok=True)
    (fake.env.proc / "cpuinfo").write_text("vendor_id\t: GenuineIntel\n")
    path = fake.env.root / gone
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    found = checks(fake.env)
    for name, option in (("vfio module", "CONFIG_VFIO_PCI=y"), ("kvm", "CONFIG_KVM_INTEL=y")):
        assert "'modprobe" not in found[name].detail
        assert "this kernel loads no modules" in found[name].detail
        assert option in found[name].detail


def test_backend_in_use_is_reported_and_sim_on_a_kvm_host_flagged(tmp_path):
    fake = healthy(tmp_path)
    found = checks(fake.env)
    assert found["backend"].status is Status.OK
    assert found["backend"].detail == "smartio (the default: the SmartIO driver is loaded)"
    sim = checks(fake.env, backend="sim")["backend"]
    assert sim.status is Status.WARN
    assert sim.detail.startswith("sim (chosen) on a host with real virtualization")
    (fake.env.dev / "kvm").unlink()
    assert checks(fake.env, backend="sim")["backend"].status is Status.OK
    empty = checks(HostEnv(tmp_path / "empty"), backend="smartio")["backend"]
    assert empty.status is Status.FAIL and "SmartIO driver is not loaded" in empty.detail


def test_doctor_finds_the_hook_under_the_libvirt_dir_it_was_installed_to(tmp_path, state_path):
    healthy(tmp_path / "host")
    private = tmp_path / "private-libvirt"
    private.mkdir()
    base = ["--root", str(tmp_path)]  # whose etc/libvirt has no hook
    r = CliRunner().invoke(main, [*base, "hook", "install", "--libvirt-dir", str(private)])
    assert r.exit_code == 0, r.output

    def hook_check(*extra: str) -> dict:
        out = CliRunner().invoke(main, [*base, "doctor", "--json", *extra]).output
        return next(c for c in json.loads(out)["checks"] if c["check"] == "libvirt hook")

    assert hook_check()["status"] == "fail"
    found = hook_check("--libvirt-dir", str(private))
    assert found == {
        "check": "libvirt hook",
        "status": "ok",
        "detail": str(private / "hooks" / "qemu.d" / "vmlend"),
    }


def test_doctor_checks_the_hypervisor_it_is_given(tmp_path):
    def hv(*args: str) -> dict:
        out = CliRunner().invoke(main, ["--root", str(tmp_path), "doctor", "--json", *args])
        return next(c for c in json.loads(out.output)["checks"] if c["check"] == "hypervisor")

    assert hv("-c", "test:///default")["status"] == "ok"
    bad = hv("-c", "qemu+unix:///system?socket=/nonexistent/sock")
    assert bad["status"] == "fail" and bad["detail"].startswith("cannot connect to qemu+unix")
    assert hv("-c", "sim:///gamma")["detail"] == "sim:///gamma is a simulated node"


def test_a_hypervisor_that_answers_is_not_reported_as_libvirtd_not_running(
    tmp_path, monkeypatch
):
    """``doctor -c URI`` with no pid file under the root (a session daemon, a test's own):
    a local daemon that answers at URI is not "not running"; with hooks installed, whether it
    runs them cannot be told. libvirt's in-process test driver and a remote host's daemon say
    nothing of this host's."""
    from vmlend import doctor

    def answers(uri: str) -> doctor.Finding:
        return doctor.Finding("hypervisor", doctor.Status.OK, f"{uri}: QEMU 8.2.2")

    monkeypatch.setattr(doctor, "check_hypervisor", answers)

    def daemon(*args: str) -> dict:
        out = CliRunner().invoke(main, ["--root", str(tmp_path), "doctor", "--json", *args])
        return next(c for c in json.loads(out.output)["checks"] if c["check"] == "libvirtd")

    local = "qemu+unix:///session?socket=/run/user/1000/libvirt/libvirt-sock"
    not_running = "not running (no live pid file); start it"
    assert daemon()["detail"] == not_running
    assert daemon("-c", local) == {
        "check": "libvirtd",
        "status": "ok",
        "detail": f"answers at {local}",
    }
    for elsewhere in ("test:///default", "qemu+ssh://root@other/system", "sim:///gamma"):
        assert daemon("-c", elsewhere)["detail"] == not_running, elsewhere
    hooks = tmp_path / "etc" / "libvirt" / "hooks"
    hooks.mkdir(parents=True)
    (hooks / "qemu").write_text("#!/bin/sh\n")
    found = daemon("-c", local)
    assert found["status"] == "warn" and "cannot be told" in found["detail"]
    monkeypatch.setattr(
        doctor, "check_hypervisor", lambda uri: doctor.Finding("hypervisor", doctor.Status.FAIL, "")
    )
    assert daemon("-c", local)["detail"] == not_running
