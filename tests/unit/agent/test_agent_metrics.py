"""The agent's metrics (``vmlend.agent.metrics``): the Prometheus text, read back with an
independent parser (prometheus_client's), its names and labels, the ledger's numbers, the
cache that keeps a scrape storm off etcd, and the HTTP endpoint scraped with urllib. No
daemon: an SQLite simulated fabric, an in-process server on a free loopback port."""

from __future__ import annotations

import base64
import logging
import os
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.simfabric import make_fabric
from vmlend.agent.metrics import (
    CONTENT_TYPE,
    AgentMetrics,
    MetricsAccess,
    parse_address,
    parse_user,
)
from vmlend.agent.metrics_http import MetricsServer
from vmlend.errors import ConfigError, StateError
from vmlend.topology.model import Holder

VMLEND = str(Path(sys.executable).parent / "vmlend")
LABELS = {"adapter", "node", "op", "outcome"}
#: The standard process metrics (Prometheus's client libraries' names).
PROCESS = {
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
    "process_open_fds",
    "process_start_time_seconds",
}


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
    assert all(name.startswith(("vmlend_", "process_")) for name in kinds)
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
        "process_cpu_seconds",
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


def test_without_a_lease_or_ledger_only_the_retry_counter_and_the_process_are_shown():
    names = {name for name, _ in samples(AgentMetrics().render())}
    assert names == {"vmlend_registry_txn_retries_total", *PROCESS}


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("127.0.0.1:9850", ("127.0.0.1", 9850)),
        ("[::1]:0", ("::1", 0)),
        ("host:1", ("host", 1)),
        (":9850", ("127.0.0.1", 9850)),  # this host only, unless a host is named
    ],
)
def test_addresses_parse(text, address):
    assert parse_address(text) == address


@pytest.mark.parametrize("text", ["9850", "127.0.0.1", "127.0.0.1:http", "h:70000", ":"])
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


# --- the endpoint under slow, vanishing and unwelcome clients (issue 37.3) -------------------
def _trickle(port: int, seconds: float) -> socket.socket:
    """A client that sends a request's first bytes one at a time, every 0.3 s."""
    peer = socket.create_connection(("127.0.0.1", port))
    request = b"GET /metrics HTTP/1.0\r\n\r\n"

    def send() -> None:
        for i in range(min(len(request), int(seconds / 0.3))):
            try:
                peer.send(request[i : i + 1])
            except OSError:  # the server cut it off
                return
            time.sleep(0.3)

    threading.Thread(target=send, daemon=True).start()
    return peer


def test_a_slow_client_holds_up_no_other_scrape(served):
    """One thread served every scrape in turn, and its 5 s timeout was per read: a client
    that trickles a byte every 0.3 s held every scrape behind it for as long as it liked."""
    slow = [_trickle(served.port, 6.0) for _ in range(3)]
    try:
        time.sleep(0.3)  # they are being served
        started = time.monotonic()
        with urllib.request.urlopen(f"http://127.0.0.1:{served.port}/metrics", timeout=5) as got:
            assert got.status == 200
        # A bound well under the 6 s the trickling clients would hold it, and loose enough
        # for a loaded machine's scheduling.
        assert time.monotonic() - started < 4.0
    finally:
        for peer in slow:
            peer.close()


def test_a_silent_client_is_cut_off_at_its_deadline_with_one_line(fabric, tmp_path, caplog):
    from vmlend.agent import metrics_http

    caplog.set_level(logging.INFO, logger="vmlend")
    server = MetricsServer(AgentMetrics(), ("127.0.0.1", 0), deadline=0.5)
    server.start()
    try:
        peer = _trickle(server.port, 10.0)
        started = time.monotonic()
        peer.settimeout(5)
        while peer.recv(1024):  # the server ends it at its deadline, not at the peer's will
            pass
        assert time.monotonic() - started < 4.0  # the 0.5 s deadline, not the peer's 10 s
        peer.close()
    finally:
        server.stop()
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == metrics_http.__name__ and not r.getMessage().startswith("serving")
    ]
    assert len(lines) == 1 and "within its deadline (0.5 s)" in lines[0], lines


