"""The few etcd v3 calls the registry needs, over etcd's HTTP/JSON gateway (via etcd3gw).

Turns etcd's failures into one-line ``StateError``s: unreachable endpoints (each is tried in
turn), a leader change or an election in progress (retried a few times first), a request too
large and a transaction with too many operations. Keys and values are bytes on the wire
(base64 in JSON); here keys are ``str`` and values ``bytes``.

With a user (``EtcdAuth``: etcd's authentication is on), the gateway authenticates before its
first request (``/v3/auth/authenticate``) and sends the token it got in the ``Authorization``
header of every later one. The token is shared by every gateway of the process to the same
endpoints as the same user (``_TOKENS``): the agent opens a gateway per hook call, and an
authentication costs etcd a bcrypt check (~0.1 s at its default cost).

etcd forgets a token after a while (a simple token after ``--auth-token-ttl`` seconds of
disuse, 300 by default; a JWT when it expires, and on a member that restarted): a request
refused with "invalid auth token" authenticates again and is sent once more (it was refused
before etcd applied anything). etcd's JSON gateway cannot authenticate
by a TLS client certificate's name (CVE-2018-16886), so a host's identity is a user and a
password; the certificates stay what keeps others off etcd's port.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from vmlend.errors import (
    LeaseExpiredError,
    RegistryAuthError,
    RegistryPermissionError,
    RegistryUnreachableError,
    StateError,
)
from vmlend.registry.deadline import call_bound

log = logging.getLogger(__name__)

#: Seconds one HTTP request to etcd may take before the endpoint counts as unreachable.
REQUEST_TIMEOUT = 5.0
#: Transient server errors (leader change, no leader, timeouts inside raft) are retried this
#: many times with a jittered backoff (about 1.5 s in all, longer than a default election).
TRANSIENT_ATTEMPTS = 6

# Substrings of etcd's error messages (etcdserver/api/v3rpc/rpctypes) that pass by themselves.
if TYPE_CHECKING:
    import requests
    from etcd3gw import exceptions as gw_errors
    from etcd3gw.client import Etcd3Client

    from vmlend.registry.credentials import EtcdAuth

# etcd3gw (and requests under it) is imported only where a gateway is made or used: a host on
# an SQLite registry - its hook above all, run for every domain operation - never loads it.

#: The advice when a cluster misbehaves (Debian's etcd-server has no etcdctl).
_HEALTH = (
    "check that a majority of its members run and see each other ('etcdctl endpoint health',"
    " from Debian's etcd-client package)"
)

_TRANSIENT = (
    "leader changed",
    "no leader",
    "request timed out",
    "too many requests",
    "context deadline exceeded",  # the gateway's own call timed out (a write without quorum)
)


#: The process's tokens, by (endpoints, user, password): a new gateway starts with the token
#: another one got, and a renewed token replaces it for all of them.
_TOKENS: dict[tuple[str, str, str], str] = {}
_TOKENS_LOCK = threading.Lock()


def call_deadline(ttl: float) -> float:
    """The per-request timeout for a process holding a lease of ``ttl`` seconds: a quarter of
    it (at most ``REQUEST_TIMEOUT``, at least 0.25 s), so a hung endpoint cannot outlast the
    lease unnoticed."""
    return max(0.25, min(REQUEST_TIMEOUT, ttl / 4))


def b64(data: str | bytes) -> str:
    # surrogateescape: a key read back from etcd (``_kv``) that is not UTF-8 names itself again
    raw = data.encode("utf-8", "surrogateescape") if isinstance(data, str) else data
    return base64.b64encode(raw).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def prefix_end(prefix: str) -> str:
    """The ``range_end`` that makes a range cover every key starting with ``prefix``."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1  # our prefixes end in "/", never in 0xff
    return raw.decode()


class KeyValue(msgspec.Struct, frozen=True):
    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int = 0


class EtcdTls(msgspec.Struct, frozen=True):
    """HTTPS to etcd: ``cacert`` verifies the server (None: the system's CAs); ``cert`` and
    ``key`` are this host's client certificate (both or neither)."""

    cacert: Path | None = None
    cert: Path | None = None
    key: Path | None = None


