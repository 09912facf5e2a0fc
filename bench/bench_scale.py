"""The fabric's size against what a host pays, side by side in one run (issue 38; prints times
and ratios to the smallest size; asserts nothing). Not part of ``make bench``: at 1,024 nodes
it takes minutes; it prints its own run time.

For each size (``--sizes``, default 64, 256 and 1,024 nodes of 16 devices, one switch:
``fabric_topology``) and each registry (``--registries``: SQLite, and a private etcd with
etcd's *default* request limits, 1.5 MiB and 128 operations):

- init: ``init_fabric`` of the topology (parse, compile, store its generation);
- lend-all: ``vmlend lend --all`` on node n0 in its own process (n0's 16 devices are not
  lent by the topology), a CLI command as a host runs it;
- devices --json: ``vmlend devices --json`` in its own process, median of ``--rounds`` (the
  host's copy of the topology current: the first run after init is not counted), and the
  same with ``--lender n0`` (one lender's 16 devices: the output no longer grows).
  CLI commands are measured in CPU time (user + system) of the child: the machine these
  figures come from is shared, and wall time there says more about the others' load;
- the same whole listing split in one child process: the fixed part (interpreter, imports,
  opening the fabric), reading every device's state, building and printing the JSON: what
  must not grow with the fabric, and what is the listing's size;
- hook prepare: the installed libvirt hook (a new process, as libvirtd runs it, no agent:
  the hook does the work itself) preparing a VM on n1 with 4 devices of the lender half the
  fabric away, then releasing it; the prepare's CPU time, median of ``--rounds``;
- reserve CPU p50: ``--vms`` one-device VMs reserved one after the other through one open
  fabric (this process's CPU, ``time.process_time``), the median of the first 100 and of the
  last 100 reserves.

With ``--crowd VMS`` it measures instead what issue 38's point 3 names: at each size, a
fresh fabric, then VMS VMs holding two devices each (two reserves, each VM on the node half
the fabric away from its lender), reserved one after the other through one open fabric; the
median CPU of the first and of the last 100 admitted reserves, and the refusals (a resource
exhausted: LUT entries, window segments) counted apart. Each of those first and last
reserves is followed by one on a twin fabric kept nearly empty, and the ratio is also given
with each end over its twin's (the machine's speed drifts between the two ends).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests.* helpers

from tests.support.etcd_daemon import EtcdServer, host_lease
from tests.support.simfabric import fabric_topology
from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, new_domain
from vmlend.errors import ResourceExhaustedError
from vmlend.hook.install import install_hook
from vmlend.sim.backend import SimFabric
from vmlend.topology.model import GiB, Holder, MiB
from vmlend.wiring.fabric import init_fabric, open_fabric

PER_NODE = 16
WINDOW = 100
ms = 1e3


def topology(nodes: int) -> str:
    """``fabric_topology`` with node n0's devices not lent (what lend-all then lends)."""
    text = fabric_topology(nodes, PER_NODE)
    head, sep, rest = text.partition('[[node]]\nname = "n1"')
    return head.replace('  kind = "nic"\n', '  kind = "nic"\n  lent = false\n') + sep + rest


def _fdid(node: int, i: int) -> int:
    return (node + 1) * 0x100 + i


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cli_time(argv: list[str], env: dict[str, str], stdin: bytes = b"") -> float:
    """The command's CPU time (user + system): on a machine others share, the steadier
    figure; its wall time grows with everybody else's load."""
    c = _children_cpu()
    subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL, input=stdin)
    return _children_cpu() - c


#: ``vmlend devices --json``'s steps in one child process, each step's CPU printed: the
#: fixed part (interpreter, imports, opening the fabric and its topology), reading every
#: device's state, and building and printing the JSON (to /dev/null).
_LISTING = """
import io, json, sys, time
from vmlend.wiring.fabric import open_fabric
from vmlend.views.devices import device_json
f = open_fabric(sys.argv[1], None, observer=True)
f.topology().node("n0")
a = time.process_time()
every = f.devices()
b = time.process_time()
out = io.StringIO()
json.dump({"format": "vmlend/1", "devices": [device_json(st) for st in every]}, out, indent=2)
sys.stdout.write(out.getvalue())
c = time.process_time()
sys.stderr.write(f"{b - a} {c - b}\\n")
"""


