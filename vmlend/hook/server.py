"""The agent's side of the hook: serve ``vmlend.hook.forward`` on a unix socket.

A hook process that only forwards argv and the XML costs an interpreter start; the imports the
work needs (lxml, sqlite3, the models) are paid once, by the agent (``docs/hooks.md``). Every
call runs through the very same ``vmlend.hook.main.run`` as in the hook process, so the two
cannot drift apart.

One acceptor thread takes connections as they come and hands each to a reader thread of its
own (at most ``MAX_READERS`` at once): it checks the peer (``SO_PEERCRED``: uid 0 or the
agent's own uid), reads the whole request within one deadline of its own and decides whether
it is this agent's (same registry, state, node, host root, backend and fault setting). Only
the reading is concurrent. One worker thread runs the accepted calls strictly in the order
their connections were accepted (``AcceptOrder``), not the order their readers happened to
finish. The kernel's listen queue is first in, first out, so for one domain that is libvirt's
order: libvirt runs a domain's hooks one after another, and two calls of one domain wait
together only when the first one's hook timed out. Its call must still run first: a release
run after the next start's prepare would take the running VM's devices away (the
``test_hook_agent`` test of the stopped agent met that order on a busy machine). So a reader
done early waits for the readers of earlier connections; an idle or trickling peer delays the
calls behind it by at most its read deadline, once (the deadlines run side by side). A call
whose hook process went away meanwhile (it timed out and exited 1, so libvirt aborted and
will run release) is skipped when running it alone would do harm (prepare, migrate,
restore); release and reconnect still run, they are idempotent. Where the socket may live and
how it takes its place is ``vmlend.hook.sockplace``.

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
import struct
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Generic, NamedTuple, TypeVar

from vmlend.config import hook_environment
from vmlend.errors import VmlendError
from vmlend.fabric.base import Fabric
from vmlend.faults import FAULT_ENV
from vmlend.hook import forward, wire
from vmlend.hook.actionlog import ActionLog, log_path_for_state
from vmlend.hook.contract import Action, parse_argv
from vmlend.hook.main import load_handlers, run
from vmlend.hook.sockplace import SocketPlace
from vmlend.hostenv import ROOT_ENV, HostEnv
from vmlend.registry import parse_location
from vmlend.settings import NODE_ENV, REGISTRY_ENV, STATE_ENV, state_path_from_env
from vmlend.wiring.fabric import BACKEND_ENV, default_backend, open_fabric

log = logging.getLogger(__name__)
T = TypeVar("T")

#: How long a reader waits for a peer's whole request (the hook writes it right after
#: connecting): one deadline per request, so a trickling peer cannot hold its reader longer;
#: peers are read concurrently, so an idle one delays no other.
READ_TIMEOUT = 1.0
#: Overrides READ_TIMEOUT in the agent's environment (tests set it short).
READ_TIMEOUT_ENV = "VMLEND_AGENT_READ_TIMEOUT"
#: Accepted calls waiting for the worker; over it the hook is told "busy" (it tries again
#: while the agent lives, else runs the call itself).
QUEUE_LIMIT = 64
#: Connections read at once (a thread each, each for at most the read deadline); over it a
#: peer is told "busy" at once.
MAX_READERS = 128
_BACKLOG = 64
#: Calls that must not run once their hook is gone: libvirt already aborted the operation.
_NOT_ALONE = (Action.PREPARE, Action.MIGRATE, Action.RESTORE)
#: How long the worker tries to hand an answer back (the hook may be gone: then it is dropped).
WRITE_TIMEOUT = 10.0
_ACCEPT_POLL = 0.2  # how often the acceptor looks at the stop flag
_PEERCRED = struct.Struct("iII")  # struct ucred: pid_t pid, uid_t uid, gid_t gid


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
        # Unset, the backend is the host's, as open_fabric chooses it for a hook process:
        # "smartio" where the driver is loaded under the root. Not "sim": an agent serving an
        # unpinned hook then ran the call on the simulator, and the VM's mdev never reached
        # the kernel (found by the kernel tier, tests/kernel/test_vm_kernel.py).
        backend=environ.get(BACKEND_ENV) or default_backend(HostEnv(Path(root))),
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


def read_timeout_from_env(environ: Mapping[str, str]) -> float:
    try:
        value = float(environ.get(READ_TIMEOUT_ENV) or READ_TIMEOUT)
    except ValueError:
        return READ_TIMEOUT
    return value if 0 < value < float("inf") else READ_TIMEOUT  # no inf, and nan fails both


#: Told of each call run: its operation (an ``Action`` value, "invalid" for a bad argv), its
#: seconds, and how often its registry transactions re-ran (``vmlend.agent.metrics``).
Observer = Callable[[str, float, int], None]


class _Call(NamedTuple):
    conn: socket.socket
    argv: list[str]
    env: dict[str, str]
    xml: bytes


class AcceptOrder(Generic[T]):
    """Hands the readers' results on in the order their connections were accepted: each
    connection takes a ticket when its reader starts, and a result waits until every earlier
    ticket has one (a call, or None for a connection answered or dropped by its reader)."""

    def __init__(self, hand_on: Callable[[T], None]) -> None:
        self._hand_on = hand_on
        self._lock = threading.Lock()
        self._issued = 0  # tickets handed out
        self._head = 0  # the oldest ticket not handed on yet
        self._finished: dict[int, T | None] = {}

    def ticket(self) -> int:
        with self._lock:
            self._issued += 1
            return self._issued - 1

    def finish(self, ticket: int, call: T | None) -> None:
        # Handed on under the lock, so two readers cannot interleave their hand-overs.
        with self._lock:
            self._finished[ticket] = call
            while self._head in self._finished:
                ready = self._finished.pop(self._head)
                self._head += 1
                if ready is not None:
                    self._hand_on(ready)


class HookServer:
    """Serves hook calls for ``identity`` on the unix socket ``path`` (``start``/``stop``)."""

    def __init__(
        self,
        path: Path,
        identity: HookIdentity,
        allowed_uids: frozenset[int] | None = None,
        read_timeout: float = READ_TIMEOUT,
        queue_limit: int = QUEUE_LIMIT,
        observe: Observer | None = None,
    ) -> None:
        self.path = path
        self.identity = identity
        self.allowed_uids = allowed_uids or frozenset({0, os.geteuid()})
        self.read_timeout = read_timeout
        self.queue_limit = queue_limit
        self._calls: queue.Queue[_Call | None] = queue.Queue(queue_limit)
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._place = SocketPlace(path)
        self._threads: list[threading.Thread] = []
        self._readers = threading.BoundedSemaphore(MAX_READERS)
        self._reading: set[threading.Thread] = set()
        self._reading_lock = threading.Lock()
        self._in_order: AcceptOrder[_Call] = AcceptOrder(self._queue_call)
        self._full_said = False
        self.served = 0  # calls run (for logs and tests)
        self.observe = observe
        #: Asked before each call is run, with its operation, domain name and XML (the agent:
        #: a prepare announces its VM to the guard): a refusal to answer the hook with, or
        #: None. It must never wait on libvirt (the deadlock rule above).
        self.before: Callable[[str, str, bytes], str | None] | None = None

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        load_handlers()  # what a call uses, imported once here rather than in the first call
        self._listener = self._place.bind(_BACKLOG)
        self._listener.settimeout(_ACCEPT_POLL)
        self._threads = [
            threading.Thread(target=self._accept_loop, name="hook-accept", daemon=True),
            threading.Thread(target=self._work_loop, name="hook-worker", daemon=True),
        ]
        for t in self._threads:
            t.start()
        log.info("serving the libvirt hook on %s", self.path)

    def stop(self) -> None:
        """Remove the socket (no new connections: those hooks run in-process), take what the
        kernel queued already, then run every accepted call (their hooks wait for the answer
        and may not fall back) and close."""
        if self._listener is None or self._stopping.is_set():
            return
        self._place.remove()
        self._stopping.set()
        self._threads[0].join()
        self._drain_backlog(self._listener)
        self._listener.close()
        while True:  # every reader ends within its deadline; what it read is queued first
            with self._reading_lock:
                reading = list(self._reading)
            if not reading:
                break
            for t in reading:
                t.join()
        self._calls.put(None)
        self._threads[1].join()
        self._place.release()
        log.info("stopped serving the hook (%d call(s) served)", self.served)

    def check_free(self) -> None:
        """ConfigError when the socket's directory is unsafe or another agent serves the hook
        on ``path`` already: called before anything else at start, so a second agent on a
        host changes nothing. Holds the socket's lock from here until ``stop``."""
        self._place.claim()

    # --- the acceptor and its readers: peer check, whole request, mine or not ---------------
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
            self._read_aside(conn)

    def _read_aside(self, conn: socket.socket) -> None:
        """Read ``conn``'s request on a thread of its own (``_take``): a peer that sends
        nothing holds up only its reader, for at most the read deadline."""
        if not self._readers.acquire(blocking=False):
            log.warning(
                "hook socket %s: %d connections are being read already; told a peer to retry",
                self.path,
                MAX_READERS,
            )
            conn.settimeout(0)
            _send(conn, wire.BUSY)
            conn.close()
            return
        ticket = self._in_order.ticket()
        t = threading.Thread(
            target=self._reader, args=(conn, ticket), name="hook-read", daemon=True
        )
        with self._reading_lock:
            self._reading.add(t)
        try:
            t.start()
        except RuntimeError as e:  # no thread to be had: the peer is told to retry
            with self._reading_lock:
                self._reading.discard(t)
            self._readers.release()
            log.warning("hook socket %s: cannot read a connection: %s", self.path, e)
            conn.close()
            self._in_order.finish(ticket, None)

    def _reader(self, conn: socket.socket, ticket: int) -> None:
        call = None
        try:
            call = self._take(conn)
        finally:
            self._in_order.finish(ticket, call)  # always: the calls behind wait for it
            with self._reading_lock:
                self._reading.discard(threading.current_thread())
            self._readers.release()

    def _drain_backlog(self, listener: socket.socket) -> None:
        """Take the connections the kernel queued before the socket was removed: their hooks
        sent (or are sending) a request and wait, so closing them would fail those hooks."""
        listener.setblocking(False)
        for _ in range(2 * _BACKLOG):  # bounded: nobody can connect to a removed socket
            try:
                conn, _addr = listener.accept()
            except OSError:  # BlockingIOError: the backlog is empty
                return
            conn.setblocking(True)
            self._read_aside(conn)

    def _take(self, conn: socket.socket) -> _Call | None:
        """Read the request on ``conn``: the call, or None once it is answered and closed."""
        try:
            call = self._receive(conn)
        except Exception as e:  # one bad peer must not stop the serving
            log.warning("hook socket %s: dropped a connection: %s", self.path, e)
            call = None
        if call is None:
            conn.close()
        return call

    def _queue_call(self, call: _Call) -> None:
        """Queue ``call`` for the worker, or tell its hook to retry when the queue is full."""
        conn = call.conn
        try:
            self._calls.put_nowait(call)
            self._full_said = False
        except queue.Full:
            if not self._full_said:  # once while it stays full: the hooks retry every 0.1 s
                self._full_said = True
                log.warning(
                    "hook socket %s: %d calls queued already; telling hooks to retry",
                    self.path,
                    self.queue_limit,
                )
            _send(conn, wire.BUSY)
            conn.close()

    def _receive(self, conn: socket.socket) -> _Call | None:
        conn.settimeout(self.read_timeout)
        _pid, uid, _gid = _PEERCRED.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
        if uid not in self.allowed_uids:
            log.warning("hook socket %s: refused a call from uid %d", self.path, uid)
            _send(conn, wire.DENIED)
            return None
        try:
            argv, env, xml = wire.decode_request(
                wire.Reader(wire.deadline_recv(conn, self.read_timeout, "request"))
            )
        except (OSError, wire.WireError) as e:
            log.warning("hook socket %s: dropped an incomplete request: %s", self.path, e)
            return None
        try:
            if forward.UNCONFIGURED_ENV in env:
                configured = self._configure(env, uid)
                if configured is None:
                    _send(conn, wire.NOT_MINE)  # the hook reads the file itself and decides
                    return None
                env = configured
            # Without a state or registry the hook's default state path depends on its own
            # uid, HOME and XDG variables, which the agent does not know: never guess.
            unpinned = not env.get(STATE_ENV) and not env.get(REGISTRY_ENV)
            theirs = None if unpinned or _relative_paths(env) else identity_of(env)
        except Exception:  # any doubt here means "not mine", never no answer
            # e.g. a registry URL this agent cannot parse (the hook reports it), or an
            # unreadable etc/vmlend/node under the hook's root: the whole request was read,
            # so an answer is owed; without one the hook would fail the VM for nothing done.
            theirs = None
        if theirs != self.identity:
            _send(conn, wire.NOT_MINE)
            return None
        return _Call(conn, argv, env, xml)

    def _configure(self, env: dict[str, str], uid: int) -> dict[str, str] | None:
        """The environment the hook would forward after reading its configuration file
        (``forward.forward_unconfigured``): the file applied by the hook's own code, or None
        when the hook must read it itself. That is when its uid is not this agent's (the file's
        ownership checks and permissions depend on who reads it), the file is unusable (the
        hook reports it, as without an agent), or it names another socket than this one."""
        if uid != os.geteuid():
            return None
        settled = {k: v for k, v in env.items() if k != forward.UNCONFIGURED_ENV}
        try:
            hook_environment(settled)
        except VmlendError:
            return None
        if os.path.abspath(forward.socket_path(settled)) != os.path.abspath(self.path):
            return None
        return forward.pinned_environment(settled)

    # --- the worker: one call at a time, in order ------------------------------------------
    def _work_loop(self) -> None:
        while (call := self._calls.get()) is not None:
            if _harmful_alone(call.argv) and _hook_gone(call.conn):
                self._skip(call)
            else:
                refusal = self._ask_before(call)
                if refusal is not None:
                    code, out, err = 1, b"", f"vmlend: {refusal}\n"
                else:
                    code, out, err = self._execute(call)
                self.served += 1
                call.conn.settimeout(WRITE_TIMEOUT)
                _send(call.conn, wire.encode_answer(code, out, err))  # the hook may be gone
            call.conn.close()

    def _ask_before(self, call: _Call) -> str | None:
        if self.before is None or not call.argv:
            return None
        try:
            return self.before(_op(call.argv), call.argv[0], call.xml)
        except Exception:  # never the reason a call goes unanswered
            log.exception("hook call %s: the agent's check before it failed", call.argv)
            return None

    def _skip(self, call: _Call) -> None:
        """The hook of this prepare, migrate or restore exited 1 already (it timed out), so
        libvirt aborted: running it now would reserve devices for a VM that is not starting."""
        what = " ".join(call.argv[1:3])
        log.warning(
            "skipped hook call %s of %s: its hook process had gone away", what, call.argv[0]
        )
        state = state_path_from_env(call.env)
        ActionLog(log_path_for_state(state)).record(
            call.argv[0],
            what,
            "SKIPPED by the agent: the hook process had gone away (timed out) before the call"
            " ran, so libvirt aborted it; nothing done",
        )

    def _execute(self, call: _Call) -> tuple[int, bytes, str]:
        started = time.monotonic()
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
            if self.observe is not None:
                self.observe(_op(call.argv), time.monotonic() - started, _reruns(opened))
        return code, stdout.getvalue(), stderr.getvalue()


def _harmful_alone(argv: list[str]) -> bool:
    try:
        return parse_argv(argv).action in _NOT_ALONE
    except VmlendError:
        return False  # run() reports a bad argv


def _op(argv: list[str]) -> str:
    try:
        return parse_argv(argv).action.value
    except VmlendError:
        return "invalid"


def _reruns(fabrics: list[Fabric]) -> int:
    """How often the registry transactions of ``fabrics`` re-ran (``EtcdRegistry.conflicts``;
    0 on a registry that does not count them)."""
    return sum(int(getattr(getattr(f, "registry", None), "conflicts", 0)) for f in fabrics)


def _hook_gone(conn: socket.socket) -> bool:
    """Whether the hook process closed its end (it exits at its timeout): a peek sees the end
    of the stream. A live hook sends nothing more, so the peek would block."""
    try:
        conn.setblocking(False)
        return conn.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset: gone as well
        return True


def _send(conn: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):
        conn.sendall(data)
