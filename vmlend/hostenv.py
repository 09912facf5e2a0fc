"""The host environment: the one object that knows where the host's filesystem starts.

Every path vmlend reads or writes on the host (``sys``, ``dev``, ``etc``, ``run``, ``proc``)
hangs off ``HostEnv.root``, like mdevctl's environment root. On a real host the root is ``/``;
tests and ``--root`` / ``VMLEND_ROOT`` point it at a directory that holds a fake tree. No other
module spells a host path: they ask this object.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import msgspec

#: Environment variable that moves the root (the CLI's ``--root`` sets the same thing).
ROOT_ENV = "VMLEND_ROOT"
DEFAULT_ROOT = Path("/")


class HostEnv(msgspec.Struct, frozen=True):
    """Where the host's ``sys``, ``dev``, ``etc``, ``run`` and ``proc`` trees live."""

    root: Path = DEFAULT_ROOT
    #: libvirt's config dir when it is not ``etc/libvirt`` under the root (a private libvirtd:
    #: ``vmlend hook install --libvirt-dir``, ``vmlend doctor --libvirt-dir``)
    libvirt_dir: Path | None = None

    @classmethod
    def from_env(
        cls, root: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> HostEnv:
        """``root`` if given, else ``$VMLEND_ROOT``, else ``/``."""
        env = os.environ if environ is None else environ
        chosen = root if root is not None else env.get(ROOT_ENV) or DEFAULT_ROOT
        return cls(Path(chosen))

    @property
    def is_real(self) -> bool:
        """True when this is the running host's own root (live udev events only exist there)."""
        return self.root.resolve() == DEFAULT_ROOT

    # --- the four trees ----------------------------------------------------------------------
    @property
    def sys(self) -> Path:
        return self.root / "sys"

    @property
    def dev(self) -> Path:
        return self.root / "dev"

    @property
    def etc(self) -> Path:
        return self.root / "etc"

    @property
    def run(self) -> Path:
        return self.root / "run"

    @property
    def proc(self) -> Path:
        return self.root / "proc"

    @property
    def var(self) -> Path:
        return self.root / "var"

    @property
    def machine_id_file(self) -> Path:
        """The host's identity (systemd's machine-id): a node name is bound to it."""
        return self.etc / "machine-id"

    @property
    def system_state(self) -> Path:
        """Where root keeps vmlend's shared state by default."""
        return self.var / "lib" / "vmlend" / "state.db"

    @property
    def topology_cache(self) -> Path:
        """Where this host keeps its copy of a cluster registry's topology
        (``vmlend.registry.topocache``)."""
        return self.var / "lib" / "vmlend" / "topology"

    @property
    def libvirt_config(self) -> Path:
        """libvirt's system config dir (hooks go to its hooks/)."""
        return self.libvirt_dir if self.libvirt_dir is not None else self.etc / "libvirt"

    # --- well-known places inside them ----------------------------------------------------
    @property
    def mdev_bus(self) -> Path:
        """``class/mdev_bus``: one link per registered mdev parent."""
        return self.sys / "class" / "mdev_bus"

    @property
    def mdev_devices(self) -> Path:
        """``bus/mdev/devices``: one link per mdev child, named by its UUID."""
        return self.sys / "bus" / "mdev" / "devices"

    @property
    def iommu_groups(self) -> Path:
        return self.sys / "kernel" / "iommu_groups"

    @property
    def iommu_class(self) -> Path:
        return self.sys / "class" / "iommu"

    def module(self, name: str) -> Path:
        """``module/<name>``: present when a kernel module is loaded (or built in with params)."""
        return self.sys / "module" / name

    @property
    def smartio(self) -> Path:
        """The SmartIO driver's class directory (docs/smartio-contract.md)."""
        return self.sys / "class" / "smartio"

    @property
    def vfio_container(self) -> Path:
        return self.dev / "vfio" / "vfio"

    @property
    def node_file(self) -> Path:
        """``etc/vmlend/node``: which fabric node this host is (host-local configuration; used
        when neither --node nor VMLEND_NODE says)."""
        return self.etc / "vmlend" / "node"

    def configured_node(self) -> str | None:
        try:
            return self.node_file.read_text().strip() or None
        except FileNotFoundError:
            return None

    @property
    def libvirt_hooks(self) -> Path:
        return self.libvirt_config / "hooks"

    def process(self, pid: int) -> Path:
        """``proc/<pid>``: exists while the process runs."""
        return self.proc / str(pid)

    @property
    def libvirtd_pidfiles(self) -> tuple[Path, ...]:
        """Where the monolithic and the modular QEMU daemon leave their pid files."""
        return (self.run / "libvirtd.pid", self.run / "virtqemud.pid")
