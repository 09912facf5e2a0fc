"""The relay daemon: control socket with SCM_RIGHTS, sessions, release, SIGTERM."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from tests.support.cli_cluster import one_line
from tests.support.fdcheck import fd_snapshot, leaked
from tests.support.irq_devices import make_device, msix_flags, msix_program
from vmlend.cli import main
from vmlend.errors import ConfigError, RelayError
from vmlend.hook.sockplace import SocketPlace
from vmlend.irq.client import RelayClient
from vmlend.irq.control import send_message
from vmlend.irq.daemon import RelayDaemon
from vmlend.irq.eventfd import EventFd
from vmlend.irq.lender import LenderRelay
from vmlend.irq.relay import Reactor
from vmlend.irq.vectors import IrqIndex

FDID = 0x7


def fires(efd: EventFd, timeout: float = 2.0) -> int:
    r, _, _ = select.select([efd], [], [], timeout)
    return efd.drain() if r else 0


def wait_until(cond, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        time.sleep(0.002)


class Lender:
    """A lender with one MSI-X device, its transport end handed to the daemon by ``attach``."""

    def __init__(self, client: RelayClient, fdid: int = FDID, vectors: int = 4) -> None:
        self.dev = make_device(msix_entries=vectors, fdid=fdid)
        for v in range(vectors):
            msix_program(self.dev.bars, v)
        self.reactor = Reactor()
        self.reactor.start("lender")
        self.relay = LenderRelay(self.reactor)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        client.attach([fdid], theirs)
        theirs.close()
        self.relay.add_sim_device(self.dev, self.relay.open_channel(mine))
        msix_flags(self.dev.config, enable=True)

    def close(self) -> None:
        self.relay.close()
        self.reactor.close()


@pytest.fixture
def daemon(tmp_path) -> Iterator[RelayDaemon]:
    d = RelayDaemon(tmp_path / "relay.sock")
    d.start()
    t = threading.Thread(target=d.serve, daemon=True)
    t.start()
    yield d
    d.stop()
    t.join(5)
    assert not t.is_alive()


def test_vmm_registers_irqfds_and_receives_interrupts(daemon):
    with RelayClient(daemon.socket_path) as vmm:
        lender = Lender(vmm)
        vm = [EventFd() for _ in range(4)]
        vmm.set_triggers(FDID, IrqIndex.MSIX, [e.fileno() for e in vm])
        for v in (0, 3, 3):
            lender.dev.raise_interrupt(v)
        assert fires(vm[0]) == 1
        # The two on vector 3 travel in one batch or in two (the lender may read its eventfd
        # between the raises), so the VM's first read may see only one: once the daemon has
        # delivered all three, the eventfds hold the rest.
        got = fires(vm[3])
        wait_until(lambda: vmm.status()["devices"][0]["delivered"] == 3)
        assert [vm[0].drain(), got + vm[3].drain()] == [0, 2]
        (dev,) = vmm.status()["devices"]
        assert (dev["fdid"], dev["delivered"], len(dev["vectors"])) == (FDID, 3, 4)
        lender.close()
        for e in vm:
            e.close()


def test_vm_stopping_releases_its_irqfds(daemon):
    before = fd_snapshot()
    admin = RelayClient(daemon.socket_path)
    lender = Lender(admin)
    vmm = RelayClient(daemon.socket_path)
    vm = [EventFd() for _ in range(4)]
    vmm.set_triggers(FDID, IrqIndex.MSIX, [e.fileno() for e in vm])
    assert len(admin.status()["devices"][0]["vectors"]) == 4
    vmm.close()  # the VMM process is gone
    wait_until(lambda: admin.status()["devices"][0]["vectors"] == [])
    # Later interrupts wait for the next VM instead of going nowhere.
    lender.dev.raise_interrupt(1)
    wait_until(lambda: admin.status()["devices"][0]["held"] == 1)
    # Hot-remove: the device is released, its transport closed; the lender just sees a hang-up.
    admin.release(FDID)
    assert admin.status()["devices"] == []
    lender.close()
    admin.close()
    for e in vm:
        e.close()
    wait_until(lambda: not leaked(before))


def test_lender_hanging_up_releases_its_devices(daemon):
    with RelayClient(daemon.socket_path) as admin:
        lender = Lender(admin)
        assert [d["fdid"] for d in admin.status()["devices"]] == [FDID]
        lender.close()
        wait_until(lambda: admin.status()["devices"] == [])


def test_bad_requests_get_errors_and_leak_nothing(daemon):
    before = fd_snapshot()
    with RelayClient(daemon.socket_path) as c:
        e = EventFd()
        with pytest.raises(RelayError, match="not attached"):
            c.set_triggers(0x99, IrqIndex.MSI, [e.fileno()])
        with pytest.raises(RelayError, match="unknown op"):
            c.request({"op": "frobnicate"}, [e.fileno()])
        with pytest.raises(RelayError, match="exactly one transport"):
            c.request({"op": "attach", "devices": [1]})
        with pytest.raises(RelayError, match="SOCK_SEQPACKET"):
            c.request({"op": "attach", "devices": [1]}, [e.fileno()])
        with pytest.raises(RelayError, match="malformed"):
            c.request({"op": "set_irqs"}, [e.fileno()])
        with pytest.raises(RelayError, match="name each passed"):
            c.request(
                {"op": "set_irqs", "device": 1, "index": 1, "flags": 36, "fds": [0, 0]},
                [e.fileno()],
            )
        with pytest.raises(RelayError, match="name each passed"):
            c.request(
                {"op": "set_irqs", "device": 1, "index": 1, "flags": 36, "fds": [-2]},
                [e.fileno()],
            )
        with pytest.raises(RelayError, match="count must equal"):
            c.request(
                {"op": "set_irqs", "device": 1, "index": 1, "flags": 36, "count": 2, "fds": [0]},
                [e.fileno()],
            )
        raw = c._sock
        raw.send(b"not json")
        with pytest.raises(RelayError, match="not JSON"):
            c.request({"op": "status"})  # the reply to the garbage comes first
        e.close()
        assert c.status()["devices"] == []
    wait_until(lambda: not leaked(before))


def test_cli_status_lists_devices(daemon, tmp_path):
    with RelayClient(daemon.socket_path) as vmm:
        lender = Lender(vmm)
        r = CliRunner().invoke(main, ["relay", "--socket", str(daemon.socket_path), "status"])
        assert r.exit_code == 0 and "0x7" in r.output and "up" in r.output
        r = CliRunner().invoke(
            main, ["relay", "--socket", str(daemon.socket_path), "status", "--json"]
        )
        assert r.exit_code == 0 and [d["fdid"] for d in json.loads(r.output)["devices"]] == [7]
        lender.close()
    r = CliRunner().invoke(main, ["relay", "--socket", str(tmp_path / "none.sock"), "status"])
    assert r.exit_code == 1 and "start it with 'vmlend relay'" in r.output


def test_a_second_stop_after_the_daemon_stopped_is_harmless(tmp_path):
    # SIGTERM twice, or a supervisor stopping a daemon whose serve() already returned.
    d = RelayDaemon(tmp_path / "relay.sock")
    d.start()
    t = threading.Thread(target=d.serve, daemon=True)
    t.start()
    d.stop()
    t.join(5)
    assert not t.is_alive() and not d.socket_path.exists()
    d.stop()


def test_second_daemon_refuses_a_live_socket(daemon):
    with pytest.raises(RelayError, match="already listens"):
        RelayDaemon(daemon.socket_path).start()


@pytest.mark.slow
@pytest.mark.daemon
def test_daemon_subprocess_relays_and_stops_on_sigterm(tmp_path):
    sock = tmp_path / "relay.sock"
    log = (tmp_path / "relay.log").open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from vmlend.cli import main; main()",
            "-v",
            "relay",
            "--socket",
            str(sock),
        ],
        stderr=log,
    )
    try:
        wait_until(sock.exists, timeout=10)
        baseline = fd_snapshot(proc.pid)
        vmm = RelayClient(sock)
        lender = Lender(vmm)
        vm = EventFd()
        vmm.set_triggers(FDID, IrqIndex.MSIX, [vm.fileno()])
        lender.dev.raise_interrupt(0)
        assert fires(vm) == 1
        vmm.release(FDID)
        vmm.close()
        lender.close()
        vm.close()
        # Everything the VM and the lender handed over is closed again in the daemon.
        wait_until(lambda: not leaked(baseline, proc.pid))
        # A borrower-side client that never reads does not stall the daemon for others.
        stuck = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        stuck.connect(str(sock))
        send_message(stuck, {"op": "status"})
        with RelayClient(sock) as other:
            assert other.status()["pid"] == proc.pid
        stuck.close()
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
        assert not sock.exists()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    assert "relay stopped" in (tmp_path / "relay.log").read_text()


def test_relay_socket_option_never_deletes_what_is_not_a_stale_socket(tmp_path):
    """Root runs the relay: ``--socket FILE`` on a regular file, or a link to one, is refused
    with one line and the file kept; only a socket nobody listens on is replaced."""
    precious = tmp_path / "precious"
    precious.write_text("keep me\n")
    r = CliRunner().invoke(main, ["relay", "--socket", str(precious)])
    assert one_line(r) == (
        f"Error: {precious} exists and is not a socket (a regular file); remove it or give"
        " another --socket"
    )
    assert precious.read_text() == "keep me\n"
    link = tmp_path / "link.sock"
    link.symlink_to(precious)
    assert "is not a socket (a symbolic link)" in one_line(
        CliRunner().invoke(main, ["relay", "--socket", str(link)])
    )
    assert link.is_symlink() and precious.read_text() == "keep me\n"


def test_a_stale_relay_socket_is_replaced(tmp_path):
    path = tmp_path / "relay.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    dead.bind(str(path))
    dead.close()  # bound, never listening: connecting is refused
    d = RelayDaemon(path)
    d.start()
    try:
        live = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        live.connect(str(path))  # listening now: the backlog takes it
        live.close()
    finally:
        d.close()


def test_a_socket_path_too_long_for_unix_sockets_says_so(tmp_path):
    long_path = tmp_path / ("d" * 60) / ("s" * 60)
    line = one_line(CliRunner().invoke(main, ["relay", "--socket", str(long_path)]))
    assert "a unix socket path holds at most 107: choose a shorter path" in line
    assert "None" not in line
    line = one_line(CliRunner().invoke(main, ["relay", "--socket", str(long_path), "status"]))
    assert "at most 107" in line and "None" not in line


def test_the_agents_hook_socket_too_long_says_so(tmp_path):
    long_path = tmp_path / ("d" * 60) / ("s" * 60)
    with pytest.raises(ConfigError, match="holds at most 107: choose a shorter path"):
        SocketPlace(long_path).bind(1)
    assert not long_path.parent.exists()  # refused before anything was made


def _path_of_length(directory, size):
    """A socket path of exactly ``size`` bytes under ``directory`` (its parent created)."""
    parent = directory / "p"
    name_len = size - len(os.fsencode(parent)) - 1
    assert name_len > 8, "the temporary directory is too long for this test"
    parent.mkdir()
    path = parent / ("s" * name_len)
    assert len(os.fsencode(path)) == size
    return path


@pytest.mark.parametrize("size", [100, 107])
def test_a_socket_path_that_fits_is_not_refused_for_its_temporary_name(tmp_path, size):
    # The listener is bound under a temporary name beside its path first; a path within
    # 14 bytes of the limit must not be refused for that name's length.
    path = _path_of_length(tmp_path, size)
    d = RelayDaemon(path)
    d.start()
    try:
        live = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        live.connect(str(path))  # listening at its path: the backlog takes it
        live.close()
    finally:
        d.close()
    path.unlink(missing_ok=True)
    place = SocketPlace(path)
    listener = place.bind(1)
    try:
        assert stat.S_ISSOCK(path.lstat().st_mode)
        assert sorted(p.name for p in path.parent.iterdir() if p.is_socket()) == [path.name]
    finally:
        listener.close()
        place.release()


def test_the_relay_socket_is_born_owner_only(tmp_path):
    d = RelayDaemon(tmp_path / "relay.sock")
    old = os.umask(0)  # whatever the caller's umask: the socket is 0600
    try:
        d.start()
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE((tmp_path / "relay.sock").lstat().st_mode) == 0o600
    finally:
        d.close()
