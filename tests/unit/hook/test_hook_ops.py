"""The hook against the real simulated fabric: libvirt's argv and XML in, state changes and
exit codes out. Every failure must leave the state exactly as it was."""

from __future__ import annotations

import io
import uuid

import pytest
from lxml import etree

from tests.support.simfabric import make_fabric
from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, new_domain, read_domain
from vmlend.hook.actionlog import ActionLog, log_path_for_state
from vmlend.hook.main import run
from vmlend.lending.devices import UndoJournal, acquire_device
from vmlend.topology.model import DeviceState, Holder, MiB
from vmlend.wiring.fabric import open_fabric

TEMPLATES = TemplateSet()
VM_UUID = uuid.UUID("6f1c5a2e-0000-4000-8000-000000000001")


def domain_xml(name: str = "vm1", fdids=(0x10, 0x12), vm_uuid=VM_UUID, memory=512 * MiB) -> bytes:
    spec = DomainSpec(
        name=name,
        memory_bytes=memory,
        uuid=vm_uuid,
        devices=[DeviceRequest(f) for f in fdids],
    )
    return new_domain(spec, templates=TEMPLATES).to_bytes()


def hook(state_path, *argv: str, xml: bytes = b"", node: str | None = None):
    out, err = io.BytesIO(), io.StringIO()
    env = {"VMLEND_STATE": str(state_path)}
    if node:
        env["VMLEND_NODE"] = node
    code = run(list(argv), stdin=io.BytesIO(xml), stdout=out, stderr=err, environ=env)
    return code, out.getvalue(), err.getvalue()


def snapshot(state_path):
    fabric = open_fabric(state_path)
    devices = {(d.fdid, d.state, d.holder) for d in fabric.devices()}
    mdevs = {(m.uuid, m.fdid) for m in fabric.mdevs()}
    return devices, mdevs


@pytest.fixture
def fabric(state_path):
    return make_fabric(state_path)


def test_prepare_reserves_and_creates_mdevs_release_returns_them(fabric, state_path):
    xml = domain_xml()
    code, _out, err = hook(state_path, "vm1", "prepare", "begin", "-", xml=xml)
    assert (code, err) == (0, "")
    f = open_fabric(state_path)
    held = {d.fdid: d for d in f.devices() if d.holder}
    assert set(held) == {0x10, 0x12}
    assert all(d.state is DeviceState.RESERVED for d in held.values())
    assert held[0x10].holder == Holder("gamma", "vm1", str(VM_UUID))
    assert {m.fdid for m in f.mdevs()} == {0x10, 0x12}
    # Running prepare again (libvirt retry) changes nothing.
    before = snapshot(state_path)
    assert hook(state_path, "vm1", "prepare", "begin", "-", xml=xml)[0] == 0
    assert snapshot(state_path) == before

    assert hook(state_path, "vm1", "release", "end", "destroyed", xml=xml) == (0, b"", "")
    f = open_fabric(state_path)
    assert not [d for d in f.devices() if d.holder] and f.mdevs() == []


def action_lines(state_path, vm: str = "vm1") -> list[str]:
    """The action log's lines about ``vm``, without their time and pid."""
    lines = ActionLog(log_path_for_state(state_path)).tail(200)
    return [line.split(f" vm={vm} ", 1)[1] for line in lines if f" vm={vm} " in line]


def test_stopped_end_does_nothing_and_release_end_releases(fabric, state_path):
    """Issue 36: libvirt logged 'iommu_group: No such file' at every stop, because the hook
    removed the mdevs at 'stopped end', before libvirt's own teardown (which still reads them)
    was done. 'stopped end' now touches nothing; 'release end' removes each mdev, then returns
    the devices."""
    xml = domain_xml()
    assert hook(state_path, "vm1", "prepare", "begin", "-", xml=xml)[0] == 0
    before, logged = snapshot(state_path), action_lines(state_path)
    assert hook(state_path, "vm1", "stopped", "end", "-", xml=xml) == (0, b"", "")
    assert snapshot(state_path) == before and action_lines(state_path) == logged

    assert hook(state_path, "vm1", "release", "end", "shutdown", xml=xml) == (0, b"", "")
    f = open_fabric(state_path)
    assert not [d for d in f.devices() if d.holder] and f.mdevs() == []
    done = action_lines(state_path)[len(logged) :]
    removed = [i for i, line in enumerate(done) if line.startswith("release: mdev ")]
    returned = [i for i, line in enumerate(done) if line.startswith("release: device ")]
    assert len(removed) == len(returned) == 2 and max(removed) < min(returned)


