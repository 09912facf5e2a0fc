"""The parts of the nemesis test (``tests/scenarios/test_nemesis.py``): a 3-member etcd on
loopback, three hosts that each reach it through proxies of their own (so one host can be cut
off), a workload of VM starts, stops, hot-adds and hot-removes through the CLI, the faults, and
a sampler of what every host's simulated hypervisor runs and of what every device serves.
Every process is started here and stopped by its PID.

Two promises (DESIGN, "Two promises, kept apart"), each checked at every sample:

(a) *Hardware exclusivity*: a device serves only the borrow of its newest fencing token. The
hosts share a lender register (``vmlend.sim.register``, ``$VMLEND_SIM_LENDERS``): each mdev
creation, release, mdev removal and take-back tells the device's lender, with the fencing
token, under the SmartIO driver's rules. ``LenderCheck`` reads it against the holds and fences
in etcd: a device that serves a borrower under a token older than its newest, or a borrower
its token was not issued to, fails the test, whatever the agents do.

(b) *The guard*: a VM uses the devices its live XML names (its vmlend metadata, or a plugged
mdev hostdev: ``devices_in``) from the moment it runs (its live XML exists, which is after its
prepare hook reserved them) or the device was hot-plugged, until its host has paused or
stopped it or the device was unplugged and dropped from the metadata. Two such VMs must never
share a device, unless only fencing can help: while a host's agent is frozen (SIGSTOP) or dead
(kill -9), nothing on that host can pause anything, so its VM runs on after its lease ended
(the guard's budget exceeded). An overlap is excused only if each of its VMs that the device
does not serve (the register, read around the sample) is on such a host (from the signal until
the agent is back and has had ``GRACE`` seconds to pause), and the device serves at most one of
the two. Every other overlap fails the test; excused ones are printed.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import re
import signal
import subprocess
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import msgspec

from tests.support.cluster_hosts import VMLEND, Host, domain_xml, stopped_children
from tests.support.etcd_daemon import EtcdServer, start_members
from tests.support.paths import REPO
from tests.support.tcp_proxy import TcpProxy
from vmlend.domain import DomainDocument, mdev_uuid, read_domain
from vmlend.domain.model import DomainXML
from vmlend.errors import VmlendError
from vmlend.events import EVENTS_ENV, EVENTS_FILE, EventLog
from vmlend.faults import FAULT_ENV, armed_path
from vmlend.hostenv import HostEnv
from vmlend.memory.windows import window_segments
from vmlend.registry import ClaimKind, parse_location
from vmlend.registry.etcd_gateway import EtcdGateway, b64, prefix_end, unb64
from vmlend.registry.etcd_keys import Keys, claims_of_block
from vmlend.registry.topocache import CACHE_FORMAT
from vmlend.registry.topopieces import PIECES_FORMAT_1, TopologyHead
from vmlend.sim.hypervisor.node import SimHypervisor
from vmlend.sim.register import LENDERS_ENV, LenderRegister, Serving, borrower_of
from vmlend.topology.chunked import CHUNK_BYTES, DIGEST_BYTES, chunks_in, digests_of, root_of
from vmlend.wiring.fabric import default_topology_text, init_fabric, open_fabric

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


#: VMs not of the default shape (512 MiB, q35): (machine, RAM). A 3 GiB i440fx guest has
#: all its RAM below 4 GiB, one DMA window where a q35 guest of that size has two, so a
#: claim made from the size alone (a win-back after a lease loss) would differ from its
#: prepare's (``dma_claim_drift``).
SHAPES: dict[tuple[str, str], tuple[str, int]] = {
    ("gamma", "g1"): ("pc", 3 * 2**30),
    ("gamma", "g2"): ("pc", 3 * 2**30),
    ("alpha", "a1"): ("pc", 3 * 2**30),
    ("beta", "b2"): ("pc", 3 * 2**30),
}

#: What each host's VMs may hot-add: every device of the four another node lends.
HOT: dict[str, tuple[int, ...]] = {
    "gamma": (0x10, 0x11, 0x20, 0x21),
    "beta": (0x10, 0x11),
    "alpha": (0x20, 0x21),
}


def vm_uuid(node: str, vm: str) -> str:
    n = sorted(VMS).index(node) * 16 + sorted(VMS[node]).index(vm) + 1
    return f"00000000-0000-4000-8000-{n:012x}"


#: The mdev UUID each device would have in each VM (the hook and attach derive it alike).
MDEVS: dict[tuple[str, str], dict[str, int]] = {
    (node, vm): {str(mdev_uuid(vm_uuid(node, vm), f)): f for f in HOT[node]}
    for node, vms in VMS.items()
    for vm in vms
}


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
        self.wait_for_start_up(self.launch_agent())

    def launch_agent(self) -> int:
        """Start the agent without waiting; the offset of its log from then on."""
        h = self.host
        self.events().note("restart")
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
        return offset

    def wait_for_start_up(self, offset: int) -> None:
        h = self.host
        assert h.agent is not None
        deadline = time.monotonic() + WAIT
        while f"reconcile of {self.node} done" not in self.log_since(offset):
            assert h.agent.poll() is None, self.log_since(offset)
            late = time.monotonic() >= deadline
            assert not late, f"{self.node}: no start-up\n{self.log_since(offset)}"
            time.sleep(0.1)

    def kill_agent(self) -> None:
        """kill -9 of the agent (the event log's ``crash`` once it is dead)."""
        agent = self.host.agent
        assert agent is not None
        agent.kill()
        agent.wait(20)
        self.events().note("crash", agent=agent.pid)

    def events(self) -> EventLog:
        """The test's side of the event log (``vmlend.events``): kills and restarts."""
        return EventLog(Path(self.host.extra_env[EVENTS_ENV]), self.node)

    def open_window(self) -> None:
        self.unguarded.append([time.monotonic(), None])

    def close_window(self) -> None:
        self.unguarded[-1][1] = time.monotonic() + GRACE

    def unguarded_at(self, t: float) -> bool:
        return self.window_at(t) is not None

    def window_at(self, t: float) -> int | None:
        """Which of ``unguarded`` holds ``t`` (None: the agent could guard then)."""
        for i, (a, b) in enumerate(self.unguarded):
            if a is not None and a <= t and (b is None or t <= b):
                return i
        return None

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
    #: What each device serves, as its lender knows it: every host's processes write it.
    lenders: LenderRegister
    #: Set by the test once the workload exists: the hook nemesis starts VMs of its own.
    work: Workload | None = None

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
    (root / "events").mkdir()
    lenders = LenderRegister(root / "lenders")
    hosts = {}
    for node in VMS:
        proxies = [TcpProxy(m.client_port) for m in members]
        url = f"etcd://{','.join(p.endpoint for p in proxies)}/{cluster}"
        host = Host(url, node, root / node)
        host.extra_env[LENDERS_ENV] = str(lenders.directory)
        host.extra_env[EVENTS_ENV] = str(root / "events")
        hosts[node] = NHost(host, proxies)
    return Cluster(members, direct, hosts, lenders)


def define_vms(c: Cluster) -> None:
    for node, vms in VMS.items():
        h = c.host(node)
        for vm, fdids in vms.items():
            xml = h.host.root / f"{vm}.xml"
            machine, memory = SHAPES.get((node, vm), ("q35", 512 * 2**20))
            xml.write_bytes(domain_xml(vm, vm_uuid(node, vm), fdids, memory, machine))
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


def keep_logs(c: Cluster, name: str, etcd_lines: int = 400) -> Path:
    """Copy what a failed run needs read to ``build/nemesis/NAME-TIME/`` in the repository
    (gitignored), out of pytest's temporary directory, which later runs remove: every host's
    agent.log and hook.log, the last ``etcd_lines`` lines of each etcd member's log, and what
    the lender register says now and its history. The directory."""
    out = REPO / "build" / "nemesis" / f"{name}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    out.mkdir(parents=True, exist_ok=True)
    for h in c.hosts.values():
        for log in ("agent.log", "hook.log"):
            src = h.host.root / log
            if src.exists():
                (out / f"{h.node}-{log}").write_bytes(src.read_bytes())
    for m in c.members:
        src = m.root / "etcd.log"
        if src.exists():
            tail = src.read_text(errors="replace").splitlines()[-etcd_lines:]
            (out / f"etcd-{m.name}.log").write_text("\n".join(tail) + "\n")
    serving = {f"{f:#x}": [s.token, s.borrower] for f, s in c.lenders.all().items()}
    (out / "lenders.json").write_text(json.dumps(serving, indent=1) + "\n")
    history = c.lenders.directory / "history.log"
    if history.exists():
        (out / "lenders-history.log").write_bytes(history.read_bytes())
    events = c.lenders.directory.parent / "events" / EVENTS_FILE
    if events.exists():
        (out / "events.jsonl").write_bytes(events.read_bytes())
    return out


# --- what runs --------------------------------------------------------------------------------
Run = tuple[str, str, str]  # (node, vm, domain id): one run of one VM
_DOMID = re.compile(rb"<domain\b[^>]*?\sid=[\"'](\d+)")


def devices_in(node: str, vm: str, xml: bytes) -> frozenset[int] | None:
    """The devices a live XML gives its VM: the ones its vmlend metadata names and the ones
    whose mdev hostdev is plugged. A hot-add plugs the hostdev before it writes the metadata,
    a hot-remove unplugs it before it removes the metadata entry: with both, a device counts
    from its hot-plug until both are gone, which covers "from the moment the hot-add succeeds
    until the unplug succeeds". None: not readable (a file being replaced)."""
    try:
        info = read_domain(xml, strict=False)
        doc = DomainDocument.parse(xml, source="live XML")
    except VmlendError:
        return None
    mdevs = MDEVS[(node, vm)]
    plugged = {mdevs.get(str(h.uuid)) for h in DomainXML(doc.root).mdev_hostdevs()}
    return frozenset(d.fdid for d in info.devices) | {f for f in plugged if f is not None}


def live_devices(h: NHost, vm: str) -> frozenset[int] | None:
    """The devices ``vm`` uses now (``devices_in``); None when it does not run."""
    try:
        xml = (h.hv_dir() / "live" / f"{vm}.xml").read_bytes()
    except FileNotFoundError:
        return None
    return devices_in(h.node, vm, xml)


def in_use(h: NHost) -> dict[Run, frozenset[int]]:
    """The VMs ``h``'s simulated hypervisor runs and has not paused, with their devices
    (``devices_in``; read from the store's files without its lock: a start holds the lock
    while its hooks run)."""
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
        fdids = devices_in(h.node, name, xml)
        if fdids is None:
            continue
        m = _DOMID.search(xml)
        domid = m.group(1).decode() if m else "?"
        out[(h.node, name, domid)] = fdids
    return out


@dataclass
class Overlap:
    wall: float
    mono: float
    fdid: int
    runs: tuple[Run, Run]
    #: The runs on a host whose agent was frozen or dead (or just back) at the sample.
    unguarded: tuple[Run, ...]
    #: The runs the device served (the lender register names them, read before or after).
    served: tuple[Run, ...]
    #: The device served at most one of the two, and each run it did not serve was unguarded:
    #: only fencing could help, and it did (promise (a), not (b)).
    excused: bool
    #: Set by ``log_evidence`` for an excused overlap: whether the lender's log also says it
    #: took the device back from each unserved run before the sample (a cross-check).
    logged: bool | None = None

    def describe(self) -> str:
        ms = int(self.wall % 1 * 1000)
        stamp = time.strftime("%H:%M:%S", time.gmtime(self.wall)) + f".{ms:03d}Z"
        a, b = (f"{n}/{v} (id {i})" for n, v, i in self.runs)
        if self.excused:
            served = ", ".join(f"{n}/{v}" for n, v, _i in self.served) or "neither"
            kind = (
                f"excused (a guard out of its budget, and the device served {served}"
                + {
                    True: "; the lender's log took it back from the other first)",
                    False: "; the lender's log has no take-back from the other before it)",
                    None: ")",
                }[self.logged]
            )
        else:
            kind = "OVERLAP"
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


def log_evidence(c: Cluster, overlaps: list[Overlap]) -> None:
    """For each excused overlap, whether the lenders' logs agree with the register: a
    take-back of the device from each run it did not serve, logged before the sample. Said,
    not judged: a run whose mdev was removed (a frozen release) is not served without any
    take-back."""
    back = taken_back(c)
    for o in overlaps:
        if o.excused:
            o.logged = all(
                any(t <= o.wall for t in back.get((o.fdid, f"{n}/{v}"), []))
                for n, v, i in o.runs
                if (n, v, i) not in o.served
            )


class LenderCheck:
    """Promise (a), hardware exclusivity, at every sample: every device serves only the borrow
    of its newest fencing token. The lender register (``vmlend.sim.register``: what each device
    serves, written by the hosts' processes under the SmartIO driver's rules) is read against
    the holds and fences in etcd, read directly: a hold's token is its key's creation revision,
    and its fence, made in the same transaction, has the same (and outlives it until the lender
    took the device back). The reads are serializable (a member without quorum answers with
    what it has): an older view only lowers ``newest``, so it never accuses wrongly.

    ``newest[fdid]``: the newest token the device is known to have been issued (the largest
    hold or fence token seen so far; tokens only grow). A register naming a borrower under an
    older token serves an ended hold after a newer one was issued; one naming a borrower the
    token was not issued to serves somebody else's hold. Either is a violation."""

    def __init__(self, c: Cluster) -> None:
        loc = parse_location(c.direct_url)
        self.register = c.lenders
        self._gw = EtcdGateway(loc.endpoints, timeout=0.5)
        self._keys = Keys(loc.cluster)
        self.newest: dict[int, int] = {}
        #: (fdid, token) -> the borrower ("node/vm") the token was issued to
        self._owners: dict[tuple[int, int], str] = {}
        #: (wall, fdid, token, borrower) whose token was never seen in a read (a hold that
        #: lived between two samples): its owner is looked up at the end
        self._pending: list[tuple[float, int, int, str]] = []
        self.violations: list[str] = []
        #: when each violation was seen (wall clock)
        self.violated_at: list[float] = []
        self._said: set[tuple[int, int, str]] = set()
        self.checked = 0
        #: samples whose etcd read failed (the bound of the sample before stood)
        self.unread = 0

    def close(self) -> None:
        self._gw.close()

    def read_etcd(self) -> None:
        ops = [
            {
                "request_range": {
                    "key": b64(prefix),
                    "range_end": b64(prefix_end(prefix)),
                    "serializable": True,
                }
            }
            for prefix in (self._keys.holds, self._keys.fences)
        ]
        try:
            answer = self._gw.call("kv/txn", {"compare": [], "success": ops, "failure": []})
        except VmlendError:
            self.unread += 1
            return
        for resp in answer.get("responses", []):
            for kv in resp.get("response_range", {}).get("kvs", []):
                d = json.loads(unb64(kv["value"]))
                # a record re-made under its key (a hand-over) names its token (etcd_txn)
                fdid, token = int(d["fdid"]), int(d.get("reissued") or kv["create_revision"])
                self._owners[(fdid, token)] = borrower_of(d["node"], d["vm"])
                self.newest[fdid] = max(self.newest.get(fdid, 0), token)

    def check(self, serving: dict[int, Serving], wall: float) -> None:
        """One read of the register (``serving``), made after the last ``read_etcd``."""
        self.checked += 1
        for fdid, s in serving.items():
            if not s.borrower:
                continue
            newest = self.newest.get(fdid, 0)
            if s.token < newest:
                who = self._owners.get((fdid, newest), "?")
                self._violate(
                    wall,
                    fdid,
                    s,
                    f"serves {s.borrower} under token {s.token}, older than its newest,"
                    f" {newest} ({who}'s)",
                )
            owner = self._owners.get((fdid, s.token))
            if owner is None:
                self._pending.append((wall, fdid, s.token, s.borrower))
            elif owner != s.borrower:
                self._violate(
                    wall, fdid, s, f"serves {s.borrower} under token {s.token}, issued to {owner}"
                )

    def finish(self) -> None:
        """Look up the owners of the tokens no read saw (etcd at the token's revision)."""
        for wall, fdid, token, borrower in self._pending:
            if (fdid, token) not in self._owners:
                _rev, kvs = self._gw.range(self._keys.fence(fdid), revision=token)
                for kv in kvs:
                    d = json.loads(kv.value)
                    if int(d.get("reissued") or kv.create_revision) == token:
                        self._owners[(fdid, token)] = borrower_of(d["node"], d["vm"])
            owner = self._owners.get((fdid, token))
            if owner != borrower:
                s = Serving(fdid, token, borrower)
                self._violate(
                    wall, fdid, s, f"serves {borrower} under token {token}, issued to {owner}"
                )
        self._pending.clear()

    def _violate(self, wall: float, fdid: int, s: Serving, what: str) -> None:
        if (fdid, s.token, s.borrower) in self._said:
            return
        self._said.add((fdid, s.token, s.borrower))
        ms = int(wall % 1 * 1000)
        stamp = time.strftime("%H:%M:%S", time.gmtime(wall)) + f".{ms:03d}Z"
        self.violations.append(f"{stamp} promise (a): device {fdid:#x} {what}")
        self.violated_at.append(wall)


class ClaimCheck:
    """Admission claims what the windows map: each running VM's DMA-window claims against the
    segments its exact RAM layout needs (its domain XML's machine and memory), on every lender
    adapter, whoever reserved them (a prepare, a hot-plug, a win-back after a lease loss).
    Read serializably, like ``LenderCheck``; a failed read is counted."""

    def __init__(self, c: Cluster) -> None:
        self.c = c
        loc = parse_location(c.direct_url)
        self._gw = EtcdGateway(loc.endpoints, timeout=0.5)
        self._keys = Keys(loc.cluster)
        with open_fabric(c.direct_url, "alpha") as f:
            topology = f.topology()
        self._segment = {a.ref: a.segment_size for a in topology.adapters()}
        self._need: dict[tuple[str, int], int] = {}  # (share, segment size) -> segments
        self.drift: list[str] = []
        self.reads = 0
        self.unread = 0

    def close(self) -> None:
        self._gw.close()

    def needs(self, share: str, segment_size: int) -> int:
        if (share, segment_size) not in self._need:
            node, vm = share.removeprefix("vm:").split("/", 1)
            ram = read_domain((self.c.host(node).host.root / f"{vm}.xml").read_bytes()).ram
            assert ram is not None, share
            self._need[(share, segment_size)] = window_segments(ram.ranges, segment_size)
        return self._need[(share, segment_size)]

    def read(self) -> None:
        prefix = self._keys.units  # layout 5: the claims are on their VMs' unit blocks
        body = {"key": b64(prefix), "range_end": b64(prefix_end(prefix)), "serializable": True}
        try:
            answer = self._gw.call("kv/range", body)
        except VmlendError:
            self.unread += 1
            return
        self.reads += 1
        claims = [
            c for kv in answer.get("kvs", []) for _f, c in claims_of_block(unb64(kv["value"]))
        ]
        for claim in claims:
            if claim.kind is not ClaimKind.DMA or not claim.share.startswith("vm:"):
                continue  # the interrupt window (MSI over the NTB) is not the VM's RAM
            want = self.needs(claim.share, self._segment[claim.adapter])
            line = (
                f"{claim.share.removeprefix('vm:')} claims {claim.segments} DMA segment(s) on"
                f" {claim.adapter}; its RAM layout needs {want}"
            )
            if claim.segments != want and line not in self.drift:
                self.drift.append(line)


class Sampler:
    """Every ``period`` s: which running, unpaused VMs use which device, on every host, and
    what each device serves. A pair counts only if both VMs are seen in use in two passes over
    all hosts (the files are read one after the other, so one pass is not a snapshot; a run
    seen in use in both passes, with a read of the other host in between, was in use at that
    read). The lender register is read before the first pass and after the second: a run
    counts as served if either read names it (``LenderCheck`` checks both reads)."""

    def __init__(self, c: Cluster, period: float = 0.1) -> None:
        self.c = c
        self.period = period
        self.samples = 0
        self.overlaps: list[Overlap] = []
        self.errors: list[str] = []
        self.lender = LenderCheck(c)
        self.claims = ClaimCheck(c)
        #: Samples taken while some host's guard was out of its budget (its agent frozen,
        #: dead or just back), and how many in each of those windows: (node, index).
        self.unguarded_samples = 0
        self.in_window: Counter[tuple[str, int]] = Counter()
        self._seen: set[tuple[int, Run, Run, bool]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def close(self) -> None:
        self.lender.close()
        self.claims.close()

    def sample(self) -> None:
        hosts = list(self.c.hosts.values())
        self.lender.read_etcd()
        if self.samples % 10 == 0:  # claims change only with holds: once a second is plenty
            self.claims.read()
        before = self.c.lenders.all()
        first = [in_use(h) for h in hosts]
        mono, wall = time.monotonic(), time.time()
        second = [in_use(h) for h in hosts]
        after = self.c.lenders.all()
        self.lender.check(before, wall)
        self.lender.check(after, wall)
        windows = [(h.node, h.window_at(mono)) for h in hosts]
        out = [(node, i) for node, i in windows if i is not None]
        if out:
            self.unguarded_samples += 1
            self.in_window.update(out)
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
            named = {s.borrower for s in (before.get(fdid), after.get(fdid)) if s is not None}
            for i, x in enumerate(who):
                for y in who[i + 1 :]:
                    unguarded = tuple(r for r in (x, y) if self.c.host(r[0]).unguarded_at(mono))
                    served = tuple(r for r in (x, y) if borrower_of(r[0], r[1]) in named)
                    excused = len(served) <= 1 and all(
                        r in unguarded for r in (x, y) if r not in served
                    )
                    # once more when it outlasts its excuse: a host back on guard must end it
                    key = (fdid, x, y, excused)
                    if key in self._seen:
                        continue
                    self._seen.add(key)
                    o = Overlap(wall, mono, fdid, (x, y), unguarded, served, excused)
                    self.overlaps.append(o)
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
    """One thread per host, each with its own ``random.Random`` (seeded), with short pauses
    until stopped: start a stopped VM; or, on a running one, destroy it, hot-add a device it
    does not have (``HOT``: any of the four another node lends, so hot-adds race with starts
    for the same devices) or hot-remove one it hot-added. A VM ``claim``-ed by a nemesis is
    left alone until it is given back."""

    def __init__(self, c: Cluster, seed: int) -> None:
        self.c = c
        self.calls: list[CliCall] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        #: Held around each action of a host's thread, and by ``claim``.
        self._busy = {node: threading.Lock() for node in VMS}
        #: How many ``claim``s hold each VM (a nemesis's ``_free_up`` may claim it again).
        self._claimed: Counter[tuple[str, str]] = Counter()
        #: Devices a nemesis needs free: no VM wanting one is started, none is hot-added.
        #: devices no VM of the workload may take now, with how many nemeses keep each off
        self._kept_off: Counter[int] = Counter()
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
        self.record(done)
        return done

    def record(self, done: CliCall) -> None:
        with self._lock:
            self.calls.append(done)

    @contextmanager
    def claim(self, node: str, vm: str) -> Iterator[None]:
        """Keep the workload off ``vm`` (after its action in progress on ``node`` ends)."""
        with self._busy[node]:
            self._claimed[(node, vm)] += 1
        try:
            yield
        finally:
            with self._busy[node]:
                self._claimed[(node, vm)] -= 1
                if not self._claimed[(node, vm)]:
                    del self._claimed[(node, vm)]

    @contextmanager
    def keep_off(self, fdid: int) -> Iterator[None]:
        """Start no VM that wants ``fdid`` and hot-add it nowhere (the workload's other VMs
        would otherwise race a nemesis for it on a loaded machine); what holds it goes on."""
        with self._lock:
            self._kept_off[fdid] += 1
        try:
            yield
        finally:
            with self._lock:
                self._kept_off -= Counter({fdid: 1})  # drops it at zero: nesting is fine

    def _run(self, node: str, seed: int) -> None:
        rng = random.Random(f"{seed}/{node}")
        h = self.c.host(node)
        while not self._stop.wait(rng.uniform(0.2, 0.8)):
            roll = rng.random()
            with self._busy[node]:
                vms = [vm for vm in sorted(VMS[node]) if (node, vm) not in self._claimed]
                if not vms:  # a nemesis has them all (one it froze, one it destroys)
                    continue
                running = {vm: d for vm in vms if (d := live_devices(h, vm)) is not None}
                if roll < 0.5 or not running:
                    self._start_or_stop(h, rng.choice(vms), running, rng)
                else:
                    vm = rng.choice(sorted(running))
                    self._hot_plug(h, vm, running[vm], rng)

    def _start_or_stop(
        self, h: NHost, vm: str, running: dict[str, frozenset[int]], rng: random.Random
    ) -> None:
        if vm not in running:
            with self._lock:
                kept_off = bool(self._kept_off.keys() & set(VMS[h.node][vm]))
            if not kept_off:
                self.call(h, "vm", "start", vm)
        elif rng.random() < 0.5:
            self.call(h, "vm", "destroy", vm)

    def _hot_plug(self, h: NHost, vm: str, used: frozenset[int], rng: random.Random) -> None:
        """Hot-remove a device ``vm`` hot-added, or hot-add one it does not have."""
        added = sorted(used - set(VMS[h.node][vm]))
        with self._lock:
            free = [f for f in HOT[h.node] if f not in used and f not in self._kept_off]
        if added and (rng.random() < 0.5 or not free):
            self.call(h, "detach", vm, f"{rng.choice(added):#x}", "--live")
        elif free:
            self.call(h, "attach", vm, f"{rng.choice(free):#x}", "--live")

    def stop_all_vms(self) -> None:
        for node in VMS:
            h = self.c.host(node)
            for vm in sorted(VMS[node]):
                if (h.hv_dir() / "live" / f"{vm}.xml").exists():
                    self.call(h, "vm", "destroy", vm)


# --- the nemeses ------------------------------------------------------------------------------
Say = Callable[[str], None]
Nemesis = Callable[["Cluster", random.Random, Say], None]


def kill_agent(c: Cluster, rng: random.Random, say: Say, away: float = 0.2) -> None:
    """kill -9 of an agent, restarted after ``away`` s (at once, or after its lease ended)."""
    h = c.host(rng.choice(sorted(VMS)))
    assert h.host.agent is not None
    say(f"kill -9 the agent of {h.node}, restart it after {away:g} s")
    h.open_window()
    h.kill_agent()
    h.host.agent.wait(20)
    time.sleep(away)
    h.start_agent()
    h.close_window()


def kill_agent_late(c: Cluster, rng: random.Random, say: Say) -> None:
    """kill -9 of an agent, not restarted until its lease has ended (what a dead host's
    agent does to the cluster), then restarted."""
    kill_agent(c, rng, say, PAST_TTL)


def freeze_agent(c: Cluster, rng: random.Random, say: Say) -> None:
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
    destroy_while_recovering(c, h, rng, say)
    h.close_window()


def freeze_agent_in_start_up(c: Cluster, rng: random.Random, say: Say) -> None:
    """kill -9 of an agent until its lease ended, then a restart SIGSTOPped past the TTL of its
    new lease as soon as it is published: in its start-up, while it re-reserves for the VMs
    that ran without their holds (or just after, on a fast machine). The lease it re-reserves
    under ends meanwhile; no device may be given up for that."""
    h = c.host(rng.choice(sorted(VMS)))
    assert h.host.agent is not None
    say(f"kill -9 the agent of {h.node}; after {PAST_TTL:g} s restart it, SIGSTOP it at once")
    h.open_window()
    h.kill_agent()
    h.host.agent.wait(20)
    time.sleep(PAST_TTL)
    offset = h.launch_agent()
    agent = h.host.agent
    deadline = time.monotonic() + WAIT
    while _lease_pid(h.host.lease_file) != agent.pid:
        assert agent.poll() is None and time.monotonic() < deadline, h.log_since(offset)
        time.sleep(0.005)
    agent.send_signal(signal.SIGSTOP)
    h.agent_stopped = True
    where = "after" if f"reconcile of {h.node} done" in h.log_since(offset) else "in"
    say(f"the SIGSTOP came {where} its start-up; SIGCONT after {PAST_TTL:g} s")
    time.sleep(PAST_TTL)
    agent.send_signal(signal.SIGCONT)
    h.agent_stopped = False
    h.wait_for_start_up(offset)
    h.close_window()


def _lease_pid(path: Path) -> int | None:
    """The pid of the agent that published the lease file (a killed one leaves its own)."""
    try:
        return int(json.loads(path.read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def destroy_while_recovering(c: Cluster, h: NHost, rng: random.Random, say: Say) -> None:
    """An operator's destroy of one of ``h``'s VMs just as its thawed agent, whose lease
    ended, re-reserves the devices of the VMs it paused: nothing re-reserved for a VM that is
    gone may stay held (the leftovers check at the end says so)."""
    running = sorted(vm for vm in VMS[h.node] if live_devices(h, vm) is not None)
    if not running or c.work is None:
        return
    vm = rng.choice(running)
    say(f"destroy {h.node}/{vm} while its agent recovers")
    with c.work.claim(h.node, vm):
        c.work.call(h, "vm", "destroy", vm)


def cut_host(c: Cluster, rng: random.Random, say: Say) -> None:
    """A silent partition of one host from every etcd member, past the TTL, then healed. Half
    the time an operator has paused one of its running VMs first: after the heal, the agent's
    lost-lease path must leave it paused and holding every device it still has (re-reserved
    or unplugged), so the operator's resume, done here then, is safe."""
    h = c.host(rng.choice(sorted(VMS)))
    running = [
        vm
        for vm in sorted(VMS[h.node])
        if live_devices(h, vm) and not (h.hv_dir() / "paused" / f"{vm}.xml").exists()
    ]
    if running and c.work is not None and rng.random() < 0.5:
        vm = rng.choice(running)
        with c.work.claim(h.node, vm):
            if live_devices(h, vm) is None:
                say(f"cut: {h.node}/{vm} stopped meanwhile")
                return
            hv = SimHypervisor(h.node, h.hv_dir(), None)
            offset = h.log_size()
            hv.suspend(vm)
            say(f"cut {h.node} off from etcd for {PAST_TTL:g} s ({vm} paused by an operator)")
            _cut_and_heal(h)
            deadline = time.monotonic() + WAIT
            while foreign := _not_held(c, h, vm):
                assert time.monotonic() < deadline, f"{h.node}/{vm} keeps {foreign}"
                time.sleep(0.1)
            _operator_resumes(c, h, hv, vm, offset, say)
        return
    say(f"cut {h.node} off from etcd for {PAST_TTL:g} s")
    _cut_and_heal(h)


#: The guard's pause of a VM it found running (``vmlend.agent.borrower``, one line per change
#: of a VM's state: "VM g1: running -> paused: the lease is in doubt (1.0 s of 2 s left)").
#: Somebody else's pause it finds is "VM g1: running -> kept: somebody else paused it".
_GUARD_PAUSED = re.compile(r"vmlend: VM (\S+): running -> paused: ")


def _raced(h: NHost, offset: int, vm: str) -> bool:
    """Whether ``h``'s guard paused ``vm`` (its log since ``offset``): it found the VM
    running, so the operator's pause landed while the guard's own was under way, and the two
    look the same to the agent (docs/cluster.md: not excluded). The VM is then the agent's."""
    return any(m.group(1) == vm for m in _GUARD_PAUSED.finditer(h.log_since(offset)))


def _operator_resumes(
    c: Cluster, h: NHost, hv: SimHypervisor, vm: str, offset: int, say: Say
) -> None:
    """The operator who paused ``vm`` (``h``'s agent log at ``offset`` then) resumes it, once
    the agent is done with it: it must still be paused and hold every device it uses, since
    no hook or agent sees that resume. Unless the guard's own pause raced the operator's
    (``_raced``): then the pause is the agent's."""
    if _raced(h, offset, vm):
        say(f"{h.node}'s guard paused {vm} as the operator did: the agent's pause")
        return
    if live_devices(h, vm) is None:
        return
    assert (h.hv_dir() / "paused" / f"{vm}.xml").exists(), (
        f"the agent of {h.node} resumed {vm}, which an operator paused"
    )
    foreign = _not_held(c, h, vm)
    assert not foreign, f"{h.node}/{vm}, paused by an operator, keeps {foreign}"
    hv.resume(vm)
    kept = ", ".join(f"{f:#x}" for f in sorted(live_devices(h, vm) or ()))
    say(f"the operator resumes {h.node}/{vm}, with {kept or 'no device'}")


def _cut_and_heal(h: NHost) -> None:
    for p in h.proxies:
        p.cut()
    time.sleep(PAST_TTL)
    for p in h.proxies:
        p.heal()


def lose_quorum(c: Cluster, rng: random.Random, say: Say) -> None:
    """Two of the three members stopped past the TTL (no quorum), then started again."""
    down = rng.sample(c.members, 2)
    say(f"stop etcd members {', '.join(m.name for m in down)} for {PAST_TTL:g} s (no quorum)")
    _bounce(down, PAST_TTL)


def kill_leader(c: Cluster, rng: random.Random, say: Say) -> None:
    """kill -9 of the etcd leader (asked of the members), past the TTL, then started again:
    the other two keep quorum and elect a new leader."""
    down = leader(c.members)
    say(f"kill -9 the etcd leader {down.name} for {PAST_TTL:g} s")
    _bounce([down], PAST_TTL, signal.SIGKILL)
    say(f"etcd leader now {leader(c.members).name}")


def leader(members: list[EtcdServer]) -> EtcdServer:
    """The member the running members name as their leader (``/v3/maintenance/status`` on
    loopback), waiting for an election if there is none yet."""
    deadline = time.monotonic() + WAIT
    while True:
        ids: dict[str, EtcdServer] = {}
        named: set[str] = set()
        for m in members:
            try:
                req = urllib.request.Request(
                    f"http://{m.endpoint}/v3/maintenance/status", data=b"{}", method="POST"
                )
                with urllib.request.urlopen(req, timeout=1) as r:
                    status = json.loads(r.read())
            except OSError:
                continue
            ids[str(status["header"]["member_id"])] = m
            if status.get("leader"):
                named.add(str(status["leader"]))
        found = [ids[x] for x in named if x in ids]
        if len(named) == 1 and found:
            return found[0]
        assert time.monotonic() < deadline, f"no etcd leader: {named}"
        time.sleep(0.05)


def freeze_hook(c: Cluster, rng: random.Random, say: Say, *, kill: bool = False) -> None:
    """SIGSTOP of a hook mid-prepare, past the TTL, then SIGCONT. A VM of one host, taken from
    the workload, is started with its hook run in the hook process itself (no agent socket, as
    when no agent serves the hook) and ``VMLEND_FAULT=prepare:after-device=STOP``: the hook
    stops itself once it holds a device, before the VM runs. ``kill``: meanwhile that host's
    agent is killed (-9) and restarted only once its lease, and with it the frozen hook's
    hold, has ended, so the lender takes the device back and another VM may take it before
    the hook goes on."""
    node = rng.choice(sorted(VMS))
    vm = rng.choice(sorted(VMS[node]))
    h, work = c.host(node), c.work
    assert work is not None and h.host.agent is not None
    with work.claim(node, vm):
        if live_devices(h, vm) is not None:
            work.call(h, "vm", "destroy", vm)
        deadline = time.monotonic() + WAIT
        first = VMS[node][vm][0]
        start = ("vm", "start", vm)
        # The prepare freezes once it holds the first device: no other VM is given it until
        # then, and the start waits until whoever holds it now lets go.
        with work.keep_off(first):
            while True:
                _free_up(c, first, deadline, say)
                if (frozen := _start_frozen(h, start, "prepare:after-device", work)) is not None:
                    break
                last = work.calls[-1] if work.calls else None
                assert time.monotonic() < deadline, (
                    f"the hook of {node}/{vm} never froze; last start: {last}"
                )
        _hold_frozen(h, work, frozen, "mid-prepare", kill, say)


def freeze_release(c: Cluster, rng: random.Random, say: Say, *, kill: bool = False) -> None:
    """SIGSTOP of a hook mid-release, past the TTL, then SIGCONT. A running VM of one host is
    destroyed with its release hook run in the hook process itself and
    ``VMLEND_FAULT=release:after-mdevs=STOP``: the hook stops itself with its mdevs removed and
    its holds not yet returned. ``kill``: meanwhile that host's agent is killed (-9) and
    restarted once its lease ended, so the lenders take the devices back and other VMs may
    take them before the stale release goes on: it must return nothing of theirs."""
    node = rng.choice(sorted(VMS))
    h, work = c.host(node), c.work
    assert work is not None and h.host.agent is not None
    vm = rng.choice(sorted(VMS[node]))
    with work.claim(node, vm):
        deadline = time.monotonic() + WAIT
        _start_kept(c, h, vm, deadline, say)
        frozen = _start_frozen(h, ("vm", "destroy", vm), "release:after-mdevs", work)
        if frozen is None:
            say(f"the release of {node}/{vm} did not stop: {work.calls[-1].describe()}")
            return
        _hold_frozen(h, work, frozen, "mid-release", kill, say)


def freeze_attach_and_kill_agent(c: Cluster, rng: random.Random, say: Say) -> None:
    """SIGSTOP of a ``vmlend attach --live`` just after its hot-plug, and kill -9 of its host's
    agent until the lease ended. The attach holds the device and has plugged it into the VM,
    but its metadata does not name it yet (``attach:after-hotplug=STOP``): the agent, when back,
    cannot know of it from the VM's XML. Meanwhile the lender takes the device back and a VM
    of another host hot-adds it. The attach, let go after the agent's restart, must find its
    hold gone and unplug the device again; until then the lender's take-back is all that
    protects the other VM (the host is unguarded)."""
    node = rng.choice(sorted(VMS))
    vm = rng.choice(sorted(VMS[node]))
    h, work = c.host(node), c.work
    assert work is not None and h.host.agent is not None
    with work.claim(node, vm):
        deadline = time.monotonic() + WAIT
        used = _start_kept(c, h, vm, deadline, say)
        free = [f for f in HOT[node] if f not in used]  # not one the workload hot-added
        if not free:
            say(f"{node}/{vm} has every device it may hot-add")
            return
        fdid = rng.choice(free)
        with work.keep_off(fdid):
            _free_up(c, fdid, deadline, say)
            attach = ("attach", vm, f"{fdid:#x}", "--live")
            frozen = _start_frozen(h, attach, "attach:after-hotplug", work)
        if frozen is None:
            say(f"the attach to {node}/{vm} did not stop: {work.calls[-1].describe()}")
            return

        def another_vm_takes_it() -> None:
            _hot_add_elsewhere(c, node, fdid, say)

        # the attach goes on before the restarted agent looks at the VMs, or after it did
        late = rng.random() < 0.5
        where = f"after its hot-plug (to go on {'after' if late else 'during'} the restart)"
        _hold_frozen(h, work, frozen, where, True, say, another_vm_takes_it, late)


def _hot_add_elsewhere(c: Cluster, node: str, fdid: int, say: Say) -> None:
    """Once the lender took ``fdid`` back (bounded wait), give it to a VM of a host other than
    ``node``: hot-added to one that runs, or taken by the start of one (hot-added after the
    start if the VM does not want it at start). The first that succeeds ends it."""
    work = c.work
    assert work is not None
    deadline = time.monotonic() + TTL + WAIT / 3
    while not _free(c, fdid):
        with open_fabric(c.direct_url, "alpha" if fdid < 0x20 else "beta") as f:
            holder = f.device(fdid).holder
        if holder is not None and holder.node != node:  # the workload was first: done
            say(f"{fdid:#x} taken back; {holder.node}/{holder.vm} holds it now (the workload)")
            return
        if time.monotonic() > deadline:
            say(f"{fdid:#x} was not taken back in time; no other VM takes it")
            return
        time.sleep(0.05)
    tried = []
    for other in sorted(n for n in VMS if n != node and fdid in HOT[n]):
        o = c.host(other)
        for vm in sorted(VMS[other]):
            with work.claim(other, vm):
                if live_devices(o, vm) is None:
                    tried.append(work.call(o, "vm", "start", vm))
                    if tried[-1].returncode != 0:
                        continue
                used = live_devices(o, vm)
                if used is not None and fdid not in used:
                    tried.append(work.call(o, "attach", vm, f"{fdid:#x}", "--live"))
                if fdid in (live_devices(o, vm) or ()):
                    say(f"{fdid:#x} taken back; now {other}/{vm} uses it")
                    return
    say(f"{fdid:#x} taken back; no VM of another host could take it ({len(tried)} calls)")


def freeze_release_and_kill_agent(c: Cluster, rng: random.Random, say: Say) -> None:
    """SIGSTOP of a hook mid-release and kill -9 of its host's agent until the lease ended."""
    freeze_release(c, rng, say, kill=True)


def kill_agent_after_commit(c: Cluster, rng: random.Random, say: Say) -> None:
    """kill -9 of an agent right after the registry committed a reserve or a release it
    served, before the event that records it: the history then has a commit nobody noted (stop
    54 met it by chance, an agent killed 15 ms after a release's commit, and the replay took
    the device's next hold for a second holder). The host's agent is restarted with
    ``VMLEND_FAULT=<reserve|release>:after-commit=ONCE`` for every process of the host (the
    seed picks which); a VM of the host (all of its VMs taken from the workload meanwhile) is
    made ready through it (stopped with its devices free, or running with them), the point
    armed, and the VM started, or destroyed. The agent dies in that call; the hook fails in one
    line, and a failed start's release then runs in the hook's own process, past the point
    the agent used up. The agent is restarted at once without the fault; the end state must
    come right without a human (the checks at the end), and the history must still replay."""
    node = rng.choice(sorted(VMS))
    h, work = c.host(node), c.work
    assert work is not None and h.host.agent is not None
    op = rng.choice(("reserve", "release"))
    vm = rng.choice(sorted(VMS[node]))
    point = f"{op}:after-commit"
    deadline = time.monotonic() + WAIT
    armed = Path(armed_path(str(h.host.root), point))
    with ExitStack() as taken:
        for v in sorted(VMS[node]):  # no other call of the host meets the fault
            taken.enter_context(work.claim(node, v))
        say(f"restart the agent of {node} to die right after a {op}'s commit ({vm})")
        h.open_window()
        h.kill_agent()
        h.host.extra_env[FAULT_ENV] = f"{point}=ONCE"
        try:
            h.start_agent()
            h.close_window()
            agent = h.host.agent
            assert agent is not None
            # made ready through the new agent, so the holds are of its lease (a running VM's
            # may be of the killed agent's, which may end before the call)
            if live_devices(h, vm) is not None:
                work.call(h, "vm", "destroy", vm)
            if op == "release":
                _start_kept(c, h, vm, deadline, say)
            else:
                for fdid in VMS[node][vm]:
                    taken.enter_context(work.keep_off(fdid))
                for fdid in VMS[node][vm]:
                    _free_up(c, fdid, deadline, say)
            h.open_window()
            armed.touch()
            argv = ("vm", "start", vm) if op == "reserve" else ("vm", "destroy", vm)
            done = work.call(h, *argv)
        finally:
            del h.host.extra_env[FAULT_ENV]
        with suppress(subprocess.TimeoutExpired):  # the call is over: any death came before
            agent.wait(2)
        said = f": {done.stderr.strip()}" if done.returncode else ""
        if agent.poll() is not None:
            h.events().note("crash", agent=agent.pid)
            say(f"the agent died after the commit; {done.describe()}{said}")
        else:  # refused before any commit (a device held meanwhile): a plain kill then
            say(f"no commit reached the point: {done.describe()}{said}; kill -9 the agent")
            h.kill_agent()
        armed.unlink(missing_ok=True)
        h.start_agent()
        h.close_window()


@dataclass
class Frozen:
    """A CLI call that stopped itself, or whose hook did (``_start_frozen``)."""

    proc: subprocess.Popen
    argv: tuple[str, ...]
    hook: int  # the stopped process's pid: the hook's, or the call's own
    wall: float
    t0: float


def _hold_frozen(
    h: NHost,
    work: Workload,
    frozen: Frozen,
    where: str,
    kill: bool,
    say: Say,
    meanwhile: Callable[[], None] | None = None,
    after_start_up: bool = False,
) -> None:
    """Keep the call stopped past the TTL (``kill``: with its host's agent dead until its
    lease ended, then restarted; ``meanwhile`` runs then, before the restart), let it and any
    later stop of the same call go on (``after_start_up``: only once the restarted agent's
    start-up is done), and record the call."""
    node, proc = h.node, frozen.proc
    assert h.host.agent is not None
    who = "the call" if frozen.hook == proc.pid else "the hook"
    say(
        f"SIGSTOP {who} of {node}/{frozen.argv[1 if frozen.argv[0] == 'attach' else -1]}"
        f" {where} (pid {frozen.hook}) for {PAST_TTL:g} s"
    )
    restart = None
    if kill:
        say(f"kill -9 the agent of {node} too, restart it after {PAST_TTL:g} s")
        h.open_window()
        h.kill_agent()
        h.host.agent.wait(20)
    time.sleep(PAST_TTL)
    if meanwhile is not None:
        meanwhile()
    if kill:
        # Its start-up waits for the hypervisor, which the frozen call holds: restart it,
        # then let the hook go on.
        failed: list[BaseException] = []

        def start_agent() -> None:
            try:
                h.start_agent()
            except BaseException as e:  # re-raised on the nemesis's thread below
                failed.append(e)

        restart = threading.Thread(target=start_agent, name=f"agent-{node}", daemon=True)
        restart.start()
        if after_start_up:
            restart.join(WAIT)
        time.sleep(0.5)
    done = _let_go(h, work, frozen)
    said = f": {done.stderr.strip()}" if done.returncode else ""
    say(f"{who} went on: {done.describe()}{said}")
    if restart is not None:
        restart.join(WAIT)
        assert not restart.is_alive(), f"the agent of {node} did not start"
        if failed:
            raise failed[0]
        h.close_window()


def _let_go(h: NHost, work: Workload, frozen: Frozen) -> CliCall:
    """SIGCONT the frozen call, and any later stop of it (a later device stops the hook
    again), until it ends; the call, recorded."""
    proc = frozen.proc
    while proc.poll() is None:
        for pid in _stopped(proc.pid):
            os.kill(pid, signal.SIGCONT)
        time.sleep(0.05)
    _out, err = proc.communicate()
    took = time.monotonic() - frozen.t0
    done = CliCall(h.node, frozen.argv, proc.returncode, err, took, frozen.wall)
    work.record(done)
    return done


def _start_kept(c: Cluster, h: NHost, vm: str, deadline: float, say: Say) -> frozenset[int]:
    """Start ``vm`` of ``h`` (claimed by the caller) unless it runs: its devices freed and kept
    off the workload until it runs, or the workload's other VMs take them back between the
    frees and the start, round after round, on a loaded machine (seed 1 saw it for 60 s).
    The devices it runs with."""
    work = c.work
    assert work is not None
    with ExitStack() as kept:
        for fdid in VMS[h.node][vm]:
            kept.enter_context(work.keep_off(fdid))
        while (used := live_devices(h, vm)) is None:
            for fdid in VMS[h.node][vm]:
                _free_up(c, fdid, deadline, say)
            work.call(h, "vm", "start", vm)
            assert time.monotonic() < deadline, f"{h.node}/{vm} never started"
    return used


def _free_up(c: Cluster, fdid: int, deadline: float, say: Say) -> None:
    """Wait until nobody holds ``fdid``; a running VM of the workload that keeps it (the
    workload may not stop it for a while) is destroyed, as an operator would."""
    asked: set[tuple[str, str]] = set()
    while not _free(c, fdid):
        with open_fabric(c.direct_url, "alpha" if fdid < 0x20 else "beta") as f:
            holder = f.device(fdid).holder
            fenced = [x for x in f.fenced() if x.fdid == fdid]
        if holder is not None and holder.node in VMS and (holder.node, holder.vm) not in asked:
            h = c.host(holder.node)
            if live_devices(h, holder.vm) is not None and c.work is not None:
                asked.add((holder.node, holder.vm))
                say(f"destroy {holder.node}/{holder.vm}, which holds {fdid:#x}")
                with c.work.claim(holder.node, holder.vm):
                    c.work.call(h, "vm", "destroy", holder.vm)
                continue
        assert time.monotonic() < deadline, (
            f"{fdid:#x} never came free: held by {holder}, fences {fenced}"
        )
        time.sleep(0.05)


def _free(c: Cluster, fdid: int) -> bool:
    """Whether nobody holds ``fdid`` and it is not fenced (the registry, read directly, as
    its lender: alpha lends 0x1*, beta 0x2*)."""
    with open_fabric(c.direct_url, "alpha" if fdid < 0x20 else "beta") as f:
        return f.device(fdid).holder is None and all(x.fdid != fdid for x in f.fenced())


def _stopped(pid: int) -> list[int]:
    """``pid`` if it is stopped (SIGSTOP), and its stopped children (``stopped_children``)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        state = ""
    return ([pid] if state == "T" else []) + stopped_children(pid)


def _start_frozen(h: NHost, argv: tuple[str, ...], point: str, work: Workload) -> Frozen | None:
    """``vmlend argv`` on ``h`` that stops itself at the fault point ``point``: in its hook,
    run in a process of its own (the fault makes its identity differ from the agent's, which so
    answers "not mine"), or in the call itself (an attach); None when the call ended first
    (recorded)."""
    env = {**h.env(), FAULT_ENV: f"{point}=STOP"}
    wall, t0 = time.time(), time.monotonic()
    proc = subprocess.Popen(
        [VMLEND, "-c", f"sim:///{h.node}", *argv],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    while proc.poll() is None:
        stopped = _stopped(proc.pid)
        if stopped:
            return Frozen(proc, argv, stopped[0], wall, t0)
        time.sleep(0.02)
    _out, err = proc.communicate()
    work.record(CliCall(h.node, argv, proc.returncode, err, time.monotonic() - t0, wall))
    return None


def _bounce(members: list[EtcdServer], seconds: float, sig: int = signal.SIGTERM) -> None:
    for m in members:
        m.stop(sig)
    time.sleep(seconds)
    for m in members:
        m.spawn()
    for m in members:
        m.wait_healthy()


def together(*parts: Nemesis) -> Nemesis:
    """Nemeses at once, each on its own thread with its own ``random.Random`` (drawn from the
    round's, so a seed still fixes their targets)."""

    def run(c: Cluster, rng: random.Random, say: Say) -> None:
        errors: list[BaseException] = []

        def one(part: Nemesis, seed: float) -> None:
            try:
                part(c, random.Random(seed), say)
            except BaseException as e:  # re-raised on the test's thread
                errors.append(e)

        threads = [
            threading.Thread(target=one, args=(p, rng.random()), name=p.__name__) for p in parts
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    run.__doc__ = " and, at the same time, ".join(
        p.__doc__.split(".")[0] for p in parts if p.__doc__
    )
    return run


def stall_domain(c: Cluster, rng: random.Random, say: Say) -> None:
    """A domain the hypervisor does not answer for, past the TTL. One host is cut off from
    etcd until its agent's guard has paused one of its running VMs; then that VM's domain
    stalls (the test holds its lock in the simulated hypervisor, as a frozen job or a stuck
    QEMU monitor would hold libvirt's domain object) while the cut heals and for ``PAST_TTL``
    more.
    The renewal after the heal resumes that VM: the resume waits for the domain, and the agent
    must renew on meanwhile. Once the domain answers, the VM runs again."""
    work = c.work
    assert work is not None
    running = [(n, vm) for n in sorted(VMS) for vm in sorted(VMS[n]) if live_devices(c.host(n), vm)]
    if not running:
        say("stall: no VM runs")
        return
    node, vm = rng.choice(running)
    h = c.host(node)
    paused = h.hv_dir() / "paused" / f"{vm}.xml"
    with work.claim(node, vm):
        if live_devices(h, vm) is None:
            say(f"stall: {node}/{vm} stopped meanwhile")
            return
        lease = h.host.published_lease()
        say(f"cut {node} off from etcd until {vm} is paused, then stall its domain")
        for p in h.proxies:
            p.cut()
        deadline = time.monotonic() + TTL
        while not paused.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not paused.exists():  # the pause came late on a loaded machine: nothing to stall
            for p in h.proxies:
                p.heal()
            say(f"{node}/{vm} was not paused within {TTL:g} s; healed, no stall")
            return
        lock = (h.hv_dir() / "locks" / vm).open("a")
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # after the pause's own job on it
            for p in h.proxies:
                p.heal()
            say(f"{node}/{vm} paused; its domain stalls for {PAST_TTL:g} s")
            time.sleep(PAST_TTL)
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
            lock.close()
        deadline = time.monotonic() + WAIT
        while paused.exists() and live_devices(h, vm) is not None:
            assert time.monotonic() < deadline, f"{node}/{vm} stayed paused after its stall"
            time.sleep(0.05)
        say(f"{node}/{vm} runs again")
        # A renewal that failed while the domain stalled is seen at the next one (TTL/3 on).
        # Not asserted: on a loaded machine the cut alone may outlast the lease; the unit test
        # (test_agent_watch) proves the renewals go on.
        time.sleep(TTL)
        kept = h.host.published_lease() == lease
        say(f"{node} {'kept' if kept else 'lost'} its lease")


def _start_with_devices(
    c: Cluster, h: NHost, vms: tuple[str, ...], deadline: float, say: Say
) -> None:
    """Make each of ``vms`` run, unpaused, with devices: started (a VM that holds one of its
    devices destroyed first), or restarted if it runs without any. Until all of them do: the
    VM holding a device the next one wants may be one of them (it hot-added it)."""
    work = c.work
    assert work is not None
    paused_dir = h.hv_dir() / "paused"

    def ready(x: str) -> bool:
        return bool(live_devices(h, x)) and not (paused_dir / f"{x}.xml").exists()

    while not all(ready(x) for x in vms):
        for x in vms:
            while not ready(x):
                if live_devices(h, x) is not None:  # without devices (hot-removed) or paused
                    work.call(h, "vm", "destroy", x)
                for wanted in VMS[h.node][x]:
                    _free_up(c, wanted, deadline, say)
                work.call(h, "vm", "start", x)
                assert time.monotonic() < deadline, f"{h.node}/{x} never ran with its devices"


def _not_held(c: Cluster, h: NHost, vm: str) -> list[str]:
    """The devices ``vm`` uses that the registry does not say it holds, with their holders."""
    with open_fabric(c.direct_url, "alpha") as f:
        holders = {st.fdid: st.holder for st in f.devices()}
    out = []
    for fdid in sorted(live_devices(h, vm) or ()):
        held = holders.get(fdid)
        if held is None or (held.node, held.vm) != (h.node, vm):
            out.append(f"{fdid:#x} (held by {held or 'nobody'})")
    return out


def cut_and_kill_paused(c: Cluster, rng: random.Random, say: Say) -> None:
    """kill -9 of an agent whose guard has paused its VMs, not restarted until its lease
    ended. Two VMs of one host run with their devices, and an operator pauses one. The host
    is cut off from etcd until the guard has paused a running VM with devices; then its agent
    is killed and the cut heals. While no agent runs there, the lenders take the devices back
    and a VM of another host takes one of the two paused VMs' devices. The restarted agent
    must know which paused VMs were its predecessor's (their pause marks): those it recovers
    (re-reserve or unplug, then resume) and the operator's stays paused, without a device
    another host holds by then, so the operator's resume is safe (resumed here once the
    agent's start-up is done)."""
    work = c.work
    assert work is not None
    node = rng.choice(sorted(VMS))
    h = c.host(node)
    assert h.host.agent is not None
    paused_dir = h.hv_dir() / "paused"
    with ExitStack() as claims:
        for name in sorted(VMS[node]):
            claims.enter_context(work.claim(node, name))
        deadline = time.monotonic() + WAIT
        vm, operators = rng.sample(sorted(VMS[node]), 2)
        wanted_here = {f for x in (vm, operators) for f in VMS[node][x]}
        with ExitStack() as kept:
            for fdid in sorted(wanted_here):  # the workload elsewhere would race for them
                kept.enter_context(work.keep_off(fdid))
            _start_with_devices(c, h, (vm, operators), deadline, say)
        hv = SimHypervisor(node, h.hv_dir(), None)
        offset = h.log_size()
        hv.suspend(operators)  # an operator's pause: no hook, no pause mark
        say(
            f"cut {node} off from etcd until its guard pauses {vm} ({operators} paused by an"
            " operator)"
        )
        for p in h.proxies:
            p.cut()
        deadline = time.monotonic() + TTL
        while not (paused_dir / f"{vm}.xml").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not (paused_dir / f"{vm}.xml").exists():
            for p in h.proxies:
                p.heal()
            hv.resume(operators)
            say(f"{node}/{vm} was not paused within {TTL:g} s; healed, nothing killed")
            return
        h.open_window()
        h.kill_agent()
        h.host.agent.wait(20)
        for p in h.proxies:
            p.heal()
        say(f"{node}/{vm} paused; kill -9 the agent of {node}, restart it after {PAST_TTL:g} s")
        time.sleep(PAST_TTL)
        # one of the two VMs' devices: the agent's or the operator's pause is explored
        taken = sorted(live_devices(h, rng.choice((vm, operators))) or ())
        if taken:
            _hot_add_elsewhere(c, node, rng.choice(taken), say)
        h.start_agent()
        h.close_window()
        deadline = time.monotonic() + WAIT
        while (paused_dir / f"{vm}.xml").exists() and live_devices(h, vm) is not None:
            assert time.monotonic() < deadline, f"{node}/{vm} stayed paused after the restart"
            time.sleep(0.05)
        say(f"{node}/{vm} runs again" if live_devices(h, vm) is not None else f"{vm} stopped")
        _operator_resumes(c, h, hv, operators, offset, say)


def freeze_hook_and_kill_agent(c: Cluster, rng: random.Random, say: Say) -> None:
    """SIGSTOP of a hook mid-prepare and kill -9 of its host's agent until the lease ended."""
    freeze_hook(c, rng, say, kill=True)


#: A lease blip: a cut longer than TTL/2 (the lease comes in doubt, and the guard pauses) and
#: shorter than the TTL. The keepalive sends every TTL/5, so the last renewal answered before
#: the cut was sent at most TTL/5 before it: the lease is in doubt at most TTL/2 after the cut,
#: and etcd ends it no earlier than TTL - TTL/5 after it (a renewal in flight is relayed at the
#: heal: the lease is usually kept, and a loss is handled like any other).
BLIP = 0.65 * TTL


def freeze_hook_and_blip(c: Cluster, rng: random.Random, say: Say) -> None:
    """A hook hung mid-prepare and a lease blip on the same host (issue 35, defect B). One VM
    is started with its prepare hook run in its own process and
    ``VMLEND_FAULT=prepare:after-device=STOP`` (as ``freeze_hook``): the hook stops once it
    holds a device, holding its domain, so every listing of the host's domains waits for it.
    Meanwhile another VM of the host is started, its prepare served by the agent, which
    announces it to the guard (the census's listing cannot see it). Then the host is cut off
    from etcd for ``BLIP`` s and healed, and the hook let go. The second VM must have been
    paused during the blip (its log: ``VM <name>: running -> paused``) and run again after it;
    the sampler checks that no device was in two VMs meanwhile; the pause must come within
    TTL of the cut (later, etcd may have ended the lease)."""
    work = c.work
    assert work is not None
    node = rng.choice(sorted(VMS))
    h = c.host(node)
    hung, other = rng.sample(sorted(VMS[node]), 2)
    paused = h.hv_dir() / "paused" / f"{other}.xml"
    with ExitStack() as held:
        for vm in (hung, other):
            held.enter_context(work.claim(node, vm))
        for fdid in sorted({*VMS[node][hung], *VMS[node][other]}):
            held.enter_context(work.keep_off(fdid))  # no other VM of the workload takes them
        deadline = time.monotonic() + WAIT
        for vm in (hung, other):
            if live_devices(h, vm) is not None:
                work.call(h, "vm", "destroy", vm)
        start = ("vm", "start", hung)
        while True:
            _free_up(c, VMS[node][hung][0], deadline, say)
            if (frozen := _start_frozen(h, start, "prepare:after-device", work)) is not None:
                break
            last = work.calls[-1] if work.calls else None
            assert time.monotonic() < deadline, f"the hook of {node}/{hung} never froze: {last}"
        try:
            say(
                f"SIGSTOP the hook of {node}/{hung} mid-prepare (pid {frozen.hook});"
                f" start {other} meanwhile"
            )
            offset = h.log_size()
            _start_kept(c, h, other, deadline, say)
            # its worker has seen it run (announced by its prepare hook, then looked at)
            seen = re.compile(rf"vmlend: VM {other}: (?:starting -> running|guarded \(running\))")
            while not seen.search(h.log_since(offset)):
                late = time.monotonic() > deadline
                assert not late, f"{node}'s guard never saw {other} run:\n{h.log_since(offset)}"
                time.sleep(0.05)
            lease = h.host.published_lease()
            say(f"{node}/{other} runs; cut {node} off from etcd for {BLIP:g} s (a lease blip)")
            for p in h.proxies:
                p.cut()
            cut = time.monotonic()
            paused_after = None  # seen paused, seconds after the cut
            while (since := time.monotonic() - cut) < BLIP:
                if paused_after is None and paused.exists():
                    paused_after = since
                time.sleep(0.02)
            for p in h.proxies:
                p.heal()
            # The doubt begins TTL/2 after the last renewal sent before the cut, so on a loaded
            # machine the pause may land just after the heal (seed 3 saw it after the heal, the
            # machine loaded): it still counts until TTL after the cut (a bound looser than the
            # lease's real end, last renewal + TTL, by up to one renewal interval).
            while paused_after is None and (since := time.monotonic() - cut) < TTL:
                if paused.exists():
                    paused_after = since
                time.sleep(0.02)
            while paused.exists() and live_devices(h, other) is not None:
                assert time.monotonic() < deadline, f"{node}/{other} stayed paused after the blip"
                time.sleep(0.05)
        finally:
            done = _let_go(h, work, frozen)
        said = f": {done.stderr.strip()}" if done.returncode else ""
        kept = "kept" if h.host.published_lease() == lease else "lost"
        say(f"healed ({node} {kept} its lease); the hook went on: {done.describe()}{said}")
        log = h.log_since(offset)
        pauses = re.findall(rf"vmlend: VM {other}: running -> paused: [^\n]*", log)
        assert paused_after is not None and pauses, (
            f"{node}'s guard did not pause {other} during the lease blip (paused"
            f" {'never' if paused_after is None else f'{paused_after:.2f} s after the cut'}):"
            f"\n{log}"
        )
        say(
            f"{node}'s guard paused {other} {paused_after:.2f} s after the cut:"
            f" {pauses[0].removeprefix('vmlend: ')}"
        )


#: The line (INFO) of a process that met a damaged chunk of its host's copy of the topology
#: (``vmlend.registry.topocache``): what it did with the copy, then "reading the registry".
_DAMAGED_COPY = re.compile(
    r"this host's copy of the topology \S+ is damaged \(([^)]*)\); ([^;]*); reading the registry"
)


@dataclass(frozen=True)
class _Copy:
    """A host's copy of the topology as its file holds it: the head, where the content
    starts, the chunks' digests and the content."""

    head: TopologyHead
    at: int
    digests: bytes
    content: bytes

    def whole(self) -> bool:
        """Its digests are the ones its head names and every chunk hashes to its own."""
        return root_of(self.digests) == self.head.sha256 and digests_of(self.content) == (
            self.digests
        )


def _copy_dir(h: NHost) -> Path:
    return HostEnv(h.host.root).topology_cache


def _read_copy(h: NHost) -> tuple[Path, _Copy] | None:
    """The host's one copy (its registry's) and what it holds; None when there is none."""
    paths = sorted(_copy_dir(h).glob("*.topology")) if _copy_dir(h).is_dir() else []
    assert len(paths) <= 1, f"{h.node} keeps copies of more than one registry: {paths}"
    try:
        data = paths[0].read_bytes() if paths else None
    except FileNotFoundError:  # removed between the listing and the read
        data = None
    if data is None:
        return None
    first = data.index(b"\n")
    second = data.index(b"\n", first + 1)
    assert data[:first] == CACHE_FORMAT, data[:first]
    head = msgspec.json.decode(data[first + 1 : second], type=TopologyHead)
    assert head.format != PIECES_FORMAT_1, head.format  # a new fabric is of format 2
    at = second + 1 + chunks_in(head.size) * DIGEST_BYTES
    return paths[0], _Copy(head, at, data[second + 1 : at], data[at:])


def _damage_met(
    h: NHost, offsets: tuple[int, int], calls: list[CliCall]
) -> list[tuple[str, str, str]]:
    """Who logged the line about a damaged copy since ``offsets`` (of ``h``'s agent.log
    and hook.log): "agent", "hook", or a CLI call of ``calls`` on ``h``; with the problem it
    saw and what it did with the copy."""
    met = []
    hook_log = h.host.root / "hook.log"
    hooks = ""
    if hook_log.exists():
        with hook_log.open("rb") as f:
            f.seek(offsets[1])
            hooks = f.read().decode(errors="replace")
    for who, text in [("agent", h.log_since(offsets[0])), ("hook", hooks)] + [
        (f"vmlend {' '.join(x.argv)} (-> {x.returncode})", x.stderr)
        for x in calls
        if x.node == h.node
    ]:
        if found := _DAMAGED_COPY.search(text):
            met.append((who, found.group(1), found.group(2)))
    return met


def damage_copy(c: Cluster, rng: random.Random, say: Say) -> None:
    """A damaged copy of the topology on one host, met by a fresh process. The host's agent is
    killed (kill -9) and bytes of one chunk of the content of the host's copy of the topology
    flipped (its two lines and its chunks' digests left as they were, so the copy opens and
    the damage is met at that chunk's first use); then the agent is started again while the
    workload goes on. Whichever process of the host meets the damage first (the agent's
    start-up, a hook mid-prepare, a CLI call) must read the chunk from the registry's pieces
    instead, remove the copy and go on (the agent's log says so: INFO); the next process
    that reads the pieces writes the copy whole again, with the same content (if the workload
    has not within a TTL, a ``vmlend devices`` of the test's does). A failed CLI call that met
    it must still say one line (the run's check). The test's topology is one chunk (under 16 KiB):
    the damage is met when a process first reads the topology's header."""
    work = c.work
    assert work is not None
    h = c.host(rng.choice(sorted(VMS)))
    assert h.host.agent is not None
    deadline = time.monotonic() + WAIT
    while (found := _read_copy(h)) is None or not found[1].whole():  # written at start-up
        assert time.monotonic() < deadline, f"{h.node} keeps no whole copy of the topology"
        time.sleep(0.1)
    path, copy = found
    hook_log = h.host.root / "hook.log"
    offsets = (h.log_size(), hook_log.stat().st_size if hook_log.exists() else 0)
    calls = len(work.calls)
    h.open_window()
    h.kill_agent()
    h.host.agent.wait(20)
    chunk = rng.randrange(chunks_in(copy.head.size))
    start = chunk * CHUNK_BYTES
    spots = sorted(
        rng.sample(range(start, min(start + CHUNK_BYTES, copy.head.size)), rng.randint(1, 4))
    )
    with path.open("r+b") as f:  # in place, as a disk or a stray write damages a file
        for spot in spots:
            f.seek(copy.at + spot)
            f.write(bytes([copy.content[spot] ^ rng.randrange(1, 256)]))
    damaged = _read_copy(h)
    assert damaged is not None and not damaged[1].whole(), f"{path} was not damaged"
    say(
        f"kill -9 the agent of {h.node}; flip {len(spots)} byte(s) of chunk {chunk} of its"
        f" copy of the topology ({path.name}, bytes {', '.join(map(str, spots))} of"
        f" {copy.head.size}); restart the agent"
    )
    h.start_agent()
    h.close_window()
    # The agent's start-up reads the topology: by its end a process of the host has met the
    # damage, read past it and removed the copy (a good one may be there again already).
    deadline = time.monotonic() + WAIT
    while (now := _read_copy(h)) is not None and now[1].content == damaged[1].content:
        late = time.monotonic() > deadline
        assert not late, f"{h.node}'s damaged copy of the topology was never removed"
        time.sleep(0.05)
    met = _damage_met(h, offsets, work.calls[calls:])
    for who, problem, done in met:
        say(f"{h.node}: met by {who}: the copy is damaged ({problem}); {done}")
    if not met:  # said at INFO: a hook's action log and a CLI call at its default level omit it
        say(f"{h.node}: the damaged copy was removed by a hook or a CLI call (said at INFO)")
    kept = [who for who, _problem, done in met if done != "it was removed"]
    assert not kept, f"{h.node}: a damaged copy of the topology was not removed by {kept}"
    rewriter = "the workload"
    deadline = time.monotonic() + TTL
    while (again := _read_copy(h)) is None or not again[1].whole():
        if time.monotonic() > deadline and rewriter == "the workload":
            rewriter = "vmlend devices"  # a read of the pieces on the host writes the copy
            r = h.cli("devices")
            assert r.returncode == 0, f"{h.node}: vmlend devices: {r.stderr}"
            deadline = time.monotonic() + WAIT
        assert time.monotonic() < deadline, f"{h.node}'s copy of the topology stays damaged"
        time.sleep(0.05)
    assert again[1].head == copy.head and again[1].content == copy.content
    say(f"{h.node}'s copy of the topology was written whole again (by {rewriter})")


#: Every nemesis, by name. The CI's fixed seed runs each once (a shuffled list of them all).
NEMESES: dict[str, Nemesis] = {
    "kill": kill_agent,
    "kill-late": kill_agent_late,
    "freeze": freeze_agent,
    "freeze-start": freeze_agent_in_start_up,
    "hook": freeze_hook,
    "release": freeze_release,
    "cut": cut_host,
    "quorum": lose_quorum,
    "leader": kill_leader,
    "stall": stall_domain,
    "copy": damage_copy,
    "commit+kill": kill_agent_after_commit,
    # combined
    "hook+kill-late": freeze_hook_and_kill_agent,
    "hook+blip": freeze_hook_and_blip,
    "release+kill-late": freeze_release_and_kill_agent,
    "attach+kill-late": freeze_attach_and_kill_agent,
    "cut+kill-paused": cut_and_kill_paused,
    "cut+leader": together(cut_host, kill_leader),
    "freeze+quorum": together(freeze_agent, lose_quorum),
}


def seed_from_env(default: int) -> int:
    return int(os.environ.get("VMLEND_NEMESIS_SEED") or default)
