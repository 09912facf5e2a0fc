"""Hosts as separate processes sharing one real etcd (each its own VMLEND_ROOT, VMLEND_NODE
and ``vmlend agent``), and a checker over the registry's history. Every process is started by
the tests and stopped by its PID."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.support.hostroot import identify
from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, new_domain
from vmlend.registry import parse_location
from vmlend.registry.etcd_gateway import EtcdGateway
from vmlend.registry.etcd_keys import Keys
from vmlend.topology.model import Holder

TTL = 2  # etcd's minimum lease
INTERVAL = 0.2
#: How long after the TTL a dead borrower's device may take to be borrowable again: the
#: lender agent's scan interval, one transaction, and slack for a loaded CI machine.
REUSE_BOUND = 3.0
VMLEND = str(Path(sys.executable).parent / "vmlend")  # the console script of this venv
GPU, NIC = 0x10, 0x20  # lent by alpha and by beta in the default topology

WEB = Holder("gamma", "web", "11111111-1111-1111-1111-111111111111")
DB = Holder("beta", "db", "22222222-2222-2222-2222-222222222222")


class Host:
    """One simulated host: a root directory, a node name and (maybe) its agent process."""

    def __init__(self, url: str, node: str, root: Path) -> None:
        self.url, self.node, self.root = url, node, root
        self.agent: subprocess.Popen | None = None
        #: More environment for every process of this host (its agent, hooks, CLI calls).
        self.extra_env: dict[str, str] = {}
        root.mkdir(parents=True, exist_ok=True)
        self.machine_id = identify(root)

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "VMLEND_REGISTRY": self.url,
            "VMLEND_NODE": self.node,
            "VMLEND_ROOT": str(self.root),
            "VMLEND_STATE": str(self.root / "state.db"),
            **self.extra_env,
        }

    @property
    def lease_file(self) -> Path:
        return self.root / "run" / "vmlend" / "agent.lease"

    def start_agent(self, *extra: str) -> None:
        """Start the agent and wait until it serves: its lease published and, when it guards
        a hypervisor (``--connect``), its start-up (recovery, reconcile) done. A test that
        freezes the agent next freezes it in its loop, not somewhere in its start-up."""
        offset = len(self.log()) if (self.root / "agent.log").exists() else 0
        log = (self.root / "agent.log").open("ab")
        self.agent = subprocess.Popen(
            [VMLEND, "agent", "--ttl", str(TTL), "--interval", str(INTERVAL), *extra],
            env=self.env,
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        deadline = time.monotonic() + 20
        while not self._published_by(self.agent.pid):
            assert self.agent.poll() is None, self.log()
            assert time.monotonic() < deadline, f"agent of {self.node} never published its lease"
            time.sleep(0.05)
        while "--connect" in extra and "start-up reconcile of" not in self.log()[offset:]:
            assert self.agent.poll() is None, self.log()
            assert time.monotonic() < deadline, f"agent of {self.node} never finished start-up"
            time.sleep(0.05)

    def _published_by(self, pid: int) -> bool:
        """Whether the lease file is this agent's (a killed one leaves its own behind)."""
        try:
            return json.loads(self.lease_file.read_text())["pid"] == pid
        except (OSError, ValueError):
            return False

    def published_lease(self) -> int | None:
        """The lease in the host's lease file; None while there is none (an agent that lost
        its lease withdraws the file before it publishes the next one)."""
        try:
            return int(json.loads(self.lease_file.read_text())["lease"])
        except (OSError, ValueError, KeyError):
            return None

    def log(self) -> str:
        return (self.root / "agent.log").read_text(errors="replace")

    def stop_agent(self, sig: int = signal.SIGTERM) -> int | None:
        if self.agent is None or self.agent.poll() is not None:
            return None if self.agent is None else self.agent.returncode
        self.agent.send_signal(sig)
        if sig in (signal.SIGTERM, signal.SIGKILL):
            return self.agent.wait(20)
        return None

    def run(self, code: str) -> subprocess.CompletedProcess:
        """Python ``code`` run as a process of this host (like its hook or CLI)."""
        return subprocess.run(
            [sys.executable, "-c", code], env=self.env, capture_output=True, text=True, timeout=60
        )

    def vmlend(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [VMLEND, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )


def reserve_code(fdid: int, holder: Holder) -> str:
    return (
        "from vmlend.wiring.fabric import open_fabric\n"
        "from vmlend.topology.model import Holder\n"
        "import os\n"
        f"f = open_fabric(os.environ['VMLEND_REGISTRY'], os.environ['VMLEND_NODE'])\n"
        f"h = Holder({holder.node!r}, {holder.vm!r}, {holder.vm_uuid!r})\n"
        f"print(f.reserve({fdid}, h).state)\n"
    )


def history(url: str) -> list[dict[int, tuple[str | None, str | None]]]:
    """Per revision from 1 to now, per device: (holder of its hold, holder of its fence)."""
    loc = parse_location(url)
    gw = EtcdGateway(loc.endpoints)
    keys = Keys(loc.cluster)
    now, _ = gw.range(keys.holds, keys.holds + "\xff")
    out = []
    for rev in range(1, now + 1):
        state: dict[int, list[str | None]] = {}
        for prefix, slot in ((keys.holds, 0), (keys.fences, 1)):
            _r, kvs = gw.range(prefix, prefix[:-1] + "0", revision=rev)
            for kv in kvs:
                d = json.loads(kv.value)
                state.setdefault(int(d["fdid"]), [None, None])[slot] = f"{d['node']}/{d['vm']}"
        out.append({f: (h, fe) for f, (h, fe) in state.items()})
    gw.close()
    return out


def check_never_two_holders(history) -> None:
    """A device's fence changes hands only through its absence (the lender took it back),
    and every hold has the fence of its own holder: no revision lets two holders use it."""
    last_fence: dict[int, str | None] = {}
    for snapshot in history:
        for fdid in set(last_fence) | set(snapshot):
            hold, fence = snapshot.get(fdid, (None, None))
            if hold is not None:
                assert fence == hold, (fdid, hold, fence)
            before = last_fence.get(fdid)
            assert before is None or fence is None or fence == before, (fdid, before, fence)
            last_fence[fdid] = fence


def domain_xml(
    name: str,
    vm_uuid: str,
    fdids: tuple[int, ...],
    memory: int = 512 * 2**20,
    machine: str = "q35",
) -> bytes:
    """A vmlend domain (512 MiB q35 unless told) using ``fdids``."""
    spec = DomainSpec(
        name=name,
        memory_bytes=memory,
        machine=machine,
        uuid=uuid.UUID(vm_uuid),
        devices=[DeviceRequest(f) for f in fdids],
    )
    return new_domain(spec, templates=TemplateSet()).to_bytes()


def stopped_children(pid: int) -> list[int]:
    """The stopped (SIGSTOP) child processes of ``pid``: a hook that stopped itself at a
    ``VMLEND_FAULT=...=STOP`` point, found under the CLI call that runs it."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] == "T" and int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out