def test_clients_gone_early_cost_one_line_each_and_no_traceback(served, capfd, caplog):
    """A client that sends its request and resets the connection: socketserver printed a
    25-line traceback for each (50 such clients: 1,250 lines on the agent's stderr)."""
    caplog.set_level(logging.INFO, logger="vmlend")
    for _ in range(50):
        peer = socket.create_connection(("127.0.0.1", served.port))
        peer.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        peer.close()  # a reset, not a close: the answer meets a dead connection
    with urllib.request.urlopen(f"http://127.0.0.1:{served.port}/metrics", timeout=10) as got:
        assert got.status == 200  # still serving
    err = capfd.readouterr().err
    assert "Traceback" not in err
    lines = [r for r in caplog.records if "metrics: 127.0.0.1:" in r.getMessage()]
    assert len(lines) + len(err.splitlines()) <= 50
    assert all("\n" not in r.getMessage() for r in lines)


def test_health_says_how_the_agent_is(fabric, tmp_path):
    metrics = AgentMetrics()
    well = [True]
    metrics.follow(health=lambda: (well[0], "lease 1a held" if well[0] else "lease 1a lost"))
    server = MetricsServer(metrics, ("127.0.0.1", 0))
    server.start()
    try:
        url = f"http://127.0.0.1:{server.port}/health"
        with urllib.request.urlopen(url, timeout=10) as got:
            assert (got.status, got.read()) == (200, b"lease 1a held\n")
        well[0] = False
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url, timeout=10)
        assert (e.value.code, e.value.read()) == (503, b"lease 1a lost\n")
    finally:
        server.stop()


def test_the_process_metrics_are_this_processes(served):
    with urllib.request.urlopen(f"http://127.0.0.1:{served.port}/metrics", timeout=10) as got:
        text = got.read().decode()
    assert value(text, "process_cpu_seconds_total") > 0
    assert value(text, "process_resident_memory_bytes") > 1 << 20
    assert value(text, "process_open_fds") == pytest.approx(len(os.listdir("/proc/self/fd")), abs=8)
    started = value(text, "process_start_time_seconds")
    assert time.time() - 86400 < started <= time.time()
    ps = subprocess.run(
        ["ps", "-o", "etimes=", "-p", str(os.getpid())], capture_output=True, text=True
    )
    if ps.returncode == 0:
        assert abs((time.time() - started) - int(ps.stdout)) <= 2


# --- TLS and basic auth -------------------------------------------------------------------
@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    where = tmp_path_factory.mktemp("metrics-tls")
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
            "-nodes", "-keyout", "key.pem", "-out", "cert.pem", "-days", "1",
            "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
        ],
        cwd=where,
        check=True,
        capture_output=True,
        timeout=30,
    )  # fmt: skip
    return where / "cert.pem", where / "key.pem"


def _hash(password: bytes) -> str:
    import bcrypt

    return bcrypt.hashpw(password, bcrypt.gensalt(4)).decode()


def _get(url: str, cafile: Path, auth: tuple[str, str] | None = None) -> int:
    request = urllib.request.Request(url)
    if auth is not None:
        token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    context = ssl.create_default_context(cafile=str(cafile))
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as got:
            return int(got.status)
    except urllib.error.HTTPError as e:
        return e.code


