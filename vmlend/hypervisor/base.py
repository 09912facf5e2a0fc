"""The hypervisor interface: what the CLI and the demo need from libvirt.

Two implementations: ``LibvirtHypervisor`` (production, any libvirt URI) and ``SimHypervisor``
(the demo's fabric nodes: keeps libvirt XML in files and runs the qemu hook as libvirtd does).
``vmlend.wiring.hypervisor.open_hypervisor`` picks one from a URI.

Flags follow libvirt's ``virDomainModificationImpact``: ``live`` changes the running domain,
``config`` its persistent definition; neither means "current" (live if running, else config).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Protocol, runtime_checkable

import msgspec

#: ``VIR_DOMAIN_METADATA_ELEMENT``: the custom-namespace element kind of ``<metadata>``.
METADATA_ELEMENT = 2


class DomainState(StrEnum):
    RUNNING = "running"
    PAUSED = "paused"
    SHUTOFF = "shutoff"

    @property
    def words(self) -> str:
        """virsh's words for the state (``shut off``), which every command prints."""
        return "shut off" if self is DomainState.SHUTOFF else self.value


class DomainInfo(msgspec.Struct, frozen=True):
    name: str
    uuid: str
    state: DomainState
    persistent: bool

    @property
    def active(self) -> bool:
        return self.state is not DomainState.SHUTOFF


class LiveMigration(msgspec.Struct, frozen=True):
    """How to move a running domain (``migrate_live``). ``persistent``: define it on the
    destination too (``VIR_MIGRATE_PERSIST_DEST``), from the source's persistent definition;
    ``undefine_source``: remove the source's definition once it runs there
    (``VIR_MIGRATE_UNDEFINE_SOURCE``); ``migration_uri``: where the memory goes
    (``VIR_MIGRATE_PARAM_URI``, e.g. ``tcp://127.0.0.1:49152`` when both daemons share one host
    name); ``listen_address``: where the destination's QEMU listens for it
    (``VIR_MIGRATE_PARAM_LISTEN_ADDRESS``; libvirt's default is every address);
    ``dest_xml``: the XML the destination starts (``VIR_MIGRATE_PARAM_DEST_XML``; None: the
    live XML, which the destination's migrate hook rewrites)."""

    persistent: bool = False
    undefine_source: bool = False
    migration_uri: str | None = None
    listen_address: str | None = None
    dest_xml: bytes | None = None


class SwitchOver(Protocol):
    """What a hot migration does at the switch-over of ``Hypervisor.migrate_live``: the
    moment the guest's vCPUs are stopped on the source and not yet running on the
    destination (docs/migration.md, "Hot")."""

    def switch(self) -> None:
        """Called with the guest paused, after the destination's hooks, before the
        destination runs it. Raising a ``VmlendError`` cancels the migration: the guest runs
        on here again and the destination's stop hooks run."""
        ...

    def resumed(self) -> None:
        """Called once the guest runs on the destination (before the source's stop hooks)."""
        ...


class MigrationStats(msgspec.Struct, frozen=True):
    """What a live migration measured. ``downtime``: seconds the guest's vCPUs were stopped
    for the switch-over (None: the hypervisor did not say)."""

    downtime: float | None = None


@runtime_checkable
class Hypervisor(Protocol):
    """One hypervisor connection. Every method raises ``LibvirtError`` subclasses
    (``UnknownDomainError``, ``DomainStateError``, ...) carrying the hypervisor's reason."""

    #: The URI this connection was opened with (``qemu:///system``, ``sim:///gamma``).
    uri: str
    #: The fabric node this hypervisor runs on; None when unknown (plain libvirt).
    node: str | None
    #: Whether ``migrate_live`` calls a ``switch_over`` at the switch-over (a hot migration
    #: needs it); libvirt offers no such call.
    hot_migration: bool
    #: Whether hot-plugging a PCIe device needs a free hot-pluggable port in the guest, as
    #: libvirt's does on q35 (``vmlend.domain.slots.free_hotplug_ports``).
    hotplug_ports: bool

    def list_domains(self) -> list[DomainInfo]:
        """Every domain, persistent or running, sorted by name."""
        ...

    def lookup(self, name_or_uuid: str) -> DomainInfo: ...

    def define(self, xml: bytes) -> DomainInfo:
        """Define or update a persistent domain. Same name must keep the same UUID."""
        ...

    def undefine(self, name: str) -> None:
        """Remove the persistent definition; a running domain goes on as a transient one."""
        ...

    def xml(self, name: str, inactive: bool = False) -> bytes:
        """The live XML of a running domain (``inactive``: the persistent one)."""
        ...

    def start(self, name: str) -> None: ...

    def shutdown(self, name: str, timeout: float) -> None:
        """Ask the guest to power off and wait up to ``timeout`` seconds for it; raises
        ``ShutdownTimeoutError`` when it is still running (``destroy`` is then the user's
        call)."""
        ...

    def destroy(self, name: str) -> None:
        """Stop the domain at once (pull the plug)."""
        ...

    def suspend(self, name: str) -> None:
        """Pause a running domain (its vCPUs stop; memory and devices stay)."""
        ...

    def resume(self, name: str) -> None:
        """Let a paused domain run again."""
        ...

    def attach_device(self, name: str, device_xml: bytes, live: bool, config: bool) -> None: ...

    def detach_device(self, name: str, device_xml: bytes, live: bool, config: bool) -> None: ...

    def get_metadata(self, name: str, uri: str, inactive: bool = False) -> bytes | None:
        """The ``<metadata>`` element in namespace ``uri`` (namespace stripped, as libvirt
        returns it), or None when absent."""
        ...

    def set_metadata(
        self, name: str, uri: str, key: str, xml: bytes | None, live: bool, config: bool
    ) -> None:
        """Set the element of namespace ``uri`` (prefix ``key``); ``xml=None`` removes it."""
        ...

    def migrate_live(
        self,
        name: str,
        dst: Hypervisor,
        how: LiveMigration,
        switch_over: SwitchOver | None = None,
    ) -> MigrationStats:
        """Move the running domain ``name`` to ``dst`` while it runs (libvirt:
        ``migrateToURI3`` with ``VIR_MIGRATE_LIVE | VIR_MIGRATE_PEER2PEER``; the destination
        runs its hook's ``migrate`` filter, then ``prepare``/``start``/``started``). On
        failure the domain still runs here. ``switch_over``: called at the switch-over (only
        where ``hot_migration``; else ``UnsupportedOperationError``, nothing done)."""
        ...

    def host_uuid(self) -> str:
        """The hypervisor host's UUID (libvirt: ``<host><uuid>`` of its capabilities, else its
        sysinfo's system UUID; "" when it says neither, as libvirt's test driver): what tells
        two hypervisors apart whatever URI reaches them."""
        ...

    def close(self) -> None: ...
