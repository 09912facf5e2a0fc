"""The cluster registry, side by side in one run (prints times and ratios; asserts nothing).

1. reserve+release p50/p99: SQLite vs etcd (a private etcd on loopback, fast election flags).
2. Admission at scale: 500 VMs with two remote devices each on a generated 60-node,
   1,020-device fabric, on each backend: total time, and the mean reserve latency of the
   first 50 VMs vs the last 50 (it should stay flat: a reserve reads only the device, its hold,
   its lender and the claims of the two adapters on its path). For contrast, the admission
   decision alone with the whole-fabric view the registry used to hand it vs the narrow one.
   Then one VM's reserve+release on a node where 200 other VMs hold devices, against the
   same on an empty node.
3. A borrower host's death: ``vmlend agent`` processes for a lender and a borrower; the
   borrower's agent is killed with SIGKILL; time until another host can reserve the device.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests.* helpers

from tests.support.etcd_daemon import EtcdServer, host_lease
from tests.support.hostroot import identify
from tests.support.simfabric import fabric_topology
from vmlend.errors import DeviceFencedError, DeviceHeldError, LenderUnavailableError
from vmlend.ledger.admission import StateView, admit
from vmlend.sim.backend import SimFabric
from vmlend.topology.model import GiB, Holder
from vmlend.wiring.fabric import default_topology_text, init_fabric, open_fabric

CYCLES = 200
VMS = 500
NODES, PER_NODE = 60, 17
TTL = 2
ms = 1e3


def _percentiles(samples: list[float]) -> tuple[float, float]:
    qs = statistics.quantiles(samples, n=100)
    return qs[49], qs[98]


def reserve_release(location) -> list[float]:
    text, source = default_topology_text()
    init_fabric(location, text, source, node="gamma")
    f = open_fabric(location, "gamma")
    h = Holder("gamma", "bench")
    out = []
    for _ in range(CYCLES):
        t = time.perf_counter()
        f.reserve(0x10, h, guest_ram=16 * GiB)
        f.release(0x10, h)
        out.append(time.perf_counter() - t)
    f.close()
    return out


def raw_cycle(url: str) -> list[float]:
    """The floor: a reserve+release's round trips as bare etcd requests (a range read and a
    one-put Txn, then a range read and a one-delete Txn), one cycle at a time."""
    from vmlend.registry import parse_location
    from vmlend.registry.etcd_gateway import EtcdGateway, b64

    gw = EtcdGateway(parse_location(url).endpoints)
    key = b64("/raw/bench/hold")
    out = []
    for _ in range(CYCLES):
        t = time.perf_counter()
        gw.call("kv/range", {"key": key})
        gw.call("kv/txn", {"success": [{"request_put": {"key": key, "value": b64("h")}}]})
        gw.call("kv/range", {"key": key})
        gw.call("kv/txn", {"success": [{"request_delete_range": {"key": key}}]})
        out.append(time.perf_counter() - t)
    gw.close()
    return out


class Shape(NamedTuple):
    """What one request of a cycle carries: keys or ranges read, compares, puts, deletes, and
    the bytes of its body."""

    reads: int = 0
    compares: int = 0
    puts: int = 0
    deletes: int = 0
    size: int = 0

    def __str__(self) -> str:
        if self.reads:
            return f"{self.reads} reads"
        parts = [f"{self.compares} compares", f"{self.puts} puts", f"{self.deletes} deletes"]
        return " + ".join(parts) + (f" ({self.size / 1024:.1f} KiB)" if self.size else "")


def shape_of(path: str, body: dict) -> Shape:
    if path != "kv/txn":  # a bare range
        return Shape(reads=1, size=len(json.dumps(body)))
    ops = body.get("success", [])
    return Shape(
        reads=sum("request_range" in op for op in ops),
        compares=len(body.get("compare", [])),
        puts=sum("request_put" in op for op in ops),
        deletes=sum("request_delete_range" in op for op in ops),
        size=len(json.dumps(body)),
    )


def replayed_cycle(location) -> tuple[list[float], list[Shape], list[Shape], int]:
    """The same requests a reserve+release sends, sent again bare (compares dropped, so each
    write applies as it did): what etcd and the HTTP client cost for these records, without
    vmlend's own work in between. ``reserve_release`` less this is vmlend's own share. Also
    the shape of each request of the reserve and of the release (``Shape``), taken after a
    first cycle so that the VM's marker exists, as in every later cycle, and the mean size of
    the values it puts."""
    text, source = default_topology_text()
    init_fabric(location, text, source, node="gamma")
    f = open_fabric(location, "gamma")
    h = Holder("gamma", "replay")
    gw = f.registry.gateway
    sent: list[tuple[str, dict]] = []
    plain = gw.call

    def recording(path: str, body: dict) -> dict:
        sent.append((path, body))
        return plain(path, body)

    f.reserve(0x10, h, guest_ram=16 * GiB)  # the first: it creates the VM's marker
    f.release(0x10, h)
    gw.call = recording  # type: ignore[method-assign]
    f.reserve(0x10, h, guest_ram=16 * GiB)
    reserving = len(sent)
    f.release(0x10, h)
    gw.call = plain  # type: ignore[method-assign]
    shapes = [shape_of(path, body) for path, body in sent]
    values = [
        len(base64.b64decode(op["request_put"]["value"]))
        for _path, body in sent
        for op in body.get("success", [])
        if "request_put" in op
    ]
    value = sum(values) // max(1, len(values))
    bare = [(path, {**body, "compare": []}) for path, body in sent]
    out = []
    for _ in range(CYCLES):
        t = time.perf_counter()
        for path, body in bare:
            gw.call(path, body)
        out.append(time.perf_counter() - t)
    f.close()
    return out, shapes[:reserving], shapes[reserving:], value


#: Request shapes of a reserve+release (``Shape``; a reserve's read, its commit, a release's
#: read, its commit) for ``shaped_cycles``: today's (measured by ``replayed_cycle`` on the same
#: GPU reserve), and a hold of at most 4 keys as issue 38 asks (docs/cluster.md, "A hold of at
#: most 4 keys": the claims and the node's index gone, one conflict key, fewer reads and
#: compares): what such requests alone cost, whatever layout writes them.
FOUR_KEYS: tuple[Shape, ...] = (
    Shape(reads=14),
    Shape(compares=13, puts=4),
    Shape(reads=10),
    Shape(compares=10, deletes=4),
)


#: The raw floor's four requests as shapes (a read, a one-put Txn, a read, a one-delete Txn).
RAW = (Shape(reads=1), Shape(puts=1), Shape(reads=1), Shape(deletes=1))


class _Shaped:
    """Cycles of bare requests of given shapes on keys of their own (``tag``): distinct keys,
    values of ``value`` bytes, compares that hold, writes that apply. What etcd and the HTTP
    client cost for requests of that size, whatever vmlend writes in them."""

    def __init__(self, url: str, value: int, tag: str) -> None:
        from vmlend.registry import parse_location
        from vmlend.registry.etcd_gateway import EtcdGateway, b64

        self.gw = EtcdGateway(parse_location(url).endpoints)
        self.keys = [b64(f"/shape/{tag}/{i:03d}") for i in range(128)]
        self.filler = b64("v" * value)

    def cycle(self, shapes: Sequence[Shape]) -> float:
        keys = self.keys
        t = time.perf_counter()
        for shape in shapes:
            if shape.reads:
                ops = [{"request_range": {"key": k}} for k in keys[: shape.reads]]
                self.gw.call("kv/txn", {"compare": [], "success": ops, "failure": []})
                continue
            compare = [
                {"key": k, "target": "VERSION", "result": "LESS", "version": 1 << 40}
                for k in keys[64 : 64 + shape.compares]
            ]
            # etcd refuses a Txn that writes a key twice: a request's deletes follow its puts
            ops = [{"request_put": {"key": k, "value": self.filler}} for k in keys[: shape.puts]]
            gone = keys[shape.puts : shape.puts + shape.deletes]
            ops += [{"request_delete_range": {"key": k}} for k in gone]
            self.gw.call("kv/txn", {"compare": compare, "success": ops, "failure": []})
        return time.perf_counter() - t

    def close(self) -> None:
        self.gw.close()


def shaped_cycles(
    url: str, shapes: dict[str, Sequence[Shape]], value: int, cycles: int = CYCLES
) -> dict[str, float]:
    """p50 of each shape's cycle, the shapes taken in turn cycle by cycle (so a machine whose
    load changes meanwhile slows them alike)."""
    client = _Shaped(url, value, "one")
    samples: dict[str, list[float]] = {name: [] for name in shapes}
    try:
        for _ in range(cycles):
            for name, shape in shapes.items():
                samples[name].append(client.cycle(shape))
    finally:
        client.close()
    return {name: statistics.median(v) for name, v in samples.items()}


def concurrent_shaped(
    url: str, shapes: Sequence[Shape], value: int, threads: int = 10, cycles: int = 20
) -> float:
    """``threads`` threads doing ``cycles`` cycles of ``shapes`` each: the run's time."""
    import threading

    def work(i: int) -> None:
        client = _Shaped(url, value, f"t{i}")
        try:
            for _ in range(cycles):
                client.cycle(shapes)
        finally:
            client.close()

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    t = time.perf_counter()
    for th in workers:
        th.start()
    for th in workers:
        th.join()
    return time.perf_counter() - t


