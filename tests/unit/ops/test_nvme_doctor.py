"""``vmlend doctor`` says which NVMe drives the SmartIO driver can share and why not the rest
(contract section 7)."""

from __future__ import annotations

from tests.support.doctor_host import checks, healthy
from vmlend.doctor import Status
from vmlend.hostenv import HostEnv
from vmlend.kernel.mdev import MdevBus


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
    # The driver's word is reported: the kernel backend runs shares (section 7)
    assert detail == "0x12: the driver offers 511 queue pairs"
    _attr(fake, "supported lots\n")
    assert "unreadable nvme_share" in checks(fake.env)["nvme sharing"].detail


def test_a_share_child_without_the_share_files_is_named(tmp_path):
    """A driver that offers shares but predates section 7's share files: doctor names the
    files the share child lacks, as the kernel backend's refusal does."""
    fake = healthy(tmp_path)
    _attr(fake, "supported 511 32 0\n")
    fake.smartio.share_files = False
    fake.remove_parent("smartio-12")
    fake.smartio.share_drive(0x12)
    fake.smartio._register(0x12)
    child = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1001"
    MdevBus(fake.env, fake).create("smartio-12", "smartio-nvme_share", child)
    detail = checks(fake.env)["nvme sharing"].detail
    assert detail == (
        f"0x12: the driver offers 511 queue pairs; refused, share mdev {child} has no"
        " smartio/nvme_share and smartio/nvme_share_state; lend it whole"
    )
    fake.smartio.share_files = True
    MdevBus(fake.env, fake).remove(child)
    MdevBus(fake.env, fake).create("smartio-12", "smartio-nvme_share", child)
    assert checks(fake.env)["nvme sharing"].detail == "0x12: the driver offers 511 queue pairs"


def test_no_driver_no_drive(tmp_path):
    assert "no SmartIO driver" in checks(HostEnv(tmp_path))["nvme sharing"].detail