class Endpoint(msgspec.Struct, frozen=True):
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


class EtcdGateway:
    """A connection to one etcd cluster through any of its client ``endpoints``."""

    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        *,
        timeout: float = REQUEST_TIMEOUT,
        sleep: Callable[[float], None] = time.sleep,
        tls: EtcdTls | None = None,
        endpoint_file: Path | None = None,
        auth: EtcdAuth | None = None,
    ) -> None:
        #: Per thread, the posts of the request in hand (``resent``).
        self._posts = threading.local()
        if not endpoints:
            raise ValueError("an etcd gateway needs at least one endpoint")
        self.endpoints = list(endpoints)
        self._clients = [_client(e, timeout, tls) for e in self.endpoints]
        self._timeout = timeout
        #: This host's etcd user (None: send no token), and the token etcd gave it.
        self._auth = auth
        self._token: str | None = self._shared_token()
        #: etcd said its authentication is off: send no token until it asks for one.
        self._auth_off = False
        self._auth_lock = threading.Lock()
        #: Tokens asked for (``/v3/auth/authenticate``), for tests and benchmarks.
        self.authentications = 0
        #: Where short-lived processes of the host share the endpoint that last answered, so
        #: a hung member listed first costs one timeout per host, not one per process.
        self._endpoint_file = endpoint_file
        self._current = self._remembered()
        self._sleep = sleep

    def _remembered(self) -> int:
        if self._endpoint_file is None or len(self.endpoints) < 2:
            return 0
        try:
            data = json.loads(self._endpoint_file.read_text())
            if data.get("endpoints") == self.where:
                return [str(e) for e in self.endpoints].index(data["good"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
        return 0

    def _remember(self, index: int) -> None:
        if self._endpoint_file is None or len(self.endpoints) < 2:
            return
        path = self._endpoint_file
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            good = str(self.endpoints[index])
            tmp.write_text(json.dumps({"endpoints": self.where, "good": good}))
            os.replace(tmp, path)
        except OSError as e:  # a user without access to the run dir: only slower
            log.debug("cannot remember the etcd endpoint in %s: %s", path, e)

    @property
    def where(self) -> str:
        return ",".join(str(e) for e in self.endpoints)

    def set_timeout(self, seconds: float) -> None:
        """Bound each HTTP request to an endpoint by ``seconds`` from now on."""
        self._timeout = seconds
        for c in self._clients:
            c.timeout = seconds

    def close(self) -> None:
        for c in self._clients:
            c.session.close()

    # --- one request, with failover and retries -------------------------------------------
    def _token_key(self) -> tuple[str, str, str] | None:
        return None if self._auth is None else (self.where, self._auth.user, self._auth.password)

    def _shared_token(self) -> str | None:
        key = self._token_key()
        with _TOKENS_LOCK:
            return None if key is None else _TOKENS.get(key)

    def _share_token(self, token: str) -> None:
        key = self._token_key()
        if key is not None:
            with _TOKENS_LOCK:
                _TOKENS[key] = token

    @property
    def user(self) -> str:
        """The etcd user this gateway authenticates as ("" when none)."""
        return "" if self._auth is None else self._auth.user

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<path>`` on a reachable endpoint; the JSON answer."""
        start = time.monotonic()
        bound = call_bound()  # the path's own deadline per call (``registry.deadline``)
        deadline = None if bound is None else start + bound
        if self._auth is None:
            try:
                return self._call(path, body, None, start, deadline)
            except _AuthNeeded:
                raise RegistryAuthError(
                    self.where,
                    "",
                    f"etcd at {self.where} requires a user (its authentication is on); name"
                    " this host's in the registry URL: ?user=NAME&password-file=PATH"
                    " (docs/cluster.md, 'Users and roles')",
                ) from None
        token = self._token
        if token is None and not self._auth_off:
            token = self._authenticate(None, start, deadline)
        try:
            return self._call(path, body, token, start, deadline)
        except _AuthNeeded as e:  # refused before etcd applied anything: send it once more
            token = self._authenticate(token, start, deadline, asked=True)
            log.info("etcd at %s: %s; authenticated again as %s", self.where, e.reason, self.user)
        try:
            return self._call(path, body, token, start, deadline)
        except _AuthNeeded as e:
            raise RegistryAuthError(
                self.where,
                self._auth.user,
                f"etcd at {self.where} refused the token it had just given user"
                f" {self._auth.user!r} ({e.reason}); retry, and if it persists check that"
                " every member runs with the same --auth-token",
            ) from None

    def _authenticate(
        self, stale: str | None, start: float, deadline: float | None, *, asked: bool = False
    ) -> str | None:
        """A token for this gateway's user, replacing ``stale`` (the one a request was refused
        with; None: none yet). Threads share one token: one that finds another thread renewed
        it meanwhile takes that. None when etcd's authentication is off (and ``asked`` False:
        etcd did not just ask for a user)."""
        assert self._auth is not None
        with self._auth_lock:
            shared = self._shared_token()
            if shared is not None and shared != stale:  # another gateway renewed it
                self._token = shared
            if self._token is not None and self._token != stale:
                return self._token
            self.authentications += 1
            body = {"name": self._auth.user, "password": self._auth.password}
            try:
                answer = self._call("auth/authenticate", body, None, start, deadline)
            except _AuthOff:
                if asked:  # etcd asked for a user, then says its authentication is off
                    raise RegistryAuthError(
                        self.where,
                        self._auth.user,
                        f"etcd at {self.where} asked for a user, then said its authentication"
                        " is off; retry",
                    ) from None
                log.debug("etcd at %s has authentication off: no token sent", self.where)
                self._auth_off = True
                return None
            except _BadPassword:
                source = f" in {self._auth.source}" if self._auth.source else ""
                raise RegistryAuthError(
                    self.where,
                    self._auth.user,
                    f"etcd at {self.where} refused user {self._auth.user!r}: wrong password or no"
                    f" such user; check the password{source} against the one set with 'etcdctl"
                    " user add' (or 'etcdctl user passwd')",
                ) from None
            token = str(answer.get("token", ""))
            if not token:
                raise StateError(f"etcd at {self.where} answered an authentication with no token")
            self._token = token
            self._share_token(token)
            self._auth_off = False
            return token

    def _call(
        self,
        path: str,
        body: dict[str, Any],
        token: str | None,
        start: float,
        deadline: float | None,
    ) -> dict[str, Any]:
        """``call``'s request with ``token``, retried over transient failures."""
        delay = 0.02
        for attempt in range(TRANSIENT_ATTEMPTS):
            try:
                return self._call_any(path, body, deadline, token)
            except _Transient as e:
                # A leader change passes in milliseconds; a member that timed out inside raft
                # (no quorum) would cost a whole timeout per attempt: one is the deadline.
                now = time.monotonic()
                if (
                    attempt == TRANSIENT_ATTEMPTS - 1
                    or now - start >= self._timeout
                    or (deadline is not None and now >= deadline)
                ):
                    raise RegistryUnreachableError(
                        self.where,
                        f"etcd at {self.where} fails ({e.reason}; {attempt + 1} attempt(s) in"
                        f" {now - start:.1f} s): no quorum (fewer than a majority"
                        f" of its members run or see each other); {_HEALTH}, then retry",
                    ) from None
                log.debug("etcd: %s; retrying", e.reason)
                pause = delay * (0.5 + random.random())
                if deadline is not None:
                    pause = min(pause, max(0.0, deadline - now))
                self._sleep(pause)
                delay *= 2
        raise AssertionError("unreachable")

    def _call_any(
        self,
        path: str,
        body: dict[str, Any],
        deadline: float | None = None,
        token: str | None = None,
    ) -> dict[str, Any]:
        """One attempt over the endpoints, the current one first. With ``deadline`` (a
        ``time.monotonic()`` value) no request outlasts it, and none starts after it."""
        from etcd3gw import exceptions as gw_errors

        failures = []
        timed_out = False
        for i in range(len(self._clients)):
            index = (self._current + i) % len(self._clients)
            client = self._clients[index]
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    failures.append(f"{self.endpoints[index]}: not tried (out of time)")
                    timed_out = True
                    break
                client.timeout = min(self._timeout, left)
            try:
                headers = {} if token is None else {"Authorization": token}
                self._posts.n = getattr(self._posts, "n", 0) + 1
                answer = client.post(client.get_url(path), data=json.dumps(body), headers=headers)
            except (gw_errors.ConnectionFailedError, gw_errors.ConnectionTimeoutError) as e:
                failures.append(f"{self.endpoints[index]}: {_short(e)}")
                timed_out |= isinstance(e, gw_errors.ConnectionTimeoutError)
                continue
            except gw_errors.Etcd3Exception as e:
                raise _server_error(e, self.where, self.user) from None
            finally:
                client.timeout = self._timeout
            if index != self._current:
                self._current = index
                self._remember(index)
            return dict(answer)
        if timed_out:
            # A member that accepts connections but never answers: it has no quorum (a
            # request waits for a leader) or it hangs. Starting etcd is not the advice.
            raise RegistryUnreachableError(
                self.where,
                f"etcd at {self.where} does not answer ({'; '.join(failures)}): no quorum, or"
                f" its members hang; {_HEALTH}, then retry",
            )
        raise RegistryUnreachableError(
            self.where,
            f"cannot reach etcd at {self.where} ({'; '.join(failures)}); start etcd or point"
            " --registry / VMLEND_REGISTRY at a running cluster",
        )

    # --- the calls --------------------------------------------------------------------------
    def range(
        self, key: str, range_end: str | None = None, revision: int = 0
    ) -> tuple[int, list[KeyValue]]:
        """The header revision and the keys in ``[key, range_end)`` (or ``key`` alone) as of
        ``revision`` (0 = now)."""
        body: dict[str, Any] = {"key": b64(key)}
        if range_end is not None:
            body["range_end"] = b64(range_end)
        if revision:
            body["revision"] = revision
        answer = self.call("kv/range", body)
        return _revision(answer), [_kv(kv) for kv in answer.get("kvs", [])]

    def read_many(
        self, ranges: list[tuple[str, str | None]], revision: int = 0
    ) -> tuple[int, list[list[KeyValue]]]:
        """Several ranges ``(key, range_end or None)`` in one request (a Txn of reads: all at
        one revision, ``revision`` or now). The revision and each range's keys, in order."""
        ops = []
        for key, end in ranges:
            r: dict[str, Any] = {"key": b64(key)}
            if end is not None:
                r["range_end"] = b64(end)
            if revision:
                r["revision"] = revision
            ops.append({"request_range": r})
        answer = self.call("kv/txn", {"compare": [], "success": ops, "failure": []})
        results = [
            [_kv(kv) for kv in resp.get("response_range", {}).get("kvs", [])]
            for resp in answer.get("responses", [])
        ]
        return _revision(answer), results

    def txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]]) -> tuple[bool, int]:
        """One transaction: ``success`` ops iff every ``compare`` holds. (succeeded, revision)"""
        self._posts.n = 0
        try:
            answer = self.call("kv/txn", {"compare": compare, "success": success, "failure": []})
        finally:
            self._posts.resent = self._posts.n > 1
        return bool(answer.get("succeeded", False)), _revision(answer)

    def resent(self) -> bool:
        """This thread's last ``txn`` was sent more than once (over a member that timed out,
        or a transient failure): an answer "not succeeded" may follow a first send that
        landed."""
        return bool(getattr(self._posts, "resent", False))