def concurrent_cycles(
    url: str, borrowers: int = 10, cycles: int = 20
) -> tuple[float, int, float, int, int]:
    """``borrowers`` threads, each its own fabric on gamma and its own device of the star
    topology, each doing ``cycles`` reserve+release: the run's time, the failed cycles, the
    same number of 4-request raw cycles done by as many threads (the floor), how often a
    transaction body ran again after a conflict, and how often an attempt from memory ran
    again on fresh reads."""
    import threading

    from tests.support.simfabric import star_topology
    from vmlend.errors import VmlendError
    from vmlend.registry import parse_location
    from vmlend.registry.etcd_gateway import EtcdGateway, b64

    init_fabric(url, star_topology(4, borrowers), "star.toml", node="h0")
    failures: list[str] = []
    conflicts: list[int] = []
    stale: list[int] = []  # attempts from memory run again on fresh reads

    def borrower(i: int) -> None:
        f = open_fabric(url, "h0")
        h = Holder("h0", f"vm{i}")
        for _ in range(cycles):
            try:
                f.reserve(0x100 + i, h)  # distinct devices of one lender, one adapter pair
                f.release(0x100 + i, h)
            except VmlendError as e:
                failures.append(str(e))
        conflicts.append(f.registry.conflicts)
        stale.append(f.registry.stale)
        f.close()

    def raw(i: int) -> None:
        gw = EtcdGateway(parse_location(url).endpoints)
        key = b64(f"/raw/concurrent/{i}")
        for _ in range(cycles):
            gw.call("kv/range", {"key": key})
            gw.call("kv/txn", {"success": [{"request_put": {"key": key, "value": b64("h")}}]})
            gw.call("kv/range", {"key": key})
            gw.call("kv/txn", {"success": [{"request_delete_range": {"key": key}}]})
        gw.close()

    times = []
    for work in (borrower, raw):
        threads = [threading.Thread(target=work, args=(i,)) for i in range(borrowers)]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        times.append(time.perf_counter() - t)
    return times[0], len(failures), times[1], sum(conflicts), sum(stale)


