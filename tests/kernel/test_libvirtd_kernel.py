"""A real private libvirtd (tests/support/libvirt_daemon.py) in the guest starts a domain with
vmlend's mdev ``<hostdev>``: libvirt finds the child, QEMU opens it through VFIO."""

from __future__ import annotations

import json
import time

import libvirt_qemu

from tests.support.kernel_guest import LEND, REAL, STUB
from tests.support.libvirt_daemon import host_supports_vfio
from vmlend.kernel.mdev import MdevBus

U1 = "83b8f4f2-509f-382f-3c1e-e6bfe0fa6001"


def test_libvirtd_starts_a_domain_with_the_mdev_hostdev(libvirtd, libvirt_guests, fabric_devices):
    assert host_supports_vfio()  # libvirt's own test for VFIO passthrough
    STUB.command("borrow", "0x12")
    MdevBus(REAL).create("smartio-12", LEND, U1)
    dom = libvirt_guests.define([U1])
    t0 = time.monotonic()
    dom.create()
    started = time.monotonic() - t0
    libvirt_guests.note_running()
    (pid,) = [p for n, p in libvirtd.qemu_pids().items() if n == dom.name()]
    cmdline = (REAL.proc / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    assert f'"sysfsdev":"/sys/bus/mdev/devices/{U1}"' in cmdline, cmdline
    # QEMU holds the child's VFIO group, and the guest's PCI bus has it (through libvirt's
    # monitor passthrough, as 'virsh qemu-monitor-command' would ask).
    group = f"/dev/vfio/{MdevBus(REAL).device(U1).iommu_group}"
    fds = (REAL.proc / str(pid) / "fd").iterdir()
    assert any(fd.resolve().as_posix() == group for fd in fds)
    reply = json.loads(libvirt_qemu.qemuMonitorCommand(dom, '{"execute":"query-pci"}', 0))
    found = [d for b in reply["return"] for d in b["devices"] if d.get("qdev_id") == "hostdev0"]
    assert [(d["id"]["vendor"], d["id"]["device"]) for d in found] == [(0x4348, 0x3253)]
    print(f"libvirtd started the domain in {started:.1f} s")
    dom.destroy()
    assert MdevBus(REAL).remove(U1)
