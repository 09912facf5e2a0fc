"""The host's ``vmlend agent`` serves the libvirt hook (``vmlend.hook.forward`` in the hook
process, ``vmlend.hook.server`` in the agent): the same results as in-process, a lean hook
process, and the fallback rules (docs/hooks.md, "The agent serves the hook").

Real processes throughout: the installed hook script as libvirtd runs it, ``vmlend agent`` as a
daemon on a unix socket, stopped by its PID. Who did the work is read from the action log: each
line names the pid of the process that wrote it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support.hostroot import identify
from tests.support.libvirt_daemon import socket_accepts
from tests.support.modtrace import run_script
from tests.support.simfabric import make_fabric
from vmlend.agent.identity import HostLock
from vmlend.doctor import Status, check_hook_served
from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, new_domain
from vmlend.hook import wire
from vmlend.hook.forward import (
    SOCKET_UNDER_ROOT,
    START_GRACE,
    forward,
    pinned_environment,
    socket_path,
)
from vmlend.hook.install import install_hook
from vmlend.hook.probe import probe_agent
from vmlend.hook.server import HookServer, identity_of
from vmlend.hostenv import HostEnv
from vmlend.registry import hostlease, parse_location
from vmlend.registry.etcd_gateway import EtcdGateway
from vmlend.registry.etcd_keys import Keys
from vmlend.topology.model import Holder, MiB
from vmlend.wiring.fabric import open_fabric

#: Nearly every case starts a real agent process and stops, freezes or kills it.
pytestmark = pytest.mark.daemon

VMLEND = str(Path(sys.executable).parent / "vmlend")
FDIDS = (0x10, 0x12, 0x21, 0x22)
NOBODY = 65534
VM_UUID = uuid.UUID("6f1c5a2e-0000-4000-8000-00000000000a")
#: What the hook process must not load when the agent does the work.
HEAVY = (
    "vmlend.fabric",
    "vmlend.sim",
    "vmlend.kernel",
    "vmlend.registry",
    "vmlend.domain",
    "lxml",
    "sqlite3",
    "libvirt",
)


def vm_xml(
    name: str = "vm1", fdids: tuple[int, ...] = FDIDS, vm_uuid: uuid.UUID = VM_UUID
) -> bytes:
    spec = DomainSpec(
        name=name,
        memory_bytes=512 * MiB,
        uuid=vm_uuid,
        devices=[DeviceRequest(f) for f in fdids],
    )
    return new_domain(spec, templates=TemplateSet()).to_bytes()


class Host:
    """One host: a root (its run/vmlend/hook.sock), an SQLite state or a registry URL, the
    installed hook, and maybe its agent."""

    def __init__(self, base: Path, registry: str | None = None, node: str = "gamma") -> None:
        self.base, self.node, self.registry = base, node, registry
        self.root = base / "root"
        self.state = self.root / "state.db"  # what the hook's file pins lies under its root
        self.root.mkdir(parents=True, exist_ok=True)
        identify(self.root)
        self.socket = hostlease.hook_socket_path(HostEnv(self.root))
        self.hook = install_hook(
            base / "libvirt",
            self.state,
            node,
            registry=registry,
            hook_socket=self.socket,
            root=self.root,
        ).path
        self.agent: subprocess.Popen[bytes] | None = None

    @property
    def env(self) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("VMLEND_") or k == "VMLEND_CONFIG"  # never the machine's
        }
        env |= {"VMLEND_STATE": str(self.state), "VMLEND_NODE": self.node}
        env["VMLEND_ROOT"] = str(self.root)
        # The simulator chosen: libvirtd's hook refuses a VM on simulated devices when no
        # SmartIO driver makes them real and nobody chose it (vmlend.hook.simulated).
        env["VMLEND_BACKEND"] = "sim"
        if self.registry:
            env["VMLEND_REGISTRY"] = self.registry
        return env

    def start_agent(
        self, *extra: str, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> int:
        log = (self.base / "agent.log").open("ab")
        self.agent = subprocess.Popen(
            [VMLEND, "agent", *extra],
            env=env or self.env,
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            cwd=cwd or self.base,
        )
        log.close()
        deadline = time.monotonic() + 30
        while not self.serving():
            assert self.agent.poll() is None, self.agent_log()
            assert time.monotonic() < deadline, f"the agent never served: {self.agent_log()}"
            time.sleep(0.05)
        return self.agent.pid

    def serving(self) -> bool:
        return socket_accepts(self.socket)

    def stop_agent(self, sig: int = signal.SIGTERM) -> int | None:
        if self.agent is None:
            return None
        if self.agent.poll() is None:
            self.agent.send_signal(signal.SIGCONT)
            self.agent.send_signal(sig)
        return self.agent.wait(30)

    def agent_log(self) -> str:
        return (self.base / "agent.log").read_text(errors="replace")

    def hook_run(
        self, op: str, xml: bytes, name: str = "vm1", **env: str
    ) -> subprocess.CompletedProcess[bytes]:
        sub = {"prepare": "begin", "migrate": "begin", "restore": "begin"}.get(op, "end")
        return subprocess.run(
            [str(self.hook), name, op, sub, "-"],
            input=xml,
            capture_output=True,
            env=self.env | env,
            timeout=120,
        )

    def log_pids(self) -> list[int]:
        """The pid of every action-log line, in order."""
        log = self.state.parent / "hook.log"
        text = log.read_text() if log.exists() else ""
        return [int(m) for m in re.findall(r" pid=(\d+) ", text)]

    def actions(self) -> list[str]:
        path = self.state.parent / "hook.log"
        lines = path.read_text().splitlines() if path.exists() else []
        return [line.split(" ", 3)[3] for line in lines]

    def snapshot(self) -> tuple[dict[int, str], set[tuple[str, int | None]]]:
        """Who holds what, and the mdev records."""
        with open_fabric(self.registry or self.state, self.node) as f:
            holds = {d.fdid: str(d.holder) for d in f.devices() if d.holder}
            return holds, {(m.uuid, m.fdid) for m in f.mdevs()}


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[dict[str, Host]]:
    """Two SQLite hosts with the same fabric: "served" (its agent does the work) and "local"
    (no agent: in-process, the reference)."""
    made = {}
    for name in ("served", "local"):
        host = Host(tmp_path / name)
        make_fabric(host.state).close()
        made[name] = host
    yield made
    for host in made.values():
        host.stop_agent(signal.SIGKILL)


def run_entry(env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess[bytes]:
    """The hook's entry (``hooks/vmlend-qemu``'s body) preparing vm1 with exactly ``env``: for
    the environments the installed script, which pins them, cannot produce."""
    code = "import sys; from vmlend.hook.entry import main; sys.exit(main())"
    return subprocess.run(
        [sys.executable, "-c", code, "vm1", "prepare", "begin", "-"],
        input=vm_xml(),
        capture_output=True,
        env=env,
        cwd=cwd,
        timeout=120,
    )


def _one_line(stderr: bytes) -> str:
    lines = stderr.decode().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


# --- served: the same results as in-process ------------------------------------------------
def test_prepare_and_release_served_by_the_agent_match_in_process(hosts):
    served, local = hosts["served"], hosts["local"]
    agent = served.start_agent()
    xml = vm_xml()
    flags = served.hook.read_text().splitlines()[0].split()[1:]
    for op in ("prepare", "release"):
        sub = "begin" if op == "prepare" else "end"
        traced = run_script(served.hook, ["vm1", op, sub, "-"], xml, served.env, flags)
        reference = local.hook_run(op, xml)
        assert (traced.code, traced.stdout, traced.stderr) == (0, b"", [])
        assert (reference.returncode, reference.stdout, reference.stderr) == (0, b"", b"")
        # The hook process forwarded: none of what the work needs was imported there.
        assert traced.within(*HEAVY) == set(), op
        assert {"vmlend.hook.forward", "vmlend.hook.wire"} <= traced.modules
        assert "socket" not in traced.modules  # the C module only: no enum, no selectors
        # nor the configuration file's parser: the agent applied the file (issue 38, point 6)
        assert traced.within("tomllib", "vmlend.config") == set(), op
        assert served.snapshot() == local.snapshot()
        if op == "prepare":
            holds, mdevs = served.snapshot()
            assert holds == dict.fromkeys(FDIDS, "gamma/vm1") and len(mdevs) == len(FDIDS)
    assert served.snapshot() == ({}, set())
    assert set(served.log_pids()) == {agent}  # the agent did all of it
    assert served.actions() == local.actions()


def test_the_simulated_hypervisors_hook_is_served_by_the_agent_too(hosts, tmp_path):
    """``-c sim:///gamma vm start`` runs ``python -m vmlend.hook``, which runs the installed
    hook's entry: with an agent serving this host, the agent does the prepare and release
    (every action-log line carries its pid), as for a real libvirtd."""
    served = hosts["served"]
    agent = served.start_agent()
    xml = tmp_path / "vm1.xml"
    xml.write_bytes(vm_xml(fdids=(0x10,)))

    def cli(*args: str) -> subprocess.CompletedProcess[bytes]:
        cmd = [VMLEND, "-c", "sim:///gamma", *args]
        return subprocess.run(cmd, env=served.env, capture_output=True, timeout=120)

    for args in (("vm", "define", str(xml)), ("vm", "start", "vm1"), ("vm", "destroy", "vm1")):
        done = cli(*args)
        assert done.returncode == 0, done.stderr
    pids = served.log_pids()
    assert pids and set(pids) == {agent}
    assert served.snapshot() == ({}, set())


@pytest.mark.parametrize("op", ["migrate", "restore"])
def test_migrate_and_restore_return_the_same_rewritten_xml(hosts, op):
    served, local = hosts["served"], hosts["local"]
    served.start_agent()
    xml = vm_xml()
    got, reference = served.hook_run(op, xml), local.hook_run(op, xml)
    assert (got.returncode, got.stderr) == (0, b"") and reference.returncode == 0
    assert got.stdout == reference.stdout and b"vmlend" in got.stdout


def test_a_refused_prepare_comes_back_as_exit_1_and_the_same_line(hosts):
    served, local = hosts["served"], hosts["local"]
    served.start_agent()
    other = Holder("gamma", "db", "22222222-2222-2222-2222-222222222222")
    for host in (served, local):
        with open_fabric(host.state, "gamma") as f:
            f.reserve(0x21, other)
    got, reference = served.hook_run("prepare", vm_xml()), local.hook_run("prepare", vm_xml())
    assert got.returncode == reference.returncode == 1
    line = _one_line(got.stderr)
    assert line == _one_line(reference.stderr) and "0x21" in line
    assert served.snapshot() == local.snapshot()
    assert served.snapshot()[0] == {0x21: str(other)}  # all or nothing


# --- not served: in-process, same results ---------------------------------------------------
def test_without_an_agent_the_hook_works_in_process(hosts):
    served = hosts["served"]
    assert not served.socket.exists()
    for op in ("prepare", "release"):
        res = served.hook_run(op, vm_xml())
        assert (res.returncode, res.stderr) == (0, b"")
    assert served.snapshot() == ({}, set()) and len(set(served.log_pids())) == 2


def test_a_stale_socket_means_in_process_and_a_new_agent_replaces_it(hosts):
    served = hosts["served"]
    served.start_agent()
    served.stop_agent(signal.SIGKILL)
    assert served.socket.exists() and not served.serving()  # what a killed agent leaves
    res = served.hook_run("prepare", vm_xml())
    assert (res.returncode, res.stderr) == (0, b"")
    assert served.snapshot()[0] == dict.fromkeys(FDIDS, "gamma/vm1")
    agent = served.start_agent()  # replaces the stale file
    res = served.hook_run("release", vm_xml())
    assert (res.returncode, res.stderr) == (0, b"")
    assert served.snapshot() == ({}, set())
    assert served.log_pids()[-1] == agent
    assert served.stop_agent() == 0 and not served.socket.exists()  # a clean stop removes it


def test_an_agent_of_another_node_or_state_does_nothing(hosts, tmp_path):
    served, local = hosts["served"], hosts["local"]
    served.start_agent(env=served.env | {"VMLEND_NODE": "alpha"})
    res = served.hook_run("prepare", vm_xml())
    assert (res.returncode, res.stderr) == (0, b"")
    assert served.agent is not None and served.agent.pid not in served.log_pids()
    served.stop_agent()
    # An agent of another state file on this socket: the same.
    served.start_agent(env=served.env | {"VMLEND_STATE": str(local.state)})
    res = served.hook_run("release", vm_xml())
    assert (res.returncode, res.stderr) == (0, b"")
    assert served.agent.pid not in served.log_pids()
    assert served.snapshot() == ({}, set()) and local.snapshot() == ({}, set())


# --- the agent dies or stalls once it has the request ---------------------------------------
def test_agent_killed_during_a_served_prepare_then_release_cleans_up(hosts):
    served = hosts["served"]
    fault = {"VMLEND_FAULT": "prepare:after-device"}  # the agent kills itself there
    served.start_agent(env=served.env | fault)
    res = served.hook_run("prepare", vm_xml(), **fault)
    assert res.returncode == 1
    line = _one_line(res.stderr)
    assert "ended the connection before answering" in line and "reconcile --fix" in line
    assert served.agent is not None and served.agent.wait(30) == -signal.SIGKILL
    assert served.snapshot()[0] == {FDIDS[0]: "gamma/vm1"}  # half done, as the line says
    # libvirt runs release after a failed prepare; the agent is gone: in-process.
    res = served.hook_run("release", vm_xml())
    assert (res.returncode, res.stderr) == (0, b"")
    assert served.snapshot() == ({}, set())
    out = subprocess.run(
        [VMLEND, "reconcile", "-c", "sim:///gamma", "--json"],
        env=served.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["drift"] == []


def _barrier(host: Host) -> None:
    """A served call that changes nothing (a release of a VM holding nothing): once it is
    answered, the agent's worker has run everything queued before it."""
    other = vm_xml("barrier", fdids=(0x10,), vm_uuid=uuid.UUID(int=1))
    res = host.hook_run("release", other, name="barrier")
    assert (res.returncode, res.stderr) == (0, b"")


