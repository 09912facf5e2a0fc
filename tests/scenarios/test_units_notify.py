"""The shipped systemd units, as installed: systemd-analyze accepts them, installing again
changes nothing, and the agent's ExecStart, run under a NOTIFY_SOCKET this test owns (systemd
is not PID 1 here), says READY=1 only once it serves the hook (and, on etcd, holds its lease),
feeds the watchdog, and says STOPPING=1 on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from tests.support.cluster_hosts import Host
from tests.support.simfabric import make_fabric
from tests.support.systemd import WAIT, NotifySocket, exec_start, verify_units
from vmlend import systemd_units


def _install(cluster, directory: Path, *extra: str) -> dict:
    r = cluster.cli("units", "install", "--dir", str(directory), "--json", *extra)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_the_units_install_verify_and_install_again_unchanged(cluster, tmp_path):
    first = _install(cluster, tmp_path)["units"]
    assert {u["name"] for u in first} == {
        "vmlend-agent.service",
        "vmlend-relay.service",
        "vmlend-mdev-watch.service",
    }
    assert {u["action"] for u in first} == {"installed"}
    verify_units(*sorted(tmp_path.glob("*.service")))
    assert {u["action"] for u in _install(cluster, tmp_path)["units"]} == {"unchanged"}
    agent = (tmp_path / "vmlend-agent.service").read_text()
    assert "Type=notify" in agent and "WatchdogSec=" in agent
    assert exec_start(tmp_path / "vmlend-agent.service")[0] == systemd_units.vmlend_command()[0]


def _serves(sock_path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(sock_path))
        except OSError:
            return False
    return True


def _run_unit(
    cluster, tmp_path: Path, env: dict[str, str]
) -> tuple[subprocess.Popen, NotifySocket, Path]:
    """The agent unit's ExecStart, as installed, under this test's notify socket."""
    _install(cluster, tmp_path / "units")
    notify = NotifySocket(tmp_path / "notify")
    log = tmp_path / "agent.log"
    env = {**env, "NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "400000"}
    with log.open("ab") as out:
        proc = subprocess.Popen(
            exec_start(tmp_path / "units" / "vmlend-agent.service"),
            env=env,
            stdout=out,
            stderr=out,
            stdin=subprocess.DEVNULL,
        )
    return proc, notify, log


def _stop(proc: subprocess.Popen, notify: NotifySocket, log: Path) -> None:
    """SIGTERM by PID: STOPPING=1 first, then a clean exit."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        notify.wait_for("STOPPING", proc, log)
    assert proc.wait(WAIT) == 0, log.read_text()


@pytest.mark.daemon
def test_on_sqlite_the_agent_is_ready_once_the_hook_is_served(cluster, tmp_path):
    root = tmp_path / "root"
    journal = NotifySocket(tmp_path / "journal")  # a datagram socket as journald's
    env = {
        **os.environ,
        "VMLEND_ROOT": str(root),
        "VMLEND_STATE": str(cluster.state_path),
        "VMLEND_LOG_SOCKET": str(journal.path),
    }
    proc, notify, log = _run_unit(cluster, tmp_path, env)
    try:
        ready = notify.wait_for("READY", proc, log)
        assert ready["READY"] == "1" and ready["MAINPID"] == str(proc.pid)
        assert _serves(root / "run" / "vmlend" / "hook.sock")
        assert notify.wait_for("WATCHDOG", proc, log)["WATCHDOG"] == "1"
        # its log lines reach the system log too, as journald entries of vmlend-agent
        entry = journal.wait_for("MESSAGE", proc, log)
        assert entry["SYSLOG_IDENTIFIER"] == "vmlend-agent" and "SQLite" in entry["MESSAGE"]
    finally:
        _stop(proc, notify, log)


@pytest.mark.slow
def test_on_etcd_ready_means_the_lease_is_held_and_the_hook_served(private_etcd, cluster, tmp_path):
    url = private_etcd.url("units")
    make_fabric(url).close()
    host = Host(url, "gamma", tmp_path / "gamma")
    proc, notify, log = _run_unit(cluster, tmp_path, host.env)
    try:
        ready = notify.wait_for("READY", proc, log)
        assert "lease" in ready["STATUS"]
        assert json.loads(host.lease_file.read_text())["pid"] == proc.pid
        assert _serves(host.root / "run" / "vmlend" / "hook.sock")
        notify.wait_for("WATCHDOG", proc, log)
    finally:
        _stop(proc, notify, log)