def listing_split(location: str, env: dict[str, str]) -> tuple[float, float, float]:
    """The whole listing's CPU as (fixed part, reading every device's state, the JSON)."""
    c = _children_cpu()
    done = subprocess.run(
        [sys.executable, "-c", _LISTING, location],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    total = _children_cpu() - c
    read, output = (float(x) for x in done.stderr.split())
    return total - read - output, read, output


def hook_prepare_cpu(location: str, nodes: int, env: dict[str, str], rounds: int) -> float:
    """The installed hook's prepare of a 4-device VM on n1 (devices of the node half the
    fabric away), in its own process without an agent: the median CPU of ``rounds``."""
    root = Path(env["VMLEND_ROOT"])
    lender = nodes // 2
    devices = [DeviceRequest(_fdid(lender, i)) for i in range(4)]
    spec = DomainSpec(
        name=f"hook-vm-{nodes}", memory_bytes=4096 * MiB, uuid=uuid.uuid4(), devices=devices
    )
    xml = new_domain(spec, templates=TemplateSet()).to_bytes()
    sqlite = location.removeprefix("sqlite://") if location.startswith("sqlite://") else None
    base = root.parent / f"hook-{'sqlite' if sqlite else 'etcd'}-{nodes}"
    hook = install_hook(
        base / "libvirt",
        Path(sqlite) if sqlite else root / "unused.db",  # under the root; etcd: unused
        "n1",
        registry=None if sqlite else location,
        config_file=base / "vmlend.toml",
        root=root,
    ).path
    hook_env = {k: v for k, v in env.items() if not k.startswith("VMLEND_")}
    hook_env["VMLEND_BACKEND"] = env["VMLEND_BACKEND"]
    argv = [str(hook), spec.name]
    cpu = []
    for _ in range(rounds + 1):  # the first: page cache and the host's copy (etcd) warm
        cpu.append(cli_time([*argv, "prepare", "begin", "-"], hook_env, xml))
        cli_time([*argv, "release", "end", "-"], hook_env, xml)
    return statistics.median(cpu[1:])


def reserve_p50(location: object, nodes: int, vms: int) -> tuple[float, float]:
    """``vms`` one-device VMs (at most one per lent device), each on the node half the fabric
    away from its device's lender; the median CPU of the first and of the last 100 reserves."""
    vms = min(vms, (nodes - 1) * PER_NODE)
    f = open_fabric(location, "n1")  # type: ignore[arg-type]
    assert isinstance(f, SimFabric)
    cpu: list[float] = []
    try:
        for vm in range(vms):
            lender = 1 + (vm // PER_NODE) % (nodes - 1)  # n0's devices are not lent
            holder = Holder(f"n{(lender + nodes // 2) % nodes}", f"vm{vm}")
            c = time.process_time()
            f.reserve(_fdid(lender, vm % PER_NODE), holder, guest_ram=GiB)
            cpu.append(time.process_time() - c)
    finally:
        f.close()
    return statistics.median(cpu[:WINDOW]), statistics.median(cpu[-WINDOW:])


def _crowd_reserve(f: SimFabric, nodes: int, vm: int, n: int) -> float | None:
    """Reserve device ``n`` (of the fabric's numbering) for VM ``vm`` half the fabric away
    from its lender; its CPU time, or None when refused for want of a resource."""
    lender = 1 + n // PER_NODE
    holder = Holder(f"n{(lender + nodes // 2) % nodes}", f"vm{vm}")
    c = time.process_time()
    try:
        f.reserve(_fdid(lender, n % PER_NODE), holder, guest_ram=GiB)
    except ResourceExhaustedError:
        return None
    return time.process_time() - c


def crowd(location: str, control: str, nodes: int, vms: int) -> dict[str, float]:
    """``vms`` two-device VMs on a fresh fabric of ``nodes`` nodes (``--crowd``): the CPU of
    each admitted reserve, the refusals apart. Beside the first and the last ``WINDOW``
    reserves, each followed by one on a twin fabric at ``control`` that stays nearly empty
    (its first VMs, one reserve each time): the same work at both ends, so the machine's own
    speed, which drifts by tens of percent over the minutes between them on a shared machine,
    divides out of the ratio of the two ratios."""
    init_fabric(location, topology(nodes), "generated.toml")
    init_fabric(control, topology(nodes), "generated.toml")
    f = open_fabric(location, "n1")  # type: ignore[arg-type]
    twin = open_fabric(control, "n1")  # type: ignore[arg-type]
    assert isinstance(f, SimFabric) and isinstance(twin, SimFabric)
    lent = (nodes - 1) * PER_NODE  # n0's devices are not lent
    total = min(vms, lent // 2)
    cpu: list[float] = []
    beside: dict[str, list[float]] = {"first": [], "last": []}
    refused = 0
    twin_n = 0
    t = time.perf_counter()
    try:
        for vm in range(total):
            for n in (2 * vm, 2 * vm + 1):
                took = _crowd_reserve(f, nodes, vm, n)
                if took is None:
                    refused += 1
                    continue
                cpu.append(took)
                end = "first" if n < WINDOW else "last" if n >= 2 * total - WINDOW else ""
                if end:
                    twin_took = _crowd_reserve(twin, nodes, twin_n // 2, twin_n)
                    twin_n += 1
                    if twin_took is not None:
                        beside[end].append(twin_took)
    finally:
        f.close()
        twin.close()
    first, last = statistics.median(cpu[:WINDOW]), statistics.median(cpu[-WINDOW:])
    twin_first, twin_last = (statistics.median(beside[e]) for e in ("first", "last"))
    return {
        "VMs": total,
        "reserves admitted": len(cpu),
        "reserves refused": refused,
        "run s": time.perf_counter() - t,
        "reserve CPU p50 first 100 ms": first * ms,
        "reserve CPU p50 last 100 ms": last * ms,
        "last/first": last / first,
        "  empty twin beside first ms": twin_first * ms,
        "  empty twin beside last ms": twin_last * ms,
        "last/first, each over its twin": (last / twin_last) / (first / twin_first),
    }


def measure(location: str, nodes: int, env: dict[str, str], args: argparse.Namespace) -> dict:
    cli = [str(Path(sys.executable).with_name("vmlend"))]
    where = ["--registry", location]
    text = topology(nodes)
    t = time.perf_counter()
    init_fabric(location, text, "generated.toml")
    out: dict[str, float] = {"init s": time.perf_counter() - t}
    out["lend-all CPU s"] = cli_time([*cli, *where, "--node", "n0", "lend", "--all"], env)
    for label, extra in (
        ("devices --json CPU ms", []),
        ("devices --json --lender CPU ms", ["--lender", "n0"]),
    ):
        cmd = [*cli, *where, "devices", "--json", *extra]
        cli_time(cmd, env)  # the host's copy written (etcd), the page cache warm
        out[label] = statistics.median(cli_time(cmd, env) for _ in range(args.rounds)) * ms
    splits = [listing_split(location, env) for _ in range(args.rounds)]
    for i, what in enumerate(("fixed part", "reading states", "JSON output")):
        out[f"  devices --json: {what} ms"] = statistics.median(x[i] for x in splits) * ms
    out["hook prepare CPU ms"] = hook_prepare_cpu(location, nodes, env, args.rounds) * ms
    first, last = reserve_p50(location, nodes, args.vms)
    out["reserve CPU p50 first 100 ms"] = first * ms
    out["reserve CPU p50 last 100 ms"] = last * ms
    out["topology text MB"] = len(text) / 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="64,256,1024", help="node counts (16 devices each)")
    ap.add_argument("--registries", default="sqlite,etcd")
    ap.add_argument("--vms", type=int, default=400, help="VMs reserved per size (>= 200)")
    ap.add_argument("--rounds", type=int, default=5, help="runs of each CLI command")
    ap.add_argument(
        "--crowd", type=int, default=0, help="instead: this many two-device VMs at each size"
    )
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        env = {k: v for k, v in os.environ.items() if not k.startswith("VMLEND_")}
        env |= {"VMLEND_ROOT": str(root / "host"), "VMLEND_BACKEND": "sim"}
        (root / "host").mkdir()
        os.environ.update({k: env[k] for k in ("VMLEND_ROOT", "VMLEND_BACKEND")})
        server: EtcdServer | None = None
        try:
            for registry in args.registries.split(","):
                if registry == "etcd":
                    server = EtcdServer(root / "etcd")  # etcd's default limits
                    server.start()
                    host_lease(server, root / "host", ttl=3600)
                rows: dict[int, dict[str, float]] = {}
                for nodes in sizes:
                    location = (
                        server.url(f"size{nodes}")
                        if registry == "etcd" and server is not None
                        else f"sqlite://{root / 'host' / f'size{nodes}.db'}"  # the hook's root
                    )
                    if args.crowd:
                        control = (
                            server.url(f"size{nodes}-twin")
                            if registry == "etcd" and server is not None
                            else f"sqlite://{root / 'host' / f'size{nodes}-twin.db'}"
                        )
                        rows[nodes] = crowd(location, control, nodes, args.crowd)
                    else:
                        rows[nodes] = measure(location, nodes, env, args)
                    print(f"  ({registry} {nodes} nodes measured)", file=sys.stderr)
                report(registry, sizes, rows)
                if server is not None:
                    server.stop()
                    server = None
        finally:
            if server is not None:
                server.stop()
    print(f"run time {time.perf_counter() - start:.0f} s; load average {os.getloadavg()}")


def report(registry: str, sizes: list[int], rows: dict[int, dict[str, float]]) -> None:
    base = sizes[0]
    print(f"\n{registry}: {PER_NODE} devices per node; ratio to {base} nodes in brackets")
    print(f"  {'':32}" + "".join(f"{n:>20}" for n in sizes))
    for metric in rows[base]:
        cells = []
        for n in sizes:
            v, v0 = rows[n][metric], rows[base][metric]
            cells.append(f"{v:10.2f} ({v / v0:5.2f}x)" if v0 else f"{v:10.2f}")
        print(f"  {metric:32}" + "".join(f"{c:>20}" for c in cells))


if __name__ == "__main__":
    main()
