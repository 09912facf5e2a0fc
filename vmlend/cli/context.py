"""The context object of one ``vmlend`` invocation (``ctx.obj``).

Apart from ``common`` so that ``vmlend --help``, which runs no command, does not load msgspec.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from vmlend.settings import default_state_path

if TYPE_CHECKING:
    from vmlend.fabric.base import Fabric
    from vmlend.topology.selectors import Alias


class CliContext(msgspec.Struct):
    """Shared state of one ``vmlend`` invocation (``ctx.obj``)."""

    state_path: Path  # the SQLite state; its directory also keeps this host's local files
    node: str | None
    verbose: int = 0
    root: Path | None = None  # host root (--root / VMLEND_ROOT); None = the real one
    registry: str | None = None  # --registry / VMLEND_REGISTRY: wins over state_path
    uri: str | None = None  # the global -c/--connect; a command's own -c wins
    #: --backend / VMLEND_BACKEND / the configuration file; None: the host's default
    #: (``vmlend.wiring.fabric.default_backend``)
    backend: str | None = None
    config_path: Path | None = None  # --config / VMLEND_CONFIG; None: the one under the root
    #: the configuration file's ``[alias]`` table: names ``--device`` may use for vendor/product
    aliases: dict[str, Alias] = {}

    @classmethod
    def create(
        cls,
        state_path: str | None,
        node: str | None,
        verbose: int,
        root: str | None = None,
        registry: str | None = None,
        backend: str | None = None,
        config_path: str | None = None,
        aliases: dict[str, Alias] | None = None,
    ) -> CliContext:
        logging.basicConfig(
            level=logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING,
            format="vmlend: %(message)s",
            stream=sys.stderr,
        )
        path = Path(state_path) if state_path else default_state_path(root)
        return cls(
            state_path=path,
            node=node,
            verbose=verbose,
            root=Path(root) if root else None,
            registry=registry or None,
            backend=backend or None,
            config_path=Path(config_path) if config_path else None,
            aliases=aliases or {},
        )

    @property
    def location(self) -> str | Path:
        """Where the shared state is: the registry URL, else the SQLite state path."""
        return self.registry or self.state_path

    def fabric(self, read_only: bool = False) -> Fabric:
        """The fabric in the state, seen from ``--node`` (StateError when there is none).
        ``read_only``: a command that only reads works on a cluster registry without knowing
        which node this host is."""
        from vmlend.wiring.fabric import open_fabric  # commands that need no fabric skip it

        return open_fabric(
            self.location, self.node, backend=self.backend, root=self.root, observer=read_only
        )

    def host_backend(self) -> str:
        """The backend this invocation uses: the chosen one, else the host's default."""
        from vmlend.hostenv import HostEnv
        from vmlend.wiring.fabric import default_backend

        return self.backend or default_backend(HostEnv.from_env(self.root))
