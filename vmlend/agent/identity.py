"""Which host this is, and that it runs one agent (DESIGN: "A node name belongs to one host
identity, and a host runs one agent").

- **The host's identity** is ``/etc/machine-id`` under the host root (systemd's convention).
  A host without one is refused: nothing else tells two hosts apart.
- **One agent per host**: ``<root>/run/vmlend/agent.lock``, held with ``flock`` for the life of
  the agent, whatever socket it serves. A second agent on the host is refused before it
  touches anything; the lock also says whether an agent lives here.
- **One host per node name**: ``agents/<node>`` binds the name to a machine-id. An agent of
  another host (or a clone of the same image that kept its machine-id, while the first host's
  agent lives: its ``hosts/<node>`` key is on a lease that is not this host's) is refused in
  one line and changes nothing. ``--take-over`` rebinds the name to this host once the old
  host's lease has expired.

``decide`` is the pure rule; the I/O around it is in ``bind_node`` and ``HostLock``.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import os
import time
from pathlib import Path

from vmlend.errors import AgentIdentityError, AgentRunningError
from vmlend.hook import agentlock
from vmlend.hostenv import HostEnv
from vmlend.registry.session import EtcdSession, HostKey, NodeBinding

#: How often, and how far apart, the agent tries its lock before it says another agent holds
#: it (a shared probe holds it for microseconds).
_ATTEMPTS = 20
_PAUSE = 0.01
#: A machine-id is 32 lower-case hex digits (machine-id(5)).
_HEX = frozenset("0123456789abcdef")


def machine_id(env: HostEnv) -> str:
    """This host's machine-id; ``AgentIdentityError`` when there is none."""
    path = env.machine_id_file
    try:
        text = path.read_text(errors="replace").strip()
    except OSError as e:
        raise AgentIdentityError(
            f"cannot read this host's identity {path} ({e.strerror or e}): a node name is bound"
            " to a host by its machine-id; create one ('systemd-machine-id-setup')"
        ) from None
    if len(text) != 32 or not set(text) <= _HEX:
        raise AgentIdentityError(
            f"{path} is not a machine-id (32 hex digits): a node name is bound to a host by it;"
            " recreate it ('systemd-machine-id-setup')"
        )
    return text


class Binding(enum.Enum):
    """What ``decide`` allows."""

    OURS = "ours"  # bound to this host already
    BIND = "bind"  # unbound (or bound by an older vmlend): bind it to this host
    TAKE_OVER = "take-over"  # another host's, whose lease has expired: rebind on request


def decide(
    node: str,
    me: str,
    bound: NodeBinding | None,
    alive: HostKey | None,
    own_lease: int | None,
    *,
    take_over: bool,
) -> Binding:
    """Whether this host (machine-id ``me``) may run ``node``'s agent: ``bound`` is what
    ``agents/<node>`` says, ``alive`` the ``hosts/<node>`` key (None: no agent's lease holds
    it), ``own_lease`` the lease this host's previous agent published (None: none).
    ``AgentIdentityError`` when not."""
    if alive is not None and alive.lease != own_lease:
        who = f"machine-id {alive.machine_id}" if alive.machine_id else "another host"
        raise AgentIdentityError(
            f"node {node} is served by an agent on {who} (lease {alive.lease:x}, pid"
            f" {alive.pid}): a node runs one agent; if this host is its replacement, wait until"
            " that lease has expired and start this agent with --take-over; nothing was changed"
        )
    if bound is None or bound.machine_id == "":
        return Binding.BIND
    if bound.machine_id == me:
        return Binding.OURS
    if not take_over:
        raise AgentIdentityError(
            f"node {node} belongs to the host with machine-id {bound.machine_id}, not this one"
            f" ({me}): give this host its own node name, or, if it replaces that host, start the"
            " agent with --take-over once that host's lease has expired; nothing was changed"
        )
    return Binding.TAKE_OVER


def bind_node(
    session: EtcdSession, me: str, own_lease: int | None, *, take_over: bool
) -> Binding:
    """Bind ``session.node`` to this host (``decide``), or refuse."""
    for _attempt in range(3):
        bound = session.binding()
        verdict = decide(
            session.node, me, bound, session.host_key(), own_lease, take_over=take_over
        )
        if verdict is Binding.OURS or session.bind(NodeBinding(me, os.getpid()), was=bound):
            return verdict
    raise AgentIdentityError(
        f"agents/{session.node} kept changing while this agent bound it: another agent starts"
        " for the same node; nothing was changed"
    )


class HostLock:
    """``<run>/vmlend/agent.lock``: held by the one agent of this host (``acquire``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    @classmethod
    def of(cls, env: HostEnv) -> HostLock:
        return cls(env.run / "vmlend" / "agent.lock")

    def acquire(self) -> None:
        """Take the lock or raise ``AgentRunningError`` naming the agent that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        # A hook or 'vmlend drain' asking whether an agent lives holds the lock shared for an
        # instant (``held_elsewhere``): tried again for a while, only an agent keeps it.
        for attempt in range(_ATTEMPTS):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if attempt + 1 < _ATTEMPTS:
                    time.sleep(_PAUSE)
                    continue
                pid = _pid_in(fd)
                os.close(fd)
                raise AgentRunningError(str(self.path), pid) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the kernel drops the lock with the last descriptor
            self._fd = None

    def held_elsewhere(self) -> bool:
        """Whether another process holds the lock (an agent lives on this host); the hook
        asks the same with ``os`` and ``fcntl`` alone (``vmlend.hook.agentlock``)."""
        return agentlock.held_elsewhere(str(self.path))


def _pid_in(fd: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(os.pread(fd, 32, 0).decode().strip() or "0") or None
    return None
