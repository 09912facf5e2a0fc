"""The host's agent lease, as the hook and the CLI on the host find it.

``vmlend agent`` holds one etcd lease for its host and publishes it in a host-local file
(``<root>/run/vmlend/agent.lease``); every cluster-registry write of the host's processes that
creates a host record (hold, claim, mdev, runtime record) attaches it. The file is written
atomically and removed when the agent stops.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from vmlend.errors import AgentNotRunningError, StateError
from vmlend.hostenv import HostEnv


class HostLease(msgspec.Struct, frozen=True):
    lease: int
    node: str
    ttl: int
    pid: int


def lease_path(env: HostEnv) -> Path:
    return env.run / "vmlend" / "agent.lease"


def hook_socket_path(env: HostEnv) -> Path:
    """Where the agent serves the hook (``vmlend.hook.server``; the hook process computes the
    same default without importing this: ``vmlend.hook.forward.SOCKET_UNDER_ROOT``)."""
    return env.run / "vmlend" / "hook.sock"


def publish(path: Path, lease: HostLease) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    import json  # only the agent and etcd hosts read or write the file

    from vmlend import safefile  # the agent (root) writes it: never through a planted link

    safefile.write_atomically(path, json.dumps(msgspec.to_builtins(lease)).encode())


def withdraw(path: Path, lease: int) -> None:
    """Remove the file if it still names ``lease`` (a newer agent may have replaced it)."""
    try:
        if read(path).lease == lease:
            path.unlink()
    except (AgentNotRunningError, StateError, OSError):
        pass


def read(path: Path) -> HostLease:
    import json

    try:
        data = json.loads(path.read_text())
        return HostLease(int(data["lease"]), str(data["node"]), int(data["ttl"]), int(data["pid"]))
    except FileNotFoundError:
        raise AgentNotRunningError(str(path)) from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise StateError(
            f"the agent lease file {path} is unreadable ({e}); restart 'vmlend agent'"
        ) from None
