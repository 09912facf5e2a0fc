"""The relay daemon: the borrower side for every device held by VMs on this node.

It listens on a unix SOCK_SEQPACKET control socket (``control.py``). Lender transports come in
with ``attach``; VMMs register their irqfds with ``set_irqs``. Each VMM connection is a
session: the eventfds it registered are closed when it disconnects, so a VM that stops (or
crashes) leaves nothing behind. ``release`` drops a hot-removed device, and a lender hanging up
drops its devices. Everything runs on one reactor thread; ``stop`` is safe from a signal
handler.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import socket
import stat
from pathlib import Path
from typing import Any

from vmlend.errors import RelayError
from vmlend.irq.borrower import BorrowerRelay
from vmlend.irq.control import close_fds, recv_message, send_message
from vmlend.irq.eventfd import EventFd
from vmlend.irq.relay import Reactor
from vmlend.safefile import kind_of, socket_bind_path, socket_path_problem

log = logging.getLogger(__name__)


class Session:
    """One control connection and the irqfds it registered."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.vectors: dict[int, list[EventFd]] = {}


class RelayDaemon:
    def __init__(self, socket_path: Path, reactor: Reactor | None = None) -> None:
        self.socket_path = socket_path
        self.reactor = reactor or Reactor()
        self.borrower = BorrowerRelay(self.reactor)
        self._sessions: dict[int, Session] = {}
        self._listener: socket.socket | None = None

    def start(self) -> None:
        """Bind the control socket (refusing to steal one a live daemon answers on)."""
        path = self.socket_path
        # Bind under a private name and rename when listening: a client that sees the socket
        # can connect at once.
        tmp = socket_bind_path(path)
        problem = socket_path_problem(path) or socket_path_problem(tmp)
        if problem is not None:
            raise RelayError(f"cannot listen on {path}: {problem}")
        self._replace_stale(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            # Born 0600 through the umask: a chmod by name in a directory a user can write
            # could be turned onto another file by renaming a link over the name.
            umask = os.umask(0o177)
            try:
                sock.bind(str(tmp))
            finally:
                os.umask(umask)
            sock.listen(16)
            os.rename(tmp, path)
        except OSError as e:
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise RelayError(f"cannot listen on {path}: {e.strerror}") from None
        sock.setblocking(False)
        self._listener = sock
        self.reactor.register(sock.fileno(), select.EPOLLIN, self._accept)
        log.info("relay listening on %s", path)

    @staticmethod
    def _replace_stale(path: Path) -> None:
        """Remove a socket file nobody listens on (a killed relay's), as the agent does with its
        hook socket. Anything else at ``path`` (a file, a link, a live socket) is refused: the
        relay runs as root and must never delete what it did not make."""
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise RelayError(
                f"{path} exists and is not a socket ({kind_of(mode)}); remove it or give"
                " another --socket"
            )
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            path.unlink(missing_ok=True)  # stale: nobody listens
            return
        except OSError as e:
            # EPROTOTYPE: another program's stream socket; anything else cannot be told apart
            raise RelayError(
                f"{path} is a socket vmlend cannot tell is stale ({e.strerror}); remove it if no"
                " program serves it, or give another --socket"
            ) from None
        else:
            raise RelayError(f"a relay daemon already listens on {path}; stop it first")
        finally:
            probe.close()

    def serve(self) -> None:
        """Run until ``stop``, then release everything."""
        try:
            self.reactor.run()
        finally:
            self.close()

    def stop(self) -> None:
        self.reactor.stop()

    def _accept(self, _events: int) -> None:
        assert self._listener is not None
        while True:
            try:
                conn, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE):
                    log.error("cannot accept a control connection: %s", e.strerror)
                    return
                raise
            conn.setblocking(False)
            session = Session(conn)
            self._sessions[conn.fileno()] = session

            def on_event(ev: int, s: Session = session) -> None:
                self._readable(s, ev)

            self.reactor.register(conn.fileno(), select.EPOLLIN, on_event)

    def _readable(self, session: Session, events: int) -> None:
        while True:
            try:
                msg, fds = recv_message(session.conn)
            except BlockingIOError:
                break
            except RelayError as e:
                self._reply(session, {"ok": False, "error": str(e)})
                continue
            except OSError:
                msg, fds = None, []
            if msg is None:
                self._end_session(session)
                return
            try:
                reply = self._handle(session, msg, fds)
            except RelayError as e:
                reply = {"ok": False, "error": str(e)}
            except (KeyError, TypeError, ValueError) as e:
                reply = {"ok": False, "error": f"malformed request: {e!r}"}
            self._reply(session, reply)
        if events & (select.EPOLLHUP | select.EPOLLERR):
            self._end_session(session)

    def _reply(self, session: Session, reply: dict[str, Any]) -> None:
        try:
            send_message(session.conn, reply)
        except OSError:
            # A client that does not read its replies is dropped, never waited for.
            self._end_session(session)

    def _handle(self, session: Session, msg: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """Every fd in ``fds`` ends up owned by the relay or closed, whatever happens."""
        op = msg.get("op")
        used: set[int] = set()
        try:
            if op == "attach":
                if len(fds) != 1:
                    raise RelayError("attach needs exactly one transport fd")
                devices = [int(f) for f in msg["devices"]]
                try:
                    sock = socket.socket(fileno=fds[0])
                except OSError:
                    raise RelayError("the transport must be a SOCK_SEQPACKET socket") from None
                used.add(0)
                if sock.type != socket.SOCK_SEQPACKET:
                    sock.close()
                    raise RelayError("the transport must be a SOCK_SEQPACKET socket")
                self.borrower.attach(devices, sock)
                return {"ok": True}
            if op == "set_irqs":
                fdid = int(msg["device"])
                positions = [int(p) for p in msg.get("fds", [])]
                if int(msg.get("count", len(positions))) != len(positions):
                    raise RelayError("set_irqs: count must equal the number of fds entries")
                named = [p for p in positions if p != -1]
                if any(not 0 <= p < len(fds) for p in named) or len(set(named)) != len(named):
                    raise RelayError("set_irqs: fds must name each passed descriptor once")
                used.update(p for p in positions if p >= 0)
                owned = self.borrower.set_irqs(
                    fdid,
                    int(msg["index"]),
                    int(msg["flags"]),
                    int(msg.get("start", 0)),
                    [fds[p] if p >= 0 else -1 for p in positions],
                )
                mine = [e for e in session.vectors.get(fdid, []) if not e.closed]
                session.vectors[fdid] = mine + owned
                return {"ok": True}
            if op == "release":
                self.borrower.release(int(msg["device"]))
                return {"ok": True}
            if op == "status":
                return {"ok": True, "devices": self.borrower.status(), "pid": os.getpid()}
            raise RelayError(f"unknown op {op!r} (attach, set_irqs, release, status)")
        finally:
            close_fds([fd for i, fd in enumerate(fds) if i not in used])

    def _end_session(self, session: Session) -> None:
        fd = session.conn.fileno()
        if fd < 0 or self._sessions.pop(fd, None) is None:
            return
        self.reactor.unregister(fd)
        session.conn.close()
        for fdid, efds in session.vectors.items():
            self.borrower.release_vectors(fdid, [e for e in efds if not e.closed])
        session.vectors.clear()

    def close(self) -> None:
        """Release every device and session, remove the socket."""
        with self.reactor.lock:
            for session in list(self._sessions.values()):
                self._end_session(session)
            self.borrower.close()
            if self._listener is not None:
                self.reactor.unregister(self._listener.fileno())
                self._listener.close()
                self._listener = None
                with contextlib.suppress(FileNotFoundError):
                    self.socket_path.unlink()
        self.reactor.close()
        log.info("relay stopped")
