"""Who may write which keys of a cluster in etcd, and the ``etcdctl`` commands that give each
host a user and a role saying so (``vmlend registry roles``). Pure: no I/O.

etcd's RBAC grants read or readwrite on one key or on a key range (``--prefix``), per role;
a request is refused ("permission denied") unless every key it reads, compares or writes is in
a granted range. Two more rules of etcd's shape what a role can be limited to (measured on
etcd 3.4, ``tests/unit/registry/test_registry_auth.py``):

- a put that attaches a key to a lease is refused unless the user may write every key already
  on that lease, and so is a lease revoke; so a host cannot put its records on another host's
  lease, nor revoke it (each host's lease carries ``hosts/<node>``, which only it may write);
- lease grants and keepalives are not checked at all: any client etcd lets in may keep any
  lease alive.

What every host must write follows from the transactions (``etcd_txn``, ``session``, ``plugs``
and their callers): a reserve is one Txn over shared keys of the device it borrows (its hold,
fence, the claims and unit blocks of the adapters on its path) and its own node's index and VM
marker; a release deletes the same; a lender's agent removes the fences of its devices; the
agent writes its node's liveness and binding. ``PREFIXES`` lists every key prefix with who
writes it; a host's role gets readwrite on the shared prefixes and on its own node's, read on
the rest; the administrator's role (``fabric init``) gets readwrite on the whole cluster.
"""

from __future__ import annotations

import enum
import shlex
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec

from vmlend.errors import ConfigError
from vmlend.registry.etcd_keys import Keys


class Writers(enum.Enum):
    """Whose role may write a prefix."""

    NODE = "its node's host"  # each host its own node's key(s) only
    HOSTS = "every host"
    ADMIN = "the administrator"


class Prefix(msgspec.Struct, frozen=True):
    """A key or key prefix under the cluster's base (``{node}`` stands for a node name; a
    pattern ending in ``/`` is a prefix, else one key), who may write it and why."""

    pattern: str
    writers: Writers
    why: str

    def key(self, keys: Keys, node: str = "") -> str:
        return keys.base + self.pattern.format(node=node)

    @property
    def is_prefix(self) -> bool:
        return self.pattern.endswith("/")


#: Every key prefix of a cluster, most specific first (``prefix_of`` takes the first match).
PREFIXES: tuple[Prefix, ...] = (
    Prefix(
        "hosts/{node}",
        Writers.NODE,
        "the node's agent: it is alive (on its lease); a revoke of that lease removes it",
    ),
    Prefix(
        "agents/{node}",
        Writers.NODE,
        "the node's agent binds the name to its machine-id; 'vmlend drain' removes it",
    ),
    Prefix(
        "held-vm/{node}/",
        Writers.NODE,
        "reserves and releases of the node's VMs (each VM's marker and unit ledger: the"
        " node's index of its holds)",
    ),
    Prefix(
        "decider/",
        Writers.HOSTS,
        "the process deciding a node's own adapter places for its VMs: its epoch (which the"
        " node's reserves compare, and write to take the node over) and its extents; any"
        " host's reserve short of units takes a node over to give its slack back",
    ),
    Prefix(
        "mdevs/{node}/",
        Writers.NODE,
        "the node's hook and CLI create and remove the mdevs of its borrowed devices",
    ),
    Prefix(
        "parents/{node}/",
        Writers.NODE,
        "the node's mdev parents of the devices it borrows",
    ),
    Prefix(
        "holds/",
        Writers.HOSTS,
        "any host borrowing the device: a reserve creates the hold, a release deletes it",
    ),
    Prefix(
        "fence/",
        Writers.HOSTS,
        "written with every hold and deleted by its release (the borrower); deleted after a"
        " take-back by the device's lender's agent",
    ),
    Prefix(
        "units/",
        Writers.HOSTS,
        "a reserve claims resources on every adapter of its path, its own and the lender's:"
        " unit blocks, which carry the claims",
    ),
    Prefix(
        "runtime/",
        Writers.HOSTS,
        "the data path of a held device (DMA windows, vectors, P2P maps, NVMe shares)",
    ),
    Prefix(
        "devices/",
        Writers.HOSTS,
        "'vmlend lend' / 'unlend' on the lender; any host's agent marks a device unavailable"
        " while its mdev parent is gone there",
    ),
    Prefix(
        "plugs/",
        Writers.HOSTS,
        "a live migration's source asks under the destination's prefix, the destination's"
        " agent answers, the source deletes it",
    ),
    Prefix(
        "migrations/",
        Writers.HOSTS,
        "a live migration's source records it, on its own lease, while it runs (the"
        " destination's agent plugs only what such a record names); keyed by VM UUID",
    ),
    Prefix(
        "meta/hypervisor-host-uuid/",
        Writers.HOSTS,
        "'vmlend migrate' records both ends' hypervisors the first time it meets them",
    ),
    Prefix("meta/", Writers.ADMIN, "'vmlend fabric init' (schema version), link-down (sim)"),
    Prefix("topology/", Writers.ADMIN, "'vmlend fabric init'"),
    Prefix("nodes/", Writers.ADMIN, "node-down and node-up (the simulated fabric)"),
)