def test_a_failed_start_is_cleaned_up_by_release_end_not_stopped_end(fabric, state_path):
    """After a failed prepare libvirt runs 'stopped end' and 'release end': a prepare killed
    after its first device (nothing rolled back) is cleaned up by the release."""
    clean = snapshot(state_path)
    xml = domain_xml()
    holder = Holder("gamma", "vm1", str(VM_UUID))
    first = read_domain(xml).devices[0]
    acquire_device(fabric, holder, first.fdid, first.mdev, UndoJournal())  # then it died
    half = snapshot(state_path)
    assert hook(state_path, "vm1", "stopped", "end", "-", xml=xml) == (0, b"", "")
    assert snapshot(state_path) == half
    assert hook(state_path, "vm1", "release", "end", "failed", xml=xml) == (0, b"", "")
    assert snapshot(state_path) == clean


def test_failure_on_second_device_returns_the_first(fabric, state_path):
    other = Holder("gamma", "vm2", str(uuid.uuid4()))
    fabric.reserve(0x12, other)
    before = snapshot(state_path)
    code, _, err = hook(state_path, "vm1", "prepare", "begin", "-", xml=domain_xml())
    assert code == 1
    assert err.count("\n") == 1
    assert "vm1" in err and "0x12" in err and "held by gamma/vm2" in err
    assert snapshot(state_path) == before


def test_unknown_fdid_fails_cleanly(fabric, state_path):
    before = snapshot(state_path)
    code, _, err = hook(
        state_path, "vm1", "prepare", "begin", "-", xml=domain_xml(fdids=(0x10, 0x99))
    )
    assert code == 1 and "unknown device fdid 0x99" in err
    assert snapshot(state_path) == before


def test_lender_that_vanished_fails_cleanly(fabric, state_path):
    fabric.set_node_up("beta", False)
    before = snapshot(state_path)
    code, _, err = hook(
        state_path, "vm1", "prepare", "begin", "-", xml=domain_xml(fdids=(0x10, 0x20))
    )
    assert code == 1 and "0x20" in err and "beta" in err
    assert snapshot(state_path) == before


def test_domain_without_vmlend_metadata_is_untouched(tmp_path):
    plain = b"<domain type='kvm'><name>plain</name><memory>65536</memory></domain>"
    missing_state = tmp_path / "never" / "state.db"
    for argv in (("prepare", "begin", "-"), ("release", "end", "-"), ("migrate", "begin", "-")):
        code, out, err = hook(missing_state, "plain", *argv, xml=plain)
        assert (code, out, err) == (0, b"", "")
    assert not missing_state.parent.exists()


def test_malformed_vmlend_xml_is_one_clear_line(fabric, state_path):
    truncated = domain_xml()[:-40]  # still names vmlend's namespace
    before = snapshot(state_path)
    code, _, err = hook(state_path, "vm1", "prepare", "begin", "-", xml=truncated)
    assert code == 1 and "domain XML on stdin" in err and err.count("\n") == 1
    assert not err.startswith("vmlend: internal error")
    assert snapshot(state_path) == before


@pytest.mark.parametrize("xml", [b"<domain><name>x</name", b""])
def test_xml_that_cannot_be_vmlend_is_left_to_libvirt(tmp_path, xml):
    # Decided from the bytes alone: no vmlend namespace, so not ours to judge, well-formed or not.
    missing_state = tmp_path / "never" / "state.db"
    assert hook(missing_state, "x", "prepare", "begin", "-", xml=xml) == (0, b"", "")
    assert not missing_state.parent.exists()


def test_missing_state_file_is_one_clear_line(tmp_path):
    code, _, err = hook(tmp_path / "nope.db", "vm1", "prepare", "begin", "-", xml=domain_xml())
    assert code == 1 and "vmlend fabric init" in err and err.count("\n") == 1


def test_release_after_a_crash_half_way_cleans_up(fabric, state_path):
    xml = domain_xml()
    assert hook(state_path, "vm1", "prepare", "begin", "-", xml=xml)[0] == 0
    f = open_fabric(state_path)
    # A crash after one mdev was removed: the other mdev and both holds remain.
    f.remove_mdev(next(m.uuid for m in f.mdevs() if m.fdid == 0x10))
    assert hook(state_path, "vm1", "release", "end", "-", xml=xml)[0] == 0
    assert hook(state_path, "vm1", "release", "end", "-", xml=xml)[0] == 0
    f = open_fabric(state_path)
    assert not [d for d in f.devices() if d.holder] and f.mdevs() == []


def test_release_does_not_touch_another_vms_devices(fabric, state_path):
    assert hook(state_path, "vm1", "prepare", "begin", "-", xml=domain_xml())[0] == 0
    xml2 = domain_xml("vm2", fdids=(0x11,), vm_uuid=uuid.uuid4())
    assert hook(state_path, "vm2", "prepare", "begin", "-", xml=xml2)[0] == 0
    assert hook(state_path, "vm1", "release", "end", "-", xml=domain_xml())[0] == 0
    f = open_fabric(state_path)
    assert {d.fdid for d in f.devices() if d.holder} == {0x11}
    assert {m.fdid for m in f.mdevs()} == {0x11}


