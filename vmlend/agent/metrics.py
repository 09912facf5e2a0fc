"""The agent's metrics in the Prometheus text format (``vmlend agent --metrics HOST:PORT``).

One ``AgentMetrics`` per agent, no process-wide registry: the counters the agent's threads
bump (renewals that failed, leases lost, hook calls and their latency, transaction re-runs)
and, at scrape time, what the agent's watch knows (lease age, paused VMs) and what the ledger
holds (per adapter LUT entries, window bytes and segments; holds by node; fences pending;
NVMe shares by node). The ledger is read on the scraping thread with a fabric of its own, at
most once per ``cache_seconds`` however many scrapes come (a storm does not hammer etcd).

Also the process's own ``process_*`` metrics under their standard names (CPU seconds, resident
memory, open descriptors, start time: read from ``/proc`` at scrape time, as prometheus_client
does) and the agent's health (``health``: what ``/health`` answers).

The text is written by hand: ``bench/bench_metrics.py`` measures it against prometheus_client
side by side (import and scrape cost; docs/cluster.md, "Metrics", has the numbers). The hook
process never imports this module; the HTTP endpoint (``vmlend.agent.metrics_http``: http.server,
ssl) is imported only when the agent serves metrics.

Nothing here calls libvirt or waits for a lock held across a libvirt call (the deadlock rule
of ``vmlend.hook.server``): the watch's lock is never held across one.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, NamedTuple, Protocol

import msgspec

from vmlend.errors import ConfigError, VmlendError

if TYPE_CHECKING:
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


#: What ``/health`` says: whether the agent is well, and one line saying how it is.
Health = Callable[[], tuple[bool, str]]


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
        self._health: Health = lambda: (True, "serving")
        self._started = _process_start()

    # --- what the agent tells --------------------------------------------------------------
    def follow(
        self,
        *,
        lease: LeaseSource | None = None,
        ttl: float | None = None,
        registry: Retries | None = None,
        open_fabric: Callable[[], Fabric] | None = None,
        health: Health | None = None,
    ) -> None:
        """Where the scrape-time values come from (the agent says so once it has them)."""
        with self._lock:
            if health is not None:
                self._health = health
            if lease is not None:
                self._lease, self._ttl = lease, ttl
            if registry is not None:
                self._registries.append(registry)
            if open_fabric is not None:
                self._open_fabric = open_fabric

    def health(self) -> tuple[bool, str]:
        """Whether the agent is well (``/health``: 200, else 503) and one line saying how."""
        with self._lock:
            health = self._health
        try:
            return health()
        except Exception as e:  # a bug in the source must not kill the endpoint
            return False, f"cannot tell: {type(e).__name__}: {e}"

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
        _process_families(out, self._started)
        out.append("")
        return "\n".join(out)


def _process_start() -> float | None:
    """When this process started (seconds since the epoch), from ``/proc``: its start in
    clock ticks after boot, and the boot time. None where there is no ``/proc``."""
    try:
        with open("/proc/self/stat", "rb") as f:
            after_name = f.read().rpartition(b")")[2].split()
        with open("/proc/stat", "rb") as f:
            boot = next(int(ln.split()[1]) for ln in f if ln.startswith(b"btime "))
        return boot + int(after_name[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _process_families(out: list[str], started: float | None) -> None:
    """The standard ``process_*`` metrics of this process (Prometheus's client libraries use
    the same names, without the ``vmlend_`` prefix)."""
    times = os.times()
    rows: list[tuple[str, str, str, float]] = [
        (
            "process_cpu_seconds_total",
            "counter",
            "Total user and system CPU time spent in seconds.",
            times.user + times.system,
        )
    ]
    try:
        with open("/proc/self/statm", "rb") as f:
            resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        rows.append(
            ("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.", resident)
        )
        rows.append(
            (
                "process_open_fds",
                "gauge",
                "Number of open file descriptors.",
                len(os.listdir("/proc/self/fd")),
            )
        )
    except (OSError, ValueError, IndexError):
        pass  # no /proc: only what os.times tells
    if started is not None:
        rows.append(
            (
                "process_start_time_seconds",
                "gauge",
                "Start time of the process since unix epoch in seconds.",
                started,
            )
        )
    for name, kind, help_text, value in rows:
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} {kind}")
        out.append(f"{name} {_num(value)}")


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
#: Where ``--metrics :PORT`` listens: this host only, unless a host is named.
DEFAULT_HOST = "127.0.0.1"
#: A bcrypt hash as Prometheus's exporter web configuration takes it ($2a$, $2b$ or $2y$).
_BCRYPT = re.compile(r"^\$2[aby]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}$")


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6; ``:PORT`` is 127.0.0.1) as a bind address;
    ConfigError in one line."""
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(
            f"--metrics {text!r}: give HOST:PORT, e.g. 10.1.0.7:9850, or :PORT for"
            f" {DEFAULT_HOST}:PORT"
        )
    return host or DEFAULT_HOST, int(port)


def parse_user(text: str) -> tuple[str, str]:
    """``USER:BCRYPT-HASH`` (a basic-auth user of the metrics endpoint); ConfigError naming
    what is wrong, in one line, without echoing the hash."""
    user, sep, hashed = text.partition(":")
    if not sep or not user or any(c.isspace() or not c.isprintable() for c in user):
        raise ConfigError(
            "a metrics user is USER:BCRYPT-HASH with a printable user name without spaces"
            " (e.g. prometheus:$2b$12$...; make the hash with 'htpasswd -nBC 12 USER')"
        )
    if not _BCRYPT.match(hashed):
        raise ConfigError(
            f"the metrics user {user!r} has no bcrypt hash ($2a$, $2b$ or $2y$, cost 04 to 31,"
            " 53 characters after it); make one with 'htpasswd -nBC 12 USER'"
        )
    return user, hashed


class MetricsAccess(msgspec.Struct, frozen=True):
    """Who may scrape: TLS (a certificate and its key, both or neither) and basic-auth users
    (name: bcrypt hash), as in Prometheus's exporter web configuration. Empty: plain HTTP,
    anyone who reaches the port."""

    cert: str | None = None
    key: str | None = None
    users: dict[str, str] = msgspec.field(default_factory=dict)
