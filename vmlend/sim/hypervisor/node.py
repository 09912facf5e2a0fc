"""The simulated hypervisor of one fabric node: libvirt's domain life cycle without QEMU.

It keeps each domain's persistent and live XML in files (``SimStore``), so every CLI process
sees the same domains, and runs the qemu hook exactly as libvirtd does (docs/hooks.md, "libvirt qemu
hook contract"): ``hook_command + [name, op, subop, extra]``, the full domain XML on stdin, the
environment passed through, synchronously.

    start:    prepare begin -, start begin -, started begin -
              (a non-zero exit aborts the start; stopped and release then still run)
    stop:     stopped end -, release end <reason>   (exit codes ignored, stderr logged)
    define, undefine, attach, detach, metadata: no hook (libvirt has none for them)
    live migration, on the destination: migrate begin - (its stdout is the XML to start),
              prepare begin -, start begin -, started begin -; then the switch-over (the
              guest's vCPUs stop on the source, the caller's ``SwitchOver`` runs, the
              vCPUs run on the destination); on the source: stopped end -, release end
              migrated

Hot-plug behaves like a working VFIO host: live attach/detach of an mdev hostdev succeeds.
A ``GuestDriver`` lets the demo play the guest (it sees starts, hot-plugs and stops).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import time
import uuid as uuidlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

import msgspec

from vmlend.errors import (
    DomainDefinitionError,
    DomainStateError,
    HookFailedError,
    ShutdownTimeoutError,
    UnknownDomainError,
    UnsupportedOperationError,
    VmlendError,
)
from vmlend.hypervisor.base import (
    DomainInfo,
    DomainState,
    Hypervisor,
    LiveMigration,
    MigrationStats,
    SwitchOver,
)
from vmlend.sim.hypervisor import xml as sim_xml
from vmlend.sim.hypervisor.store import SimStore

log = logging.getLogger(__name__)


class GuestDriver(Protocol):
    """The simulated guest. Raising a ``VmlendError`` from ``on_started`` fails the start,
    from ``on_device_added``/``on_device_removed`` fails the hot-plug (nothing changes)."""

    def on_started(self, name: str, domain_xml: bytes) -> None: ...

    def on_device_added(self, name: str, device_xml: bytes) -> None: ...

    def on_device_removed(self, name: str, device_xml: bytes) -> None: ...

    def on_shutdown_request(self, name: str) -> bool:
        """True when the guest obeys the ACPI power button (False: it ignores it)."""
        ...

    def on_stopped(self, name: str) -> None: ...


class IdleGuest:
    """A guest that does nothing but power off when asked; subclass to override a part."""

    def on_started(self, name: str, domain_xml: bytes) -> None:
        pass

    def on_device_added(self, name: str, device_xml: bytes) -> None:
        pass

    def on_device_removed(self, name: str, device_xml: bytes) -> None:
        pass

    def on_shutdown_request(self, name: str) -> bool:
        return True

    def on_stopped(self, name: str) -> None:
        pass


class HookRun(msgspec.Struct, frozen=True):
    argv: tuple[str, ...]
    returncode: int
    stderr: str
    stdout: bytes = b""

    def reason(self) -> str:
        lines = [ln.strip() for ln in self.stderr.splitlines() if ln.strip()]
        detail = "; ".join(lines) if lines else "no message on stderr"
        return f"hook '{' '.join(self.argv[-3:-1])}' exited {self.returncode}: {detail}"


class HookRunner:
    """Runs ``hook_command`` like libvirtd runs its qemu hook. ``None``: no hook installed."""

    def __init__(self, hook_command: Sequence[str] | None, timeout: float = 120.0) -> None:
        self.command = list(hook_command) if hook_command else None
        self.timeout = timeout

    def run(self, name: str, op: str, subop: str, extra: str, xml: bytes) -> HookRun:
        if self.command is None:
            return HookRun((name, op, subop, extra), 0, "")
        argv = (*self.command, name, op, subop, extra or "-")
        log.debug("hook: %s", " ".join(argv))
        try:
            done = subprocess.run(
                argv, input=xml, capture_output=True, timeout=self.timeout, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return HookRun(argv, 255, f"cannot run hook {argv[0]}: {e}")
        return HookRun(argv, done.returncode, done.stderr.decode("utf-8", "replace"), done.stdout)


def _resolve_impact(live: bool, config: bool, running: bool) -> tuple[bool, bool]:
    """libvirt's VIR_DOMAIN_AFFECT_CURRENT: neither flag means live if running, else config."""
    if live or config:
        return live, config
    return running, not running


