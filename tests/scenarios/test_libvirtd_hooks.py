"""libvirt's qemu hook contract, shown with a real private libvirtd and real TCG guests.

These are the facts vmlend's hook is built on ("libvirt qemu hook
contract"); if a libvirt upgrade changes one of them, a test here fails first.
"""

from __future__ import annotations

import time
import uuid

import libvirt
import pytest
from lxml import etree

from tests.support.libvirt_daemon import mdev_hostdev_xml, needs_no_vfio, pid_alive

pytestmark = pytest.mark.libvirtd

START = [("prepare", "begin", "-"), ("start", "begin", "-"), ("started", "begin", "-")]
# libvirt 9.0 passes "-" as release's extra; from 10.5 it is the shut-off reason.
STOP = [("stopped", "end", "-"), ("release", "end", "-")]
FAILED_START = [("prepare", "begin", "-"), ("stopped", "end", "-"), ("release", "end", "-")]


def mdev_uuids(xml: str) -> list[str]:
    root = etree.fromstring(xml.encode())
    return root.xpath("devices/hostdev[@type='mdev']/source/address/@uuid")


def running_qemu_pid(libvirtd, name: str) -> int:
    pid = libvirtd.qemu_pids()[name]
    assert pid_alive(pid)
    return pid


def test_start_and_destroy_run_the_hook_in_documented_order(
    libvirtd, libvirt_guests, hook_recorder
):
    dom = libvirt_guests.define()
    name = dom.name()
    assert hook_recorder.calls(name) == [], "define must run no hook"

    started = time.monotonic()
    dom.create()
    start_seconds = time.monotonic() - started
    assert dom.isActive()
    pid = running_qemu_pid(libvirtd, name)
    assert hook_recorder.ops(name) == START
    assert start_seconds < 10

    dom.destroy()
    assert hook_recorder.ops(name) == START + STOP
    assert not pid_alive(pid), "destroy returned but QEMU is still running"
    # Every call names the domain in argv and gets its full XML on stdin.
    calls = hook_recorder.calls(name)
    assert {(c.argv[0], c.uuid) for c in calls} == {(name, dom.UUIDString())}
    assert "qemu-system-x86_64" in libvirtd.domain_log(name)


def test_failing_prepare_blocks_the_start_and_stopped_release_still_run(
    libvirtd, libvirt_guests, hook_recorder
):
    reason = "vmlend: device 0x1234 is held by domain other-vm"
    hook_recorder.install(fail="prepare", message=reason)
    dom = libvirt_guests.define()
    name = dom.name()

    with pytest.raises(libvirt.libvirtError) as failed:
        dom.create()
    assert failed.value.get_error_code() == libvirt.VIR_ERR_HOOK_SCRIPT_FAILED
    assert reason in str(failed.value), "libvirt must show the hook's stderr to the user"
    assert not dom.isActive()
    assert name not in libvirtd.qemu_pids()
    assert hook_recorder.ops(name) == FAILED_START
    assert reason in libvirtd.read_log()

    # Nothing is left behind: with a willing hook the same domain starts normally.
    hook_recorder.install()
    dom.create()
    assert dom.isActive()
    assert hook_recorder.ops(name) == FAILED_START + START


def test_hook_exit_code_and_missing_hook_command_reach_libvirt(
    libvirtd, libvirt_guests, hook_recorder, tmp_path
):
    missing = tmp_path / "no-such-hook"
    libvirtd.install_hook([str(missing)])
    dom = libvirt_guests.define()
    with pytest.raises(libvirt.libvirtError) as failed:
        dom.create()
    assert failed.value.get_error_code() == libvirt.VIR_ERR_HOOK_SCRIPT_FAILED
    assert str(missing) in str(failed.value)
    assert not dom.isActive()

    libvirtd.remove_hook()  # the trampoline alone accepts everything
    dom.create()
    assert dom.isActive()


@needs_no_vfio
def test_mdev_guest_passes_prepare_then_libvirt_refuses_it_without_vfio(
    libvirtd, libvirt_guests, hook_recorder
):
    mdev = str(uuid.uuid4())
    dom = libvirt_guests.define([mdev])
    name = dom.name()
    # define keeps the mdev hostdev (libvirt fills in managed='no' and a PCI address).
    assert mdev_uuids(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)) == [mdev]

    with pytest.raises(libvirt.libvirtError) as refused:
        dom.create()
    assert refused.value.get_error_code() == libvirt.VIR_ERR_CONFIG_UNSUPPORTED
    assert "Mediated host device assignment requires VFIO support" in str(refused.value)
    assert not dom.isActive()
    assert name not in libvirtd.qemu_pids()
    # prepare ran (with the mdev in its XML: where vmlend creates it), then the cleanup.
    assert hook_recorder.ops(name) == FAILED_START
    assert [c.mdevs for c in hook_recorder.calls(name)] == [(mdev,)] * 3


def test_config_attach_and_detach_of_an_mdev_on_a_running_guest(
    libvirtd, libvirt_guests, hook_recorder
):
    dom = libvirt_guests.define()
    dom.create()
    mdev = str(uuid.uuid4())
    device = mdev_hostdev_xml(mdev)

    dom.attachDeviceFlags(device, libvirt.VIR_DOMAIN_AFFECT_CONFIG)
    assert mdev_uuids(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)) == [mdev]
    assert mdev_uuids(dom.XMLDesc(0)) == [], "a CONFIG attach must not touch the live guest"

    dom.detachDeviceFlags(device, libvirt.VIR_DOMAIN_AFFECT_CONFIG)
    assert mdev_uuids(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)) == []
    assert dom.isActive()
    # Device changes run no hook (there is no hot-plug hook): only the start's three calls.
    assert hook_recorder.ops(dom.name()) == START


@needs_no_vfio
def test_live_attach_of_an_mdev_is_refused_without_vfio(libvirtd, libvirt_guests, hook_recorder):
    dom = libvirt_guests.define()
    dom.create()
    device = mdev_hostdev_xml(str(uuid.uuid4()))

    with pytest.raises(libvirt.libvirtError) as refused:
        dom.attachDeviceFlags(device, libvirt.VIR_DOMAIN_AFFECT_LIVE)
    assert refused.value.get_error_code() == libvirt.VIR_ERR_CONFIG_UNSUPPORTED
    assert dom.isActive(), "a refused hot-plug must leave the guest running"
    assert mdev_uuids(dom.XMLDesc(0)) == []
    assert mdev_uuids(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)) == []
    assert hook_recorder.ops(dom.name()) == START
