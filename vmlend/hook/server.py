"""The agent's side of the hook: serve ``vmlend.hook.forward`` on a unix socket.

A hook process that only forwards argv and the XML costs an interpreter start; the imports the
work needs (lxml, sqlite3, the models) are paid once, by the agent (``docs/hooks.md``). Every
call runs through the very same ``vmlend.hook.main.run`` as in the hook process, so the two
cannot drift apart.

One acceptor thread takes connections in arrival order: it checks the peer (``SO_PEERCRED``:
uid 0 or the agent's own uid), reads the whole request and decides whether it is this agent's
(same registry, state, node, host root, backend and fault setting). One worker thread runs the
accepted calls strictly in that order (a release queued behind its prepare runs after it) and
runs a call even when its hook process went away meanwhile, since that process may no longer
fall back (``forward``'s rules).

**Deadlock rule.** libvirt holds the domain's job while the hook runs. So nothing on this path
may call libvirt, nor wait for anything (lock, event, queue) that the agent's lease, guard or
recovery code holds while it calls libvirt: the hook would wait for the agent, the agent for
libvirt, libvirt for the hook. The worker therefore opens its own fabric per call and shares
nothing with those threads.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import queue
import socket
import stat
import struct
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from vmlend.errors import ConfigError, VmlendError
from vmlend.fabric.base import Fabric
from vmlend.fabric.open import BACKEND_ENV, open_fabric
from vmlend.faults import FAULT_ENV
from vmlend.hook import wire
from vmlend.hook.main import load_handlers, run
from vmlend.hostenv import ROOT_ENV, HostEnv
from vmlend.registry import parse_location
from vmlend.settings import NODE_ENV, REGISTRY_ENV, STATE_ENV, state_path_from_env

log = logging.getLogger(__name__)

#: How long the acceptor waits for a peer's request (the hook writes it right after connecting).
READ_TIMEOUT = 10.0
#: How long the worker tries to hand an answer back (the hook may be gone: then it is dropped).
WRITE_TIMEOUT = 10.0
_ACCEPT_POLL = 0.2  # how often the acceptor looks at the stop flag
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


class HookIdentity(NamedTuple):
    """What must be equal for the agent to run a hook call as the hook process would."""

    registry: str
    state: str
    node: str
    root: str
    backend: str
    fault: str


def identity_of(environ: Mapping[str, str]) -> HookIdentity:
    """The identity a process with this environment works under. An unset node stays ""
    (on SQLite: the state's local node), so a hook and an agent must both name it or neither."""
    state = os.path.abspath(state_path_from_env(dict(environ)))
    registry = environ.get(REGISTRY_ENV) or state
    root = os.path.abspath(environ.get(ROOT_ENV) or "/")
    node = environ.get(NODE_ENV) or HostEnv(Path(root)).configured_node() or ""
    return HookIdentity(
        registry=str(parse_location(registry)),
        state=state,
        node=node,
        root=root,
        backend=environ.get(BACKEND_ENV) or "sim",
        fault=environ.get(FAULT_ENV) or "",
    )


def _relative_paths(environ: Mapping[str, str]) -> bool:
    """Whether a path in the request is relative: it names a file in the hook's working
    directory, which the agent does not know, so the call is never the agent's."""
    paths = [environ.get(STATE_ENV), environ.get(ROOT_ENV)]
    registry = environ.get(REGISTRY_ENV) or ""
    if "://" not in registry:
        paths.append(registry)
    elif registry.startswith("sqlite://"):
        paths.append(registry.removeprefix("sqlite://"))
    return any(p and not os.path.isabs(p) for p in paths)


class _Call(NamedTuple):
    conn: socket.socket
    argv: list[str]
    env: dict[str, str]
    xml: bytes


class HookServer:
    """Serves hook calls for ``identity`` on the unix socket ``path`` (``start``/``stop``)."""

    def __init__(
        self,
        path: Path,
        identity: HookIdentity,
        allowed_uids: frozenset[int] | None = None,
    ) -> None:
        self.path = path
        self.identity = identity
        self.allowed_uids = allowed_uids or frozenset({0, os.getuid()})
        self._calls: queue.Queue[_Call | None] = queue.Queue()
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._inode: int | None = None
        self._threads: list[threading.Thread] = []
        self.served = 0  # calls run (for logs and tests)

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        load_handlers()  # what a call uses, imported once here rather than in the first call
        self._listener = self._bind()
        self._threads = [
            threading.Thread(target=self._accept_loop, name="hook-accept", daemon=True),
            threading.Thread(target=self._work_loop, name="hook-worker", daemon=True),
        ]
        for t in self._threads:
            t.start()
        log.warning("serving the libvirt hook on %s", self.path)

    def stop(self) -> None:
        """Stop accepting, remove the socket, then run what was already accepted (its hooks
        wait for the answer and may not fall back)."""
        if self._listener is None or self._stopping.is_set():
            return
        self._stopping.set()
        self._threads[0].join()
        self._remove_socket()
        self._listener.close()
        self._calls.put(None)
        self._threads[1].join()
        log.warning("stopped serving the hook (%d call(s) served)", self.served)

    def check_free(self) -> None:
        """ConfigError when another agent serves the hook on ``path`` already: called before
        anything else at start, so a second agent on a host changes nothing."""
        self._replace_stale(self.path)

    def _bind(self) -> socket.socket:
        path = self.path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._replace_stale(path)
        # Bound under a temporary name, made 0600, listening, then renamed into place: the
        # socket never exists at its real path with a wider mode or before it accepts.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(tmp))
            os.chmod(tmp, 0o600)
            listener.listen(64)
            listener.settimeout(_ACCEPT_POLL)
            os.replace(tmp, path)
            self._inode = path.stat().st_ino
        except OSError as e:
            listener.close()
            tmp.unlink(missing_ok=True)
            raise ConfigError(f"cannot serve the hook on {path}: {e.strerror}") from None
        return listener

    @staticmethod
    def _replace_stale(path: Path) -> None:
        """A socket file no one listens on is a killed agent's: remove it. A live one is
        another agent's: refuse to start rather than take its hooks."""
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise ConfigError(f"{path} exists and is not a socket; remove it and start again")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            path.unlink(missing_ok=True)
            return
        except OSError:
            pass  # unusable anyway: replace it
        else:
            raise ConfigError(f"another vmlend agent serves the hook on {path}; stop it first")
        finally:
            probe.close()
        path.unlink(missing_ok=True)

    def _remove_socket(self) -> None:
        try:
            if self.path.stat().st_ino == self._inode:  # not a newer agent's
                self.path.unlink()
        except OSError:
            pass

    # --- the acceptor: arrival order, peer check, whole request, mine or not ---------------
    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, _addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as e:
                log.warning("hook socket %s: accept failed: %s", self.path, e)
                self._stopping.wait(_ACCEPT_POLL)
                continue
            try:
                call = self._receive(conn)
            except Exception as e:  # one bad peer must not stop the serving
                log.warning("hook socket %s: dropped a connection: %s", self.path, e)
                call = None
            if call is None:
                conn.close()
            else:
                self._calls.put(call)

    def _receive(self, conn: socket.socket) -> _Call | None:
        conn.settimeout(READ_TIMEOUT)
        _pid, uid, _gid = _PEERCRED.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
        if uid not in self.allowed_uids:
            log.warning("hook socket %s: refused a call from uid %d", self.path, uid)
            _send(conn, wire.DENIED)
            return None
        try:
            argv, env, xml = wire.decode_request(wire.Reader(conn.recv))
        except (OSError, wire.WireError) as e:
            log.warning("hook socket %s: dropped an incomplete request: %s", self.path, e)
            return None
        try:
            theirs = None if _relative_paths(env) else identity_of(env)
        except VmlendError:
            theirs = None  # e.g. a registry URL this agent cannot parse: the hook reports it
        if theirs != self.identity:
            _send(conn, wire.NOT_MINE)
            return None
        return _Call(conn, argv, env, xml)

    # --- the worker: one call at a time, in order ------------------------------------------
    def _work_loop(self) -> None:
        while (call := self._calls.get()) is not None:
            code, out, err = self._execute(call)
            self.served += 1
            call.conn.settimeout(WRITE_TIMEOUT)
            _send(call.conn, wire.encode_answer(code, out, err))  # the hook may be gone: fine
            call.conn.close()

    def _execute(self, call: _Call) -> tuple[int, bytes, str]:
        opened: list[Fabric] = []

        def open_for_call(location: Path | str, node: str | None) -> Fabric:
            # The identity matched, so root and backend are the agent's own; named here so no
            # setting of the agent's process environment can differ from the hook's.
            fabric = open_fabric(
                location, node, backend=self.identity.backend, root=Path(self.identity.root)
            )
            opened.append(fabric)
            return fabric

        stdout, stderr = io.BytesIO(), io.StringIO()
        try:
            code = run(
                call.argv,
                stdin=io.BytesIO(call.xml),
                stdout=stdout,
                stderr=stderr,
                environ=dict(call.env),
                open_fabric=open_for_call,
            )
        except Exception as e:  # run() reports errors itself; this is a bug in it
            log.exception("hook call %s failed in the agent", call.argv)
            return 1, b"", f"vmlend: internal error in the agent: {type(e).__name__}: {e}\n"
        finally:
            for fabric in opened:  # a hook process exits; the agent must close what it opened
                close = getattr(fabric, "close", None)  # not part of the Fabric protocol
                try:
                    if close is not None:
                        close()
                except Exception as e:
                    log.warning("closing the fabric of a hook call: %s", e)
        return code, stdout.getvalue(), stderr.getvalue()


def _send(conn: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):
        conn.sendall(data)
