"""The agent's metrics in the Prometheus text format (``vmlend agent --metrics HOST:PORT``).

One ``AgentMetrics`` per agent, no process-wide registry: the counters the agent's threads
bump (renewals that failed, leases lost, hook calls and their latency, transaction re-runs)
and, at scrape time, what the agent's watch knows (lease age, paused VMs) and what the ledger
holds (per adapter LUT entries, window bytes and segments; holds by node; fences pending;
NVMe shares by node). The ledger is read on the scraping thread with a fabric of its own, at
most once per ``cache_seconds`` however many scrapes come (a storm does not hammer etcd).

The text is written by hand: ``bench/bench_metrics.py`` measures it against prometheus_client
side by side (import and scrape cost; docs/cluster.md, "Metrics", has the numbers). The hook
process never imports this module; the HTTP server (``http.server``) is imported only when
``serve`` is called, so an agent without ``--metrics`` pays for neither.

Nothing here calls libvirt or waits for a lock held across a libvirt call (the deadlock rule
of ``vmlend.hook.server``): the watch's lock is never held across one.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, NamedTuple, Protocol

from vmlend.errors import ConfigError, VmlendError

if TYPE_CHECKING:
    from http.server import HTTPServer

    from vmlend.fabric.base import Fabric

log = logging.getLogger(__name__)

PREFIX = "vmlend_"
#: Upper bounds (seconds) of the hook latency histogram: a forwarded no-op takes
#: milliseconds, a prepare on etcd tens of milliseconds, one stuck behind etcd seconds.
HOOK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: How long one read of the ledger answers scrapes.
CACHE_SECONDS = 2.0
#: The runtime record kind of an NVMe share (``vmlend.ledger.nvmeshares.SHARE_RECORD``,
#: named here so the agent need not import the NVMe share code to count them).
SHARE_RECORD = "nvme-share"


class LeaseSource(Protocol):
    """What the agent's lease watch tells (``vmlend.agent.watch.LeaseWatch``)."""

    def age(self) -> float: ...

    def paused_count(self) -> int: ...


class Outcome(Protocol):
    """What became of one VM a lost-lease recovery handled (``recover.VmRecovery``)."""

    @property
    def outcome(self) -> str: ...


class Retries(Protocol):
    """A registry that counts its transaction re-runs (``EtcdRegistry.conflicts``)."""

    conflicts: int


class AdapterRow(NamedTuple):
    adapter: str
    lut_used: int
    lut_usable: int
    window_used: int
    window_size: int
    segments_used: int
    segments: int


class FabricSample(NamedTuple):
    """One read of the ledger."""

    adapters: list[AdapterRow]
    holds: dict[str, int]  # by the holder's node
    fences_pending: int  # this node's fenced devices, waiting to be taken back
    shares: dict[str, int]  # NVMe shares, by the holder's node


def read_fabric(fabric: Fabric) -> FabricSample:
    """What the fabric gauges show, read from the ledger (``StateError`` when unreachable)."""
    adapters = [
        AdapterRow(
            ref,
            u.lut_used,
            u.adapter.lut_usable,
            u.window_used,
            u.adapter.window_size,
            u.segments_used,
            u.adapter.segments,
        )
        for ref, u in sorted(fabric.usage().items())
    ]
    holds: dict[str, int] = {}
    shares: dict[str, int] = {}
    fenced = getattr(fabric, "fenced", None)  # a lender's capability (TakesBack)
    fences = len(fenced()) if fenced is not None else 0
    registry = getattr(fabric, "registry", None)
    if registry is not None:
        with registry.read() as tx:
            for hold in tx.holds().values():
                holds[hold.holder.node] = holds.get(hold.holder.node, 0) + 1
            for rec in tx.runtime(kind=SHARE_RECORD):
                node = str(rec.data.get("holder", {}).get("node", ""))
                shares[node] = shares.get(node, 0) + 1
    return FabricSample(adapters, holds, fences, shares)


