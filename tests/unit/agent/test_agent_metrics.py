"""The agent's metrics (``vmlend.agent.metrics``): the Prometheus text, read back with an
independent parser (prometheus_client's), its names and labels, the ledger's numbers, the
cache that keeps a scrape storm off etcd, and the HTTP endpoint scraped with urllib. No
daemon: an SQLite simulated fabric, an in-process server on a free loopback port."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.simfabric import make_fabric
from vmlend.agent.metrics import CONTENT_TYPE, AgentMetrics, MetricsServer, parse_address
from vmlend.errors import ConfigError, StateError
from vmlend.topology.model import Holder

VMLEND = str(Path(sys.executable).parent / "vmlend")
LABELS = {"adapter", "node", "op", "outcome"}


class FakeLease:
    def __init__(self, age: float = 1.5, paused: int = 0) -> None:
        self.seconds, self.paused = age, paused

    def age(self) -> float:
        return self.seconds

    def paused_count(self) -> int:
        return self.paused


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of the exposition, by name and labels."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(text: str, name: str, **labels: str) -> float:
    return samples(text)[(name, frozenset(labels.items()))]


@pytest.fixture
def fabric(tmp_path):
    f = make_fabric(tmp_path / "state.db")
    yield f
    f.close()


def full_metrics(fabric, **kw) -> AgentMetrics:
    m = AgentMetrics(**kw)
    m.follow(lease=FakeLease(), ttl=10, open_fabric=lambda: fabric)
    return m


def test_the_text_parses_and_every_name_follows_prometheus_conventions(fabric):
    fabric.reserve(0x10, Holder("gamma", "web"))
    m = full_metrics(fabric)
    m.observe_hook("prepare", 0.02)
    m.renew_failed()
    m.recovered([])
    families = {f.name: f for f in text_string_to_metric_families(m.render())}
    kinds = {name: f.type for name, f in families.items()}
    assert all(name.startswith("vmlend_") for name in kinds)
    # the parser drops a counter's _total from the family name; every sample keeps it
    for f in families.values():
        for s in f.samples:
            assert set(s.labels) - {"le"} <= LABELS, s
            if f.type == "counter":
                assert s.name.endswith("_total") or s.name.endswith("_created"), s
    assert kinds["vmlend_hook_call_duration_seconds"] == "histogram"
    assert {k for k, t in kinds.items() if t == "counter"} == {
        "vmlend_lease_renew_failures",
        "vmlend_leases_lost",
        "vmlend_vm_recoveries",
        "vmlend_hook_calls",
        "vmlend_registry_txn_retries",
    }
    for gauge in ("lease_age_seconds", "lease_ttl_seconds", "paused_vms", "fences_pending"):
        assert kinds[f"vmlend_{gauge}"] == "gauge"


def test_adapter_gauges_and_holds_are_the_ledgers(fabric):
    fabric.reserve(0x10, Holder("gamma", "web"))
    fabric.reserve(0x20, Holder("beta", "db"))
    text = full_metrics(fabric).render()
    usage = fabric.usage()
    assert usage and any(u.lut_used for u in usage.values())
    for ref, u in usage.items():
        assert value(text, "vmlend_adapter_lut_entries_used", adapter=ref) == u.lut_used
        assert value(text, "vmlend_adapter_lut_entries", adapter=ref) == u.adapter.lut_usable
        assert value(text, "vmlend_adapter_window_bytes_used", adapter=ref) == u.window_used
        assert value(text, "vmlend_adapter_window_bytes", adapter=ref) == u.adapter.window_size
        assert value(text, "vmlend_adapter_segments_used", adapter=ref) == u.segments_used
        assert value(text, "vmlend_adapter_segments", adapter=ref) == u.adapter.segments
    assert value(text, "vmlend_holds", node="gamma") == 1
    assert value(text, "vmlend_holds", node="beta") == 1
    assert value(text, "vmlend_fences_pending") == 0  # SQLite leaves no fences
    assert value(text, "vmlend_registry_up") == 1


def test_lease_gauges_and_counters_say_what_the_agent_told(fabric):
    m = AgentMetrics()
    m.follow(lease=FakeLease(age=3.25, paused=2), ttl=10, open_fabric=lambda: fabric)
    m.renew_failed()
    m.renew_failed()
    m.lease_lost()
    text = m.render()
    assert value(text, "vmlend_lease_age_seconds") == 3.25
    assert value(text, "vmlend_lease_ttl_seconds") == 10
    assert value(text, "vmlend_paused_vms") == 2
    assert value(text, "vmlend_lease_renew_failures_total") == 2
    assert value(text, "vmlend_leases_lost_total") == 1


def test_recoveries_count_by_outcome():
    from vmlend.agent.recover import VmRecovery

    m = AgentMetrics()
    m.follow(lease=FakeLease(), ttl=10)
    m.recovered([VmRecovery("web", outcome="resumed"), VmRecovery("app", why="unplug failed")])
    m.recovered([VmRecovery("db", outcome="resumed")])
    text = m.render()
    assert value(text, "vmlend_vm_recoveries_total", outcome="resumed") == 2
    assert value(text, "vmlend_vm_recoveries_total", outcome="paused") == 1


def test_hook_calls_count_by_op_with_a_cumulative_latency_histogram():
    m = AgentMetrics()
    for seconds in (0.001, 0.03, 0.03, 7.0):
        m.observe_hook("prepare", seconds, retries=1)
    m.observe_hook("release", 0.002)
    text = m.render()
    assert value(text, "vmlend_hook_calls_total", op="prepare") == 4
    assert value(text, "vmlend_hook_calls_total", op="release") == 1
    h = "vmlend_hook_call_duration_seconds"
    assert value(text, f"{h}_bucket", op="prepare", le="0.005") == 1
    assert value(text, f"{h}_bucket", op="prepare", le="0.05") == 3
    assert value(text, f"{h}_bucket", op="prepare", le="5.0") == 3
    assert value(text, f"{h}_bucket", op="prepare", le="10.0") == 4
    assert value(text, f"{h}_bucket", op="prepare", le="+Inf") == 4
    assert value(text, f"{h}_count", op="prepare") == 4
    assert value(text, f"{h}_sum", op="prepare") == pytest.approx(7.061)
    assert value(text, "vmlend_registry_txn_retries_total") == 4


class Counting:
    """A registry's re-run counter (``EtcdRegistry.conflicts``)."""

    conflicts = 3