def test_reconnect_recreates_a_missing_mdev_and_never_fails(fabric, state_path):
    xml = domain_xml()
    assert hook(state_path, "vm1", "prepare", "begin", "-", xml=xml)[0] == 0
    f = open_fabric(state_path)
    f.remove_mdev(next(m.uuid for m in f.mdevs() if m.fdid == 0x12))
    assert hook(state_path, "vm1", "reconnect", "begin", "-", xml=xml)[0] == 0
    assert {m.fdid for m in open_fabric(state_path).mdevs()} == {0x10, 0x12}
    # A device now held elsewhere is a logged problem, not a killed guest.
    f = open_fabric(state_path)
    assert hook(state_path, "vm1", "release", "end", "-", xml=xml)[0] == 0
    f.reserve(0x12, Holder("gamma", "vm9", str(uuid.uuid4())))
    assert hook(state_path, "vm1", "reconnect", "begin", "-", xml=xml)[0] == 0
    log = "\n".join(ActionLog(log_path_for_state(state_path)).tail(5))
    assert "reconnect: device 0x12: PROBLEM: device 0x12 is held by gamma/vm9" in log
    assert open_fabric(state_path).device(0x12).holder.vm == "vm9"  # not taken over


def test_migrate_prints_the_xml_for_this_host(fabric, state_path):
    xml = domain_xml()
    code, out, err = hook(state_path, "vm1", "migrate", "begin", "-", xml=xml)
    assert (code, err) == (0, "")
    assert b"gamma" in out and b"vmlend" in out
    info = read_domain(out)
    assert info.host_node == "gamma"
    assert [d.fdid for d in info.devices] == [0x10, 0x12]


def test_migrate_with_a_device_unknown_here_cancels(fabric, state_path):
    code, out, err = hook(state_path, "vm1", "migrate", "begin", "-", xml=domain_xml(fdids=(0x77,)))
    assert code == 1 and out == b"" and "0x77" in err


def test_actions_are_logged_and_shown_by_the_cli(fabric, state_path):
    from click.testing import CliRunner

    from vmlend.cli import main

    assert hook(state_path, "vm1", "prepare", "begin", "-", xml=domain_xml())[0] == 0
    r = CliRunner().invoke(main, ["hook", "log", "-n", "5"])
    assert r.exit_code == 0
    assert "vm=vm1 prepare: reserve 0x10: ok" in r.output
    assert "2 devices ready" in r.output


# --- regressions found in review --------------------------------------------------------


def test_reconnect_never_fails_the_guest(fabric, state_path, tmp_path):
    """libvirt kills a running guest whose reconnect hook fails: an inconsistent XML or a
    missing state must be logged, not fatal."""
    xml = domain_xml()
    assert hook(state_path, "vm1", "prepare", "begin", "-", xml=xml)[0] == 0
    doc = etree.fromstring(xml)
    for h in doc.iter("hostdev"):  # e.g. unplugged by hand: metadata and hostdevs disagree
        h.getparent().remove(h)
    code, _out, err = hook(state_path, "vm1", "reconnect", "begin", "-", xml=etree.tostring(doc))
    assert (code, err) == (0, "")
    code, _out, err = hook(tmp_path / "gone" / "s.db", "vm1", "reconnect", "begin", "-", xml=xml)
    assert (code, err) == (0, "")
    log = "\n".join(ActionLog(tmp_path / "gone" / "hook.log").tail(3))
    assert "reconnect: PROBLEM (guest kept running): no vmlend state" in log


def test_release_of_a_copied_xml_leaves_the_running_vms_mdev(fabric, state_path):
    """A clone (new name and UUID, hostdev and metadata copied) is refused at prepare; libvirt
    then runs its release, which must not remove the original VM's mdev."""
    a = domain_xml("vmA", fdids=(0x10,))
    assert hook(state_path, "vmA", "prepare", "begin", "-", xml=a)[0] == 0
    clone_uuid = uuid.UUID("6f1c5a2e-0000-4000-8000-00000000000b")
    b = a.replace(b"vmA", b"vmB").replace(str(VM_UUID).encode(), str(clone_uuid).encode())
    assert hook(state_path, "vmB", "prepare", "begin", "-", xml=b)[0] == 1
    before = snapshot(state_path)
    assert hook(state_path, "vmB", "release", "end", "-", xml=b)[0] == 0
    assert snapshot(state_path) == before
    assert [m.fdid for m in open_fabric(state_path).mdevs()] == [0x10]