def test_a_stopped_agent_times_the_hook_out_then_skips_only_what_libvirt_aborted(hosts):
    served = hosts["served"]
    agent = served.start_agent()
    assert served.agent is not None
    res = served.hook_run("prepare", vm_xml())
    assert (res.returncode, res.stderr) == (0, b"")
    served.agent.send_signal(signal.SIGSTOP)
    try:
        for op in ("release", "prepare", "migrate"):
            res = served.hook_run(op, vm_xml(), VMLEND_HOOK_TIMEOUT="1")
            assert res.returncode == 1, op
            assert "gave no answer within 1 s" in _one_line(res.stderr)
        assert served.snapshot()[0] == dict.fromkeys(FDIDS, "gamma/vm1")  # nothing yet
    finally:
        served.agent.send_signal(signal.SIGCONT)
    _barrier(served)
    # The release still ran (idempotent, and libvirt relies on it); the prepare and the
    # migrate, whose hooks had failed so libvirt aborted them, did nothing.
    assert served.snapshot() == ({}, set())
    actions = [a for a in served.actions() if not a.startswith("release: nothing")]
    skipped = [a for a in actions if "SKIPPED" in a]
    assert [a.split(":")[0] for a in skipped] == ["prepare begin", "migrate begin"]
    assert "rewrote XML" not in " ".join(actions)
    assert sum(a.startswith("prepare: reserve") for a in actions) == len(FDIDS)  # the first
    assert set(served.log_pids()) == {agent}
    log = served.agent_log()
    assert "skipped hook call prepare begin of vm1" in log
    assert "skipped hook call migrate begin of vm1" in log


