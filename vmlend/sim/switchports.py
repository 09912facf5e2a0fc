"""The requester tables of the cluster switches' ports, as the simulated fabric programs them.

Each port of a cluster switch lets across only the requesters in its table: one entry per
requester device (``vmlend.topology.requesters``: bus:device on its lender, shared by the
device's functions), out of the switch's ``requester_entries``. A borrowed device's crossing
holds an entry on every port of its route (the port it enters each switch by and the one it
leaves by). A shared drive's crossing into a VM's node (and a two-path share's backup
crossing), and peer-to-peer's between two lenders, hold one the same way. The table records
who uses each entry (a borrowed device's fdid, or a ``(fdid, crossing)`` pair for another
crossing), so an entry goes with its last user, and the invariant checker can tell whose it
is.
"""

from __future__ import annotations

from collections.abc import Iterable

from vmlend.errors import SwitchPortFullError
from vmlend.topology.model import Topology
from vmlend.topology.requesters import SwitchPort

#: Who uses a requester entry: the fdid of a borrowed device (its borrow's crossing), or
#: ``(fdid, what)`` for another crossing whose entries ``fdid``'s hold claims (``"nvme>gamma"``:
#: shared drive ``fdid``'s crossing into gamma; ``"p2p gamma/web from 0x10"``: peer-to-peer
#: from 0x10 to target ``fdid``); an entry stays while any user passes the port.
PortUser = int | tuple[int, str]


def user_fdid(user: PortUser) -> int:
    """The device whose hold claims ``user``'s entries."""
    return user if isinstance(user, int) else user[0]


class SwitchPorts:
    """Every cluster switch port's requester table (empty until a crossing passes it)."""

    def __init__(self, topology: Topology) -> None:
        self._topology = topology
        self._tables: dict[str, dict[str, set[PortUser]]] = {}  # port -> requester -> users

    def size(self, port: SwitchPort) -> int:
        """Entries of ``port``'s table."""
        return self._topology.switch_requester_entries(port.switch)

    def add(self, ports: Iterable[SwitchPort], requester: str, user: PortUser) -> None:
        """``user``'s crossing as ``requester`` passes ``ports``: an entry on each (its
        device's, when another function or crossing has one there). All or nothing:
        ``SwitchPortFullError`` naming the first full port, nothing changed."""
        ports = list(ports)
        for p in ports:
            table = self._tables.get(p.name, {})
            if requester not in table and len(table) >= self.size(p):
                raise SwitchPortFullError(p.switch, p.name, requester, self.size(p))
        for p in ports:
            self._tables.setdefault(p.name, {}).setdefault(requester, set()).add(user)

    def remove(self, ports: Iterable[SwitchPort], requester: str, user: PortUser) -> None:
        """``user``'s crossing no longer passes ``ports``: an entry goes with its last user."""
        for p in ports:
            table = self._tables.get(p.name)
            users = table.get(requester) if table is not None else None
            if table is None or users is None:
                continue
            users.discard(user)
            if not users:
                del table[requester]
            if not table:
                del self._tables[p.name]

    def entries(self, port: str) -> dict[str, frozenset[PortUser]]:
        """Port ``port``'s table: requester -> the crossings that use the entry."""
        return {r: frozenset(f) for r, f in sorted(self._tables.get(port, {}).items())}

    def ports(self) -> list[str]:
        """The ports with at least one entry, by name."""
        return sorted(self._tables)
