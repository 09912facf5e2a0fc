"""Forcing the worst interleaving of two hosts' steps on etcd instead of leaving it to timing:
another step lands just before a fabric's next commit is sent."""

from __future__ import annotations

from collections.abc import Callable


def landing_first(fabric, action: Callable[[], object]) -> Callable[[], None]:
    """Make ``fabric``'s next commit run ``action`` (another host's whole step) just before
    it is sent, once; returns what puts the fabric's commits back as they were."""
    gateway = fabric.registry.gateway
    commit = gateway.txn
    landed: list[bool] = []

    def txn(compare, success):
        if success and not landed:
            landed.append(True)
            action()
        return commit(compare, success)

    gateway.txn = txn  # this fabric's commits only

    def restore() -> None:
        gateway.txn = commit

    return restore