def _host_and_hook_env(tmp_path: Path) -> tuple[Host, dict[str, str]]:
    """A host with a fresh SQLite state, and the environment its installed hook forwards
    (pinned to its state, root, node and socket), for a HookServer run in this process."""
    host = Host(tmp_path / "h")
    make_fabric(host.state).close()
    env = {
        "VMLEND_STATE": str(host.state),
        "VMLEND_ROOT": str(host.root),
        "VMLEND_NODE": "gamma",
        "VMLEND_HOOK_SOCKET": str(host.socket),
        "VMLEND_HOOK_TIMEOUT": "30",
    }
    return host, env


def test_a_timed_out_release_runs_before_the_next_prepare_read_whole_first(tmp_path):
    """vm1 runs; its release hook timed out (its request was still arriving) and libvirt's
    next start sent the prepare whole. The worker ran calls in the order their readers
    finished, so the prepare ran first and the release then took the started VM's devices
    (met as the stopped agent's test failing on a busy machine). Calls now run in the order
    their connections were accepted."""
    host, env = _host_and_hook_env(tmp_path)
    server = HookServer(host.socket, identity_of(env), read_timeout=30)
    server.start()
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    got: list[int | None] = []
    second = threading.Thread(
        target=lambda: got.append(forward(["vm1", "prepare", "begin", "-"], vm_xml(), env))
    )
    try:
        assert forward(["vm1", "prepare", "begin", "-"], vm_xml(), env) == 0
        release = wire.encode_request(["vm1", "release", "end", "-"], env, vm_xml())
        peer.connect(str(host.socket))
        peer.sendall(release[:10])  # the release's reader is waiting for the rest
        _wait_queued(host.socket, 0)
        second.start()
        _wait_queued(host.socket, 0)
        time.sleep(0.5)  # the prepare's reader has read it whole meanwhile
        peer.sendall(release[10:])
        peer.close()  # and its hook is gone (it timed out): a release still runs
        second.join(60)
    finally:
        peer.close()
        server.stop()
    assert got == [0] and server.served == 3
    assert host.snapshot()[0] == dict.fromkeys(FDIDS, "gamma/vm1")  # the VM keeps its devices
    ops = [a.split(":")[0] for a in host.actions()]
    runs = [op for i, op in enumerate(ops) if i == 0 or ops[i - 1] != op]
    assert runs == ["prepare", "release", "prepare"], host.actions()


def _wait_queued(path: Path, count: int) -> None:
    """Wait until exactly ``count`` connections to the socket ``path`` wait in its listen
    backlog. ``/proc/net/unix`` lists them with the listener's bound address (the agent binds
    under a temporary name in the same directory, then renames it) and state 02."""
    deadline = time.monotonic() + 30
    while True:
        lines = Path("/proc/net/unix").read_text().splitlines()
        queued = sum(ln.split()[5] == "02" and f" {path.parent}/" in ln for ln in lines)
        if queued == count:
            return
        assert time.monotonic() < deadline, f"{queued} connection(s) queued, not {count}"
        time.sleep(0.02)


def test_a_request_the_agent_cannot_judge_is_answered_not_mine(hosts):
    # Deciding "mine or not" may fail in ways no VmlendError covers (here a root the file
    # system refuses: an embedded NUL, which only a raw request can carry). The whole request
    # was read, so the agent owes an answer: "not mine", and the hook runs the call itself,
    # instead of a dropped connection that fails the VM's start "maybe half done".
    served = hosts["served"]
    served.start_agent()
    env = {"VMLEND_STATE": str(served.state), "VMLEND_ROOT": "/tmp/bad\x00root"}
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        peer.settimeout(30)
        peer.connect(str(served.socket))
        peer.sendall(wire.encode_request(["vm1", "prepare", "begin", "-"], env, vm_xml()))
        kind, *_rest = wire.decode_answer(wire.Reader(peer.recv))
    finally:
        peer.close()
    assert kind == wire.NOT_MINE
    assert served.snapshot() == ({}, set())  # nothing was done
    assert served.serving()


