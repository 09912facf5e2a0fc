"""vmlend's production path end to end in the guest: ``vmlend hook install`` into the private
libvirtd (tests/support/libvirt_daemon.py), a domain made by ``vmlend xml new``, started with
``vmlend vm start`` (libvirtd runs the installed hook, which borrows through the SmartIO
stand-in and creates the mdev in the kernel; QEMU opens it through VFIO), a device hot-added
with ``vmlend attach --live``, and ``vmlend vm destroy``. The same domain started and
destroyed with ``virsh`` alone (the test shells out to it as an operator would; vmlend never
does). A live detach that no guest OS acknowledges, ending in vmlend's timeout.
libvirtd restarted under a running VM (the hook's ``reconnect``), on a daemon of the test's own.
``vmlend agent`` (SQLite: the hook server only) serving the installed hook on the kernel backend.

The CLI commands run in this process (click's runner: the commands' code, not a fresh
interpreter, which costs seconds under TCG); the hook runs as libvirtd runs it, the installed
script in a process of its own. Issue 36's two release defects each fail a test here on the code
before their fix: a release that removed every child under the parent of a device the VM held
(children vmlend did not make, here under ``smartio-1``), and a release at ``stopped end``,
before libvirt's own teardown, which then found the mdev gone."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import libvirt
import libvirt_qemu
import pytest

from tests.support.etcd_daemon import cluster_name
from tests.support.hostroot import identify
from tests.support.kernel_guest import FOREIGN, LEND, PORTS, REAL, STUB, available
from tests.support.kernel_host import hold_leases, operator_host
from tests.support.libvirt_daemon import LibvirtDaemon, pid_alive, wait_for
from vmlend.domain import read_domain
from vmlend.hook.actionlog import log_path_for_state
from vmlend.hostenv import HostEnv
from vmlend.kernel.mdev import MdevBus
from vmlend.registry import hostlease

pytestmark = pytest.mark.libvirtd

#: Children vmlend did not make (as mdevctl or another share would), under the parent of 0x12.
FOREIGN_1 = "83b8f4f2-509f-382f-3c1e-e6bfe0fa8001"
#: mtty's PCI identity: what QEMU sees of every stand-in device.
MTTY_ID = (0x4348, 0x3253)


@pytest.fixture
def host(libvirtd, tmp_path, fabric_devices):
    with operator_host(libvirtd, tmp_path) as h:
        yield h


class Witness:
    """libvirtd's main hook (the trampoline's target), which libvirtd runs before the scripts
    in hooks/qemu.d: it notes, at each call, the mdevs the kernel has. So its note of a call
    shows what vmlend's hook had done up to the call before."""

    def __init__(self, libvirtd, path: Path) -> None:
        self.path = path
        script = (
            f'cat >/dev/null; echo "$2/$3 $(ls /sys/bus/mdev/devices | tr "\\n" " ")" >> {path}'
        )
        libvirtd.install_hook(["/bin/bash", "-c", script, "witness"])

    def calls(self) -> list[tuple[str, set[str]]]:
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        return [(op, set(rest.split())) for op, _, rest in (ln.partition(" ") for ln in lines)]


def qemu_pid(libvirtd, name: str) -> int:
    return libvirtd.qemu_pids()[name]


def holds_group(pid: int, uuid: str) -> bool:
    """Whether QEMU ``pid`` has the VFIO group of mdev ``uuid`` open."""
    dev = MdevBus(REAL).device(uuid)
    assert dev is not None
    group = f"/dev/vfio/{dev.iommu_group}"
    return any(fd.resolve().as_posix() == group for fd in (REAL.proc / str(pid) / "fd").iterdir())


def pci_devices(devices: list[dict]) -> list[dict]:
    """Every device of a ``query-pci`` bus, those behind its bridges (root ports) too."""
    found = []
    for d in devices:
        found.append(d)
        found.extend(pci_devices(d.get("pci_bridge", {}).get("devices", [])))
    return found


def errors_about(log: str, *uuids: str) -> list[str]:
    return [ln for ln in log.splitlines() if " error : " in ln and any(u in ln for u in uuids)]