def _client(endpoint: Endpoint, timeout: float, tls: EtcdTls | None) -> Etcd3Client:
    import requests
    from etcd3gw.client import Etcd3Client

    if tls is None:
        client = Etcd3Client(endpoint.host, endpoint.port, timeout=timeout, api_path="/v3/")
        _settle_environment(client.session, client.get_url(""))
        return client
    session = requests.Session()
    if tls.cacert is not None:
        session.verify = str(tls.cacert)
        # Else requests lets $REQUESTS_CA_BUNDLE / $CURL_CA_BUNDLE override the CA the URL
        # names, and etcd's certificate fails to verify against the system's CAs.
        session.trust_env = False
    if tls.cert is not None and tls.key is not None:
        session.cert = (str(tls.cert), str(tls.key))
    client = Etcd3Client(
        endpoint.host,
        endpoint.port,
        protocol="https",
        timeout=timeout,
        api_path="/v3/",
        session=session,
    )
    _settle_environment(session, client.get_url(""))
    return client


def _settle_environment(session: requests.Session, url: str) -> None:
    """Read what the environment says about ``url`` (proxies, ``no_proxy``, a CA bundle,
    ~/.netrc) once, and stop ``session`` from reading it again on every request: requests
    re-reads the whole environment and stats ~/.netrc per request, about 0.7 ms each, the
    largest single cost of a registry call. The endpoint's URL never changes, and neither
    does the environment of a process, so the answer is the same."""
    from requests.utils import get_netrc_auth

    if not session.trust_env:
        return
    settings = session.merge_environment_settings(url, {}, None, session.verify, None)
    session.proxies.update(settings["proxies"])
    session.verify = settings["verify"]
    if session.auth is None:
        session.auth = get_netrc_auth(url)
    session.trust_env = False