def _trickle(path: Path, seconds: float) -> socket.socket:
    """A peer that connects and sends a request's first bytes one at a time, every 0.3 s."""
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    peer.connect(str(path))
    frame = wire.encode_request(["vm9", "release", "end", "-"], {}, b"<domain/>")

    def send() -> None:
        for i in range(int(seconds / 0.3)):
            try:
                peer.send(frame[i : i + 1])
            except OSError:  # the agent dropped it
                return
            time.sleep(0.3)

    threading.Thread(target=send, daemon=True).start()
    return peer


def test_a_trickling_peer_does_not_hold_the_hooks_behind_it(hosts):
    served = hosts["served"]
    agent = served.start_agent(env=served.env | {"VMLEND_AGENT_READ_TIMEOUT": "1"})
    peer = _trickle(served.socket, 8.0)
    try:
        _wait_queued(served.socket, 0)  # the acceptor took the trickling peer first
        res = served.hook_run("prepare", vm_xml(), VMLEND_HOOK_TIMEOUT="4")
        assert (res.returncode, res.stderr) == (0, b"")
        assert set(served.log_pids()) == {agent}
        deadline = time.monotonic() + 10  # its own reader drops it at its deadline
        while "dropped an incomplete request: no whole request within 1 s" not in (
            served.agent_log()
        ):
            assert time.monotonic() < deadline, served.agent_log()
            time.sleep(0.1)
    finally:
        peer.close()


def test_idle_connections_cost_the_hook_behind_them_one_deadline(hosts):
    """A privileged local process opens 30 idle connections ahead of a hook. The acceptor read
    one peer at a time, so each cost the hook its 1 s deadline (30 s); now each peer is read
    on a reader of its own, the deadlines run side by side, and the hook waits for one."""
    served = hosts["served"]
    agent = served.start_agent()  # the default deadline, as on a real host
    idle = []
    try:
        for _ in range(30):
            peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            peer.connect(str(served.socket))
            idle.append(peer)
        # Served within the hook's own timeout: read one at a time, the 30 deadlines (30 s)
        # would pass it; side by side they cost about one. A bound, not a measured time, so
        # a loaded machine's slow scheduling does not fail it.
        res = served.hook_run("prepare", vm_xml(), VMLEND_HOOK_TIMEOUT="15")
        assert (res.returncode, res.stderr) == (0, b"")
        assert set(served.log_pids()) == {agent}  # the agent ran it, not the hook itself
        deadline = time.monotonic() + 10
        while served.agent_log().count("no whole request within 1 s") < 30:
            assert time.monotonic() < deadline, served.agent_log()
            time.sleep(0.1)
    finally:
        for peer in idle:
            peer.close()


def _idle_peers(path: Path, n: int) -> list[socket.socket]:
    """Up to ``n`` connections that send nothing (a connect the full backlog refuses is
    left out: non-blocking, so the test itself never waits on it)."""
    peers = []
    for _ in range(n):
        peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        peer.setblocking(False)
        try:
            peer.connect(str(path))
        except BlockingIOError:
            peer.close()
            continue
        peers.append(peer)
    return peers


def test_seventy_idle_peers_never_make_the_hook_run_beside_a_live_agent(etcd_url, tmp_path):
    """70 idle connections filled the agent's listen backlog (64), the hook's connect failed
    and the hook ran the prepare in-process beside the live agent: two writers for one host.
    Now the acceptor takes them all at once and the agent serves the hook."""
    make_fabric(etcd_url).close()
    host = Host(tmp_path / "gamma", registry=etcd_url)
    idle: list[socket.socket] = []
    try:
        agent = host.start_agent("--ttl", "10", "--interval", "0.2")
        idle = _idle_peers(host.socket, 70)
        res = host.hook_run("prepare", vm_xml(fdids=(0x10,)), VMLEND_HOOK_TIMEOUT="20")
        assert (res.returncode, res.stderr) == (0, b"")
        assert set(host.log_pids()) == {agent}  # never in-process
    finally:
        for peer in idle:
            peer.close()
        host.stop_agent()


@pytest.mark.parametrize("on", ["etcd", "sqlite"])
def test_a_live_agent_whose_socket_is_gone_fails_the_hook_in_one_line(on, request, tmp_path):
    """The agent lives (it holds the host's agent lock) but its socket is gone: the hook used
    to run the call in-process beside it. Now it waits (bounded by its timeout) for the socket,
    then fails the operation with one line, nothing done. On SQLite too: the agent that only
    serves the hook holds the lock as well."""
    registry = request.getfixturevalue("etcd_url") if on == "etcd" else None
    host = Host(tmp_path / "gamma", registry=registry)
    make_fabric(registry or host.state).close()
    try:
        host.start_agent(*(("--ttl", "10", "--interval", "0.2") if registry else ()))
        host.socket.unlink()  # the agent lives on; nobody can reach it
        res = host.hook_run("prepare", vm_xml(fdids=(0x10,)), VMLEND_HOOK_TIMEOUT="2")
        assert res.returncode == 1
        line = _one_line(res.stderr)
        assert line.startswith("vmlend: this host's vmlend agent runs (it holds ")
        assert "nobody listens on its socket (tried for 2 s; " in line
        assert line.endswith("nothing was done (the hook does not run it beside the agent);"
                             " see the agent's log, then try again")  # fmt: skip
        # With the default answer timeout (60 s) the hook waits for a socket only for its
        # start-up grace: an agent starting up lists the domains, and libvirt holds this VM
        # while its hook runs, so a longer wait would hold up both (the nemesis found it).
        res = host.hook_run("prepare", vm_xml(fdids=(0x10,)))
        assert res.returncode == 1
        assert f"(tried for {START_GRACE:g} s; an agent starting up" in _one_line(res.stderr)
        assert host.snapshot() == ({}, set()) and host.log_pids() == []  # nothing done
    finally:
        host.stop_agent()
    # the agent gone (its lock with it), the hook runs in-process, as without an agent
    res = host.hook_run("prepare", vm_xml(fdids=(0x10,)), VMLEND_HOOK_TIMEOUT="2")
    assert (res.returncode, res.stderr) == (0, b"")
    assert host.snapshot()[0] == {0x10: "gamma/vm1"}