def test_registry_retries_add_the_agents_registry_and_its_hook_calls():
    m = AgentMetrics()
    reg = Counting()
    m.follow(registry=reg)
    m.observe_hook("release", 0.01, retries=2)
    assert value(m.render(), "vmlend_registry_txn_retries_total") == 5
    reg.conflicts = 4
    assert value(m.render(), "vmlend_registry_txn_retries_total") == 6


def test_a_scrape_storm_reads_the_ledger_once_per_cache_period(fabric):
    clock = Clock()
    reads: list[int] = []

    class Watched:
        """The fabric, counting its ``usage`` reads."""

        def __getattr__(self, name):
            return getattr(fabric, name)

        def usage(self):
            reads.append(1)
            return fabric.usage()

    m = AgentMetrics(cache_seconds=2.0, clock=clock)
    m.follow(open_fabric=Watched)
    for _ in range(50):
        text = m.render()
    assert len(reads) == 1
    assert ("vmlend_holds", frozenset({("node", "gamma")})) not in samples(text)
    fabric.reserve(0x10, Holder("gamma", "web"))
    clock.now += 2.5  # the cached sample is old now: the next scrape reads again
    text = m.render()
    assert len(reads) == 2
    assert value(text, "vmlend_holds", node="gamma") == 1


def test_an_unreachable_ledger_shows_registry_down_and_no_stale_numbers(fabric):
    clock = Clock()
    broken = [False]

    class Flaky:
        def __getattr__(self, name):
            return getattr(fabric, name)

        def usage(self):
            if broken[0]:
                raise StateError("etcd unreachable")
            return fabric.usage()

    m = AgentMetrics(cache_seconds=1.0, clock=clock)
    m.follow(lease=FakeLease(), ttl=10, open_fabric=Flaky)
    assert value(m.render(), "vmlend_registry_up") == 1
    broken[0] = True
    clock.now += 5
    text = m.render()
    assert value(text, "vmlend_registry_up") == 0
    assert not any(name.startswith("vmlend_adapter_") for name, _ in samples(text))
    assert value(text, "vmlend_lease_age_seconds") == 1.5  # the agent's own numbers stay


