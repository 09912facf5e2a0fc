"""Which fabric node this host is, and what changing it would orphan.

The state records the local node; the hook returns at release what the VM holds *on this node*.
Re-identifying a host that still has holds under its old name would leave those holds to a
node nobody speaks for: the hook would return nothing on release.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from vmlend.errors import ConfigError
from vmlend.registry import SqliteRegistry


class IdentityChange(msgspec.Struct, frozen=True):
    old: str
    new: str
    held: list[str]  # "0x10 by gamma/vm1", the holds and mdevs of the old identity

    def refusal(self) -> ConfigError:
        shown = ", ".join(self.held[:3]) + (" ..." if len(self.held) > 3 else "")
        return ConfigError(
            f"this host is node {self.old} in the state, which still has {len(self.held)}"
            f" hold(s) or mdev(s) there ({shown}); --node {self.new} would make it {self.new}"
            f" and its hook would no longer return them: stop those VMs first (or 'vmlend"
            " reconcile --fix'), or pass --force"
        )


def identity_change(state_path: Path, new: str) -> IdentityChange | None:
    """What making this host ``new`` changes in the state at ``state_path``; None when the
    state does not exist yet, has no topology, or already says ``new``."""
    if not state_path.exists():
        return None
    with SqliteRegistry.open(state_path) as reg, reg.read() as tx:
        if not tx.has_topology():
            return None
        old = tx.topology().local_node
        if old == new:
            return None
        held = [
            f"{fdid:#x} by {h.holder}"
            for fdid, h in sorted(tx.holds().items())
            if h.holder.node == old
        ]
        held += [f"mdev {m.uuid}" for m in tx.mdevs(old)]
    return IdentityChange(old, new, held)