def _start_hook(host: Host, name: str, op: str, xml: bytes) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [str(host.hook), name, op, "end", "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=host.env | {"VMLEND_HOOK_TIMEOUT": "30"},
    )
    assert proc.stdin is not None
    proc.stdin.write(xml)
    proc.stdin.close()
    return proc


def test_a_clean_stop_runs_every_call_it_had_taken(hosts):
    """SIGTERM while three release hooks wait on the agent (its worker is held up by another
    process's lock on the state): the stop removes the socket, then runs every call it had
    taken (their hooks may not fall back) before it exits."""
    served = hosts["served"]
    agent = served.start_agent(env=served.env | {"VMLEND_AGENT_READ_TIMEOUT": "3"})
    assert served.agent is not None
    res = served.hook_run("prepare", vm_xml())
    assert (res.returncode, res.stderr) == (0, b"")
    lock = sqlite3.connect(served.state, isolation_level=None)
    hooks: list[subprocess.Popen[bytes]] = []
    try:
        lock.execute("BEGIN EXCLUSIVE")
        hooks.append(_start_hook(served, "vm1", "release", vm_xml()))
        for n in (2, 3):
            xml = vm_xml(f"vm{n}", vm_uuid=uuid.UUID(int=n))
            hooks.append(_start_hook(served, f"vm{n}", "release", xml))
        time.sleep(2.0)  # started, connected and read: one runs (blocked), two are queued
        served.agent.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while served.socket.exists():  # the stop began: nobody new can connect
            assert time.monotonic() < deadline
            time.sleep(0.05)
        lock.execute("ROLLBACK")
        results = [(h.wait(60), h.stderr.read() if h.stderr else b"") for h in hooks]
    finally:
        lock.close()
        for h in hooks:
            if h.poll() is None:
                h.kill()
                h.wait()
    assert results == [(0, b"")] * 3
    assert served.agent.wait(30) == 0 and not served.socket.exists()
    assert served.snapshot() == ({}, set())
    assert set(served.log_pids()) == {agent}  # served by the stopping agent, not in-process


# --- who may use the agent --------------------------------------------------------------------
@pytest.fixture
def open_host() -> Iterator[Host]:
    """A host under a directory uid 65534 may enter (pytest's tmp_path is root's only)."""
    base = Path(tempfile.mkdtemp(prefix="vmlend-hookserver-"))
    try:
        base.chmod(0o755)
        host = Host(base)
        make_fabric(host.state).close()
        yield host
        host.stop_agent(signal.SIGKILL)
    finally:
        shutil.rmtree(base)


#: ``forward`` as uid 65534: imports first (the venv and Python's own C modules, fcntl for
#: the agent lock, may live where that user cannot enter), then drops to 65534 and forwards a
#: prepare; prints what forward returned.
AS_NOBODY = f"""
import fcntl, os, sys
from vmlend.hook.forward import forward
os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})
env = dict(os.environ)
print(repr(forward(["vm1", "prepare", "begin", "-"], sys.stdin.buffer.read(), env)))
"""