def _pick(
    cfg: sim_xml.Element | None, live: sim_xml.Element | None, inactive: bool
) -> sim_xml.Element:
    """The XML libvirt shows: ``inactive`` the persistent one (a transient domain's live XML
    without its id), else the live one when running."""
    if inactive and cfg is not None:
        return cfg
    if live is None:
        assert cfg is not None, "a domain has a persistent or a live XML"
        return cfg
    return sim_xml.inactive_copy(live) if inactive else live


class SimHypervisor:
    """``Hypervisor`` of the simulated fabric node ``node``, state under ``data_dir``.

    ``release_reasons``: pass the shut-off reason to ``release`` (libvirt >= 10.5: shutdown,
    destroyed, failed); False passes "-" like libvirt 9.0 on this machine kind.
    """

    #: ``migrate_live`` calls a ``SwitchOver`` with the guest paused (hot migration).
    hot_migration = True
    #: Hot-plug behaves like a working VFIO host's, with no PCIe topology to run out of.
    hotplug_ports = False

    def __init__(
        self,
        node: str,
        data_dir: Path,
        hook_command: Sequence[str] | None,
        guest_driver: GuestDriver | None = None,
        *,
        release_reasons: bool = True,
        hook_timeout: float = 120.0,
    ) -> None:
        self.node: str | None = node
        self.uri: str = f"sim:///{node}"
        self.store = SimStore(data_dir)
        self.hooks = HookRunner(hook_command, hook_timeout)
        self.guest: GuestDriver = guest_driver or IdleGuest()
        self.release_reasons = release_reasons

    # --- reading state -------------------------------------------------------------------
    def _load(self, name: str, op: str) -> tuple[sim_xml.Element | None, sim_xml.Element | None]:
        """(persistent XML, live XML) of ``name``; ``UnknownDomainError`` when neither."""
        cfg, live = self.store.read("config", name), self.store.read("live", name)
        if cfg is None and live is None:
            raise UnknownDomainError(name, self.uri)
        parse = sim_xml.parse
        return (
            None if cfg is None else parse(cfg, op, name),
            None if live is None else parse(live, op, name),
        )

    def _info(self, name: str) -> DomainInfo:
        cfg, live = self._load(name, "lookup")
        root = live if live is not None else cfg
        assert root is not None
        return DomainInfo(
            name=name,
            uuid=sim_xml.uuid_of(root),
            state=(
                DomainState.SHUTOFF
                if live is None
                else DomainState.PAUSED
                if self.store.read("paused", name) is not None
                else DomainState.RUNNING
            ),
            persistent=cfg is not None,
        )

    def _resolve(self, name_or_uuid: str) -> str:
        """The domain name for a name or UUID (names win, as names are checked first)."""
        names = self.store.names()
        if name_or_uuid in names:
            return name_or_uuid
        try:
            wanted = str(uuidlib.UUID(name_or_uuid))
        except ValueError:
            raise UnknownDomainError(name_or_uuid, self.uri) from None
        for name in names:
            try:
                if self._info(name).uuid == wanted:
                    return name
            except UnknownDomainError:  # a transient domain stopped meanwhile (reads take
                continue  # no lock: every file is replaced whole)
        raise UnknownDomainError(name_or_uuid, self.uri)

    def list_domains(self) -> list[DomainInfo]:
        # Each domain under its lock, as libvirt locks each domain object it lists: a domain
        # whose hook runs holds the listing up (one reason a hook must not call back).
        out = []
        for name in self.store.names():
            with self.store.locked(name):
                try:
                    out.append(self._info(name))
                except UnknownDomainError:  # undefined meanwhile
                    continue
        return out

    def lookup(self, name_or_uuid: str) -> DomainInfo:
        name = self._resolve(name_or_uuid)
        with self.store.locked(name):
            return self._info(name)

    def xml(self, name: str, inactive: bool = False) -> bytes:
        name = self._resolve(name)
        with self.store.locked(name):
            cfg, live = self._load(name, "read XML of")
        return sim_xml.serialize(_pick(cfg, live, inactive))

    # --- definitions ---------------------------------------------------------------------
    def define(self, xml: bytes) -> DomainInfo:
        root = sim_xml.parse_domain(xml)
        name, uuid = sim_xml.name_of(root), sim_xml.uuid_of(root)
        with self.store.locked():
            for other in self.store.names():
                try:
                    info = self._info(other)
                except UnknownDomainError:  # a transient domain stopped meanwhile
                    continue
                if other == name and info.uuid != uuid:
                    raise DomainDefinitionError(
                        "define", name, f"domain '{name}' already exists with uuid {info.uuid}"
                    )
                if other != name and info.uuid == uuid:
                    raise DomainDefinitionError(
                        "define", name, f"domain '{other}' is already defined with uuid {uuid}"
                    )
            # A running domain keeps its live XML; the new definition applies at next start.
            self.store.write("config", name, sim_xml.serialize(root))
            info = self._info(name)
        log.info("defined %s (%s) on %s", name, uuid, self.uri)
        return info

    def undefine(self, name: str) -> None:
        with self.store.locked():
            name = self._resolve(name)
            with self.store.locked(name):
                cfg, _live = self._load(name, "undefine")
                if cfg is None:
                    raise DomainStateError("undefine", name, "cannot undefine transient domain")
                self.store.remove("config", name)

    # --- life cycle ----------------------------------------------------------------------
    def start(self, name: str) -> None:
        name = self._resolve(name)
        with self.store.locked(name):
            cfg, live = self._load(name, "start")
            if live is not None:
                raise DomainStateError("start", name, "domain is already running")
            assert cfg is not None
            xml = sim_xml.serialize(sim_xml.live_copy(cfg, self.store.next_id()))
            for op in ("prepare", "start"):
                run = self.hooks.run(name, op, "begin", "-", xml)
                if run.returncode != 0:
                    self._stop_hooks(name, xml, "failed", after_failed_start=True)
                    raise HookFailedError("start", name, run.reason())
            # QEMU runs from here on (libvirt runs 'started' once the process is up).
            self.store.write("live", name, xml)
            try:
                run = self.hooks.run(name, "started", "begin", "-", xml)
                if run.returncode != 0:
                    raise HookFailedError("start", name, run.reason())
                self.guest.on_started(name, xml)
            except VmlendError:
                self.store.remove("live", name)  # QEMU is gone before libvirt runs 'stopped'
                self._stop_hooks(name, xml, "failed", after_failed_start=True)
                raise
        log.info("started %s on %s", name, self.uri)

    def _stop_hooks(
        self, name: str, xml: bytes, reason: str, *, after_failed_start: bool = False
    ) -> None:
        """``stopped end -`` then ``release end <reason>``; libvirt ignores their exit codes.
        After a failed start their failures go to the log only (as libvirtd's would): the
        start's own error is the one line its caller prints."""
        extra = reason if self.release_reasons else "-"
        level = logging.INFO if after_failed_start else logging.WARNING
        for op, subop, arg in (("stopped", "end", "-"), ("release", "end", extra)):
            run = self.hooks.run(name, op, subop, arg, xml)
            if run.returncode != 0:
                log.log(level, "%s (ignored, as libvirt does)", run.reason())

    def _stop(self, name: str, op: str, reason: str) -> None:
        """Power off a running domain (caller holds its lock)."""
        _cfg, live = self._load(name, op)
        if live is None:
            raise DomainStateError(op, name, "domain is not running")
        self.guest.on_stopped(name)
        # libvirt runs 'stopped' and 'release' once the QEMU process is gone: from here on
        # the domain uses nothing, however long its hooks take (the live XML is "QEMU runs").
        self.store.remove("live", name)
        self.store.remove("paused", name)
        self._stop_hooks(name, sim_xml.serialize(live), reason)
        log.info("stopped %s on %s (%s)", name, self.uri, reason)

    def shutdown(self, name: str, timeout: float) -> None:
        name = self._resolve(name)
        with self.store.locked(name):
            _cfg, live = self._load(name, "shut down")
            if live is None:
                raise DomainStateError("shut down", name, "domain is not running")
            # The simulated guest answers at once, so there is nothing to wait for.
            if not self.guest.on_shutdown_request(name):
                raise ShutdownTimeoutError(
                    "shut down",
                    name,
                    f"the guest is still running after {timeout:g} s",
                    hint="it ignores ACPI power-off; 'destroy' stops it at once",
                )
            self._stop(name, "shut down", "shutdown")

    def destroy(self, name: str) -> None:
        name = self._resolve(name)
        with self.store.locked(name):
            self._stop(name, "destroy", "destroyed")

    def _set_paused(self, name: str, op: str, paused: bool) -> None:
        name = self._resolve(name)
        with self.store.locked(name):
            _cfg, live = self._load(name, op)
            if live is None:
                raise DomainStateError(op, name, "domain is not running")
            if paused:
                self.store.write("paused", name, b"")  # a marker: the simulated vCPUs stop
            else:
                self.store.remove("paused", name)
        log.info("%s %s on %s", "paused" if paused else "resumed", name, self.uri)

    def suspend(self, name: str) -> None:
        self._set_paused(name, "suspend", True)

    def resume(self, name: str) -> None:
        self._set_paused(name, "resume", False)

    # --- changes to one domain ----------------------------------------------------------
    def _targets(self, name: str, op: str, live: bool, config: bool) -> dict[str, sim_xml.Element]:
        """The XML trees ``op`` changes, keyed "live"/"config", after libvirt's checks."""
        cfg_root, live_root = self._load(name, op)
        live, config = _resolve_impact(live, config, live_root is not None)
        if live and live_root is None:
            raise DomainStateError(op, name, "domain is not running")
        if config and cfg_root is None:
            raise DomainStateError(op, name, "transient domains do not have any persistent config")
        out = {}
        if config and cfg_root is not None:
            out["config"] = cfg_root
        if live and live_root is not None:
            out["live"] = live_root
        return out

    def _commit(self, name: str, trees: dict[str, sim_xml.Element]) -> None:
        for kind, root in trees.items():
            self.store.write(kind, name, sim_xml.serialize(root))

    def attach_device(self, name: str, device_xml: bytes, live: bool, config: bool) -> None:
        op = "attach device to"
        name = self._resolve(name)
        with self.store.locked(name):
            trees = self._targets(name, op, live, config)
            dev = sim_xml.parse_device(device_xml, op, name)
            for root in trees.values():
                sim_xml.add_device(root, dev, op)
            if "live" in trees:
                self.guest.on_device_added(name, sim_xml.serialize(dev))
            self._commit(name, trees)
        log.info("attached %s to %s (%s)", sim_xml.describe(dev), name, "+".join(trees))

    def detach_device(self, name: str, device_xml: bytes, live: bool, config: bool) -> None:
        op = "detach device from"
        name = self._resolve(name)
        with self.store.locked(name):
            trees = self._targets(name, op, live, config)
            dev = sim_xml.parse_device(device_xml, op, name)
            removed = {kind: sim_xml.remove_device(root, dev, op) for kind, root in trees.items()}
            if "live" in removed:
                self.guest.on_device_removed(name, sim_xml.serialize(removed["live"]))
            self._commit(name, trees)
        log.info("detached %s from %s (%s)", sim_xml.describe(dev), name, "+".join(trees))

    def get_metadata(self, name: str, uri: str, inactive: bool = False) -> bytes | None:
        name = self._resolve(name)
        with self.store.locked(name):
            cfg, live = self._load(name, "read metadata of")
        return sim_xml.get_metadata(_pick(cfg, live, inactive), uri)

    def set_metadata(
        self, name: str, uri: str, key: str, xml: bytes | None, live: bool, config: bool
    ) -> None:
        op = "set metadata of"
        name = self._resolve(name)
        with self.store.locked(name):
            trees = self._targets(name, op, live, config)
            for root in trees.values():
                sim_xml.set_metadata(root, uri, key, xml, op)
            self._commit(name, trees)

    # --- live migration ------------------------------------------------------------------
    def migrate_live(
        self,
        name: str,
        dst: Hypervisor,
        how: LiveMigration,
        switch_over: SwitchOver | None = None,
    ) -> MigrationStats:
        """Move the running ``name`` to the simulated node ``dst``, as a peer-to-peer live
        migration does. The destination's hooks run first (a failing one cancels the migration:
        the domain still runs here); the switch-over (``switch_over``'s ``switch``, then the
        live XML there and gone here) is the downtime; a ``switch`` that raises cancels it
        (the destination's stop hooks run, the domain still runs here). Then
        ``switch_over``'s ``resumed``, and the source's stop hooks with reason ``migrated``."""
        op = "migrate"
        if not isinstance(dst, SimHypervisor):
            raise UnsupportedOperationError(
                op, name, f"a simulated node migrates only to another one, not to {dst.uri}"
            )
        if dst.store.data_dir == self.store.data_dir:
            raise DomainStateError(op, name, "the destination is this node")
        name = self._resolve(name)
        with self._both_locked(dst, name):
            cfg, live = self._load(name, op)
            if live is None:
                raise DomainStateError(op, name, "domain is not running")
            uuid = sim_xml.uuid_of(live)
            there_cfg = dst.store.read("config", name)
            if dst.store.read("live", name) is not None:
                raise DomainStateError(op, name, f"domain '{name}' is already active on {dst.uri}")
            if (
                there_cfg is not None
                and sim_xml.uuid_of(sim_xml.parse(there_cfg, op, name)) != uuid
            ):
                raise DomainDefinitionError(
                    op, name, f"{dst.uri} has another domain named '{name}' (another uuid)"
                )
            xml = how.dest_xml if how.dest_xml is not None else sim_xml.serialize(live)
            run = dst.hooks.run(name, "migrate", "begin", "-", xml)
            if run.returncode != 0:
                raise HookFailedError(op, name, run.reason())
            incoming = run.stdout.strip() or xml  # an empty answer: the XML as it was
            root = sim_xml.live_copy(sim_xml.parse_domain(incoming), dst.store.next_id())
            if sim_xml.name_of(root) != name or sim_xml.uuid_of(root) != uuid:
                raise HookFailedError(op, name, "the migrate hook changed the name or uuid")
            there = sim_xml.serialize(root)
            for hook_op in ("prepare", "start", "started"):
                run = dst.hooks.run(name, hook_op, "begin", "-", there)
                if run.returncode != 0:
                    dst._stop_hooks(name, there, "failed", after_failed_start=True)
                    raise HookFailedError(op, name, run.reason())
            # Switch-over: the source's vCPUs stop, the rest of the memory goes, the
            # destination's run. The simulated memory copy is the two file writes.
            paused = time.monotonic()
            if switch_over is not None:
                try:
                    switch_over.switch()
                except VmlendError:
                    # QEMU's incoming side is torn down; the source's vCPUs run on
                    dst._stop_hooks(name, there, "failed", after_failed_start=True)
                    raise
            dst.store.write("live", name, there)
            if how.persistent and cfg is not None:
                dst.store.write("config", name, sim_xml.serialize(cfg))
            self.store.remove("live", name)
            self.store.remove("paused", name)
            downtime = time.monotonic() - paused
            if switch_over is not None:
                switch_over.resumed()
            if how.undefine_source:
                self.store.remove("config", name)
            self._stop_hooks(name, sim_xml.serialize(live), "migrated")
        log.info("migrated %s live from %s to %s", name, self.uri, dst.uri)
        return MigrationStats(downtime=downtime)

    @contextlib.contextmanager
    def _both_locked(self, other: SimHypervisor, name: str) -> Iterator[None]:
        """The domain's lock here and on ``other``, always in the same order (by directory),
        so that two migrations in opposite directions cannot deadlock."""
        first, second = sorted((self, other), key=lambda h: str(h.store.data_dir))
        with first.store.locked(name), second.store.locked(name):
            yield

    def host_uuid(self) -> str:
        """Stable per simulated node: derived from where its domains live (another state's
        node of the same name is another host)."""
        where = os.path.abspath(self.store.data_dir)
        return str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"vmlend-sim://{where}"))

    def close(self) -> None:
        """Nothing to release: every operation opens and closes its files."""