def _bounded(fabric: Fabric, ttl: float | None) -> Fabric:
    """A scrape waits for etcd no longer than the agent's own calls do (a blackholed
    endpoint must not hold scrapes for the HTTP client's default timeout)."""
    gateway = getattr(getattr(fabric, "registry", None), "gateway", None)
    if ttl is not None and gateway is not None:
        from vmlend.registry.etcd_gateway import call_deadline

        gateway.set_timeout(call_deadline(int(ttl)))
    return fabric


class _Histogram:
    __slots__ = ("count", "counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * len(HOOK_BUCKETS)  # not cumulative: one bucket per observation
        self.total = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        for i, bound in enumerate(HOOK_BUCKETS):
            if seconds <= bound:
                self.counts[i] += 1
                break
        self.total += seconds
        self.count += 1


class AgentMetrics:
    """The metrics of one agent. The ``*ed``/``observe_*`` methods are called from the agent's
    threads; ``render`` from the scraping thread."""

    def __init__(
        self, *, cache_seconds: float = CACHE_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._lock = threading.Lock()  # the counters
        self._read_lock = threading.Lock()  # one ledger read at a time; the rest use its sample
        self._clock = clock
        self._cache_seconds = cache_seconds
        self.renew_failures = 0
        self.leases_lost = 0
        self.recoveries: dict[str, int] = {}  # by outcome: resumed, unplugged, paused
        self.hook_calls: dict[str, _Histogram] = {}
        self._hook_retries = 0
        self._lease: LeaseSource | None = None
        self._ttl: float | None = None
        self._registries: list[Retries] = []
        self._open_fabric: Callable[[], Fabric] | None = None
        self._fabric: Fabric | None = None
        self._sample: FabricSample | None = None
        self._sampled_at = -math.inf
        self._read_ok = True

    # --- what the agent tells --------------------------------------------------------------
    def follow(
        self,
        *,
        lease: LeaseSource | None = None,
        ttl: float | None = None,
        registry: Retries | None = None,
        open_fabric: Callable[[], Fabric] | None = None,
    ) -> None:
        """Where the scrape-time values come from (the agent says so once it has them)."""
        with self._lock:
            if lease is not None:
                self._lease, self._ttl = lease, ttl
            if registry is not None:
                self._registries.append(registry)
            if open_fabric is not None:
                self._open_fabric = open_fabric

    def renew_failed(self) -> None:
        with self._lock:
            self.renew_failures += 1

    def lease_lost(self) -> None:
        with self._lock:
            self.leases_lost += 1

    def recovered(self, results: Iterable[Outcome]) -> None:
        """The VMs a recovery after a lost lease (or at start-up) handled."""
        with self._lock:
            for r in results:
                self.recoveries[r.outcome] = self.recoveries.get(r.outcome, 0) + 1

    def observe_hook(self, op: str, seconds: float, retries: int = 0) -> None:
        """One hook call the agent ran: its operation, how long it took, and how often its
        registry transactions re-ran."""
        with self._lock:
            self.hook_calls.setdefault(op, _Histogram()).observe(seconds)
            self._hook_retries += retries

    def close(self) -> None:
        with self._read_lock:
            fabric, self._fabric = self._fabric, None
        close = getattr(fabric, "close", None)
        if close is not None:
            try:
                close()
            except VmlendError as e:
                log.warning("metrics: closing the fabric: %s", e)

    # --- the scrape ------------------------------------------------------------------------
    def _fabric_sample(self) -> tuple[FabricSample | None, bool]:
        """The ledger's numbers, read again when the cached ones are older than the cache
        time; whether the last read succeeded."""
        with self._read_lock:
            if self._open_fabric is None:
                return None, True
            if self._clock() - self._sampled_at < self._cache_seconds:
                return self._sample, self._read_ok
            try:
                if self._fabric is None:
                    self._fabric = _bounded(self._open_fabric(), self._ttl)
                self._sample, self._read_ok = read_fabric(self._fabric), True
            except VmlendError as e:  # unreachable etcd: say so, show no stale numbers
                log.warning("metrics: cannot read the ledger: %s", e)
                self._sample, self._read_ok = None, False
            self._sampled_at = self._clock()
            return self._sample, self._read_ok

    def render(self) -> str:
        """The Prometheus text exposition (format 0.0.4)."""
        sample, read_ok = self._fabric_sample()
        with self._lock:
            lease, ttl = self._lease, self._ttl
            renew_failures, leases_lost = self.renew_failures, self.leases_lost
            recoveries = sorted(self.recoveries.items())
            calls = {
                op: (list(h.counts), h.total, h.count) for op, h in sorted(self.hook_calls.items())
            }
            retries = self._hook_retries + sum(r.conflicts for r in self._registries)
        out: list[str] = []
        if self._open_fabric is not None:
            _family(out, "registry_up", "gauge", "1 when the last read of the ledger succeeded.")
            out.append(f"{PREFIX}registry_up {int(read_ok)}")
        if sample is not None:
            _fabric_families(out, sample)
        if lease is not None:
            _family(
                out,
                "lease_age_seconds",
                "gauge",
                "Seconds since this host's lease was last renewed (VMs pause at half the TTL).",
            )
            out.append(f"{PREFIX}lease_age_seconds {_num(lease.age())}")
            if ttl is not None:
                _family(out, "lease_ttl_seconds", "gauge", "The TTL of this host's lease.")
                out.append(f"{PREFIX}lease_ttl_seconds {_num(ttl)}")
            _family(
                out,
                "paused_vms",
                "gauge",
                "VMs with remote devices the agent paused while its lease was in doubt.",
            )
            out.append(f"{PREFIX}paused_vms {lease.paused_count()}")
            _family(
                out,
                "lease_renew_failures_total",
                "counter",
                "Lease renewals that failed (etcd unreachable or slow).",
            )
            out.append(f"{PREFIX}lease_renew_failures_total {renew_failures}")
            _family(
                out,
                "leases_lost_total",
                "counter",
                "Leases this agent lost and replaced (its holds were gone).",
            )
            out.append(f"{PREFIX}leases_lost_total {leases_lost}")
            _family(
                out,
                "vm_recoveries_total",
                "counter",
                "VMs recovered after a lost lease, by outcome (kept-paused: an operator's"
                " pause kept, devices done; paused: not done, left paused).",
            )
            for outcome, n in recoveries:
                out.append(f"{PREFIX}vm_recoveries_total{{outcome={_label(outcome)}}} {n}")
        _family(
            out, "hook_calls_total", "counter", "libvirt hook calls the agent ran, by operation."
        )
        for op, (_counts, _total, count) in calls.items():
            out.append(f"{PREFIX}hook_calls_total{{op={_label(op)}}} {count}")
        _family(
            out,
            "hook_call_duration_seconds",
            "histogram",
            "How long the hook calls the agent ran took, by operation.",
        )
        for op, (counts, total, count) in calls.items():
            lab = f"op={_label(op)}"
            running = 0
            for bound, n in zip(HOOK_BUCKETS, counts, strict=True):
                running += n
                out.append(
                    f'{PREFIX}hook_call_duration_seconds_bucket{{{lab},le="{_num(bound)}"}}'
                    f" {running}"
                )
            out.append(f'{PREFIX}hook_call_duration_seconds_bucket{{{lab},le="+Inf"}} {count}')
            out.append(f"{PREFIX}hook_call_duration_seconds_sum{{{lab}}} {_num(total)}")
            out.append(f"{PREFIX}hook_call_duration_seconds_count{{{lab}}} {count}")
        _family(
            out,
            "registry_txn_retries_total",
            "counter",
            "Registry transactions re-run because another host changed what they read.",
        )
        out.append(f"{PREFIX}registry_txn_retries_total {retries}")
        out.append("")
        return "\n".join(out)


def _fabric_families(out: list[str], s: FabricSample) -> None:
    per_adapter = (
        ("adapter_lut_entries_used", "LUT entries the holds use on the adapter.", 1),
        ("adapter_lut_entries", "LUT entries the adapter has for lending.", 2),
        ("adapter_window_bytes_used", "NTB window bytes the holds use on the adapter.", 3),
        ("adapter_window_bytes", "The adapter's NTB window size in bytes.", 4),
        ("adapter_segments_used", "NTB window segments the holds use on the adapter.", 5),
        ("adapter_segments", "NTB window segments the adapter has.", 6),
    )
    for name, help_text, col in per_adapter:
        _family(out, name, "gauge", help_text)
        for row in s.adapters:
            out.append(f"{PREFIX}{name}{{adapter={_label(row.adapter)}}} {row[col]}")
    _by_node(out, "holds", "Devices held, by the holding node.", s.holds)
    _family(
        out,
        "fences_pending",
        "gauge",
        "Devices this node lends whose holder's lease ended, waiting to be taken back.",
    )
    out.append(f"{PREFIX}fences_pending {s.fences_pending}")
    _by_node(out, "nvme_shares", "Queue-level NVMe shares, by the holding node.", s.shares)


def _by_node(out: list[str], name: str, help_text: str, values: dict[str, int]) -> None:
    _family(out, name, "gauge", help_text)
    for node, n in sorted(values.items()):
        out.append(f"{PREFIX}{name}{{node={_label(node)}}} {n}")


def _family(out: list[str], name: str, kind: str, help_text: str) -> None:
    out.append(f"# HELP {PREFIX}{name} {help_text}")
    out.append(f"# TYPE {PREFIX}{name} {kind}")


def _label(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return f'"{escaped}"'


def _num(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


# --- the HTTP endpoint ----------------------------------------------------------------------
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: Seconds a scraper may take to send its request (one thread serves them all).
HANDLER_TIMEOUT = 5.0


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as a bind address; ConfigError in one line."""
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"--metrics {text!r}: give HOST:PORT, e.g. 127.0.0.1:9850")
    return host, int(port)


class MetricsServer:
    """Serves ``metrics.render()`` at ``/metrics`` on its own thread (``bind``, ``start``,
    ``stop``); bound before the agent takes its lease, so a bad address changes nothing."""

    def __init__(self, metrics: AgentMetrics, address: tuple[str, int]) -> None:
        self.metrics = metrics
        self.address = address
        self._httpd: HTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        assert self._httpd is not None
        return int(self._httpd.server_address[1])

    def bind(self) -> None:
        import socket
        import socketserver
        from http.server import HTTPServer

        handler = _handler(self.metrics)
        host, port = self.address
        family = socket.AF_INET6 if ":" in host else socket.AF_INET

        # One thread serves every scrape, in turn: the ledger's fabric stays on the thread that
        # opened it, and a scrape storm queues instead of multiplying the reads.
        class Server(HTTPServer):
            address_family = family

            def server_bind(self) -> None:
                # HTTPServer's own asks the resolver for the host's FQDN (a reverse lookup
                # that may hang on a host without DNS); nothing here needs that name.
                socketserver.TCPServer.server_bind(self)
                self.server_name, self.server_port = str(host), int(self.server_address[1])

        try:
            self._httpd = Server((host, port), handler)
        except OSError as e:  # in use, not ours, or no such name
            where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
            raise ConfigError(f"--metrics {where}: cannot listen: {e.strerror or e}") from None

    def start(self) -> None:
        if self._httpd is None:
            self.bind()
        assert self._httpd is not None
        self._thread = threading.Thread(
            target=self._serve, args=(self._httpd,), name="metrics", daemon=True
        )
        self._thread.start()
        host, _port = self.address
        log.warning("serving metrics on http://%s:%d/metrics", host, self.port)

    def stop(self) -> None:
        if self._httpd is None:
            return
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()
        self._httpd = None

    def _serve(self, httpd: HTTPServer) -> None:
        try:
            httpd.serve_forever(0.2)
        finally:
            self.metrics.close()  # on the thread that opened its fabric


def _handler(metrics: AgentMetrics) -> type:
    from http.server import BaseHTTPRequestHandler

    class Handler(BaseHTTPRequestHandler):
        timeout = HANDLER_TIMEOUT  # a peer that sends nothing does not hold the scrapes

        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                self.send_error(404, "only /metrics here")
                return
            try:
                body = metrics.render().encode()
            except Exception:  # a bug in a collector must not kill the agent's endpoint
                log.exception("metrics: rendering failed")
                self.send_error(500)
                return
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            log.debug("metrics: " + format, *args)

    return Handler