class RevisionCompactedError(StateError):
    """A snapshot read asked for a revision etcd has compacted away: re-run with fresh reads."""


class _Transient(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _AuthNeeded(Exception):
    """etcd wants a (new) token: none was sent, or it forgot the one sent."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _AuthOff(Exception):
    """An authentication, answered "authentication is not enabled"."""


class _BadPassword(Exception):
    """An authentication, refused: no such user or a wrong password."""


def _short(e: Exception) -> str:
    text = str(e) or type(e).__name__
    # requests' messages carry the whole urllib3 chain; the last clause says what happened.
    return text.rsplit(": ", 1)[-1].rstrip(")'\"") or text


#: etcd's messages (auth/store.go) meaning "authenticate (again) and resend".
_AUTH_AGAIN = ("invalid auth token", "user name is empty")


def _server_error(e: gw_errors.Etcd3Exception, where: str, user: str = "") -> Exception:
    from etcd3gw import exceptions as gw_errors

    try:
        message = str(json.loads(e.detail_text or "{}").get("error", "")) or str(e.detail_text)
    except ValueError:
        message = str(e.detail_text or e)
    message = message.removeprefix("etcdserver: ")
    if any(t in message for t in _TRANSIENT) or isinstance(e, gw_errors.ConnectionTimeoutError):
        return _Transient(message or "timeout")
    if "has been compacted" in message:
        return RevisionCompactedError(f"etcd at {where} compacted the revision a transaction read")
    if "request is too large" in message or "larger than max" in message:
        return StateError(
            f"etcd at {where} refused a request as too large (over its --max-request-bytes);"
            " nothing was written; raise the limit (a topology is written in pieces of 512 KiB,"
            " so etcd must take at least 1.5 MiB, its default)"
        )
    if "too many operations in txn" in message:
        return StateError(
            f"etcd at {where} refused a transaction with too many operations (over its"
            " --max-txn-ops, default 128); nothing was written; raise the limit"
        )
    if "requested lease not found" in message:
        return LeaseExpiredError()
    if any(t in message for t in _AUTH_AGAIN):
        return _AuthNeeded(message)
    if "authentication failed" in message:  # "..., invalid user ID or password"
        return _BadPassword(message)
    if "authentication is not enabled" in message:
        return _AuthOff(message)
    if "permission denied" in message:
        return RegistryPermissionError(where, user)
    if "user name not found" in message:  # the token's user was deleted meanwhile
        return RegistryAuthError(
            where,
            user,
            f"etcd at {where} no longer knows user {user!r}; add it again ('vmlend registry"
            " roles' prints how)",
        )
    return StateError(f"etcd at {where} failed: {message or e}")


def _revision(answer: dict[str, Any]) -> int:
    return int(answer.get("header", {}).get("revision", 0))


def _kv(kv: dict[str, Any]) -> KeyValue:
    return KeyValue(
        # Keys are vmlend's own UTF-8, but whoever may write the registry may write any bytes:
        # such a key must be one odd record to its reader, not a UnicodeDecodeError in a loop.
        key=unb64(kv["key"]).decode("utf-8", "surrogateescape"),
        value=unb64(kv.get("value", "")),
        mod_revision=int(kv.get("mod_revision", 0)),
        create_revision=int(kv.get("create_revision", 0)),
        lease=int(kv.get("lease", 0)),
    )