def test_tls_and_basic_auth_as_prometheus_exporters_take_them(certificate, caplog):
    caplog.set_level(logging.INFO, logger="vmlend")
    cert, key = certificate
    access = MetricsAccess(str(cert), str(key), {"prometheus": _hash(b"s3cret")})
    server = MetricsServer(AgentMetrics(), ("127.0.0.1", 0), access, deadline=2.0)
    server.start()
    try:
        url = f"https://127.0.0.1:{server.port}"
        assert _get(f"{url}/metrics", cert, ("prometheus", "s3cret")) == 200
        assert _get(f"{url}/metrics", cert, ("prometheus", "s3cret")) == 200  # remembered
        assert _get(f"{url}/health", cert, ("prometheus", "s3cret")) == 200
        assert _get(f"{url}/metrics", cert) == 401
        assert _get(f"{url}/metrics", cert, ("prometheus", "wrong")) == 401
        assert _get(f"{url}/metrics", cert, ("nobody", "s3cret")) == 401
        with pytest.raises(OSError):  # plain HTTP to the HTTPS port: no answer
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5)
    finally:
        server.stop()
    failures = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert all("\n" not in m and "s3cret" not in m for m in failures)


@pytest.mark.parametrize(
    ("access", "says"),
    [
        (MetricsAccess(cert="/nonexistent/cert.pem"), "both metrics-tls-cert and"),
        (MetricsAccess("/nonexistent/c.pem", "/nonexistent/k.pem"), "cannot be used"),
    ],
)
def test_an_unusable_tls_setting_is_one_line_at_bind(access, says):
    with pytest.raises(ConfigError) as e:
        MetricsServer(AgentMetrics(), ("127.0.0.1", 0), access).bind()
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "text", ["prometheus", ":$2b$04$" + "a" * 53, "prometheus:plain", "a b:$2b$04$" + "a" * 53]
)
def test_a_metrics_user_without_a_bcrypt_hash_is_refused(text):
    with pytest.raises(ConfigError) as e:
        parse_user(text)
    assert "\n" not in str(e.value) and "plain" not in str(e.value)


@pytest.mark.daemon
def test_the_configuration_files_metrics_users_are_checked_like_every_key(tmp_path):
    make_fabric(tmp_path / "state.db").close()
    config = tmp_path / "vmlend.toml"
    config.write_text('[agent]\nmetrics = ":0"\nmetrics-user = ["prometheus:notahash"]\n')
    env = {
        "VMLEND_STATE": str(tmp_path / "state.db"),
        "VMLEND_ROOT": str(tmp_path),
        "VMLEND_CONFIG": str(config),
        "PATH": "",
    }
    run = subprocess.run([VMLEND, "agent"], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    [line] = run.stderr.strip().splitlines()
    assert str(config) in line and "metrics-user" in line and "bcrypt" in line
    assert not (tmp_path / "run" / "vmlend" / "hook.sock").exists()


@pytest.mark.daemon
def test_an_sqlite_agent_exports_the_fabric_gauges(tmp_path):
    """On SQLite the agent exported 3 families, although 'agent --help' promises LUT and
    window use."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fabric = make_fabric(tmp_path / "state.db")
    fabric.reserve(0x10, Holder("gamma", "web"))
    fabric.close()
    env = {"VMLEND_STATE": str(tmp_path / "state.db"), "VMLEND_ROOT": str(tmp_path), "PATH": ""}
    log = (tmp_path / "agent.log").open("wb")
    agent = subprocess.Popen(
        [VMLEND, "agent", "--metrics", f"127.0.0.1:{port}"], env=env, stdout=log, stderr=log
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as got:
                    text = got.read().decode()
                # the endpoint serves from the agent's start; the ledger's gauges come once
                # the agent has opened it (a CI run scraped once before that)
                if "vmlend_registry_up" in text:
                    break
            except OSError:
                pass
            assert agent.poll() is None, (tmp_path / "agent.log").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        agent.terminate()
        agent.wait(30)
        log.close()
    names = {name for name, _ in samples(text)}
    assert {
        "vmlend_registry_up",
        "vmlend_adapter_lut_entries_used",
        "vmlend_adapter_lut_entries",
        "vmlend_adapter_window_bytes_used",
        "vmlend_adapter_window_bytes",
        "vmlend_adapter_segments_used",
        "vmlend_adapter_segments",
        "vmlend_fences_pending",
        *PROCESS,
    } <= names
    assert value(text, "vmlend_holds", node="gamma") == 1
