"""Hand a hook call to this host's ``vmlend agent``, which has everything imported already.

The hook process pays an interpreter start and this module; the agent runs the call through
the very same ``vmlend.hook.main.run`` and sends back the exit code, stdout and stderr
(``docs/hooks.md``, "The agent serves the hook"). Only builtins, ``os``, ``time`` and the C
``_socket`` module are imported: ``socket`` itself pulls in ``enum`` and ``selectors``
(~20 ms, measured with ``-X importtime``), more than everything else here.

The rules, which keep a hook call done exactly once:

- no socket file, connection refused (a stale file of a killed agent), permission denied, a
  listener that is not root's nor ours (``SO_PEERCRED``: it could answer anything, and for
  migrate/restore our stdout becomes libvirt's domain XML), a request over the wire limits, or
  the request could not be written whole: the agent cannot have run it, so ``forward`` returns
  None and the caller runs the call in-process, as without an agent;
- the agent answers "not mine" (it serves another registry, state, node, root, backend) or
  "denied" (our uid may not use it) or "busy" (its queue is full): nothing was done, None as
  well;
- **but never beside a live agent**: when this host's agent lives (it holds its lock,
  ``vmlend.hook.agentlock``) and did nothing but "not mine", the hook tries again within the
  answer timeout (a request not written whole, "busy"; no socket yet: for ``START_GRACE``
  at most, as an agent starting up may wait for this VM), then fails the call
  with one line, nothing done ("denied", an untrusted listener, a call over the wire limits:
  at once). Running it in-process would be a second writer for the host beside the agent;
- once the whole request was written, never fall back: wait for the answer. A connection that
  ends early (the agent died) or no answer within the timeout exits 1 with one line, since the
  agent may have done part of the work or may still do it.

**The configuration file, read by the agent** (``forward_unconfigured``). Parsing the file
the hook pins takes ``tomllib``, whose imports (``re``, ``string``, ``typing``, ``enum``,
``datetime``) cost a hook process more than its interpreter start. So the hook first offers
the call as it is, before reading the file: to the socket its environment names (else the
default under its root), marked ``UNCONFIGURED_ENV``. The agent applies the same file with the
same code (``vmlend.config.hook_environment``) and runs the call only if the result is its
own: the same settings and this very socket. Anything else (the file names another socket or
state, the file is unusable, the caller is of another uid, an agent before this marker: it
sees no state and says "not mine") is "not mine", nothing done, and the hook goes the way
above: reads the file itself, then forwards by the rules above or runs the call in-process.
"""

from __future__ import annotations

import _socket  # the C module: see above
import os
import sys
import time

from vmlend.hook import wire

TYPE_CHECKING = False  # not from typing: see above
if TYPE_CHECKING:
    from collections.abc import Mapping

#: The agent's socket; ``vmlend hook install`` pins it like the state path.
SOCKET_ENV = "VMLEND_HOOK_SOCKET"
#: Seconds to wait for the agent's answer (tests set it short).
TIMEOUT_ENV = "VMLEND_HOOK_TIMEOUT"
DEFAULT_TIMEOUT = 60.0
#: The default socket under the host root ($VMLEND_ROOT, else /), beside the agent's lease file.
SOCKET_UNDER_ROOT = ("run", "vmlend", "hook.sock")
#: What the agent needs to decide "mine or not" and to run the call as this process would.
FORWARDED_PREFIX = "VMLEND_"
_CLIENT_ONLY = (SOCKET_ENV, TIMEOUT_ENV)
#: Set in a request whose hook has not read its configuration file yet: the agent applies it
#: (``forward_unconfigured``). Never set in a process's own environment.
UNCONFIGURED_ENV = "VMLEND_HOOK_UNCONFIGURED"


def socket_path(environ: Mapping[str, str]) -> str:
    pinned = environ.get(SOCKET_ENV)
    if pinned:
        return pinned
    return os.path.join(environ.get("VMLEND_ROOT") or "/", *SOCKET_UNDER_ROOT)


