"""The parts of the nemesis test (``tests/scenarios/test_nemesis.py``): a 3-member etcd on
loopback, three hosts that each reach it through proxies of their own (so one host can be cut
off), a workload of VM starts and stops through the CLI, the faults, and a sampler of what
every host's simulated hypervisor runs. Every process is started here and stopped by its PID.

What "in use" means (issue 20): a VM uses the devices its live XML names from the moment it
runs (its live XML exists, which is after its prepare hook reserved them) until its host has
paused or stopped it, or the lender has taken the device back from it (mappings cut, device
reset). Two such VMs must never share a device. The take-back can only matter while a host's
agent is frozen (SIGSTOP) or dead (kill -9): nothing on that host can pause anything then, so
its VM runs on after its lease ended, and the promise rests on fencing. So an overlap is
excused only if one of its VMs is on such a host (from the signal until the agent is back and
has had ``GRACE`` seconds to pause) *and* the device's lender logged taking the device back from
that VM before the sample (``confirm_excuses``). Every other overlap fails the test; excused
ones are printed.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from tests.support.cluster_hosts import VMLEND, Host, domain_xml
from tests.support.etcd_daemon import EtcdServer, start_members
from tests.support.tcp_proxy import TcpProxy
from vmlend.domain import read_domain
from vmlend.errors import VmlendError
from vmlend.wiring.fabric import default_topology_text, init_fabric

TTL = 2
INTERVAL = 0.2
#: How long a nemesis lasts when it must outlast the lease.
PAST_TTL = TTL + 1.0
#: After a frozen or dead agent is back: the time it has to pause (it renews at most TTL/3
#: late, sees the lease gone, pauses), with slack for a loaded machine.
GRACE = 2 * TTL + 2.0
#: Bounded waits for a process to do what it must (start-ups on a loaded machine included).
WAIT = 90.0

#: The VMs of each host and the remote devices they use; every device is wanted by VMs on two
#: hosts (0x10, 0x11: alpha lends; 0x20, 0x21: beta lends), so the workload races for them.
VMS: dict[str, dict[str, tuple[int, ...]]] = {
    "gamma": {"g1": (0x10,), "g2": (0x20,), "g3": (0x11, 0x21)},
    "beta": {"b1": (0x10,), "b2": (0x11,)},
    "alpha": {"a1": (0x20,), "a2": (0x21,)},
}


def vm_uuid(node: str, vm: str) -> str:
    n = sorted(VMS).index(node) * 16 + sorted(VMS[node]).index(vm) + 1
    return f"00000000-0000-4000-8000-{n:012x}"


@dataclass
class NHost:
    """One host: ``Host`` (root, node, agent) plus its proxies to the etcd members and the
    windows in which its agent could not guard its VMs (monotonic times; end None: open)."""

    host: Host
    proxies: list[TcpProxy]
    unguarded: list[list[float | None]] = field(default_factory=list)
    agent_stopped: bool = False

    @property
    def node(self) -> str:
        return self.host.node

    def hv_dir(self) -> Path:
        return self.host.root / "hv" / self.node

    def env(self) -> dict[str, str]:
        return {**self.host.env, "VMLEND_HOOK_TIMEOUT": "60"}

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [VMLEND, "-c", f"sim:///{self.node}", *args],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=300,
        )

    def log_size(self) -> int:
        path = self.host.root / "agent.log"
        return path.stat().st_size if path.exists() else 0

    def log_since(self, offset: int) -> str:
        path = self.host.root / "agent.log"
        with path.open("rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    @property
    def connect(self) -> tuple[str, str]:
        return ("--connect", f"sim:///{self.node}")

    def start_agent(self) -> None:
        """Start the agent (guarding ``sim:///NODE``) and wait until its start-up is done."""
        h = self.host
        offset = self.log_size()
        log = (h.root / "agent.log").open("ab")
        h.agent = subprocess.Popen(
            [VMLEND, "agent", "--ttl", str(TTL), "--interval", str(INTERVAL), *self.connect],
            env=h.env,
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        deadline = time.monotonic() + WAIT
        while f"reconcile of {self.node} done" not in self.log_since(offset):
            assert h.agent.poll() is None, self.log_since(offset)
            late = time.monotonic() >= deadline
            assert not late, f"{self.node}: no start-up\n{self.log_since(offset)}"
            time.sleep(0.1)

    def open_window(self) -> None:
        self.unguarded.append([time.monotonic(), None])

    def close_window(self) -> None:
        self.unguarded[-1][1] = time.monotonic() + GRACE

    def unguarded_at(self, t: float) -> bool:
        return any(a is not None and a <= t and (b is None or t <= b) for a, b in self.unguarded)

    def stop_agent(self) -> None:
        agent = self.host.agent
        if agent is None or agent.poll() is not None:
            return
        if self.agent_stopped:
            agent.send_signal(signal.SIGCONT)
            self.agent_stopped = False
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(20)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait(20)


@dataclass
class Cluster:
    members: list[EtcdServer]
    direct_url: str
    hosts: dict[str, NHost]

    def host(self, node: str) -> NHost:
        return self.hosts[node]


def start_cluster(root: Path, cluster: str) -> Cluster:
    """Three etcd members; alpha, beta and gamma each with proxies of their own to every
    member, the default topology, and the VMs of ``VMS`` defined (not started). The agents are
    started by the caller (``NHost.start_agent``)."""
    members = start_members(root / "etcd", 3)
    endpoints = ",".join(m.endpoint for m in members)
    direct = f"etcd://{endpoints}/{cluster}"
    text, source = default_topology_text()
    init_fabric(direct, text, source)
    hosts = {}
    for node in VMS:
        proxies = [TcpProxy(m.client_port) for m in members]
        url = f"etcd://{','.join(p.endpoint for p in proxies)}/{cluster}"
        hosts[node] = NHost(Host(url, node, root / node), proxies)
    return Cluster(members, direct, hosts)


def define_vms(c: Cluster) -> None:
    for node, vms in VMS.items():
        h = c.host(node)
        for vm, fdids in vms.items():
            xml = h.host.root / f"{vm}.xml"
            xml.write_bytes(domain_xml(vm, vm_uuid(node, vm), fdids))
            r = h.cli("vm", "define", str(xml))
            assert r.returncode == 0, r.stderr


def stop_cluster(c: Cluster) -> None:
    for h in c.hosts.values():
        for p in h.proxies:
            p.heal()
    for h in c.hosts.values():
        h.stop_agent()
    for h in c.hosts.values():
        for p in h.proxies:
            p.close()
    for m in c.members:
        m.stop()


# --- what runs --------------------------------------------------------------------------------
Run = tuple[str, str, str]  # (node, vm, domain id): one run of one VM
_DOMID = re.compile(rb"<domain\b[^>]*?\sid=[\"'](\d+)")


def in_use(h: NHost) -> dict[Run, frozenset[int]]:
    """The VMs ``h``'s simulated hypervisor runs and has not paused, with their devices (read
    from the store's files without its lock: a start holds the lock while its hooks run)."""
    live_dir, paused_dir = h.hv_dir() / "live", h.hv_dir() / "paused"
    out: dict[Run, frozenset[int]] = {}
    for path in sorted(live_dir.glob("*.xml")) if live_dir.is_dir() else []:
        name = path.stem
        try:
            xml = path.read_bytes()
        except FileNotFoundError:
            continue
        if (paused_dir / f"{name}.xml").exists():
            continue
        try:
            info = read_domain(xml, strict=False)
        except VmlendError:
            continue
        m = _DOMID.search(xml)
        domid = m.group(1).decode() if m else "?"
        out[(h.node, name, domid)] = frozenset(d.fdid for d in info.devices)
    return out


@dataclass
class Overlap:
    wall: float
    mono: float
    fdid: int
    runs: tuple[Run, Run]
    #: The runs on a host whose agent was frozen or dead (or just back) at the sample.
    unguarded: tuple[Run, ...]
    #: Set by ``confirm_excuses``: an unguarded run's device had been taken back from it.
    excused: bool = False

    def describe(self) -> str:
        ms = int(self.wall % 1 * 1000)
        stamp = time.strftime("%H:%M:%S", time.gmtime(self.wall)) + f".{ms:03d}Z"
        a, b = (f"{n}/{v} (id {i})" for n, v, i in self.runs)
        kind = (
            "excused (its agent was frozen or dead, and the lender had taken the device back)"
            if self.excused
            else "OVERLAP"
        )
        return f"{stamp} {kind}: device {self.fdid:#x} in use by {a} and by {b}"


_TAKEN_BACK = re.compile(r"^(\S+)Z vmlend: took back (0x[0-9a-f]+) from (\S+) ", re.M)


def taken_back(c: Cluster) -> dict[tuple[int, str], list[float]]:
    """When each lender's agent took a device back from which VM (its log lines)."""
    out: dict[tuple[int, str], list[float]] = {}
    for h in c.hosts.values():
        for stamp, fdid, holder in _TAKEN_BACK.findall(h.log_since(0)):
            when = datetime.fromisoformat(stamp).replace(tzinfo=UTC).timestamp()
            out.setdefault((int(fdid, 16), holder), []).append(when)
    return out


def confirm_excuses(c: Cluster, overlaps: list[Overlap]) -> None:
    """An overlap with a run on an unguarded host is excused only if the lender had taken the
    device back from that run before the sample: then its mappings were cut (issue 20: a VM
    uses a device "until ... the lender has taken the device back")."""
    back = taken_back(c)
    for o in overlaps:
        o.excused = any(
            t <= o.wall for n, v, _i in o.unguarded for t in back.get((o.fdid, f"{n}/{v}"), [])
        )


class Sampler:
    """Every ``period`` s: which running, unpaused VMs use which device, on every host. A pair
    counts only if both VMs are seen in use in two passes over all hosts (the files are read
    one after the other, so one pass is not a snapshot; a run seen in use in both passes, with a
    read of the other host in between, was in use at that read)."""

    def __init__(self, c: Cluster, period: float = 0.1) -> None:
        self.c = c
        self.period = period
        self.samples = 0
        self.overlaps: list[Overlap] = []
        self.errors: list[str] = []
        self._seen: set[tuple[int, Run, Run]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def sample(self) -> None:
        hosts = list(self.c.hosts.values())
        first = [in_use(h) for h in hosts]
        mono, wall = time.monotonic(), time.time()
        second = [in_use(h) for h in hosts]
        runs: dict[Run, frozenset[int]] = {}
        for a, b in zip(first, second, strict=True):
            for run, fdids in a.items():
                if run in b:
                    runs[run] = fdids & b[run]
        users: dict[int, list[Run]] = {}
        for run, fdids in runs.items():
            for fdid in fdids:
                users.setdefault(fdid, []).append(run)
        for fdid, who in users.items():
            for i, x in enumerate(who):
                for y in who[i + 1 :]:
                    key = (fdid, x, y)
                    if key in self._seen:
                        continue
                    self._seen.add(key)
                    unguarded = tuple(r for r in (x, y) if self.c.host(r[0]).unguarded_at(mono))
                    self.overlaps.append(Overlap(wall, mono, fdid, (x, y), unguarded))
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.sample()
            except Exception as e:  # reported at the end, never lost
                self.errors.append(f"{type(e).__name__}: {e}")


# --- the workload -----------------------------------------------------------------------------
@dataclass
class CliCall:
    node: str
    argv: tuple[str, ...]
    returncode: int
    stderr: str
    seconds: float
    wall: float  # when it began

    def describe(self) -> str:
        ms = int(self.wall % 1 * 1000)
        stamp = time.strftime("%H:%M:%S", time.gmtime(self.wall)) + f".{ms:03d}Z"
        return (
            f"{stamp} +{self.seconds:.1f}s {self.node}: {' '.join(self.argv)} -> {self.returncode}"
        )


class Workload:
    """One thread per host: start a stopped VM or destroy a running one, at random (a
    ``random.Random`` per host, seeded), with short pauses, until stopped."""

    def __init__(self, c: Cluster, seed: int) -> None:
        self.c = c
        self.calls: list[CliCall] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(node, seed), name=f"work-{node}", daemon=True)
            for node in VMS
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self, check: bool = True) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(WAIT * 3 if check else 5)
            assert not check or not t.is_alive(), f"workload thread {t.name} did not finish"

    def call(self, h: NHost, *argv: str) -> CliCall:
        t0, wall = time.monotonic(), time.time()
        r = h.cli(*argv)
        done = CliCall(h.node, argv, r.returncode, r.stderr, time.monotonic() - t0, wall)
        with self._lock:
            self.calls.append(done)
        return done

    def _run(self, node: str, seed: int) -> None:
        rng = random.Random(f"{seed}/{node}")
        h = self.c.host(node)
        while not self._stop.wait(rng.uniform(0.2, 0.8)):
            vm = rng.choice(sorted(VMS[node]))
            running = (h.hv_dir() / "live" / f"{vm}.xml").exists()
            if not running:
                self.call(h, "vm", "start", vm)
            elif rng.random() < 0.5:
                self.call(h, "vm", "destroy", vm)

    def stop_all_vms(self) -> None:
        for node in VMS:
            h = self.c.host(node)
            for vm in sorted(VMS[node]):
                if (h.hv_dir() / "live" / f"{vm}.xml").exists():
                    self.call(h, "vm", "destroy", vm)


# --- the nemeses ------------------------------------------------------------------------------
def kill_agent(c: Cluster, rng: random.Random, say: Callable[[str], None]) -> None:
    """kill -9 of an agent; restarted at once or after its lease ended."""
    h = c.host(rng.choice(sorted(VMS)))
    away = rng.choice([0.2, PAST_TTL])
    assert h.host.agent is not None
    say(f"kill -9 the agent of {h.node}, restart it after {away:g} s")
    h.open_window()
    h.host.agent.kill()
    h.host.agent.wait(20)
    time.sleep(away)
    h.start_agent()
    h.close_window()


def freeze_agent(c: Cluster, rng: random.Random, say: Callable[[str], None]) -> None:
    """SIGSTOP of an agent past the TTL, then SIGCONT."""
    h = c.host(rng.choice(sorted(VMS)))
    assert h.host.agent is not None
    say(f"SIGSTOP the agent of {h.node} for {PAST_TTL:g} s")
    h.open_window()
    h.host.agent.send_signal(signal.SIGSTOP)
    h.agent_stopped = True
    time.sleep(PAST_TTL)
    h.host.agent.send_signal(signal.SIGCONT)
    h.agent_stopped = False
    h.close_window()


def cut_host(c: Cluster, rng: random.Random, say: Callable[[str], None]) -> None:
    """A silent partition of one host from every etcd member, past the TTL, then healed."""
    h = c.host(rng.choice(sorted(VMS)))
    say(f"cut {h.node} off from etcd for {PAST_TTL:g} s")
    for p in h.proxies:
        p.cut()
    time.sleep(PAST_TTL)
    for p in h.proxies:
        p.heal()


def lose_quorum(c: Cluster, rng: random.Random, say: Callable[[str], None]) -> None:
    """Two of the three members stopped past the TTL (no quorum), then started again."""
    down = rng.sample(c.members, 2)
    say(f"stop etcd members {', '.join(m.name for m in down)} for {PAST_TTL:g} s (no quorum)")
    _bounce(down, PAST_TTL)


def stop_member(c: Cluster, rng: random.Random, say: Callable[[str], None]) -> None:
    """One member killed (-9) past the TTL, then started again: the others keep quorum."""
    down = [rng.choice(c.members)]
    say(f"kill -9 etcd member {down[0].name} for {PAST_TTL:g} s")
    _bounce(down, PAST_TTL, signal.SIGKILL)


def _bounce(members: list[EtcdServer], seconds: float, sig: int = signal.SIGTERM) -> None:
    for m in members:
        m.stop(sig)
    time.sleep(seconds)
    for m in members:
        m.spawn()
    for m in members:
        m.wait_healthy()


NEMESES: dict[str, Callable[[Cluster, random.Random, Callable[[str], None]], None]] = {
    "kill": kill_agent,
    "freeze": freeze_agent,
    "cut": cut_host,
    "quorum": lose_quorum,
    "member": stop_member,
}


def seed_from_env(default: int) -> int:
    return int(os.environ.get("VMLEND_NEMESIS_SEED") or default)
