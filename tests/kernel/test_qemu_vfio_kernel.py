"""QEMU opens a real mdev through VFIO (``-device vfio-pci,sysfsdev=...``, as libvirt starts
a domain with an mdev hostdev) and the device shows in ``query-pci`` over QMP."""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.support.kernel_guest import LEND, REAL, STUB
from tests.support.qmp_client import Qmp
from vmlend.kernel.mdev import MdevBus

U1 = "83b8f4f2-509f-382f-3c1e-e6bfe0fa5001"
#: The stand-in's child is mtty's serial card: its PCI identity (a WCH CH352 dual-port card).
MTTY_VENDOR, MTTY_DEVICE = 0x4348, 0x3253


@pytest.mark.daemon
def test_qemu_opens_the_mdev_through_vfio_and_lists_it(tmp_path, fabric_devices):
    STUB.command("borrow", "0x12")
    dev = MdevBus(REAL).create("smartio-12", LEND, U1)
    sysfsdev = REAL.mdev_devices / U1
    qmp_path = tmp_path / "qmp.sock"
    qemu = subprocess.Popen(
        [
            "qemu-system-x86_64", "-machine", "q35", "-accel", "tcg", "-m", "64",
            "-nodefaults", "-display", "none", "-S",
            "-qmp", f"unix:{qmp_path},server=on,wait=off",
            "-device", f"vfio-pci,sysfsdev={sysfsdev},id=lent0",
        ],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        try:
            qmp = Qmp(qmp_path, time.monotonic() + 120)
        except AssertionError:
            qemu.kill()
            raise AssertionError(f"QEMU did not start: {qemu.communicate()[1]}") from None
        buses = qmp.cmd("query-pci")["return"]
        found = [d for b in buses for d in b["devices"] if d.get("qdev_id") == "lent0"]
        assert len(found) == 1, buses
        lent = found[0]
        assert (lent["id"]["vendor"], lent["id"]["device"]) == (MTTY_VENDOR, MTTY_DEVICE)
        assert any(bar["type"] == "io" for bar in lent["regions"])  # the serial ports' BARs
        # VFIO has the group open: its character device is in QEMU's file table.
        group = f"/dev/vfio/{dev.iommu_group}"
        fds = list((REAL.proc / str(qemu.pid) / "fd").iterdir())
        assert any(fd.resolve().as_posix() == group for fd in fds)
        qmp.cmd("quit")
        assert qemu.wait(timeout=60) == 0
    finally:
        if qemu.poll() is None:
            qemu.kill()
            qemu.wait()
    assert MdevBus(REAL).remove(U1)  # closed again: the kernel lets it go