def pinned_environment(environ: Mapping[str, str]) -> dict[str, str]:
    return {
        k: v for k, v in environ.items() if k.startswith(FORWARDED_PREFIX) and k not in _CLIENT_ONLY
    }


def answer_timeout(environ: Mapping[str, str]) -> float:
    try:
        value = float(environ.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT)
    except ValueError:
        return DEFAULT_TIMEOUT  # a test knob must never be why a VM fails to start
    # 1e400 parses as inf and "nan" as nan: neither is a timeout a socket can take
    return value if 0 < value < float("inf") else DEFAULT_TIMEOUT


#: How long one connect may wait (a full listen backlog holds it): tried again within the
#: answer timeout while this host's agent lives.
CONNECT_TIMEOUT = 2.0
#: How long the hook pauses between two tries while the agent lives but did not take the call.
RETRY_PAUSE = 0.1
#: How long the hook waits for a live agent's socket to appear (within the answer timeout).
#: Short on purpose: an agent starting up lists the host's domains, and libvirt holds this
#: VM's object while its hook runs, so a listing waits for this hook as long as it waits for
#: the agent: a longer wait only makes the start fail later, and the agent start later.
START_GRACE = 5.0

# Why the agent did nothing (``_attempt``), and so what the hook may do instead.
_NOT_ITS = "the agent serves another registry, state, node or root"  # in-process, always
_NO_SOCKET = "nobody listens on its socket"  # these three: wait while the agent lives
_UNSENT = "the request could not be written whole"
_BUSY = "too many calls were waiting in it"
_DENIED = "it serves only root and its own uid"  # these two: refused while it lives
_UNTRUSTED = "the listener on its socket is neither root's nor this uid's"
_WAIT_FOR = (_NO_SOCKET, _UNSENT, _BUSY)


def forward_unconfigured(
    argv: list[str], xml: bytes, environ: Mapping[str, str] | None = None
) -> int | None:
    """The exit code of the call as the agent ran it after applying the hook's configuration
    file itself, or None when it did nothing (any reason): the caller then reads the file and
    calls ``forward``. One attempt, no waiting: the rules of ``forward`` apply from there.
    Once the whole request is written the answer is final, as in ``forward``."""
    env = os.environ if environ is None else environ
    pinned = pinned_environment(env)
    pinned[UNCONFIGURED_ENV] = "1"
    if not wire.within_limits(argv, pinned, xml):
        return None
    got = _attempt(socket_path(env), wire.encode_request(argv, pinned, xml), answer_timeout(env))
    return got if isinstance(got, int) else None


def forward(argv: list[str], xml: bytes, environ: Mapping[str, str] | None = None) -> int | None:
    """The exit code of the call as the agent ran it (its stdout and stderr written to ours),
    or None when the caller must run the call itself: the agent did nothing and this host's
    agent does not live (``agentlock``), or it said the call is not its own. While the agent
    lives the call is never run beside it: the hook tries again (a starting agent, a full
    queue) within the answer timeout, then fails with one line, nothing done."""
    env = os.environ if environ is None else environ
    path = socket_path(env)
    pinned = pinned_environment(env)
    timeout = answer_timeout(env)
    if not wire.within_limits(argv, pinned, xml):
        # the agent would drop it unanswered: do it here, unless the agent lives
        if not _agent_lives(env):
            return None
        return _refused(
            path,
            env,
            f"the call is over what the agent takes ({len(xml)} bytes of XML, at most"
            f" {wire.MAX_BLOB}; {len(argv)} arguments and {len(pinned)} settings, at most"
            f" {wire.MAX_STRINGS} each of at most {wire.MAX_STRING} bytes)",
        )
    request = wire.encode_request(argv, pinned, xml)
    began = time.monotonic()
    deadline = began + timeout
    while True:
        got = _attempt(path, request, timeout)
        if isinstance(got, int):
            return got
        if got == _NOT_ITS or not _agent_lives(env):
            return None
        now = time.monotonic()
        # no socket yet: an agent in its start-up, which may wait for this very hook
        until = min(deadline, began + START_GRACE) if got == _NO_SOCKET else deadline
        if got not in _WAIT_FOR or now >= until:
            if got == _NO_SOCKET:
                why = (
                    f"{got} (tried for {until - began:g} s; an agent starting up waits for"
                    " the VMs a hook holds up)"
                )
            else:
                why = f"{got} (tried for {timeout:g} s)" if got in _WAIT_FOR else got
            return _refused(path, env, why)
        time.sleep(min(RETRY_PAUSE, until - now))


