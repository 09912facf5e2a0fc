"""The agent's metrics written by hand (``vmlend.agent.metrics``) against prometheus_client,
side by side in one run: what each adds to the agent's start (imports) and what one scrape of
the same metrics costs. Ratios, so the numbers hold on a loaded machine.

The scrape set is a large cluster's: 16 adapters, 16 nodes holding devices, every hook
operation with its latency histogram. The ledger is not read here (both would read it the
same way, through a cached sample): this is the rendering alone.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from vmlend.agent.metrics import HOOK_BUCKETS, AdapterRow, AgentMetrics, FabricSample

RUNS = 9  # interpreter starts per variant (interleaved)
SCRAPES = 300
OPS = ("prepare", "release", "reconnect", "migrate", "restore", "ignore")
ADAPTERS = 16
NODES = 16

#: What each way adds to an agent that has its own modules loaded already: the hand-written
#: text needs only the HTTP server (and only with --metrics); prometheus_client brings its own.
VARIANTS = {"hand-written (http.server)": "http.server", "prometheus_client": "prometheus_client"}


def _import_cost(module: str) -> float:
    """Seconds ``import module`` takes after ``import vmlend.agent.service`` (``-X importtime``:
    the cumulative time of that one import, so the interpreter's start is not in it)."""
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import vmlend.agent.service; import {module}"],
        check=True,
        capture_output=True,
        text=True,
    )
    for line in run.stderr.splitlines():
        fields = [f.strip() for f in line.removeprefix("import time:").split("|")]
        if len(fields) == 3 and fields[2] == module:
            return int(fields[1]) / 1e6
    raise RuntimeError(f"no import time for {module}")


def import_costs() -> dict[str, float]:
    took: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(RUNS):
        for name, module in VARIANTS.items():
            took[name].append(_import_cost(module))
    return {name: statistics.median(t) for name, t in took.items()}


def sample() -> FabricSample:
    gib = 1 << 30
    adapters = [
        AdapterRow(f"n{i}:0", i, 30, i * 4 * gib, 128 * gib, i, 32) for i in range(ADAPTERS)
    ]
    holds = {f"n{i}": i + 1 for i in range(NODES)}
    return FabricSample(adapters, holds, 2, {f"n{i}": 1 for i in range(NODES // 2)})


class _Lease:
    def age(self) -> float:
        return 1.25

    def paused_count(self) -> int:
        return 0


def hand_written() -> Callable[[], bytes]:
    m = AgentMetrics(cache_seconds=3600)
    fixed = sample()
    m.follow(lease=_Lease(), ttl=10, open_fabric=lambda: None)  # type: ignore[arg-type,return-value]
    m._fabric_sample = lambda: (fixed, True)  # type: ignore[method-assign]
    for i, op in enumerate(OPS * 50):
        m.observe_hook(op, 0.001 * (i % 40))
    return lambda: m.render().encode()


def with_prometheus_client() -> Callable[[], bytes]:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.registry import Collector

    fixed = sample()

    class Ledger(Collector):
        def collect(self):  # type: ignore[no-untyped-def]
            cols = (
                ("adapter_lut_entries_used", 1),
                ("adapter_lut_entries", 2),
                ("adapter_window_bytes_used", 3),
                ("adapter_window_bytes", 4),
                ("adapter_segments_used", 5),
                ("adapter_segments", 6),
            )
            for name, col in cols:
                g = GaugeMetricFamily(f"vmlend_{name}", name, labels=["adapter"])
                for row in fixed.adapters:
                    g.add_metric([row.adapter], row[col])
                yield g
            for name, values in (("holds", fixed.holds), ("nvme_shares", fixed.shares)):
                g = GaugeMetricFamily(f"vmlend_{name}", name, labels=["node"])
                for node, n in sorted(values.items()):
                    g.add_metric([node], n)
                yield g
            yield GaugeMetricFamily("vmlend_fences_pending", "fences", value=fixed.fences_pending)
            yield GaugeMetricFamily("vmlend_lease_age_seconds", "age", value=1.25)
            yield GaugeMetricFamily("vmlend_paused_vms", "paused", value=0)

    reg = CollectorRegistry(auto_describe=False)
    reg.register(Ledger())
    Gauge("vmlend_registry_up", "up", registry=reg).set(1)
    Gauge("vmlend_lease_ttl_seconds", "ttl", registry=reg).set(10)
    Counter("vmlend_lease_renew_failures", "renew", registry=reg)
    Counter("vmlend_leases_lost", "lost", registry=reg)
    Counter("vmlend_registry_txn_retries", "retries", registry=reg)
    calls = Counter("vmlend_hook_calls", "calls", ["op"], registry=reg)
    took = Histogram(
        "vmlend_hook_call_duration_seconds", "took", ["op"], buckets=HOOK_BUCKETS, registry=reg
    )
    for i, op in enumerate(OPS * 50):
        calls.labels(op).inc()
        took.labels(op).observe(0.001 * (i % 40))
    return lambda: generate_latest(reg)


def per_scrape(render: Callable[[], bytes]) -> float:
    render()
    times = []
    for _ in range(5):
        begin = time.perf_counter()
        for _ in range(SCRAPES):
            render()
        times.append((time.perf_counter() - begin) / SCRAPES)
    return min(times)


def main() -> None:
    costs = import_costs()
    hand_add, client_add = costs["hand-written (http.server)"], costs["prometheus_client"]
    ms = 1000
    print(
        f"import on top of the agent (median of {RUNS}): hand-written + http.server"
        f" {hand_add * ms:6.1f} ms, prometheus_client {client_add * ms:6.1f} ms,"
        f" client/hand {client_add / hand_add:5.2f}x"
    )
    hand, client = hand_written(), with_prometheus_client()
    h, c = per_scrape(hand), per_scrape(client)
    print(
        f"one scrape ({ADAPTERS} adapters, {NODES} nodes, {len(OPS)} ops): hand-written"
        f" {h * ms:6.3f} ms ({len(hand())} bytes), prometheus_client {c * ms:6.3f} ms"
        f" ({len(client())} bytes), client/hand {c / h:5.2f}x"
    )


if __name__ == "__main__":
    main()