def test_returning_a_device_by_a_copied_xml_leaves_the_running_vms_mdev(fabric, state_path):
    """detach and reconcile return one device with the mdev the XML names: another VM's
    mdev is left alone (and said so), as release does."""
    from vmlend.lending.devices import return_device

    a = domain_xml("vmA", fdids=(0x10,))
    assert hook(state_path, "vmA", "prepare", "begin", "-", xml=a)[0] == 0
    before = snapshot(state_path)
    (mdev,) = (m.uuid for m in fabric.mdevs())
    lines: list[str] = []
    clone = Holder("gamma", "vmB", "6f1c5a2e-0000-4000-8000-00000000000b")
    assert not return_device(fabric, clone, 0x10, mdev.upper(), lines.append)
    assert snapshot(state_path) == before
    assert lines == [f"mdev {mdev}: named by this domain but serves gamma/vmA; left alone"]


def test_release_removes_only_the_mdevs_recorded_for_the_vm(fabric, state_path):
    """Issue 36: 'vm destroy' removed every mdev under the parent of a device the VM held.
    Beside vm1's own mdev of 0x10, the simulated host has 22 of another type (other VMs'
    shares) and one of vmlend's type made for no VM; vm1's release removes its own only."""
    from vmlend.ledger.shareops import SHARE_MDEV_TYPE
    from vmlend.registry import MdevRecord, SqliteRegistry

    xml = domain_xml(fdids=(0x10,))
    assert hook(state_path, "vm1", "prepare", "begin", "-", xml=xml)[0] == 0
    (own,) = open_fabric(state_path).mdevs()
    others = [
        MdevRecord(str(uuid.uuid4()), 0x10, "gamma", own.parent, SHARE_MDEV_TYPE, f"vm{i}", 0.0)
        for i in range(2, 24)
    ]
    others.append(MdevRecord(str(uuid.uuid4()), 0x10, "gamma", own.parent, own.type_id, "", 0.0))
    with SqliteRegistry.open(state_path) as reg, reg.write() as tx:
        for rec in others:
            tx.add_mdev(rec)
    for _ in range(2):  # and a re-run changes nothing more
        assert hook(state_path, "vm1", "release", "end", "destroyed", xml=xml) == (0, b"", "")
        f = open_fabric(state_path)
        assert {m.uuid for m in f.mdevs()} == {r.uuid for r in others}
        assert f.device(0x10).holder is None
    log = [line for line in ActionLog(log_path_for_state(state_path)).tail(50) if "vm=vm1" in line]
    removed = [line.split("release: ")[1] for line in log if line.endswith(": removed")]
    assert removed == [f"mdev {own.uuid}: removed"]


def test_stdin_is_drained_even_for_bad_arguments(state_path):
    stdin = io.BytesIO(b"<domain/>" * 1000)
    code = run(["vm1"], stdin=stdin, stdout=io.BytesIO(), stderr=io.StringIO(), environ={})
    assert code == 1 and stdin.read() == b""


def test_library_warnings_go_to_the_action_log_not_stderr(fabric, state_path):
    import logging

    def noisy_open(path, node):
        logging.getLogger("vmlend.fabric").warning("something odd about the fabric")
        return open_fabric(path, node)

    err = io.StringIO()
    code = run(
        ["vm1", "prepare", "begin", "-"],
        stdin=io.BytesIO(domain_xml()),
        stdout=io.BytesIO(),
        stderr=err,
        environ={"VMLEND_STATE": str(state_path)},
        open_fabric=noisy_open,
    )
    assert (code, err.getvalue()) == (0, "")
    log = "\n".join(ActionLog(log_path_for_state(state_path)).tail(10))
    assert "vm=vm1 warning: something odd about the fabric" in log


def test_prepare_and_reconnect_reserve_with_the_xmls_interrupt_path(fabric, state_path):
    from vmlend.topology.model import InterruptPath

    spec = DomainSpec(
        "vm1",
        512 * MiB,
        uuid=VM_UUID,
        devices=[DeviceRequest(0x10), DeviceRequest(0x12, interrupts=InterruptPath.NTB)],
        interrupts=InterruptPath.RELAY,
    )
    xml = new_domain(spec, templates=TemplateSet()).to_bytes()
    assert hook(state_path, "vm1", "prepare", "begin", "-", xml=xml)[0] == 0
    f = open_fabric(state_path)
    assert f.interrupt_window(0x10) is None and f.interrupt_window(0x12) is not None
    # libvirtd restarted while the holds were lost: reconnect takes them again, the same way.
    assert hook(state_path, "vm1", "release", "end", "-", xml=xml)[0] == 0
    assert hook(state_path, "vm1", "reconnect", "begin", "-", xml=xml)[0] == 0
    f = open_fabric(state_path)
    assert f.interrupt_window(0x10) is None and f.interrupt_window(0x12) is not None