def _attempt(path: str, request: bytes, timeout: float) -> int | str:
    """Send ``request`` to the agent at ``path``: the exit code of the call it ran, or why it
    did nothing (nothing was sent, or it answered that it did nothing)."""
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        try:
            sock.settimeout(min(timeout, CONNECT_TIMEOUT))
            sock.connect(path)
        except OSError as e:
            # no file, refused (a stale file), a full backlog, permission denied: nothing sent
            return _DENIED if isinstance(e, PermissionError) else _NO_SOCKET
        try:
            if not _trusted_peer(sock):
                return _UNTRUSTED  # nothing sent yet
            sock.settimeout(timeout)
            # Never half-close after this (shutdown(SHUT_WR)): the agent reads an end of stream
            # as "this hook has gone" and skips a prepare/migrate/restore it has queued.
            sock.sendall(request)
        except OSError:
            # The agent runs a request only once it has read all of it, up to the end mark: a
            # send that failed was not read whole, so nothing ran (docs/hooks.md).
            return _UNSENT
        try:
            recv = wire.deadline_recv(sock, timeout, "answer")
            kind, code, out, err = wire.decode_answer(wire.Reader(recv))
        except TimeoutError:
            return _lost(path, f"gave no answer within {timeout:g} s")
        except (OSError, wire.WireError):
            return _lost(path, "ended the connection before answering (it died?)")
    finally:
        sock.close()
    if kind == wire.BUSY:
        return _BUSY
    if kind == wire.DENIED:
        return _DENIED
    if kind != wire.RAN:
        return _NOT_ITS
    if out:
        sys.stdout.buffer.write(out)
        sys.stdout.buffer.flush()
    if err:
        sys.stderr.write(err)
        sys.stderr.flush()
    return code


def _agent_lives(env: Mapping[str, str]) -> bool:
    from vmlend.hook.agentlock import held_elsewhere, lock_path

    return held_elsewhere(lock_path(env.get("VMLEND_ROOT")))


def _refused(path: str, env: Mapping[str, str], why: str) -> int:
    """This host's agent lives but did not take the call: fail it, nothing done (running it
    here would make two writers for one host)."""
    from vmlend.hook.agentlock import lock_path

    print(
        f"vmlend: this host's vmlend agent runs (it holds {lock_path(env.get('VMLEND_ROOT'))})"
        f" but did not take the call on {path}: {why}; nothing was done (the hook does not run"
        " it beside the agent); see the agent's log, then try again",
        file=sys.stderr,
    )
    return 1


def _trusted_peer(sock: _socket.socket) -> bool:
    """Whether the listener runs as root or as our effective uid: only those could have
    created a socket we trust with the call (struct ucred: pid, uid, gid as native ints)."""
    cred = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12)
    uid = int.from_bytes(cred[4:8], sys.byteorder)
    return uid in (0, os.geteuid())


def _lost(path: str, what: str) -> int:
    print(
        f"vmlend: the vmlend agent serving this hook ({path}) {what}; the operation may be"
        " half done: 'vmlend reconcile' shows it and 'vmlend reconcile --fix' repairs it"
        " (libvirt runs release after a failed prepare)",
        file=sys.stderr,
    )
    return 1