#: VMs on the borrower's node that hold a device each, for ``crowded_node``.
NEIGHBOURS = 200


def crowded_node(location) -> tuple[float, float]:
    """reserve+release p50 of one VM's remote device on node n0, first alone, then with
    ``NEIGHBOURS`` other VMs on n0 holding one of n0's own devices each: a reserve should read
    its own VM's records, not every VM's of its node."""
    init_fabric(location, fabric_topology(2, NEIGHBOURS + 1), "crowded.toml", node="n0")
    f = open_fabric(location, "n0")
    probe, remote = Holder("n0", "probe"), 0x200

    def p50() -> float:
        out = []
        for _ in range(CYCLES // 2):
            t = time.perf_counter()
            f.reserve(remote, probe)
            f.release(remote, probe)
            out.append(time.perf_counter() - t)
        return statistics.median(out)

    alone = p50()
    for i in range(NEIGHBOURS):
        f.reserve(0x101 + i, Holder("n0", f"neighbour{i}"))
    crowded = p50()
    f.close()
    return alone, crowded


def admit_many(location) -> tuple[float, list[float], SimFabric]:
    init_fabric(location, fabric_topology(NODES, PER_NODE), "generated.toml")
    fabrics: dict[str, SimFabric] = {}
    lat = []
    start = time.perf_counter()
    for vm in range(VMS):
        first = 2 * vm
        lender = first // PER_NODE
        node = f"n{(lender + NODES // 2) % NODES}"
        f = fabrics.get(node)
        if f is None:
            opened = open_fabric(location, node)
            assert isinstance(opened, SimFabric)
            f = fabrics[node] = opened
        holder = Holder(node, f"vm{vm}")
        for dev in (first, first + 1):
            fdid = (dev // PER_NODE + 1) * 0x100 + dev % PER_NODE
            t = time.perf_counter()
            f.reserve(fdid, holder, guest_ram=1 * GiB)
            lat.append(time.perf_counter() - t)
    total = time.perf_counter() - start
    keep = fabrics.pop(next(iter(fabrics)))
    for f in fabrics.values():
        f.close()
    return total, lat, keep


def decision_cost(f: SimFabric) -> tuple[float, float]:
    """The admission decision with the whole fabric's state vs with the narrow view."""
    topo = f.topology()
    fdid, node = (NODES - 1 + 1) * 0x100 + PER_NODE - 1, "n0"  # a free device
    with f.registry.read() as tx:
        full = StateView(tx.nodes(), tx.devices(), tx.holds(), tx.claims())
        narrow = f._view(tx, topo, fdid, node, Holder(node, "probe"))
    n = 50

    def per(view: StateView) -> float:
        t = time.perf_counter()
        for _ in range(n):
            admit(topo, view, fdid, node, GiB, Holder(node, "probe"))
        return (time.perf_counter() - t) / n

    return per(full), per(narrow)


def death_to_reuse(server: EtcdServer, root: Path) -> float:
    url = server.url("death")
    text, source = default_topology_text()
    init_fabric(url, text, source)
    vmlend = str(Path(sys.executable).parent / "vmlend")
    agents = {}
    for node in ("alpha", "gamma"):
        identify(root / node)  # the agent refuses a host without a machine-id
        env = {**os.environ, "VMLEND_REGISTRY": url, "VMLEND_NODE": node}
        env["VMLEND_ROOT"] = str(root / node)
        with open(root / f"{node}-agent.log", "wb") as log:  # a file: a pipe could fill
            agents[node] = subprocess.Popen(
                [vmlend, "agent", "--ttl", str(TTL), "--interval", "0.2"],
                env=env,
                stderr=log,
            )

    def check_alive(*nodes: str) -> None:
        for node in nodes:
            agent = agents[node]
            if agent.poll() is not None:  # it would never publish its lease: say why
                why = (root / f"{node}-agent.log").read_text().strip().splitlines()
                for other in agents.values():
                    other.kill()  # by its PID: this bench started it
                    other.wait()
                raise SystemExit(f"{node}'s agent exited {agent.returncode}: {why[-1:]}")

    try:
        # Both: beta's reserve needs the lender's agent alive, gamma's needs its own lease.
        for node in agents:
            while not (root / node / "run" / "vmlend" / "agent.lease").exists():
                check_alive(*agents)
                time.sleep(0.05)
        os.environ["VMLEND_ROOT"] = str(root / "gamma")
        open_fabric(url, "gamma").reserve(0x10, Holder("gamma", "web"))
        host_lease(server, root / "beta")
        os.environ["VMLEND_ROOT"] = str(root / "beta")
        beta = open_fabric(url, "beta")
        agents["gamma"].send_signal(signal.SIGKILL)
        agents["gamma"].wait()
        died = time.perf_counter()
        while True:
            try:
                beta.reserve(0x10, Holder("beta", "db"))
                break
            except (DeviceHeldError, DeviceFencedError, LenderUnavailableError):
                # the last: alpha's agent not seen alive yet (its hosts/ key follows its lease
                # file), or its lease lapsed on a loaded machine and it takes a new one
                check_alive("alpha")
                time.sleep(0.02)
        reused = time.perf_counter() - died
        agents["alpha"].send_signal(signal.SIGTERM)
        agents["alpha"].wait(20)
    finally:  # an exception (the reserve refused otherwise) leaves no agent behind
        for agent in agents.values():
            if agent.poll() is None:
                agent.kill()  # by its PID: this bench started it
                agent.wait()
    return reused


#: The borrower's TTL under a partition: long enough that TTL/2 stands out from the ticks.
PARTITION_TTL = 4


def partition_to_pause(server: EtcdServer, root: Path) -> float:
    """A borrower cut off from etcd (a blackhole): seconds from the cut to its paused VM."""
    from tests.support.partition import cut_off_borrower, cut_to_pause

    with cut_off_borrower(server, root / "cut", "cut", PARTITION_TTL) as c:
        return cut_to_pause(c)


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        server = EtcdServer(root / "etcd")
        server.start()
        try:
            host_lease(server, root / "host", ttl=3600)
            os.environ["VMLEND_ROOT"] = str(root / "host")
            sq = reserve_release(root / "rr.db")
            et = reserve_release(server.url("rr"))
            raw = raw_cycle(server.url("raw"))
            (sq50, sq99), (et50, et99) = _percentiles(sq), _percentiles(et)
            raw50, _ = _percentiles(raw)
            replayed, reserving, releasing, value = replayed_cycle(server.url("replay"))
            replay50, _ = _percentiles(replayed)
            print(
                f"reserve+release p50/p99   SQLite {sq50 * ms:6.2f}/{sq99 * ms:6.2f} ms"
                f"   etcd {et50 * ms:6.2f}/{et99 * ms:6.2f} ms"
                f"   etcd/SQLite p50 {et50 / sq50:5.2f}x"
            )
            print(
                f"reserve+release on etcd vs 4 raw etcd requests, p50: {et50 * ms:6.2f} vs"
                f" {raw50 * ms:6.2f} ms, {et50 / raw50:5.2f}x (goal <= 1.2x)"
            )
            print(
                f"  of which: the cycle's own {len(reserving) + len(releasing)} requests sent bare"
                f" {replay50 * ms:6.2f} ms"
                f" ({replay50 / raw50:4.2f}x the raw ones: etcd's and the client's cost of"
                f" the records); vmlend's work between them {(et50 - replay50) * ms:5.2f} ms"
            )
            print(
                f"  what it sends: a reserve {', then '.join(map(str, reserving))};"
                f" a release {', then '.join(map(str, releasing))}"
            )
            # The cycle's own requests (a process that committed before sends its commits
            # alone: docs/cluster.md, "Commits from what the last commit knew").
            today = [*reserving, *releasing]
            shaped = shaped_cycles(
                server.url("shapes"), {"raw": RAW, "today": today, "four": FOUR_KEYS}, value
            )
            print(
                f"  bare requests, taken in turn: of the cycle's shape ({len(today)} requests)"
                f" {shaped['today'] * ms:6.2f} ms, of a hold of at most 4 keys read first"
                f" ({', '.join(map(str, FOUR_KEYS))})"
                f" {shaped['four'] * ms:6.2f} ms, raw {shaped['raw'] * ms:6.2f} ms:"
                f" {shaped['today'] / shaped['raw']:4.2f}x and"
                f" {shaped['four'] / shaped['raw']:4.2f}x"
                " (a floor for such a layout, before vmlend's own work)"
            )
            took, failed, floor, reruns, stale = concurrent_cycles(server.url("many"))
            print(
                f"10 concurrent borrowers x 20 cycles on etcd: {failed} failed cycles,"
                f" {reruns} re-runs, {stale} attempts from memory read again;"
                f" {took:5.2f} s vs {floor:5.2f} s for as many raw 4-request cycles,"
                f" throughput {floor / took:5.0%} of the floor (goal >= 70 %, 0 failed)"
            )
            rounds = [
                (concurrent_shaped(server.url("shapes"), RAW, value),
                 concurrent_shaped(server.url("shapes"), FOUR_KEYS, value))
                for _ in range(3)
            ]  # fmt: skip
            print(
                "  10 threads x 20 bare cycles of a hold of at most 4 keys vs raw, 3 rounds:"
                f" {', '.join(f'{raw_s / four_s:.0%}' for raw_s, four_s in rounds)} of the"
                " floor's throughput (a ceiling for such a layout)"
            )
            own = [
                (concurrent_shaped(server.url("shapes"), RAW, value),
                 concurrent_shaped(server.url("shapes"), today, value))
                for _ in range(3)
            ]  # fmt: skip
            print(
                "  10 threads x 20 bare cycles of the cycle's own requests vs raw, 3 rounds:"
                f" {', '.join(f'{raw_s / c_s:.0%}' for raw_s, c_s in own)} of the"
                " floor's throughput (a ceiling for vmlend's cycle)"
            )
            alone, crowded = crowded_node(server.url("crowded"))
            print(
                f"reserve+release p50 on etcd, borrower's node alone vs with {NEIGHBOURS} other"
                f" VMs holding devices: {alone * ms:6.2f} vs {crowded * ms:6.2f} ms,"
                f" {crowded / alone:5.2f}x (flat: 1.0x)"
            )
            for name, location in (("SQLite", root / "big.db"), ("etcd", server.url("big"))):
                total, lat, f = admit_many(location)
                first, last = statistics.mean(lat[:100]), statistics.mean(lat[-100:])
                print(
                    f"{name:6} {VMS} two-device VMs on {NODES} nodes / {NODES * PER_NODE} devices:"
                    f" {total:6.2f} s total; reserve first 50 VMs {first * ms:6.2f} ms,"
                    f" last 50 {last * ms:6.2f} ms, last/first {last / first:5.2f}x"
                )
                if name == "SQLite":
                    full, narrow = decision_cost(f)
                    print(
                        f"       admission decision at {VMS} VMs: whole-fabric view"
                        f" {full * ms:6.2f} ms, narrow view {narrow * ms:6.3f} ms,"
                        f" full/narrow {full / narrow:6.1f}x"
                    )
                f.close()
            reused = death_to_reuse(server, root)
            print(
                f"borrower host killed (lease TTL {TTL} s): device borrowable again after"
                f" {reused:5.2f} s ({reused / TTL:4.2f}x the TTL)"
            )
            paused = partition_to_pause(server, root)
            print(
                f"borrower cut off from etcd (lease TTL {PARTITION_TTL} s): VM paused after"
                f" {paused:5.2f} s (TTL/2 = {PARTITION_TTL / 2:g} s; goal <= TTL/2 + 1 s)"
            )
        finally:
            server.stop()


if __name__ == "__main__":
    main()
