"""libvirt's qemu hook calling convention, as pure data (libvirt's hooks docs; docs/hooks.md).

argv: object (domain name), operation, sub-operation, extra ("-" when empty); the domain XML on
stdin. Exit 0 is success; non-zero makes libvirt log our stderr and abort the operation (only
where libvirt honours it: prepare, start, migrate, restore, reconnect).
"""

from __future__ import annotations

import enum

import msgspec

from vmlend.errors import ConfigError
from vmlend.hook.prefilter import OPERATIONS


class Action(enum.Enum):
    """What vmlend does for a (operation, sub-operation) pair."""

    PREPARE = "prepare"  # reserve devices, create mdevs (all or nothing)
    RELEASE = "release"  # remove mdevs, return devices (idempotent)
    RECONNECT = "reconnect"  # libvirtd restarted with the VM running: reconcile
    MIGRATE = "migrate"  # incoming migration: print the XML rewritten for this host
    RESTORE = "restore"  # restore from a save image: filter, same rewrite as migrate
    IGNORE = "ignore"


_ACTIONS: dict[tuple[str, str], Action] = {ops: Action(name) for ops, name in OPERATIONS.items()}


class HookCall(msgspec.Struct, frozen=True):
    domain: str
    operation: str
    sub_operation: str
    extra: str  # "" when libvirt passed "-"

    @property
    def action(self) -> Action:
        return _ACTIONS.get((self.operation, self.sub_operation), Action.IGNORE)

    def __str__(self) -> str:
        return f"{self.domain} {self.operation} {self.sub_operation} {self.extra or '-'}"


def parse_argv(argv: list[str]) -> HookCall:
    """Parse the hook's arguments (without argv[0])."""
    if len(argv) < 3:
        raise ConfigError(
            "usage: <hook> DOMAIN OPERATION SUB-OPERATION [EXTRA] with the domain XML on stdin "
            "(libvirt runs this; see 'vmlend hook install')"
        )
    extra = argv[3] if len(argv) > 3 else "-"
    return HookCall(
        domain=argv[0],
        operation=argv[1],
        sub_operation=argv[2],
        extra="" if extra == "-" else extra,
    )