def prefix_of(keys: Keys, key: str, nodes: Iterable[str]) -> tuple[Prefix, str] | None:
    """The entry of ``PREFIXES`` that ``key`` of ``keys``' cluster falls under, and the node
    whose it is ("" for a prefix of no node's); None when no entry names it (its writer is
    then the administrator alone: a host's role grants only what the table lists)."""
    for p in PREFIXES:
        for node in nodes if "{node}" in p.pattern else ("",):
            mine = p.key(keys, node)
            if key.startswith(mine) if p.is_prefix else key == mine:
                return p, node
    return None


# --- users, roles and the etcdctl commands -----------------------------------------------------
ADMIN = "admin"


def user_of(cluster: str, node: str) -> str:
    """The etcd user (and role) of ``node``'s host in ``cluster``: ``gamma@lab``."""
    return f"{node}@{cluster}"


def admin_of(cluster: str) -> str:
    """The administrator's etcd user (and role) of ``cluster``: ``admin@lab``."""
    return user_of(cluster, ADMIN)


class Permission(msgspec.Struct, frozen=True):
    kind: str  # "read" or "readwrite"
    key: str
    prefix: bool


def host_permissions(keys: Keys, node: str) -> list[Permission]:
    """What ``node``'s role gets: read on the whole cluster, readwrite on the shared prefixes
    and on its own node's keys."""
    out = [Permission("read", keys.base, True)]
    for p in PREFIXES:
        if p.writers is Writers.HOSTS:
            out.append(Permission("readwrite", p.key(keys), True))
    for p in PREFIXES:
        if p.writers is Writers.NODE:
            out.append(Permission("readwrite", p.key(keys, node), p.is_prefix))
    return out


def admin_permissions(keys: Keys) -> list[Permission]:
    return [Permission("readwrite", keys.base, True)]


class EtcdctlTarget(msgspec.Struct, frozen=True):
    """Where ``etcdctl`` reaches the cluster: its endpoints (with their scheme) and the TLS
    files of the registry URL the command was given (None: not given)."""

    endpoints: tuple[str, ...]
    cacert: Path | None = None
    cert: Path | None = None
    key: Path | None = None


def etcdctl_script(
    cluster: str, nodes: Sequence[str], target: EtcdctlTarget, *, only: bool = False
) -> str:
    """A shell script of ``etcdctl`` commands that gives each of ``nodes`` its user and role,
    and (unless ``only``: hosts added later) makes etcd's root user and the administrator and
    enables authentication. It may run again: a user or role that exists is left alone (its
    permissions are granted again, which changes nothing). Passwords are never in it: each
    user's is read from ``$VMLEND_PASSWORDS/<user>``."""
    keys = Keys(cluster)
    if ADMIN in nodes:
        raise ConfigError(
            f"node {ADMIN!r} would have the etcd user of the cluster's administrator"
            f" ({admin_of(cluster)}); rename the node in the topology"
        )
    q = shlex.quote
    env = [f"export ETCDCTL_ENDPOINTS={q(','.join(target.endpoints))}"]
    for name, path in (("CACERT", target.cacert), ("CERT", target.cert), ("KEY", target.key)):
        if path is not None:
            env.append(f"export ETCDCTL_{name}={q(str(path))}")
    example = user_of(cluster, nodes[0] if nodes else "gamma")
    lines = [
        "#!/bin/sh",
        f"# etcd users and roles of the vmlend cluster {cluster!r} ('vmlend registry roles'):",
        "# one user and one role per host, which may write its own node's keys and the shared",
        "# ones (docs/cluster.md, 'Users and roles'), and the administrator's, which may write",
        f"# everything under {keys.base} ('vmlend fabric init'). Review it, then run it where",
        "# etcdctl (Debian: etcd-client) reaches the cluster. Each user's password is the one",
        "# line, without blanks, of the file $VMLEND_PASSWORDS/<user> (root's password in",
        "# $VMLEND_PASSWORDS/root); copy a host's to that host as /etc/vmlend/etcd-password",
        "# (root's, mode 0600) and name it in the host's registry URL:",
        f"#   ...?user={example}&password-file=/etc/vmlend/etcd-password",
        "set -eu",
        ': "${VMLEND_PASSWORDS:?name the directory of the password files}"',
        *env,
        "export ETCDCTL_USER=root",
        'ETCDCTL_PASSWORD=$(cat "$VMLEND_PASSWORDS/root"); export ETCDCTL_PASSWORD',
        'ensure_role() { etcdctl role get "$1" >/dev/null 2>&1 || etcdctl role add "$1"; }',
        "ensure_user() {",
        '  etcdctl user get "$1" >/dev/null 2>&1 ||'
        ' etcdctl user add "$1" --interactive=false <"$VMLEND_PASSWORDS/$1"',
        '  etcdctl user grant-role "$1" "$2"',
        "}",
    ]
    if not only:
        lines += ["# etcd's root user: 'auth enable' needs it", "ensure_user root root"]
        lines += _role(admin_of(cluster), admin_permissions(keys), "the administrator")
    for node in nodes:
        lines += _role(user_of(cluster, node), host_permissions(keys, node), f"host {node}")
    if not only:
        lines += ["etcdctl auth enable"]
    return "\n".join(lines) + "\n"


def _role(name: str, permissions: list[Permission], who: str) -> list[str]:
    q = shlex.quote
    out = [f"# {name}: {who}", f"ensure_role {q(name)}"]
    for p in permissions:
        prefix = " --prefix" if p.prefix else ""
        out.append(f"etcdctl role grant-permission {q(name)} {p.kind} {q(p.key)}{prefix}")
    out.append(f"ensure_user {q(name)} {q(name)}")
    return out