def _as_nobody(host: Host) -> tuple[str, str]:
    """What forward returned as uid 65534, and what it wrote to stderr."""
    out = subprocess.run(
        [sys.executable, "-c", AS_NOBODY],
        input=vm_xml(),
        capture_output=True,
        env=host.env | {"VMLEND_HOOK_SOCKET": str(host.socket)},
        timeout=60,
        cwd="/",
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.decode().strip(), out.stderr.decode()


def test_another_uid_is_never_served_nor_run_beside_the_agent(open_host):
    """A hook of another uid is not served, and while the agent lives (it holds the host's
    agent lock, on SQLite too) it is not run in-process either: one line, nothing done."""
    open_host.start_agent()
    assert (open_host.socket.stat().st_mode & 0o777) == 0o600
    # permission denied on connect
    code, err = _as_nobody(open_host)
    assert code == "1" and "it serves only root and its own uid; nothing was done" in err, err
    # Even through a socket someone made world-writable, the peer's uid is checked.
    open_host.socket.chmod(0o666)
    code, err = _as_nobody(open_host)
    assert code == "1" and "it serves only root and its own uid; nothing was done" in err, err
    assert "refused a call from uid 65534" in open_host.agent_log()
    assert open_host.snapshot() == ({}, set()) and open_host.log_pids() == []


# --- the cluster registry ---------------------------------------------------------------------
def test_an_agent_on_etcd_serves_the_hook_and_the_holds_carry_its_lease(etcd_url, tmp_path):
    make_fabric(etcd_url).close()
    host = Host(tmp_path / "gamma", registry=etcd_url)
    try:
        agent = host.start_agent("--ttl", "2", "--interval", "0.2")
        lease = hostlease.read(hostlease.lease_path(HostEnv(host.root))).lease
        res = host.hook_run("prepare", vm_xml(fdids=(0x10, 0x20)))
        assert (res.returncode, res.stderr) == (0, b"")
        assert set(host.log_pids()) == {agent}
        loc = parse_location(etcd_url)
        keys, gw = Keys(loc.cluster), EtcdGateway(loc.endpoints)
        try:
            for fdid in (0x10, 0x20):
                _rev, kvs = gw.range(keys.hold(fdid))
                assert [kv.lease for kv in kvs] == [lease], hex(fdid)
        finally:
            gw.close()
        res = host.hook_run("release", vm_xml(fdids=(0x10, 0x20)))
        assert (res.returncode, res.stderr) == (0, b"")
        assert host.snapshot() == ({}, set())
    finally:
        host.stop_agent()


# --- the pieces -------------------------------------------------------------------------------
def test_the_hook_and_the_agent_agree_on_the_default_socket(tmp_path):
    env = {"VMLEND_ROOT": str(tmp_path)}
    assert socket_path(env) == str(hostlease.hook_socket_path(HostEnv(tmp_path)))
    assert socket_path({}) == os.path.join("/", *SOCKET_UNDER_ROOT)
    assert socket_path({"VMLEND_HOOK_SOCKET": "/x.sock"}) == "/x.sock"
    pinned = pinned_environment(
        {"VMLEND_STATE": "s", "VMLEND_HOOK_TIMEOUT": "1", "HOME": "/root", "VMLEND_FAULT": "f"}
    )
    assert pinned == {"VMLEND_STATE": "s", "VMLEND_FAULT": "f"}


def test_the_wire_format_round_trips_and_refuses_bad_frames():
    argv = ["vm1", "prepare", "begin", "-", "caf\udce9"]  # not UTF-8 in argv: kept
    env = {"VMLEND_STATE": "/s.db"}
    frame = wire.encode_request(argv, env, b"<domain/>")
    assert wire.decode_request(wire.Reader(io.BytesIO(frame).read)) == (argv, env, b"<domain/>")
    for bad in (frame[:-1], b"HTTP/1.1" + frame[8:], frame[:-8] + b"XXXXXXXX"):
        with pytest.raises(wire.WireError):
            wire.decode_request(wire.Reader(io.BytesIO(bad).read))
    huge = wire.MAGIC + (wire.MAX_STRINGS + 1).to_bytes(4, "big")
    with pytest.raises(wire.WireError, match="over the limit"):
        wire.decode_request(wire.Reader(io.BytesIO(huge).read))
    answer = wire.encode_answer(-2, b"<x/>", "vmlend: no\n")
    assert wire.decode_answer(wire.Reader(io.BytesIO(answer).read)) == (
        wire.RAN,
        -2,
        b"<x/>",
        "vmlend: no\n",
    )
    with pytest.raises(wire.WireError):
        wire.decode_answer(wire.Reader(io.BytesIO(b"?").read))


def test_doctor_says_whether_an_agent_serves_the_installed_hook(hosts):
    served = hosts["served"]
    host = HostEnv(served.root)
    host.libvirt_config.mkdir(parents=True)
    install_hook(
        host.libvirt_config, served.state, "gamma", hook_socket=served.socket, root=served.root
    )
    finding = check_hook_served(host)
    assert finding is not None and finding.status is Status.WARN
    assert "no vmlend agent serves the hook" in finding.detail and "no socket" in finding.detail
    served.start_agent()
    finding = check_hook_served(host)
    assert finding is not None and finding.status is Status.OK
    assert finding.detail == f"by the vmlend agent on {served.socket}"
    served.stop_agent()
    served.start_agent(env=served.env | {"VMLEND_NODE": "alpha"})
    finding = check_hook_served(host)
    assert finding is not None and finding.status is Status.WARN
    assert "serves another registry, node or root" in finding.detail
    assert served.log_pids() == []  # probing touched nothing


def test_a_second_agent_on_the_host_refuses_to_start_and_changes_nothing(hosts):
    served = hosts["served"]
    first = served.start_agent()
    second = subprocess.run(
        [VMLEND, "agent"], env=served.env, capture_output=True, text=True, timeout=60
    )
    assert second.returncode == 1
    assert second.stderr.strip().splitlines()[-1] == (
        f"Error: another vmlend agent serves the hook on {served.socket}; stop it first"
    )
    assert served.serving()
    res = served.hook_run("prepare", vm_xml())
    assert (res.returncode, res.stderr) == (0, b"") and set(served.log_pids()) == {first}


def test_a_relative_state_in_a_request_is_never_the_agents(hosts, tmp_path):
    # "state.db" in the hook's working directory is the agent's state only by accident of
    # where each process runs: the agent must not guess.
    served = hosts["served"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    served.start_agent(env=served.env | {"VMLEND_STATE": "state.db"}, cwd=elsewhere)
    rel = {"VMLEND_STATE": "state.db", "VMLEND_HOOK_SOCKET": str(served.socket)}
    out = run_entry(served.env | rel, cwd=served.state.parent)
    assert (out.returncode, out.stderr) == (0, b"")
    assert served.agent is not None and served.agent.pid not in served.log_pids()
    assert served.snapshot()[0] == dict.fromkeys(FDIDS, "gamma/vm1")  # done, in-process
    assert not (elsewhere / "hook.log").exists()


# --- whom the hook trusts, where the agent serves -------------------------------------------
#: A listener that is not root's: binds argv[1] as uid 65534 and answers any request with a
#: forged domain XML, as a hostile local user could. Prints what it saw.
FORGER = f"""
import os, socket, sys
from vmlend.hook import wire
os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(sys.argv[1]); listener.listen(8); listener.settimeout(60)
print("ready", flush=True)
conn, _ = listener.accept()
conn.settimeout(10)
try:
    wire.decode_request(wire.Reader(conn.recv))
except (OSError, wire.WireError):
    print("no request", flush=True)
    sys.exit(0)
conn.sendall(wire.encode_answer(0, b"<domain>forged</domain>", ""))
print("answered", flush=True)
"""


def test_the_hook_never_trusts_a_listener_of_another_uid(hosts):
    local = hosts["local"]
    base = Path(tempfile.mkdtemp(prefix="vmlend-forger-"))
    forger = None
    try:
        base.chmod(0o755)
        theirs = base / "nobody"
        theirs.mkdir()
        os.chown(theirs, NOBODY, NOBODY)
        sock = theirs / "hook.sock"
        forger = subprocess.Popen(
            [sys.executable, "-c", FORGER, str(sock)],
            stdout=subprocess.PIPE,
            text=True,
            cwd="/",
        )
        assert forger.stdout is not None and forger.stdout.readline() == "ready\n"
        res = local.hook_run("migrate", vm_xml(), VMLEND_HOOK_SOCKET=str(sock))
        assert forger.wait(30) == 0
        assert forger.stdout.read() == "no request\n"  # connected, checked, sent nothing
    finally:
        if forger is not None and forger.poll() is None:
            forger.kill()
            forger.wait()
        shutil.rmtree(base)
    assert (res.returncode, res.stderr) == (0, b"")
    assert b"forged" not in res.stdout and b"vmlend" in res.stdout  # done in-process


@pytest.mark.parametrize(
    "mode", [0o777, 0o1777, 0o775, "owned by 65534"], ids=["777", "1777", "775", "other-owner"]
)
def test_the_agent_refuses_a_socket_directory_others_can_write(hosts, mode):
    served = hosts["served"]
    base = Path(tempfile.mkdtemp(prefix="vmlend-sockdir-"))
    try:
        base.chmod(0o755)
        where = base / "run"
        where.mkdir()
        if mode == "owned by 65534":
            os.chown(where, NOBODY, NOBODY)
            where.chmod(0o755)
        else:
            where.chmod(int(mode))
        out = subprocess.run(
            [VMLEND, "agent", "--hook-socket", str(where / "hook.sock")],
            env=served.env,
            capture_output=True,
            text=True,
            timeout=20,
        )
        assert out.returncode == 1
        line = out.stderr.strip().splitlines()[-1]
        assert line.startswith(f"Error: the hook socket's directory {where} (owner uid ")
        assert line.endswith(
            "is writable by others: make it owned by root or uid 0 and mode 755, or choose"
            " another --hook-socket"
        )
        assert list(where.iterdir()) == []  # nothing created there
    finally:
        shutil.rmtree(base)


def test_the_agent_refuses_a_lock_file_another_user_made(hosts):
    # Whoever owns the lock file could hold its flock and keep every agent out.
    served = hosts["served"]
    sock = served.base / "sock" / "hook.sock"
    sock.parent.mkdir(mode=0o755)
    lock = sock.with_name(".hook.sock.lock")
    lock.touch(mode=0o644)
    os.chown(lock, NOBODY, NOBODY)
    out = subprocess.run(
        [VMLEND, "agent", "--hook-socket", str(sock)],
        env=served.env,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert out.returncode == 1
    line = out.stderr.strip().splitlines()[-1]
    assert line == (
        f"Error: cannot serve the hook on {sock}: {lock} is not a plain file of root or this"
        " user; remove it"
    )
    assert not sock.exists()


def test_the_agent_creates_the_socket_directory_0755(hosts):
    served = hosts["served"]
    served.start_agent()
    assert (served.socket.parent.stat().st_mode & 0o777) == 0o755


def test_a_second_agent_does_not_wait_on_nor_replace_a_busy_socket(tmp_path):
    # A live listener whose backlog is full (an agent overloaded, or stopped with hooks
    # queued) never accepts the probe: the new agent must not hang, nor take the path.
    host = Host(tmp_path / "h")
    make_fabric(host.state).close()
    host.socket.parent.mkdir(parents=True)
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(host.socket))
    live.listen(0)
    queued = []
    try:
        for _ in range(8):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.setblocking(False)
            queued.append(c)
            try:
                c.connect(str(host.socket))
            except BlockingIOError:
                break
        out = subprocess.run(
            [VMLEND, "agent"], env=host.env, capture_output=True, text=True, timeout=20
        )
        assert out.returncode == 1
        assert out.stderr.strip().splitlines()[-1] == (
            f"Error: another vmlend agent serves the hook on {host.socket} but does not answer"
            " (stopped? overloaded?); stop it first"
        )
        assert host.socket.exists()
        assert probe_agent(host.socket, {"VMLEND_STATE": str(host.state)}) == "not accepting"
    finally:
        for c in queued:
            c.close()
        live.close()


def test_of_two_agents_starting_together_exactly_one_serves(hosts):
    served = hosts["served"]
    agents = [
        subprocess.Popen(
            [VMLEND, "agent"],
            env=served.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        deadline = time.monotonic() + 30
        while sum(a.poll() is None for a in agents) > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        running = [a for a in agents if a.poll() is None]
        assert len(running) == 1, [a.returncode for a in agents]
        loser = next(a for a in agents if a.poll() is not None)
        assert loser.returncode == 1 and loser.stderr is not None
        assert loser.stderr.read().strip().splitlines()[-1] == (
            f"Error: another vmlend agent serves the hook on {served.socket}; stop it first"
        )
        res = served.hook_run("prepare", vm_xml())
        assert (res.returncode, res.stderr) == (0, b"")
        assert set(served.log_pids()) == {running[0].pid}
    finally:
        for a in agents:
            if a.poll() is None:
                a.send_signal(signal.SIGKILL)
            a.wait(30)


# --- what the agent does not take -------------------------------------------------------------
def test_a_request_without_state_or_registry_is_never_the_agents(tmp_path):
    # Without VMLEND_STATE the hook's state is a default that depends on its uid, HOME and XDG
    # variables; the agent cannot know those, so it must not guess, even when the guess would
    # name its own state.
    host = Host(tmp_path / "h")
    host.state = HostEnv(host.root).system_state
    host.state.parent.mkdir(parents=True)
    make_fabric(host.state).close()
    env = {k: v for k, v in host.env.items() if k != "VMLEND_STATE"}
    try:
        agent = host.start_agent()
        out = run_entry(env | {"VMLEND_HOOK_SOCKET": str(host.socket)})
    finally:
        host.stop_agent(signal.SIGKILL)
    assert (out.returncode, out.stderr) == (0, b"")
    text = (host.state.parent / "hook.log").read_text()
    pids = {int(m) for m in re.findall(r" pid=(\d+) ", text)}
    assert pids and agent not in pids  # done in-process, on the same default state
    with open_fabric(host.state, "gamma") as f:
        assert {d.fdid for d in f.devices() if d.holder} == set(FDIDS)


def test_a_request_over_the_wire_limits_is_refused_while_the_agent_lives(hosts):
    """Over what the agent takes: refused in one line while the agent lives (never run beside
    it), run in-process once no agent lives."""
    served = hosts["served"]
    served.start_agent()
    padding = b"<!--" + b"x" * (9 * 1024 * 1024) + b"-->"  # over the 8 MiB the agent takes
    big = vm_xml().replace(b"</domain>", padding + b"</domain>")
    res = served.hook_run("prepare", big)
    assert res.returncode == 1
    assert b"the call is over what the agent takes" in res.stderr, res.stderr
    assert served.snapshot() == ({}, set()) and served.log_pids() == []
    served.stop_agent()
    res = served.hook_run("prepare", big)
    assert (res.returncode, res.stderr) == (0, b"")
    assert served.snapshot()[0] == dict.fromkeys(FDIDS, "gamma/vm1")
    assert wire.within_limits(["vm1"], {}, b"x" * wire.MAX_BLOB)
    assert not wire.within_limits(["vm1"], {}, b"x" * (wire.MAX_BLOB + 1))
    assert not wire.within_limits(["vm1"], {"VMLEND_X": "y" * (wire.MAX_STRING + 1)}, b"")
    assert not wire.within_limits(["a"] * (wire.MAX_STRINGS + 1), {}, b"")
    frame = wire.encode_request(["vm1"], {}, b"x" * (wire.MAX_BLOB + 1))
    with pytest.raises(wire.WireError, match="over the limit"):
        wire.decode_request(wire.Reader(io.BytesIO(frame).read))


def _full_queue(
    tmp_path: Path,
) -> Iterator[tuple[Host, dict[str, str], HookServer, Callable[[], None]]]:
    """A hook server with room for one queued call, its worker held up (the state is locked
    by another process's transaction) on vm1's prepare and vm2's release queued behind it."""
    host, env = _host_and_hook_env(tmp_path)
    server = HookServer(host.socket, identity_of(env), queue_limit=1)
    server.start()
    lock = sqlite3.connect(host.state, isolation_level=None)
    codes: dict[str, int | None] = {}

    def hook(name: str, op: str, xml: bytes) -> None:
        codes[name] = forward([name, op, "begin" if op == "prepare" else "end", "-"], xml, env)

    waiting = [
        threading.Thread(target=hook, args=("vm1", "prepare", vm_xml())),
        threading.Thread(
            target=hook, args=("vm2", "release", vm_xml("vm2", vm_uuid=uuid.UUID(int=2)))
        ),
    ]

    def unblock() -> None:
        with contextlib.suppress(sqlite3.Error):
            lock.execute("ROLLBACK")

    try:
        lock.execute("BEGIN EXCLUSIVE")
        for t in waiting:
            t.start()
            time.sleep(0.5)  # the first is running (blocked), the second queued
        yield host, env, server, unblock
    finally:
        unblock()
        lock.close()
        for t in waiting:
            t.join(60)
        server.stop()
    assert codes == {"vm1": 0, "vm2": 0}


def test_a_full_queue_tells_the_hook_busy_and_without_an_agent_it_runs_in_process(tmp_path):
    with contextmanager(_full_queue)(tmp_path) as (host, env, server, _unblock):
        third = vm_xml("vm3", vm_uuid=uuid.UUID(int=3))
        assert forward(["vm3", "release", "end", "-"], third, env) is None  # run it yourself
        assert server.served == 0
    assert server.served == 2
    assert host.snapshot()[0] == dict.fromkeys(FDIDS, "gamma/vm1")


def test_a_full_queue_makes_the_hook_wait_while_the_agent_lives(tmp_path, capsys):
    """The agent lives (it holds the host's agent lock) and its queue is full: the hook used
    to run the call in-process beside it. Now it tries again until the queue has room (served
    by the agent), or fails with one line once its timeout has passed, nothing done."""
    with contextmanager(_full_queue)(tmp_path) as (host, env, server, unblock):
        lock = HostLock.of(HostEnv(host.root))
        lock.acquire()  # this process stands for the agent
        try:
            third = vm_xml("vm3", vm_uuid=uuid.UUID(int=3))
            argv = ["vm3", "release", "end", "-"]
            started = time.monotonic()
            assert forward(argv, third, env | {"VMLEND_HOOK_TIMEOUT": "1"}) == 1
            assert time.monotonic() - started >= 1.0
            line = _one_line(capsys.readouterr().err.encode())
            assert "too many calls were waiting in it (tried for 1 s); nothing was done" in line
            assert server.served == 0
            got: list[int | None] = []
            waiting = threading.Thread(target=lambda: got.append(forward(argv, third, env)))
            waiting.start()
            time.sleep(0.5)
            assert waiting.is_alive() and server.served == 0  # it waits, and did not run it
            unblock()  # the worker goes on: the queue has room again
            waiting.join(60)
        finally:
            lock.release()
    assert got == [0] and server.served == 3  # the agent ran it once the queue had room


def test_hook_install_warns_about_a_socket_directory_the_agent_would_refuse(tmp_path):
    libvirt = tmp_path / "libvirt"
    libvirt.mkdir()
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("VMLEND_") or k == "VMLEND_CONFIG"  # never the machine's
    }
    base = [VMLEND, "--state", str(tmp_path / "state.db"), "hook", "install"]
    args = ["--libvirt-dir", str(libvirt), "--hook-socket"]
    out = subprocess.run(
        [*base, *args, str(shared / "hook.sock")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == [
        "vmlend: warning: 'vmlend agent' will refuse to serve the hook: the hook socket's"
        f" directory {shared} (owner uid 0, mode 1777) is writable by others: make it owned by"
        " root or uid 0 and mode 755, or choose another --hook-socket"
    ]
    safe = tmp_path / "run"
    out = subprocess.run(
        [*base, *args, str(safe / "hook.sock")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (out.returncode, out.stderr) == (0, "")


#: ``vmlend ARGS...`` as uid 65534: everything the agent uses is imported first (the
#: interpreter's own files may be where that user cannot read).
AGENT_AS_NOBODY = f"""
import os, sys
import vmlend.cli.cmd_agent, vmlend.hook.server
from vmlend.cli import run
from vmlend.hook.main import load_handlers
load_handlers()
os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})
sys.argv = ["vmlend", *sys.argv[1:]]
sys.exit(run())
"""


def test_an_agent_that_may_not_probe_the_socket_leaves_it_alone():
    # uid 65534 owns the directory, root listens on the socket (0600): the probe gets EACCES.
    # That is no proof the socket is stale, so the new agent must not unlink it.
    base = Path(tempfile.mkdtemp(prefix="vmlend-eacces-"))
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        base.chmod(0o755)
        sock = hostlease.hook_socket_path(HostEnv(base))  # the default: no --hook-socket
        run = sock.parent
        run.mkdir(parents=True)
        os.chown(run, NOBODY, NOBODY)
        live.bind(str(sock))
        sock.chmod(0o600)
        live.listen(8)
        # without the test's configuration file too: 65534 cannot enter the test's directory
        env = {k: v for k, v in os.environ.items() if not k.startswith("VMLEND_")}
        env["VMLEND_ROOT"] = str(base)
        argv = ["--state", str(run / "state.db"), "agent"]
        out = subprocess.run(
            [sys.executable, "-c", AGENT_AS_NOBODY, *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=20,
            cwd="/",
        )
        assert out.returncode == 1
        assert out.stderr.strip().splitlines()[-1] == (
            f"Error: cannot tell whether an agent serves the hook on {sock} (Permission"
            " denied); remove it if none does"
        )
        assert sock.exists() and sock.stat().st_uid == 0  # still the live one
    finally:
        live.close()
        shutil.rmtree(base)


def test_a_call_the_agent_refuses_before_it_runs_is_one_line_and_changes_nothing(
    tmp_path, capsys
):
    """The agent is asked before each call (``HookServer.before``): a prepare refused there
    (its lease is in doubt) answers exit 1 with the agent's one line, and nothing is done."""
    host, env = _host_and_hook_env(tmp_path)
    asked: list[tuple[str, str]] = []
    refusal = "cannot start VM 'vm1' now: this host's lease is in doubt"

    def before(action: str, vm: str, xml: bytes) -> str | None:
        asked.append((action, vm))
        return refusal if action == "prepare" else None

    server = HookServer(host.socket, identity_of(env))
    server.before = before
    server.start()
    try:
        code = forward(["vm1", "prepare", "begin", "-"], vm_xml(), env)
    finally:
        server.stop()
    assert code == 1 and asked == [("prepare", "vm1")]
    assert capsys.readouterr().err == f"vmlend: {refusal}\n"
    assert host.snapshot()[0] == {}  # nothing reserved
