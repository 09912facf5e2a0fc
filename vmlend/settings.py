"""Where vmlend keeps its state by default. No CLI imports: the hook uses this too."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping  # annotations only: the hook imports this module

STATE_ENV = "VMLEND_STATE"
NODE_ENV = "VMLEND_NODE"
#: A registry URL (etcd://... or sqlite:///...); wins over VMLEND_STATE for the shared state.
REGISTRY_ENV = "VMLEND_REGISTRY"


def default_state_path(root: str | os.PathLike[str] | None = None) -> Path:
    """Root keeps the state with the system (under the host ``root``, default ``$VMLEND_ROOT``
    or /); others under the XDG state dir."""
    if os.geteuid() == 0:
        from vmlend.hostenv import HostEnv  # loaded when used: the hook reads only the names above

        return HostEnv.from_env(root).system_state
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "vmlend" / "state.db"


def state_path_from_env(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    value = env.get(STATE_ENV)
    return Path(value) if value else default_state_path()


def registry_from_env(environ: Mapping[str, str] | None = None) -> str | Path:
    """Where the shared state is: $VMLEND_REGISTRY, else the SQLite file of $VMLEND_STATE
    (or the default path)."""
    env = os.environ if environ is None else environ
    return env.get(REGISTRY_ENV) or state_path_from_env(env)
