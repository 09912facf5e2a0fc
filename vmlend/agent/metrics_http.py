"""The agent's metrics endpoint (``vmlend agent --metrics``): ``/metrics`` (the text of
``vmlend.agent.metrics``) and ``/health`` over HTTP, or HTTPS with basic-auth users as
Prometheus's exporter web configuration has them (``MetricsAccess``).

Imported only when the agent serves metrics: ``http.server``, ``ssl`` and the thread pool cost
an agent without ``--metrics`` nothing. Every request has a thread of its own and one deadline
from its connection to its answer's last byte; a request that fails is one log line, never a
traceback (socketserver's default prints 25 lines for a client gone early).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import logging
import socket
import socketserver
import ssl
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from vmlend.agent.metrics import CONTENT_TYPE, AgentMetrics, MetricsAccess
from vmlend.errors import ConfigError

log = logging.getLogger(__name__)

#: Seconds one request may take, from its connection to the last byte of its answer (the TLS
#: handshake, the request, the ledger read, the answer): a slow or silent peer holds only its
#: own thread, and that for no longer than this.
REQUEST_DEADLINE = 10.0
#: Requests served at once; a connection over it is closed at once (one log line).
MAX_CONNECTIONS = 32


class MetricsServer:
    """Serves ``metrics.render()`` at ``/metrics`` and the agent's health at ``/health``
    (``bind``, ``start``, ``stop``); bound before the agent takes its lease, so a bad address,
    certificate or key changes nothing.

    Each request is served on a thread of its own (at most ``MAX_CONNECTIONS`` at once) within
    ``REQUEST_DEADLINE`` from its connection to its answer's last byte, and one that fails
    (a peer gone early, too slow, a bad handshake, wrong credentials) is one log line. The
    text itself is rendered on one thread of its own, in turn: the ledger's fabric stays on
    the thread that opened it (an SQLite connection must), and a scrape storm waits on the
    cached read instead of multiplying reads."""

    def __init__(
        self,
        metrics: AgentMetrics,
        address: tuple[str, int],
        access: MetricsAccess | None = None,
        *,
        deadline: float = REQUEST_DEADLINE,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.metrics = metrics
        self.address = address
        self.access = access or MetricsAccess()
        self.deadline = deadline
        self.max_connections = max_connections
        self._httpd: socketserver.TCPServer | None = None
        self._thread: threading.Thread | None = None
        self._render: ThreadPoolExecutor | None = None
        self._tls: ssl.SSLContext | None = None
        self._auth: _BasicAuth | None = None

    @property
    def port(self) -> int:
        assert self._httpd is not None
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        host, _port = self.address
        where = f"[{host}]" if ":" in host else host
        return f"{'https' if self._tls else 'http'}://{where}:{self.port}"

    def bind(self) -> None:
        self._tls = _tls_context(self.access)
        self._auth = _BasicAuth(self.access.users) if self.access.users else None
        host, port = self.address
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server = self

        class Server(socketserver.ThreadingMixIn, HTTPServer):
            address_family = family
            daemon_threads = True
            block_on_close = False  # each request ends by its deadline; stop waits for none

            def server_bind(self) -> None:
                # HTTPServer's own asks the resolver for the host's FQDN (a reverse lookup
                # that may hang on a host without DNS); nothing here needs that name.
                socketserver.TCPServer.server_bind(self)
                self.server_name, self.server_port = str(host), int(self.server_address[1])

            def get_request(self) -> tuple[socket.socket, Any]:
                conn, address = self.socket.accept()
                if tls is not None:  # the handshake is the request thread's, within its deadline
                    conn = tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
                return conn, address

            def process_request(self, request: Any, client_address: Any) -> None:
                if not slots.acquire(blocking=False):
                    log.warning(
                        "metrics: %s: %d requests are being served already; closed",
                        _peer(client_address),
                        server.max_connections,
                    )
                    self.shutdown_request(request)
                    return
                try:
                    super().process_request(request, client_address)
                except BaseException:
                    slots.release()
                    raise

            def process_request_thread(self, request: Any, client_address: Any) -> None:
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    slots.release()

            def handle_error(self, request: Any, client_address: Any) -> None:
                # socketserver prints a traceback to stderr: one line instead
                e = sys.exc_info()[1]
                log.warning("metrics: %s: %s", _peer(client_address), _why(e))

        slots = threading.BoundedSemaphore(self.max_connections)
        tls = self._tls
        try:
            self._httpd = Server((host, port), _handler(self))
        except OSError as e:  # in use, not ours, or no such name
            where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
            raise ConfigError(f"--metrics {where}: cannot listen: {e.strerror or e}") from None

    def start(self) -> None:
        if self._httpd is None:
            self.bind()
        assert self._httpd is not None
        self._render = ThreadPoolExecutor(1, thread_name_prefix="metrics-render")
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, args=(0.2,), name="metrics", daemon=True
        )
        self._thread.start()
        if self._auth is not None and self._tls is None:
            log.warning(
                "metrics: basic auth without TLS: passwords cross the network in the clear;"
                " give metrics-tls-cert and metrics-tls-key"
            )
        log.warning("serving metrics on %s/metrics", self.url)

    def stop(self) -> None:
        if self._httpd is None:
            return
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()
        self._httpd = None
        if self._render is not None:
            self._render.submit(self.metrics.close)  # on the thread that opened its fabric
            self._render.shutdown(wait=True)
            self._render = None

    # --- what a request thread asks ---------------------------------------------------------
    def render(self, deadline: float) -> str:
        """The text, rendered on the render thread; TimeoutError once ``deadline`` (monotonic)
        passes first (the ledger read hangs: etcd is slow)."""
        assert self._render is not None
        future = self._render.submit(self.metrics.render)
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            raise TimeoutError("the ledger was not read in time") from None

    def authorized(self, header: str | None) -> bool:
        return self._auth is None or self._auth.check(header)

    def handshake(self, conn: socket.socket, deadline: float) -> None:
        if isinstance(conn, ssl.SSLSocket):
            conn.settimeout(_left(deadline))
            conn.do_handshake()


def _tls_context(access: MetricsAccess) -> ssl.SSLContext | None:
    if access.cert is None and access.key is None:
        return None
    if access.cert is None or access.key is None:
        raise ConfigError(
            "the metrics endpoint's TLS needs both metrics-tls-cert and metrics-tls-key"
        )
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(access.cert, access.key)
    except (OSError, ssl.SSLError) as e:
        why = getattr(e, "strerror", None) or getattr(e, "reason", None) or str(e)
        raise ConfigError(
            f"the metrics endpoint's TLS certificate {access.cert} or key {access.key} cannot"
            f" be used: {why}; give a PEM certificate and its unencrypted key"
        ) from None
    return ctx


#: Checked against when the user is unknown, so that a wrong name costs what a wrong password
#: does (a well-formed cost-10 hash; the answer is "no" whatever it says).
_DUMMY_HASH = b"$2b$10$8GjqA3OgCwDGzqNMdrc/feQexRh9.1kfbjK1TsgXpOAyF2WXsojIy"


class _BasicAuth:
    """Basic-auth users with bcrypt hashes. A check costs a bcrypt round (one at a time: a
    flood of wrong passwords takes one core at most); a password that passed is remembered
    (as a digest) so that every scrape does not pay it again."""

    def __init__(self, users: dict[str, str]) -> None:
        try:
            import bcrypt
        except ImportError:
            raise ConfigError(
                "metrics users need the Python package bcrypt (a vmlend dependency):"
                " reinstall vmlend"
            ) from None
        self._bcrypt = bcrypt
        self._users = {u: h.encode() for u, h in users.items()}
        self._lock = threading.Lock()
        self._passed: dict[tuple[str, bytes], bytes] = {}

    def check(self, header: str | None) -> bool:
        if header is None:
            return False
        scheme, _sep, token = header.strip().partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            user, sep, password = base64.b64decode(token.strip(), validate=True).partition(b":")
            name = user.decode()
        except (ValueError, UnicodeDecodeError):
            return False
        if not sep:
            return False
        hashed = self._users.get(name)
        digest = hashlib.sha256(password).digest()
        with self._lock:
            if hashed is None:
                self._bcrypt.checkpw(password, _DUMMY_HASH)  # the same cost as a wrong password
                return False
            if self._passed.get((name, digest)) == hashed:
                return True
            if not self._bcrypt.checkpw(password, hashed):
                return False
            if len(self._passed) >= 64:
                self._passed.clear()
            self._passed[(name, digest)] = hashed
        return True


class _DeadlineReader(io.RawIOBase):
    """A socket's bytes, each read bounded by what is left of one deadline for them all: a
    peer that trickles cannot stretch it."""

    def __init__(self, conn: socket.socket, deadline: float) -> None:
        super().__init__()
        self._conn = conn
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self._conn.settimeout(_left(self._deadline))
        return self._conn.recv_into(buffer)


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the request's deadline passed")
    return left


def _peer(address: Any) -> str:
    try:
        host, port = address[0], address[1]
    except (TypeError, IndexError):
        return str(address)
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


def _why(e: BaseException | None) -> str:
    """One line for a failed request."""
    if isinstance(e, TimeoutError):
        return f"no whole request or answer within the deadline ({e})"
    if isinstance(e, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)):
        return "the client went away before its answer was written"
    if isinstance(e, ssl.SSLError):
        return f"TLS failed: {e.reason or e}"
    if isinstance(e, OSError):
        return f"{e.strerror or e}"
    return f"{type(e).__name__}: {e}"


def _handler(server: MetricsServer) -> type[BaseHTTPRequestHandler]:
    metrics = server.metrics

    class Handler(BaseHTTPRequestHandler):
        timeout = None  # the deadline decides, not a timeout per read
        # Nobody speaks HTTP/0.9: every answer, an error too, starts with a status line.
        default_request_version = "HTTP/1.0"
        #: The request's deadline (monotonic), from its connection on.
        deadline = 0.0

        def setup(self) -> None:
            self.deadline = time.monotonic() + server.deadline
            super().setup()
            server.handshake(self.connection, self.deadline)
            self.rfile = io.BufferedReader(_DeadlineReader(self.connection, self.deadline))

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path not in ("/metrics", "/", "/health"):
                self._answer(404, "only /metrics and /health here\n")
                return
            if not server.authorized(self.headers.get("Authorization")):
                self._answer(401, "unauthorized\n", {"WWW-Authenticate": 'Basic realm="vmlend"'})
                return
            if path == "/health":
                ok, text = metrics.health()
                self._answer(200 if ok else 503, text + "\n")
                return
            try:
                body = server.render(self.deadline)
            except TimeoutError:
                self._answer(503, "the ledger was not read in time; scrape again\n")
                return
            except Exception as e:  # a bug in a collector must not kill the agent's endpoint
                log.warning("metrics: rendering failed: %s: %s", type(e).__name__, e)
                self._answer(500, "rendering failed; see the agent's log\n")
                return
            self._answer(200, body, {"Content-Type": CONTENT_TYPE})

        def _answer(self, code: int, text: str, headers: dict[str, str] | None = None) -> None:
            body = text.encode()
            self.send_response(code)
            for name, value in (headers or {"Content-Type": "text/plain; charset=utf-8"}).items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.connection.settimeout(_left(self.deadline))  # sendall: total, not per send
            self.wfile.write(body)
            if code >= 400:
                log.warning(
                    "metrics: %s: %s answered %d", _peer(self.client_address), self.path[:80], code
                )

        def log_error(self, format: str, *args: Any) -> None:
            # a request that never was one (a timeout, a bad request line): one line
            if args and isinstance(args[0], TimeoutError):
                text = f"no whole request within its deadline ({server.deadline:g} s)"
            else:
                text = format % args
            log.warning("metrics: %s: %s", _peer(self.client_address), text)

        def send_error(
            self, code: int, message: str | None = None, explain: str | None = None
        ) -> None:
            with contextlib.suppress(OSError):  # the peer is gone: log_error said it already
                super().send_error(code, message, explain)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("metrics: " + format, *args)

    return Handler
