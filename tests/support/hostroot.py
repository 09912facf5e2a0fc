"""A host root of a test's own, with what identifies a host in it: ``etc/machine-id`` (the
agent binds its node name to it) and, optionally, ``etc/vmlend/node``."""

from __future__ import annotations

import uuid
from pathlib import Path


def identify(root: Path, node: str | None = None, machine_id: str | None = None) -> str:
    """Give the host rooted at ``root`` a machine-id (a new one unless given) and a node name;
    the machine-id. An existing machine-id is kept (a restarted host is the same host)."""
    etc = root / "etc"
    etc.mkdir(parents=True, exist_ok=True)
    path = etc / "machine-id"
    if machine_id is None and path.exists():
        machine_id = path.read_text().strip()
    machine_id = machine_id or uuid.uuid4().hex
    path.write_text(machine_id + "\n")
    if node is not None:
        (etc / "vmlend").mkdir(exist_ok=True)
        (etc / "vmlend" / "node").write_text(node + "\n")
    return machine_id