def test_label_values_are_escaped():
    m = AgentMetrics()
    m.observe_hook('we"ird\\op\n', 0.01)
    assert value(m.render(), "vmlend_hook_calls_total", op='we"ird\\op\n') == 1


def test_without_a_lease_or_ledger_only_the_hook_and_retry_counters_are_shown():
    names = {name for name, _ in samples(AgentMetrics().render())}
    assert names == {"vmlend_registry_txn_retries_total"}


@pytest.mark.parametrize(
    ("text", "address"),
    [("127.0.0.1:9850", ("127.0.0.1", 9850)), ("[::1]:0", ("::1", 0)), ("host:1", ("host", 1))],
)
def test_addresses_parse(text, address):
    assert parse_address(text) == address


@pytest.mark.parametrize("text", ["9850", "127.0.0.1", ":9850", "127.0.0.1:http", "h:70000"])
def test_a_bad_address_is_refused_in_one_line(text):
    with pytest.raises(ConfigError) as e:
        parse_address(text)
    assert "\n" not in str(e.value) and "HOST:PORT" in str(e.value)


@pytest.fixture
def served(fabric, tmp_path):
    metrics = AgentMetrics()
    # opened on the serving thread, as the agent's is (an SQLite fabric stays on its thread)
    metrics.follow(lease=FakeLease(), ttl=10, open_fabric=lambda: make_fabric(tmp_path / "m.db"))
    server = MetricsServer(metrics, ("127.0.0.1", 0))
    server.start()
    yield server
    server.stop()


def test_the_endpoint_serves_the_text_to_an_http_client(served):
    served.metrics.observe_hook("prepare", 0.01)
    url = f"http://127.0.0.1:{served.port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as answer:
        assert answer.status == 200
        assert answer.headers["Content-Type"] == CONTENT_TYPE
        text = answer.read().decode()
    assert value(text, "vmlend_hook_calls_total", op="prepare") == 1
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://127.0.0.1:{served.port}/other", timeout=10)
    assert e.value.code == 404


def test_a_port_in_use_is_refused_in_one_line_and_a_stopped_server_frees_its_port(served):
    port = served.port
    other = MetricsServer(AgentMetrics(), ("127.0.0.1", port))
    with pytest.raises(ConfigError) as e:
        other.bind()
    assert "\n" not in str(e.value) and f"127.0.0.1:{port}" in str(e.value)
    served.stop()
    with socket.create_server(("127.0.0.1", port)):  # free again
        pass


@pytest.mark.daemon
def test_vmlend_agent_refuses_a_bad_metrics_address_before_serving(tmp_path):
    make_fabric(tmp_path / "state.db").close()
    env = {"VMLEND_STATE": str(tmp_path / "state.db"), "VMLEND_ROOT": str(tmp_path), "PATH": ""}
    run = subprocess.run(
        [VMLEND, "agent", "--metrics", "localhost"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode != 0
    [line] = run.stderr.strip().splitlines()
    assert "--metrics 'localhost'" in line
    assert not (tmp_path / "run" / "vmlend" / "hook.sock").exists()
