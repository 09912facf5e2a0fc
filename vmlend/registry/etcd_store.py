"""``EtcdRegistry``: the shared state of a cluster in etcd, with optimistic write transactions.

``transact(body)`` runs ``body`` against a snapshot, buffers its writes and commits them in one
etcd Txn guarded by compares on everything it read (``etcd_txn``). When another host changed
any of that first, the body runs again on fresh reads: at most ``ATTEMPTS`` times, sleeping a
jittered, doubling pause between runs (2 ms up to 200 ms; about 1.5 s in all), then a
``StateError``. No lock is ever held, so a crashed host blocks nobody.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar, cast

from vmlend.errors import AgentNotRunningError, StateError
from vmlend.registry.api import StateTxn
from vmlend.registry.decider import RunAgain, process_deciders
from vmlend.registry.decoded import Decoded
from vmlend.registry.etcd_gateway import EtcdGateway, RevisionCompactedError
from vmlend.registry.etcd_keys import Keys
from vmlend.registry.etcd_topology import EtcdTopology
from vmlend.registry.etcd_txn import EtcdTxn, Snapshot
from vmlend.registry.etcd_warm import WarmCache
from vmlend.registry.records import Claim
from vmlend.registry.schema import ETCD_HOLDS_LAYOUT, ETCD_SCHEMA_VERSION
from vmlend.registry.topocache import TopologyCache
from vmlend.registry.topopieces import StoredView

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The compares etcd takes in one Txn (its default --max-txn-ops): an attempt from memory
#: with more (a remembered range's keys are compared one by one) runs again on fresh reads.
MAX_COMPARES = 128

#: How often a write body runs before the transaction gives up on conflicts.
ATTEMPTS = 12
_FIRST_PAUSE = 0.002
_MAX_PAUSE = 0.2


class EtcdRegistry:
    """The state of cluster ``cluster`` in the etcd reached through ``gateway``."""

    shares_host_identity = False

    def __init__(
        self,
        gateway: EtcdGateway,
        cluster: str,
        *,
        attempts: int = ATTEMPTS,
        sleep: Callable[[float], None] = time.sleep,
        host_lease: Callable[[], int] | None = None,
        cache: TopologyCache | None = None,
    ) -> None:
        self._gw = gateway
        #: This host's agent lease for the records it creates (None: refuse such writes).
        self._host_lease = host_lease
        self.keys = Keys(cluster)
        self.cluster = cluster
        self._attempts = attempts
        self._sleep = sleep
        self._topology_cache: dict[str, StoredView] = {}
        #: Claims decoded from their unit blocks' values (``EtcdTxn._claims_of``), shared by
        #: the threads.
        self._claims_seen: Decoded[bytes, tuple[tuple[int, Claim], ...]] = Decoded()
        #: The topology's generations, and this host's copy of the current one (``cache``).
        self.generations = EtcdTopology(gateway, self.keys, cache)
        #: Conflicts seen by ``transact`` (re-runs), for benchmarks and tests.
        self.conflicts = 0
        #: What this registry's commits knew, for the next transaction (``etcd_warm``).
        self._warm = WarmCache()
        #: Attempts from remembered items run again on fresh reads (``transact``).
        self.stale = 0
        #: The nodes whose own places this process decides (``vmlend.registry.decider``):
        #: one state for every registry of the process on this cluster (an agent opens
        #: several), so that it decides as one; a test standing for another process gives
        #: its registry a state of its own.
        self.deciders = process_deciders(f"{self.where}|{cluster}")

    @property
    def where(self) -> str:
        return f"etcd://{self._gw.where}/{self.cluster}"

    # --- opening -----------------------------------------------------------------------
    @property
    def gateway(self) -> EtcdGateway:
        return self._gw

    @classmethod
    def open(
        cls,
        gateway: EtcdGateway,
        cluster: str,
        host_lease: Callable[[], int] | None = None,
        cache: TopologyCache | None = None,
        *,
        upgrading: bool = False,
    ) -> EtcdRegistry:
        """The cluster's state; ``StateError`` when there is none, it is from a newer vmlend,
        or (unless ``upgrading``: ``vmlend registry upgrade``) of a layout whose holds this
        vmlend does not read. ``cache``: this host's copy of the topology (none: read from
        etcd)."""
        reg = cls(gateway, cluster, host_lease=host_lease, cache=cache)
        with reg.read() as tx:
            raw = tx.meta("schema_version")
        if raw is None:
            raise StateError(
                f"no vmlend state in {reg.where}; run 'vmlend fabric init' with this --registry"
                " first"
            )
        version = check_schema(raw, reg.where)
        if version < ETCD_HOLDS_LAYOUT and not upgrading:
            raise StateError(
                f"the vmlend state in {reg.where} has layout {version}, whose holds this vmlend"
                f" does not read (it writes layout {ETCD_SCHEMA_VERSION}): stop 'vmlend agent'"
                " on every host, run 'vmlend registry upgrade', then start the agents again"
            )
        return reg

    @classmethod
    def create(
        cls,
        gateway: EtcdGateway,
        cluster: str,
        init: Callable[[StateTxn], None],
        cache: TopologyCache | None = None,
    ) -> EtcdRegistry:
        """Create the cluster's state filled by ``init``, in one transaction (and the
        topology's pieces before it); ``FileExistsError`` when it exists (like the SQLite
        backend's file)."""
        reg = cls(gateway, cluster, cache=cache)

        def body(tx: StateTxn) -> None:
            if tx.meta("schema_version") is not None:
                raise FileExistsError(reg.where)
            tx.set_meta("schema_version", str(ETCD_SCHEMA_VERSION))
            init(tx)

        reg.transact(body)
        log.debug("created state in %s", reg.where)
        return reg

    def close(self) -> None:
        self._gw.close()

    def __enter__(self) -> EtcdRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def host_lease(self) -> int:
        """This host's agent lease (the one the records it creates go on);
        ``AgentNotRunningError`` when none was given."""
        if self._host_lease is None:
            raise AgentNotRunningError(f"{self.where} (no agent lease given)")
        return self._host_lease()

    # --- transactions --------------------------------------------------------------------
    def _txn(self, writable: bool, warm: WarmCache | None = None) -> EtcdTxn:
        memo: list[int] = []

        def lease() -> int:  # read once per attempt: a restarted agent has a new lease
            if not memo:
                if self._host_lease is None:
                    raise AgentNotRunningError(f"{self.where} (no agent lease given)")
                memo.append(self._host_lease())
            return memo[0]

        return EtcdTxn(
            Snapshot(self._gw, warm),
            self.keys,
            writable,
            self._topology_cache,
            lease,
            self.generations,
            self._claims_seen,
            self.deciders,
        )

    def _settle(self, tx: EtcdTxn, committed: bool) -> None:
        """After an attempt that wrote topology generations: delete them when it did not
        commit; when it did, delete every older one (and a loser's staged one: see
        ``etcd_topology``)."""
        if not tx.staged:
            return
        # Failing here changes nothing that was decided: what is left, the next install's
        # collect deletes. So it is logged, never raised over the transaction's outcome.
        try:
            if committed:
                self.generations.collect()
                return
            for generation in tx.staged:
                self.generations.drop(generation)
        except StateError as e:
            log.warning("old topology generations left in %s: %s", self.where, e)

    def forget(self) -> None:
        """Drop what earlier commits knew: the next transaction reads everything."""
        self._warm.clear()

    @contextlib.contextmanager
    def read(self) -> Iterator[StateTxn]:
        """A consistent snapshot for reading (every read at one revision)."""
        yield self._txn(writable=False)

    def transact(self, body: Callable[[StateTxn], T]) -> T:
        """Run ``body`` and commit what it wrote iff nothing it read changed meanwhile;
        otherwise run it again. ``body`` may run several times: it must not touch hardware.

        The first attempt takes what earlier commits knew (``etcd_warm``) instead of reading
        it, so an unchanged cluster commits in one request. Only a commit is checked by etcd:
        a refusal or an answer without writes from such an attempt, or a commit it fails, is
        asked again from fresh reads (that attempt is not counted, nor paused after)."""
        start = time.monotonic()
        pause = _FIRST_PAUSE
        attempt = 0
        warm: WarmCache | None = self._warm if self._warm else None
        while attempt < self._attempts:
            tx = self._txn(writable=True, warm=warm)
            outcome: _Outcome[T] = _Outcome("unknown")
            try:
                outcome = self._attempt(tx, body)
            finally:
                try:
                    self._settle(tx, outcome.kind == "committed")
                finally:  # whatever that raised: the node's other threads wait on this
                    tx.settle(outcome.kind, outcome.revision)
            if outcome.kind == "committed":
                log.debug("committed at revision %d", outcome.revision)
                tx.learn(self._warm, outcome.revision)
                return cast(T, outcome.result)
            if outcome.kind == "read":
                return cast(T, outcome.result)  # the snapshot was consistent: nothing to commit
            if outcome.kind == "fresh":
                # What was remembered was stale somewhere (or the answer needs one
                # revision's reads): forget it all, and run again on fresh reads.
                self._warm.clear()
                self.stale += 1
                warm = None
                continue
            attempt += 1
            self.conflicts += 1
            log.debug("transaction conflict (attempt %d); re-running", attempt)
            if attempt < self._attempts:
                self._sleep(pause * (0.5 + random.random()))
                pause = min(pause * 2, _MAX_PAUSE)
        raise StateError(
            f"the registry {self.where} kept changing under this transaction ({self._attempts}"
            f" attempts in {time.monotonic() - start:.1f} s); nothing was written; retry"
        )

    def _attempt(self, tx: EtcdTxn, body: Callable[[StateTxn], T]) -> _Outcome[T]:
        """One run of ``body`` and its commit."""
        try:
            result = body(tx)
            ops = tx.operations()
            compares = tx.compares() if ops else []
        except Exception as e:
            if isinstance(e, RunAgain) and e.pause:
                return _Outcome("conflict")
            if tx.warmed or isinstance(e, RunAgain):
                return _Outcome("fresh")  # decided on remembered items: ask again, fresh
            if isinstance(e, RevisionCompactedError):
                return _Outcome("conflict")
            raise
        if not ops:
            return _Outcome("fresh") if tx.warmed else _Outcome("read", result)
        if tx.warmed and len(compares) > MAX_COMPARES:
            return _Outcome("fresh")  # more than etcd takes: fresh reads compare fewer
        # An error of the commit itself is raised, also from memory: a commit whose answer
        # was lost may have landed, and must not be asked again as if refused.
        tx.sent = True
        try:
            ok, revision = self._gw.txn(compares, ops)
            tx.resent = not ok and self._gw.resent()
        except RevisionCompactedError:
            ok, revision = False, 0
        if ok:
            return _Outcome("committed", result, revision)
        return _Outcome("fresh") if tx.warmed else _Outcome("conflict")

    @contextlib.contextmanager
    def write(self) -> Iterator[StateTxn]:
        """A write that runs its body once and fails on a conflict (for callers that cannot
        re-run; prefer ``transact``)."""
        tx = self._txn(writable=True)
        ok = False
        kind, revision = "unknown", 0
        try:
            yield tx
            ops = tx.operations()
            if ops:
                tx.sent = True
                ok, revision = self._gw.txn(tx.compares(), ops)
                tx.resent = not ok and self._gw.resent()
            kind = "committed" if ok else "read" if not ops else "conflict"
        finally:
            try:
                self._settle(tx, ok)
            finally:
                tx.settle(kind, revision)
        if ops and not ok:
            raise StateError(
                f"the registry {self.where} changed under this transaction; nothing was"
                " written; retry"
            )


class _Outcome(Generic[T]):
    """How one attempt of ``transact`` ended: ``committed`` (at ``revision``), ``read`` (no
    writes, from fresh reads: ``result`` stands), ``conflict`` (run again after a pause),
    ``fresh`` (decided on remembered items: run again at once on fresh reads) or, while it
    runs or when it raised, ``unknown``."""

    __slots__ = ("kind", "result", "revision")

    def __init__(self, kind: str, result: T | None = None, revision: int = 0) -> None:
        self.kind = kind
        self.result = result
        self.revision = revision


def check_schema(raw: str, where: str) -> int:
    try:
        version = int(raw)
    except ValueError:
        raise StateError(f"the vmlend state in {where} has a bad schema version {raw!r}") from None
    if version > ETCD_SCHEMA_VERSION:
        raise StateError(
            f"the vmlend state in {where} has schema version {version}, newer than this vmlend"
            f" understands ({ETCD_SCHEMA_VERSION}); upgrade vmlend on this host"
        )
    if version < 1:
        raise StateError(f"the vmlend state in {where} has unknown schema version {version}")
    return version
