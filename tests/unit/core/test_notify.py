"""sd_notify without libsystemd: datagrams to $NOTIFY_SOCKET (a path or the abstract
namespace), the watchdog only when asked for this very process and at most four per period,
and nothing at all (no error) outside systemd."""

from __future__ import annotations

import os
import socket

from vmlend.notify import Notifier


def _listener(address):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(address)
    s.settimeout(2)
    return s


def test_ready_status_and_stopping_reach_a_path_socket(tmp_path):
    with _listener(str(tmp_path / "n")) as s:
        n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "n")})
        assert n.ready("serving")
        assert s.recv(4096).decode() == f"READY=1\nSTATUS=serving\nMAINPID={os.getpid()}\n"
        assert n.stopping("bye")
        assert s.recv(4096) == b"STOPPING=1\nSTATUS=bye\n"


def test_the_abstract_namespace(tmp_path):
    name = f"vmlend-test-{os.getpid()}"
    with _listener(b"\0" + name.encode()) as s:
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).status("x")
        assert s.recv(4096) == b"STATUS=x\n"


def test_outside_systemd_or_with_the_manager_gone_nothing_fails(tmp_path):
    assert not Notifier({}).ready("x")
    gone = Notifier({"NOTIFY_SOCKET": str(tmp_path / "nobody")})
    assert not gone.ready("x") and not gone.status("y")  # logged once, never raised


def test_the_watchdog_is_fed_only_when_asked_and_not_more_than_four_times_a_period(tmp_path):
    now = [0.0]
    env = {"NOTIFY_SOCKET": str(tmp_path / "n"), "WATCHDOG_USEC": "2000000"}
    with _listener(str(tmp_path / "n")):
        n = Notifier(env, clock=lambda: now[0])
        assert n.watchdog_seconds == 2.0
        sent = []
        for _ in range(40):  # 4 s of a loop turning every 0.1 s
            sent.append(n.watchdog())
            now[0] += 0.1
        assert sum(sent) == 8  # one per 0.5 s: a quarter of the period
    assert not Notifier({"NOTIFY_SOCKET": str(tmp_path / "n")}).watchdog()  # not asked
    other_pid = {**env, "WATCHDOG_PID": str(os.getpid() + 1)}
    assert Notifier(other_pid).watchdog_seconds is None  # asked of another process