def test_a_vm_starts_gets_a_device_hot_added_and_is_destroyed_through_libvirtd(
    host, libvirtd, libvirt_conn, tmp_path, capsys
):
    witness = Witness(libvirtd, tmp_path / "witness.log")
    bus = MdevBus(REAL)
    u1 = host.new_vm("web", "0x12")

    t0 = time.monotonic()
    host.vmlend("vm", "start", "web")
    started = time.monotonic() - t0
    dom = libvirt_conn.lookupByName("web")
    assert dom.isActive()
    # The hook borrowed 0x12 through the driver and the kernel made the child there; libvirt
    # handed it to QEMU as vfio-pci, and QEMU holds its VFIO group.
    dev = bus.device(u1)
    assert dev is not None and (dev.parent, dev.type_id) == ("smartio-12", LEND)
    pid = qemu_pid(libvirtd, "web")
    cmdline = (REAL.proc / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    assert f'"sysfsdev":"/sys/bus/mdev/devices/{u1}"' in cmdline, cmdline
    assert holds_group(pid, u1)
    assert host.registry() == ([(0x12, "web")], [(u1, "web")])

    # A child vmlend did not make, beside the VM's under the same parent.
    bus.create("smartio-12", FOREIGN, FOREIGN_1)

    # Hot-add: no hook runs for it, vmlend borrows 0x10 itself and libvirt plugs it in.
    t0 = time.monotonic()
    host.vmlend("attach", "web", "0x10", "--live")
    attached = time.monotonic() - t0
    (u2,) = [d.uuid for d in bus.devices() if d.parent == "smartio-10"]
    assert bus.device(u2).type_id == LEND and holds_group(pid, u2)
    reply = json.loads(libvirt_qemu.qemuMonitorCommand(dom, '{"execute":"query-pci"}', 0))
    found = [d for b in reply["return"] for d in pci_devices(b["devices"])]
    ids = [(d["id"]["vendor"], d["id"]["device"]) for d in found]
    assert ids.count(MTTY_ID) == 2, found
    held, records = host.registry()
    assert (sorted(held), sorted(records)) == (
        [(0x10, "web"), (0x12, "web")], sorted([(u1, "web"), (u2, "web")]),
    )  # fmt: skip

    t0 = time.monotonic()
    host.vmlend("vm", "destroy", "web")
    destroyed = time.monotonic() - t0
    assert not dom.isActive()
    calls = witness.calls()
    at_release = next((mdevs for op, mdevs in calls if op == "release/end"), None)
    problems = []
    # Issue 36: vmlend's hook does nothing at 'stopped end', which libvirt calls before its
    # own teardown; the mdevs go at 'release end', libvirt's last call.
    if at_release is None or not {u1, u2} <= at_release:
        problems.append(f"the VM's mdevs were gone before 'release end': {calls}")
    errors = errors_about(libvirtd.read_log(), u1, u2)
    if errors:
        problems.append(f"libvirtd logged errors about the VM's mdevs: {errors}")
    # Issue 36: release removes the mdevs the registry records for the VM, nothing else.
    left = sorted(d.uuid for d in bus.devices())
    if left != [FOREIGN_1]:
        problems.append(f"after the release the kernel has {left}, not only {FOREIGN_1}")
    if host.registry() != ([], []):
        problems.append(f"the registry still holds {host.registry()}")
    assert not problems, "\n".join(problems)
    # 0x10's parent had nothing left: unborrowed. 0x12's keeps the child vmlend did not make.
    assert STUB.registered() == ["smartio-12"]
    with capsys.disabled():  # the tier's output shows where the time goes
        print(f"\n  vm start {started:.1f} s, attach --live {attached:.1f} s,"
              f" vm destroy {destroyed:.1f} s")  # fmt: skip


def test_two_vms_asking_for_the_last_instance_get_one_clear_refusal_and_leak_nothing(
    host, libvirtd, capsys
):
    """0x12's parent has one smartio-lend instance left (a child vmlend did not make holds a
    port of three); two VMs that name the device start at once: one runs with it, the other
    is refused with one line that names the device and its holder, and leaves nothing."""
    bus = MdevBus(REAL)
    STUB.command("borrow", "0x12")  # as an earlier borrower left it: registered, in use
    bus.create("smartio-12", FOREIGN, FOREIGN_1)
    assert available(0x12) == 1 and available(0x12, FOREIGN) == PORTS - 1
    mdevs = {name: host.new_vm(name, "0x12") for name in ("left", "right")}

    errors: dict[str, str] = {}

    def start(name: str) -> None:
        conn = libvirt.open(libvirtd.uri)
        try:
            conn.lookupByName(name).create()
        except libvirt.libvirtError as e:
            errors[name] = f"{e.get_error_code()} {e}"
        finally:
            conn.close()

    threads = [threading.Thread(target=start, args=(n,)) for n in mdevs]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    both = time.monotonic() - t0
    assert len(errors) == 1, errors
    ((loser, error),) = errors.items()
    (winner,) = set(mdevs) - {loser}
    assert error.startswith(f"{libvirt.VIR_ERR_HOOK_SCRIPT_FAILED} "), error
    assert "device 0x12" in error and f"held by gamma/{winner}" in error, error
    conn = libvirt.open(libvirtd.uri)
    try:
        assert conn.lookupByName(winner).isActive() and not conn.lookupByName(loser).isActive()
    finally:
        conn.close()
    # Nothing of the loser's anywhere: the kernel, the registry.
    assert sorted(d.uuid for d in bus.devices()) == sorted([mdevs[winner], FOREIGN_1])
    assert available(0x12) == 0
    assert host.registry() == ([(0x12, winner)], [(mdevs[winner], winner)])

    t0 = time.monotonic()
    host.vmlend("vm", "destroy", winner)
    destroyed = time.monotonic() - t0
    left = [d.uuid for d in bus.devices()]
    assert left == [FOREIGN_1], f"after the release the kernel has {left}, not only {FOREIGN_1}"
    assert host.registry() == ([], [])
    assert available(0x12) == 1
    with capsys.disabled():
        print(f"\n  two starts at once {both:.1f} s, vm destroy {destroyed:.1f} s")


def virsh(uri: str, *args: str) -> str:
    """The operator's ``virsh -c URI ARGS...``; its output (it must succeed). vmlend itself
    never runs virsh: this is the user's side of the production path."""
    r = subprocess.run(["virsh", "-c", uri, *args], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (args, r.stdout, r.stderr)
    return r.stdout


def test_a_vm_made_by_xml_new_runs_and_stops_through_virsh(host, libvirtd, libvirt_conn, capsys):
    """No vmlend command between the XML and the stop: ``virsh define``, ``virsh start`` and
    ``virsh destroy``, with vmlend's hook in libvirtd doing the borrowing and the release."""
    bus = MdevBus(REAL)
    xml, u1 = host.xml_new("web", "0x12")
    virsh(host.uri, "define", str(xml))

    t0 = time.monotonic()
    out = virsh(host.uri, "start", "web")
    started = time.monotonic() - t0
    assert "Domain 'web' started" in out, out
    dom = libvirt_conn.lookupByName("web")
    assert dom.isActive()
    dev = bus.device(u1)
    assert dev is not None and (dev.parent, dev.type_id) == ("smartio-12", LEND)
    pid = qemu_pid(libvirtd, "web")
    assert holds_group(pid, u1)
    assert host.registry() == ([(0x12, "web")], [(u1, "web")])
    bus.create("smartio-12", FOREIGN, FOREIGN_1)  # a child vmlend did not make, beside it

    t0 = time.monotonic()
    out = virsh(host.uri, "destroy", "web")
    destroyed = time.monotonic() - t0
    assert "Domain 'web' destroyed" in out, out
    assert not dom.isActive()
    assert errors_about(libvirtd.read_log(), u1) == []
    left = sorted(d.uuid for d in bus.devices())
    assert left == [FOREIGN_1], f"after the release the kernel has {left}, not only {FOREIGN_1}"
    assert host.registry() == ([], [])
    assert STUB.registered() == ["smartio-12"]  # the parent keeps the child vmlend did not make
    assert host.hook_log("web", "prepare") and host.hook_log("web", "release")
    with capsys.disabled():
        print(f"\n  virsh start {started:.1f} s, virsh destroy {destroyed:.1f} s")


def test_a_live_detach_the_guest_never_acknowledges_times_out_keeping_the_device(
    host, libvirtd, libvirt_conn, capsys
):
    """The tier's guests run no OS (SeaBIOS finds nothing to boot), so nothing answers the
    ACPI unplug request: libvirt's live detach returns with the device still plugged, and
    vmlend waits for it to leave the live XML for ``--timeout`` seconds (10 by default; 2
    here, since no answer is coming). Then, as docs/user-guide.md and ``DetachTimeoutError``
    say: one error line, exit 1, and the device stays the VM's: plugged, reserved, its mdev
    held by QEMU, nothing for ``reconcile`` to repair. The stop returns it as usual."""
    bus = MdevBus(REAL)
    u1 = host.new_vm("web", "0x12")
    host.vmlend("vm", "start", "web")
    dom = libvirt_conn.lookupByName("web")
    pid = qemu_pid(libvirtd, "web")

    t0 = time.monotonic()
    r = host.run("detach", "web", "0x12", "--live", "--timeout", "2")
    waited = time.monotonic() - t0
    assert r.exit_code == 1, r.output
    assert r.output.splitlines() == [
        f"Error: detach device from web refused: device 0x12 (mdev {u1}) is still attached"
        " after 2 s; the guest did not release it; re-run 'vmlend"
        " detach web 0x12' once it has (the device stays reserved until then)"
    ], r.output
    # Still the VM's everywhere: libvirt's live XML (hostdev and vmlend's metadata), the
    # registry, the kernel, QEMU.
    assert dom.isActive()
    live = dom.XMLDesc(0)
    assert f'uuid="{u1}"' in live or f"uuid='{u1}'" in live, live
    assert [d.fdid for d in read_domain(live.encode()).devices] == [0x12]
    assert host.registry() == ([(0x12, "web")], [(u1, "web")])
    dev = bus.device(u1)
    assert dev is not None and dev.parent == "smartio-12" and holds_group(pid, u1)
    drift = json.loads(host.vmlend("reconcile", "--json"))["drift"]
    assert drift == [], drift

    host.vmlend("vm", "destroy", "web")
    assert bus.devices() == [] and host.registry() == ([], []) and STUB.registered() == []
    with capsys.disabled():
        print(f"\n  detach --live until its timeout {waited:.1f} s")


@pytest.fixture
def own_libvirtd(libvirtd, tmp_path_factory):
    """A private libvirtd of this test's own (the test restarts it), with the session daemon's
    QEMU capability cache so that it skips the probe."""
    daemon = LibvirtDaemon(
        tmp_path_factory.mktemp("lvr"), cache_dir=libvirtd.layout.private("cache")
    )
    try:
        daemon.start()
        yield daemon
    finally:
        survivors = daemon.stop()
        assert not survivors, f"processes left running after libvirtd teardown: {survivors}"


def test_libvirtd_restarted_under_a_running_vm_reconnects_and_releases_later(
    own_libvirtd, tmp_path, fabric_devices, capsys
):
    """libvirtd restarts while a VM runs with a remote device: the new daemon runs the hook's
    ``reconnect begin``, which finds the VM's hold and mdev as they were (docs/hooks.md); the
    VM keeps running on the same QEMU, which still holds the mdev; ``vmlend reconcile``
    finds nothing to repair; and the stop through the new daemon releases as usual."""
    daemon = own_libvirtd
    bus = MdevBus(REAL)
    with operator_host(daemon, tmp_path) as host:
        u1 = host.new_vm("web", "0x12")
        host.vmlend("vm", "start", "web")
        pid = qemu_pid(daemon, "web")
        assert holds_group(pid, u1)
        assert host.hook_log("web", "reconnect") == []
        before = daemon.pids["libvirtd"]

        restarted = daemon.restart_libvirtd()
        assert daemon.pids["libvirtd"] != before
        # The new daemon reconnects to its guests in threads of its own, maybe after its
        # socket is up: wait for the hook's last record of it (ops.reconnect ends with
        # "consistent" or the problem; a hook that failed records "PROBLEM ...").
        def reconnect_done() -> bool:
            done = ("consistent", "PROBLEM")
            return any(w in m for m in host.hook_log("web", "reconnect") for w in done)

        t0 = time.monotonic()
        wait_for(reconnect_done, 120, "the reconnect hook", 0.1)
        reconnected = time.monotonic() - t0
        # It found the hold and the mdev as they were (acquire_device is idempotent, and says
        # so step by step), and changed nothing: the DMA windows it writes again are the same
        # (docs/smartio-contract.md section 8: the driver takes the same text unchanged).
        assert host.hook_log("web", "reconnect") == [
            "reserve 0x12: ok", f"mdev {u1} for 0x12 under smartio-12: ok",
            f"DMA windows of 0x12 (low) written to mdev {u1}: ok", "1 device consistent",
        ]  # fmt: skip
        conn = daemon.connect()
        try:
            assert conn.lookupByName("web").isActive()
        finally:
            conn.close()
        assert qemu_pid(daemon, "web") == pid and pid_alive(pid)
        dev = bus.device(u1)
        assert dev is not None and (dev.parent, dev.type_id) == ("smartio-12", LEND)
        assert holds_group(pid, u1)
        assert host.registry() == ([(0x12, "web")], [(u1, "web")])
        report = json.loads(host.vmlend("reconcile", "--json"))  # exit 0: nothing to repair
        assert (report["node"], report["drift"]) == ("gamma", []), report

        t0 = time.monotonic()
        host.vmlend("vm", "destroy", "web")
        destroyed = time.monotonic() - t0
        assert not pid_alive(pid)
        assert bus.devices() == [] and host.registry() == ([], []) and STUB.registered() == []
        assert errors_about(daemon.read_log(), u1) == []
    with capsys.disabled():
        print(f"\n  libvirtd restart {restarted:.1f} s, reconnect hook {reconnected:.1f} s"
              f" later, vm destroy {destroyed:.1f} s")  # fmt: skip


@pytest.mark.parametrize("registry", ["sqlite", "etcd"])
def test_the_agent_on_the_kernel_backend_serves_libvirtds_hook(
    registry, libvirtd, libvirt_conn, tmp_path, fabric_devices, request, capsys
):
    """``vmlend agent`` serving libvirtd's hook on the kernel backend (docs/hooks.md, "The
    agent serves the hook"): on SQLite the hook server only; on a private etcd also this
    host's lease, which the holds it takes for the hook carry. libvirtd runs the installed
    hook, which forwards prepare and release to the agent over the socket ``hook install``
    pinned, and the agent borrows through the SmartIO stand-in and creates and removes the
    mdev in the kernel. Every hook record of the VM is the agent's (its pid); what the kernel,
    QEMU and the registry hold is what the in-process hook leaves; SIGTERM stops the agent
    with exit 0."""
    url = None
    if registry == "etcd":
        # A cluster of this test's own on the session's etcd; not the etcd_url fixture, which
        # publishes a stand-in lease under a root of its own: here the agent publishes its
        # lease under this host's root, and the hook's calls take it.
        url = request.getfixturevalue("etcd").url(cluster_name(request))
        identify(tmp_path)  # the machine-id the etcd agent binds its node name to
    bus = MdevBus(REAL)
    with operator_host(libvirtd, tmp_path, url) as host:
        u1 = host.new_vm("web", "0x12")
        pinned = tomllib.loads(host.config.read_text())["hook-socket"]
        sock = host.work / pinned.lstrip("/")  # as seen inside the host root (the test's dir)
        env = {k: v for k, v in os.environ.items() if k != "VMLEND_STATE"}  # ours: --state
        agent_log = host.work / "agent.log"
        log = agent_log.open("wb")
        t0 = time.monotonic()
        # On etcd a long lease: under TCG on a loaded machine a renewal of the default 10 s
        # lease once went unanswered for 8 s (it recovered); this test is about serving the
        # hook, not the lease's timing.
        ttl = ["--ttl", "60"] if url is not None else []
        agent = subprocess.Popen(
            [str(Path(sys.executable).parent / "vmlend"), *host.options, "agent", *ttl],
            env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()
        try:

            def serving() -> bool:
                assert agent.poll() is None, agent_log.read_text()
                return sock.is_socket()

            wait_for(serving, 300, f"the agent's socket {sock}", 0.1)
            ready = time.monotonic() - t0

            t0 = time.monotonic()
            r = host.run("vm", "start", "web")
            started = time.monotonic() - t0
            assert r.exit_code == 0, "\n".join(
                [r.output, log_path_for_state(host.state).read_text(), agent_log.read_text()]
            )
            dom = libvirt_conn.lookupByName("web")
            assert dom.isActive()
            dev = bus.device(u1)
            assert dev is not None and (dev.parent, dev.type_id) == ("smartio-12", LEND)
            assert holds_group(qemu_pid(libvirtd, "web"), u1)
            assert host.registry() == ([(0x12, "web")], [(u1, "web")])
            assert host.hook_log("web", "prepare")[-1] == "1 device ready"
            if url is not None:
                lease = hostlease.read(hostlease.lease_path(HostEnv(host.work))).lease
                assert hold_leases(url, 0x12) == [lease]

            t0 = time.monotonic()
            host.vmlend("vm", "destroy", "web")
            destroyed = time.monotonic() - t0
            assert bus.devices() == [] and host.registry() == ([], [])
            assert STUB.registered() == []
            assert errors_about(libvirtd.read_log(), u1) == []
            lines = log_path_for_state(host.state).read_text().splitlines()
            mine = [ln for ln in lines if " vm=web " in ln]
            assert {int(p) for ln in mine for p in re.findall(r" pid=(\d+) ", ln)} == {agent.pid}
            assert any(" vm=web release: " in ln for ln in mine), lines
        finally:
            if agent.poll() is None:
                agent.send_signal(signal.SIGTERM)
            code = agent.wait(60)
        assert code == 0, agent_log.read_text()
    with capsys.disabled():
        print(f"\n  {registry}: agent serving after {ready:.1f} s, vm start {started:.1f} s,"
              f" vm destroy {destroyed:.1f} s (hook served by the agent)")  # fmt: skip
