"""``vmlend drain``: decommission this host's agent explicitly.

A stopped agent keeps its lease for the next one (a restart or an upgrade disturbs no VM), so
giving the lease up is a step of its own: with the agent stopped and no VM of this host using
a remote device any more, revoke the lease (every record of the host goes with it), remove
``agents/<node>`` if it binds the node to this host, and the lease file.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from vmlend.agent.identity import HostLock
from vmlend.errors import AgentNotRunningError, ConfigError, StateError
from vmlend.hook.domainview import read_hook_domain
from vmlend.hypervisor.base import DomainState, Hypervisor
from vmlend.registry import hostlease
from vmlend.registry.session import EtcdSession


def vms_with_remote_devices(hv: Hypervisor, node: str, lenders: dict[int, str]) -> list[str]:
    """The running or paused VMs here that use a device another node lends."""
    out = []
    for info in hv.list_domains():
        if info.state not in (DomainState.RUNNING, DomainState.PAUSED):
            continue
        dom = read_hook_domain(hv.xml(info.name), strict=False)
        if dom is not None and any(lenders.get(d.fdid, "") != node for d in dom.devices):
            out.append(info.name)
    return out


class Drained(msgspec.Struct):
    """What ``drain`` did: the lease given up (None: there was none) and whether it was
    revoked (else it ends by its TTL), whether the node name was unbound, one line each."""

    node: str
    lease: int | None = None
    revoked: bool = False
    unbound: bool = False
    lines: list[str] = msgspec.field(default_factory=list)


def drain(
    session: EtcdSession,
    lock: HostLock,
    lease_file: Path,
    machine_id: str,
    running: list[str] | None,
) -> Drained:
    """Give up this host's lease and node binding. ``running``: the VMs still using remote
    devices (None: not checked, no hypervisor given)."""
    if lock.held_elsewhere():
        raise ConfigError(
            f"a vmlend agent runs on this host ({lock.path} is held): stop it first"
            " (e.g. 'systemctl stop vmlend-agent'), then drain"
        )
    if running:
        raise ConfigError(
            f"VMs {', '.join(running)} use remote devices on this host: stop them or move"
            " them to another host first ('vmlend migrate'); nothing was changed"
        )
    out = Drained(session.node)
    lines = out.lines
    try:
        published = hostlease.read(lease_file)
    except AgentNotRunningError:
        published = None
    except StateError as e:
        lines.append(f"lease file: {e}")
        published = None
    if published is not None:
        out.lease = published.lease
        try:
            session.revoke(published.lease)
            out.revoked = True
            lines.append(f"lease {published.lease:x}: revoked (this host's records went with it)")
        except StateError as e:
            lines.append(f"lease {published.lease:x}: not revoked ({e}); it ends by its TTL")
        hostlease.withdraw(lease_file, published.lease)
    else:
        lines.append("no lease to give up")
    if session.unbind(machine_id):
        out.unbound = True
        lines.append(f"node {session.node}: no longer bound to this host")
    else:
        lines.append(f"node {session.node}: bound to another host, left as it is")
    return out
