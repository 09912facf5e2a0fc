"""``vmlend doctor`` says which NVMe drives the SmartIO driver can share and why not the rest
(contract section 6)."""

from __future__ import annotations

from tests.support.doctor_host import checks, healthy
from vmlend.doctor import Status
from vmlend.hostenv import HostEnv


def _attr(fake, text):
    (fake.env.smartio / "smartio-12" / "nvme_share").write_text(text)


def test_a_driver_without_sharing_is_named_as_the_reason(tmp_path):
    fake = healthy(tmp_path)
    found = checks(fake.env)["nvme sharing"]
    assert found.status is Status.OK  # lending the drive whole still works
    assert "0x12: refused, the SmartIO driver offers no queue-level sharing" in found.detail


def test_the_driver_reason_and_the_supported_case(tmp_path):
    fake = healthy(tmp_path)
    _attr(fake, "unsupported controller has no per-queue LBA guard\n")
    assert (
        "refused, controller has no per-queue LBA guard" in checks(fake.env)["nvme sharing"].detail
    )
    _attr(fake, "supported 511 32 0\n")
    detail = checks(fake.env)["nvme sharing"].detail
    # The driver's word is reported, and so is vmlend's own limit: the kernel backend
    # refuses shares (SharingUnsupportedError), so the drive is not called shareable.
    assert detail.startswith("0x12: the driver offers 511 queue pairs")
    assert "does not run shares yet; lend it whole" in detail
    _attr(fake, "supported lots\n")
    assert "unreadable nvme_share" in checks(fake.env)["nvme sharing"].detail


def test_no_driver_no_drive(tmp_path):
    assert "no SmartIO driver" in checks(HostEnv(tmp_path))["nvme sharing"].detail
