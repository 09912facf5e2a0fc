"""The backports tier with libvirt 11.3: two private libvirtds in the 6.12 guest (their own
roots and host UUIDs, so libvirt does not refuse the move as "to the same host"), vmlend's hook
installed on both with ``vmlend hook install``, and a live migration of a domain with an mdev
hostdev from one to the other, the device plugged throughout (VFIO migration v2 in QEMU 10).

What one kernel cannot show: vmlend's own domains. vmlend derives a device's mdev UUID from the
VM's UUID and the device (vmlend/domain/uuids.py), the same on every host, and the destination's
``migrate`` hook re-derives it (vmlend/domain/rewrite.py, ``rederive_mdev_uuids``): the
destination QEMU must open the very mdev the source QEMU holds until the switch-over, which one
kernel cannot give twice (and both daemons here are the same vmlend node). So the domain here
carries no vmlend metadata: the hook runs at both ends and passes it through unchanged, and the
destination XML names the second mdev. docs/testing.md says what a two-kernel tier needs."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import libvirt
import pytest
from lxml import etree

from tests.support.kernel_guest import LEND, REAL, STUB
from tests.support.kernel_host import operator_host
from tests.support.libvirt_daemon import HookRecorder, LibvirtDaemon, guest_xml
from vmlend.kernel.mdev import MdevBus

pytestmark = [pytest.mark.backports, pytest.mark.daemon, pytest.mark.libvirtd]

SRC_MDEV = "83b8f4f2-509f-382f-3c1e-e6bfe0fa7001"
DST_MDEV = "83b8f4f2-509f-382f-3c1e-e6bfe0fa7002"
SRC_FDID, DST_FDID = 0x12, 0x20
VM_UUID = "6f1c5a2e-0000-4000-8000-0000000bb039"
QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"
#: vfio-pci's properties as test_backports_migration_kernel.py sets them, as -global options
#: (libvirt has no attribute for either; it marks the domain tainted by custom arguments).
#: x-device-dirty-page-tracking=off: Debian's 6.12 has no IOMMUFD, so mtty's DMA logging
#: reports fail; the type1 container tracks dirty pages instead. enable-migration=on: left at
#: auto, QEMU 10 blocks the migration of a device without device or IOMMUFD dirty tracking
#: ("VFIO device doesn't support device and IOMMU dirty tracking", which libvirt reports as
#: it asks QEMU for blockers); on, it only warns and uses the container's (every pinned page
#: dirty; mtty pins none).
VFIO_GLOBALS = (
    "vfio-pci.x-device-dirty-page-tracking=off",
    "vfio-pci.enable-migration=on",
)


def domain(mdev: str) -> str:
    root = etree.fromstring(guest_xml("bpo-mig", VM_UUID, [mdev]).encode())
    cmdline = etree.SubElement(root, f"{{{QEMU_NS}}}commandline", nsmap={"qemu": QEMU_NS})
    for prop in VFIO_GLOBALS:
        for value in ("-global", prop):
            etree.SubElement(cmdline, f"{{{QEMU_NS}}}arg", value=value)
    return etree.tostring(root, encoding="unicode")


def hostdev_uuids(xml: str) -> list[str]:
    return etree.fromstring(xml.encode()).xpath("//hostdev[@type='mdev']/source/address/@uuid")


@pytest.fixture
def two_daemons(tmp_path_factory) -> Iterator[tuple[LibvirtDaemon, LibvirtDaemon]]:
    src = LibvirtDaemon(tmp_path_factory.mktemp("src"), host_uuid=str(uuid.uuid4()))
    dst = LibvirtDaemon(
        tmp_path_factory.mktemp("dst"),
        cache_dir=src.layout.private("cache"),  # skip a second QEMU probe
        host_uuid=str(uuid.uuid4()),
    )
    started = []
    try:
        for d in (src, dst):
            d.start()
            started.append(d)
        yield src, dst
    finally:
        for d in started:
            survivors = d.stop()
            assert not survivors, f"processes left running after libvirtd teardown: {survivors}"


def test_libvirt_live_migrates_an_mdev_domain_between_two_daemons_with_the_hook(
    two_daemons, tmp_path, fabric_devices
):
    src, dst = two_daemons
    STUB.command("borrow", f"{SRC_FDID:#x}")
    STUB.command("borrow", f"{DST_FDID:#x}")
    bus = MdevBus(REAL)
    bus.create(f"smartio-{SRC_FDID:x}", LEND, SRC_MDEV)
    bus.create(f"smartio-{DST_FDID:x}", LEND, DST_MDEV)
    (tmp_path / "s").mkdir()
    (tmp_path / "d").mkdir()
    with operator_host(src, tmp_path / "s"), operator_host(dst, tmp_path / "d"):
        # libvirtd's main hook records each call; vmlend's, in hooks/qemu.d, runs after it
        # for the same call (operator_host installed it there with `vmlend hook install`).
        seen = {
            n: HookRecorder(d, tmp_path / f"{n}-hooks.jsonl")
            for n, d in (("src", src), ("dst", dst))
        }
        for recorder in seen.values():
            recorder.install()
        sconn, dconn = src.connect(), dst.connect()
        try:
            dom = sconn.createXML(domain(SRC_MDEV), 0)
            params = {
                libvirt.VIR_MIGRATE_PARAM_DEST_XML: domain(DST_MDEV),
                libvirt.VIR_MIGRATE_PARAM_URI: "tcp://127.0.0.1:49152",
            }
            try:
                moved = dom.migrate3(dconn, params, libvirt.VIR_MIGRATE_LIVE)
            except libvirt.libvirtError as e:
                pytest.fail(
                    f"libvirt refused or failed the migration: {e}\n--- source log\n"
                    f"{src.read_log()[-3000:]}\n--- destination log\n{dst.read_log()[-3000:]}"
                    f"\n--- source QEMU\n{src.domain_log('bpo-mig')[-2000:]}"
                    f"\n--- destination QEMU\n{dst.domain_log('bpo-mig')[-2000:]}"
                )
            assert moved.isActive()
            assert hostdev_uuids(moved.XMLDesc(0)) == [DST_MDEV]
            assert [d.name() for d in sconn.listAllDomains()] == []  # transient: gone
            # The hooks ran where libvirt runs them for an incoming migration: the migrate
            # filter and the prepare at the destination, on the destination's XML.
            dst_calls = {c.op[:2]: c for c in seen["dst"].calls("bpo-mig")}
            assert {("migrate", "begin"), ("prepare", "begin")} <= dst_calls.keys()
            assert dst_calls["prepare", "begin"].mdevs == (DST_MDEV,)
            assert ("release", "end") in {c.op[:2] for c in seen["src"].calls("bpo-mig")}
            moved.destroy()
        finally:
            sconn.close()
            dconn.close()
    assert bus.remove(SRC_MDEV)
    assert bus.remove(DST_MDEV)
