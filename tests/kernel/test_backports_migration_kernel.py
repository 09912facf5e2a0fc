"""The backports tier (``make test-kernel-backports``: Debian's 6.12 kernel, QEMU 10): two
QEMUs in one guest kernel live-migrate a VM whose mtty mdev (the stand-in's parent, renamed;
6.12's sample implements VFIO migration) stays plugged. The source runs on one parent's
``smartio-lend`` child, the destination, started with ``-incoming``, on another's: the device's
state moves through VFIO's migration protocol v2 (the only one QEMU 10 speaks; QEMU 7.2 of the
main tier has none and refuses to migrate a VFIO device)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.support.kernel_guest import LEND, REAL, STUB
from tests.support.qmp_client import Qmp
from vmlend.kernel.mdev import MdevBus

pytestmark = [pytest.mark.backports, pytest.mark.daemon, pytest.mark.qemu]

SRC_UUID = "83b8f4f2-509f-382f-3c1e-e6bfe0fa6001"
DST_UUID = "83b8f4f2-509f-382f-3c1e-e6bfe0fa6002"
#: Two lent devices of the default topology: each borrowed one is an mdev parent (smartio-<fdid>)
#: with its own pool of ports, room for one smartio-lend child.
SRC_FDID, DST_FDID = 0x12, 0x20
#: QEMUs under TCG inside a TCG guest on a loaded 2-core host: generous, not a timing claim.
DEADLINE_S = 600
#: enable-migration=on: QEMU refuses to start unless the device implements VFIO migration (v2).
#: x-device-dirty-page-tracking=off: mtty registers DMA-logging callbacks (it does no DMA, they
#: report nothing), so QEMU would prefer them; but Debian's 6.12 is built without IOMMUFD, and
#: without CONFIG_IOMMUFD_DRIVER the kernel's iova_bitmap is a stub, so every DMA logging report
#: fails with EOPNOTSUPP ("Failed to get DMA logging report ... Operation not supported", and
#: "ram_save_setup failed"). Off, QEMU asks the type1 container, which logs the pages it pinned.
VFIO_MIGRATION = "enable-migration=on,x-device-dirty-page-tracking=off"
#: The migration stream: TCP on the guest's loopback.
URI = "tcp:127.0.0.1:4444"


def start_qemu(
    tmp_path: Path, name: str, uuid: str, *extra: str
) -> tuple[subprocess.Popen[str], Qmp]:
    qmp_path = tmp_path / f"{name}.qmp"
    qemu = subprocess.Popen(
        [
            "qemu-system-x86_64", "-machine", "q35", "-accel", "tcg", "-m", "64",
            "-nodefaults", "-display", "none", "-S",
            "-qmp", f"unix:{qmp_path},server=on,wait=off",
            "-device", f"vfio-pci,sysfsdev={REAL.mdev_devices / uuid},id=lent0,{VFIO_MIGRATION}",
            *extra,
        ],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        return qemu, Qmp(qmp_path, time.monotonic() + DEADLINE_S)
    except AssertionError:
        qemu.kill()
        raise AssertionError(f"QEMU ({name}) did not start: {qemu.communicate()[1]}") from None


def wait_migration(qmp: Qmp) -> dict[str, object]:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        info = qmp.cmd("query-migrate")["return"]
        if info.get("status") in ("completed", "failed", "cancelled"):
            return info
        assert time.monotonic() < deadline, f"the migration did not end: {info}"
        time.sleep(0.5)


def stop_and_read(procs: list[subprocess.Popen[str]]) -> list[str]:
    """The QEMUs' standard errors (what they reported), once stopped: for a failure's message."""
    out = []
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        out.append(proc.communicate()[1])
    return out


def lent_devices(qmp: Qmp) -> list[dict[str, object]]:
    buses = qmp.cmd("query-pci")["return"]
    return [d for b in buses for d in b["devices"] if d.get("qdev_id") == "lent0"]


def test_qemu_live_migrates_a_vm_with_its_mdev_plugged(tmp_path, fabric_devices):
    STUB.command("borrow", f"{SRC_FDID:#x}")
    STUB.command("borrow", f"{DST_FDID:#x}")
    bus = MdevBus(REAL)
    bus.create(f"smartio-{SRC_FDID:x}", LEND, SRC_UUID)
    bus.create(f"smartio-{DST_FDID:x}", LEND, DST_UUID)
    procs: list[subprocess.Popen[str]] = []
    try:
        dst, dst_qmp = start_qemu(tmp_path, "dst", DST_UUID, "-incoming", URI)
        procs.append(dst)
        src, src_qmp = start_qemu(tmp_path, "src", SRC_UUID)
        procs.append(src)
        assert src_qmp.cmd("query-migrate-capabilities")["return"]  # the QMP link is up
        assert "return" in src_qmp.cmd("migrate", uri=URI)
        info = wait_migration(src_qmp)
        if info["status"] != "completed":
            pytest.fail(f"the migration {info}; QEMU said:\n" + "\n".join(stop_and_read(procs)))
        # The device's state went through VFIO's migration data stream, not around it.
        vfio = info.get("vfio")
        assert isinstance(vfio, dict) and vfio["transferred"] > 0, info
        assert src_qmp.cmd("query-status")["return"]["status"] == "postmigrate"
        # On the destination the device is there (never unplugged) and the VM runs on.
        assert len(lent_devices(dst_qmp)) == 1
        assert "return" in dst_qmp.cmd("cont")
        assert dst_qmp.cmd("query-status")["return"]["status"] == "running"
        for qmp, proc in ((src_qmp, src), (dst_qmp, dst)):
            qmp.cmd("quit")
            assert proc.wait(timeout=DEADLINE_S) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    # both closed again: the kernel lets the children go
    assert bus.remove(SRC_UUID)
    assert bus.remove(DST_UUID)
