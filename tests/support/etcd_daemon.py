"""A private, real etcd for tests, and the pytest fixtures around it.

etcd (Debian's etcd-server) runs on free loopback ports with a temporary data dir and the
fast election flags (--heartbeat-interval 10 --election-timeout 100), is healthy in ~0.1 s,
and is stopped by PID. Every test
gets its own cluster name, so its keys live under their own prefix ``/vmlend/<name>/``.

Register with ``pytest_plugins = ["tests.support.etcd_daemon"]``. Fixtures:
  etcd          session: the running EtcdServer
  etcd_url      a registry URL ``etcd://127.0.0.1:PORT/<unique cluster>`` for one test
  private_etcd  an EtcdServer of the test's own (for tests that stop and restart it)
``start_members(root, n)`` starts an n-member cluster (e.g. to take its quorum away).
Outside CI a machine without etcd skips these tests; in CI (``$CI`` set) that is a failure.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.needs import need

#: The kernel tier's guest runs under TCG on a shared machine: there etcd once took more than
#: 15 s to answer its first health check while the machine's load was 22 on 2 cores.
START_TIMEOUT = 120.0 if os.environ.get("VMLEND_KERNEL_GUEST") else 15.0
STOP_TIMEOUT = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@dataclass
class EtcdServer:
    """One etcd member under ``root``; ``start()`` / ``stop()`` by PID, restartable."""

    root: Path
    client_port: int = field(default_factory=free_port)
    peer_port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    name: str = "default"
    #: ``--initial-cluster`` of a multi-member cluster (None: this member alone).
    initial_cluster: str | None = None
    #: More flags, e.g. ``("--auth-token-ttl=1",)``.
    extra_args: tuple[str, ...] = ()

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def url(self, cluster: str) -> str:
        return f"etcd://{self.endpoint}/{cluster}"

    def start(self) -> None:
        # A lone member's first start: nobody knows its ports yet, so a port another process
        # bound between ``free_port`` and etcd's own bind is given up for fresh ones (CI met
        # it: "bind: address already in use"). A restart keeps its ports: clients have them.
        first = self.proc is None and self.initial_cluster is None
        for attempt in range(3):
            self.spawn()
            try:
                self.wait_healthy()
                return
            except RuntimeError as e:
                if not first or attempt == 2 or "address already in use" not in str(e):
                    raise
            shutil.rmtree(self.root / "data", ignore_errors=True)
            self.client_port, self.peer_port = free_port(), free_port()

    def spawn(self) -> None:
        client = f"http://{self.endpoint}"
        peer = self.peer_url
        self.root.mkdir(parents=True, exist_ok=True)
        log = (self.root / "etcd.log").open("ab")
        argv = [
            "etcd",
            f"--name={self.name}",
            f"--data-dir={self.root / 'data'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster={self.initial_cluster or f'{self.name}={peer}'}",
            "--heartbeat-interval=10",
            "--election-timeout=100",
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()

    def wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited at start: {self.log_tail()}")
            if self.healthy():
                return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"etcd not healthy after {START_TIMEOUT} s: {self.log_tail()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as r:
                return b'"true"' in r.read()
        except OSError:
            return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop our etcd by its PID (SIGKILL after a grace period)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(STOP_TIMEOUT)
        assert not _pid_alive(self.proc.pid) or self.proc.returncode is not None

    def log_tail(self, lines: int = 5) -> str:
        path = self.root / "etcd.log"
        return (
            " | ".join(path.read_text(errors="replace").splitlines()[-lines:])
            if path.exists()
            else ""
        )


def start_members(root: Path, n: int) -> list[EtcdServer]:
    """A cluster of ``n`` members on loopback (healthy: a leader elected); stop each by PID."""
    members = [EtcdServer(root / f"m{i}", name=f"m{i}") for i in range(n)]
    initial = ",".join(f"{m.name}={m.peer_url}" for m in members)
    for m in members:
        m.initial_cluster = initial
        m.spawn()
    try:
        for m in members:
            m.wait_healthy()
    except BaseException:
        for m in members:
            m.stop()
        raise
    return members


def _need_etcd() -> None:
    need(
        shutil.which("etcd") is not None,
        "etcd is not installed (make sysdeps installs etcd-server)",
    )


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    _need_etcd()
    server = EtcdServer(tmp_path_factory.mktemp("etcd"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def cluster_name(request: pytest.FixtureRequest) -> str:
    """A cluster name (key prefix) of this test alone."""
    base = re.sub(r"[^A-Za-z0-9_-]", "-", request.node.name)[:40].strip("-") or "t"
    return f"{base}-{secrets.token_hex(3)}"


def host_lease(server: EtcdServer, root: Path, node: str = "test", ttl: int = 600) -> int:
    """Grant a lease and publish it as the agent of the host rooted at ``root`` would (a test
    stand-in for ``vmlend agent``: long enough to need no keepalive)."""
    from vmlend.hostenv import HostEnv
    from vmlend.registry import hostlease

    body = json.dumps({"TTL": ttl, "ID": 0}).encode()
    req = urllib.request.Request(f"http://{server.endpoint}/v3/lease/grant", data=body)
    with urllib.request.urlopen(req, timeout=5) as r:
        lease = int(json.loads(r.read())["ID"])
    lease_file = hostlease.lease_path(HostEnv(root))
    hostlease.publish(lease_file, hostlease.HostLease(lease, node, ttl, os.getpid()))
    return lease


@pytest.fixture
def etcd_url(etcd: EtcdServer, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch) -> str:
    """A cluster of this test alone, and a host root (``$VMLEND_ROOT``) whose agent lease is
    published, so the test's processes may create holds."""
    root = tmp_path / "etcd-host"
    host_lease(etcd, root)
    monkeypatch.setenv("VMLEND_ROOT", str(root))
    return etcd.url(cluster_name(request))


@pytest.fixture
def private_etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    _need_etcd()
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def etcd_requests(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The path of every request an etcd gateway sends from now on."""
    from vmlend.registry.etcd_gateway import EtcdGateway

    sent: list[str] = []
    real_call = EtcdGateway.call

    def counting(self: EtcdGateway, path: str, body: dict) -> dict:
        sent.append(path)
        return real_call(self, path, body)

    monkeypatch.setattr(EtcdGateway, "call", counting)
    return sent
