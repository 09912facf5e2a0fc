"""The production hypervisor: libvirt through libvirt-python, errors made one line."""

from __future__ import annotations

import logging
import time
import uuid as uuidlib
from collections.abc import Callable
from typing import TypeVar

import libvirt

from vmlend.errors import (
    DomainDefinitionError,
    DomainOperationError,
    DomainStateError,
    HookFailedError,
    ShutdownTimeoutError,
    UnknownDomainError,
    UnsupportedOperationError,
    VmlendError,
)
from vmlend.hypervisor.base import (
    METADATA_ELEMENT,
    DomainInfo,
    DomainState,
    Hypervisor,
    LiveMigration,
    MigrationStats,
    SwitchOver,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

_UNSUPPORTED = {
    libvirt.VIR_ERR_NO_SUPPORT,
    libvirt.VIR_ERR_CONFIG_UNSUPPORTED,
    libvirt.VIR_ERR_ARGUMENT_UNSUPPORTED,
    libvirt.VIR_ERR_OPERATION_UNSUPPORTED,
}
_BAD_XML = {
    libvirt.VIR_ERR_XML_ERROR,
    libvirt.VIR_ERR_XML_DETAIL,
    libvirt.VIR_ERR_XML_INVALID_SCHEMA,
    libvirt.VIR_ERR_NO_NAME,
}
# On define, libvirt also reports bad input (malformed UUID, name/UUID clash) as these.
_BAD_DEFINITION = _BAD_XML | {
    libvirt.VIR_ERR_INTERNAL_ERROR,
    libvirt.VIR_ERR_OPERATION_FAILED,
    libvirt.VIR_ERR_INVALID_ARG,
}
_STATES = {
    libvirt.VIR_DOMAIN_PAUSED: DomainState.PAUSED,
    libvirt.VIR_DOMAIN_PMSUSPENDED: DomainState.PAUSED,
    libvirt.VIR_DOMAIN_SHUTOFF: DomainState.SHUTOFF,
    libvirt.VIR_DOMAIN_CRASHED: DomainState.SHUTOFF,
}


def one_line(e: libvirt.libvirtError) -> str:
    """libvirt's reason without the multi-line context some parsers add (source + caret)."""
    text = e.get_error_message() or str(e)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0] if lines else "unknown libvirt error"


def map_error(e: libvirt.libvirtError, op: str, domain: str, uri: str) -> VmlendError:
    """The ``VmlendError`` for libvirt's refusal of ``op`` on ``domain``."""
    code = e.get_error_code() or 0
    reason = one_line(e)
    if code == libvirt.VIR_ERR_NO_DOMAIN:
        return UnknownDomainError(domain, uri)
    if code == libvirt.VIR_ERR_HOOK_SCRIPT_FAILED:
        return HookFailedError(op, domain, reason, code)
    if code in _UNSUPPORTED:
        hint = "this libvirt driver cannot do it" if code == libvirt.VIR_ERR_NO_SUPPORT else ""
        return UnsupportedOperationError(op, domain, reason, code, hint)
    if code in (libvirt.VIR_ERR_OPERATION_INVALID, libvirt.VIR_ERR_DEVICE_MISSING):
        return DomainStateError(op, domain, reason, code)
    if code in (_BAD_DEFINITION if op == "define" else _BAD_XML):
        return DomainDefinitionError(op, domain, reason, code)
    return DomainOperationError(op, domain, reason, code)


def _state(code: int) -> DomainState:
    # NOSTATE, RUNNING, BLOCKED and SHUTDOWN ("being shut down") all mean QEMU is there.
    return _STATES.get(code, DomainState.RUNNING)


def _flags(live: bool, config: bool) -> int:
    return (libvirt.VIR_DOMAIN_AFFECT_LIVE if live else 0) | (
        libvirt.VIR_DOMAIN_AFFECT_CONFIG if config else 0
    )


def _decode(xml: bytes, op: str, what: str) -> str:
    try:
        return xml.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DomainDefinitionError(op, what, f"XML is not UTF-8: {e}") from None


def _is_uuid(text: str) -> bool:
    try:
        uuidlib.UUID(text)
    except ValueError:
        return False
    return True


def migrate_flags(how: LiveMigration) -> int:
    """libvirt's ``virDomainMigrateFlags`` for a live, peer-to-peer migration."""
    flags: int = libvirt.VIR_MIGRATE_LIVE | libvirt.VIR_MIGRATE_PEER2PEER
    if how.persistent:
        flags |= libvirt.VIR_MIGRATE_PERSIST_DEST
    if how.undefine_source:
        flags |= libvirt.VIR_MIGRATE_UNDEFINE_SOURCE
    return flags


def migrate_params(how: LiveMigration, name: str) -> dict[str, str]:
    """``migrateToURI3``'s typed parameters: the migration URI and the destination XML."""
    params: dict[str, str] = {}
    if how.migration_uri:
        params[libvirt.VIR_MIGRATE_PARAM_URI] = how.migration_uri
    if how.listen_address:
        params[libvirt.VIR_MIGRATE_PARAM_LISTEN_ADDRESS] = how.listen_address
    if how.dest_xml is not None:
        params[libvirt.VIR_MIGRATE_PARAM_DEST_XML] = _decode(how.dest_xml, "migrate", name)
    return params


def _completed_downtime(dst: Hypervisor, name: str) -> float | None:
    """The downtime libvirt measured for the migration that just completed (the
    destination keeps the completed job's statistics), in seconds; None when it cannot say."""
    if not isinstance(dst, LibvirtHypervisor):
        return None
    try:
        stats = dst.conn.lookupByName(name).jobStats(libvirt.VIR_DOMAIN_JOB_STATS_COMPLETED)
    except libvirt.libvirtError as e:
        log.debug("no completed job statistics for %s on %s: %s", name, dst.uri, one_line(e))
        return None
    downtime = stats.get("downtime")
    return None if downtime is None else float(downtime) / 1000.0


class LibvirtHypervisor:
    """``Hypervisor`` over one open ``libvirt.virConnect`` (owned: ``close`` closes it)."""

    #: libvirt runs no caller's code at a migration's switch-over: a device stays plugged
    #: across it only through its driver's VFIO migration states, which vmlend's mdev lacks.
    hot_migration = False
    #: On q35 libvirt plugs a hot-added mdev only into a free pcie-root-port (or a switch's
    #: downstream port) and adds none to a running guest.
    hotplug_ports = True

    def __init__(
        self,
        conn: libvirt.virConnect,
        *,
        node: str | None = None,
        poll_interval: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._conn: libvirt.virConnect | None = conn
        self.uri: str = conn.getURI()
        self.node = node
        self._poll = poll_interval
        self._clock = clock
        self._sleep = sleep

    # --- helpers -------------------------------------------------------------------------
    @property
    def conn(self) -> libvirt.virConnect:
        if self._conn is None:
            raise DomainOperationError("use", self.uri, "the connection is closed")
        return self._conn

    def _dom(self, name_or_uuid: str, op: str) -> libvirt.virDomain:
        try:
            if _is_uuid(name_or_uuid):
                try:
                    return self.conn.lookupByUUIDString(name_or_uuid)
                except libvirt.libvirtError as e:
                    if e.get_error_code() != libvirt.VIR_ERR_NO_DOMAIN:
                        raise
            return self.conn.lookupByName(name_or_uuid)
        except libvirt.libvirtError as e:
            raise map_error(e, op, name_or_uuid, self.uri) from None

    @staticmethod
    def _info(dom: libvirt.virDomain) -> DomainInfo:
        return DomainInfo(
            name=dom.name(),
            uuid=dom.UUIDString(),
            state=_state(dom.state()[0]),
            persistent=bool(dom.isPersistent()),
        )

    def _call(self, op: str, name: str, fn: Callable[[libvirt.virDomain], T]) -> T:
        dom = self._dom(name, op)
        try:
            return fn(dom)
        except libvirt.libvirtError as e:
            raise map_error(e, op, name, self.uri) from None

    # --- Hypervisor ----------------------------------------------------------------------
    def list_domains(self) -> list[DomainInfo]:
        out = []
        try:
            doms = self.conn.listAllDomains(0)
        except libvirt.libvirtError as e:
            raise map_error(e, "list", "domains", self.uri) from None
        for dom in doms:
            try:
                out.append(self._info(dom))
            except libvirt.libvirtError as e:
                # Gone between listing and asking: not an error for a listing.
                if e.get_error_code() != libvirt.VIR_ERR_NO_DOMAIN:
                    raise map_error(e, "list", dom.name(), self.uri) from None
        return sorted(out, key=lambda d: d.name)

    def lookup(self, name_or_uuid: str) -> DomainInfo:
        return self._call("lookup", name_or_uuid, self._info)

    def define(self, xml: bytes) -> DomainInfo:
        text = _decode(xml, "define", "domain XML")
        try:
            dom = self.conn.defineXML(text)
        except libvirt.libvirtError as e:
            raise map_error(e, "define", "domain XML", self.uri) from None
        info = self._info(dom)
        log.info("defined %s (%s) on %s", info.name, info.uuid, self.uri)
        return info

    def undefine(self, name: str) -> None:
        self._call("undefine", name, lambda d: d.undefine())

    def xml(self, name: str, inactive: bool = False) -> bytes:
        flags = libvirt.VIR_DOMAIN_XML_INACTIVE if inactive else 0
        text: str = self._call("read XML of", name, lambda d: d.XMLDesc(flags))
        return text.encode("utf-8")

    def start(self, name: str) -> None:
        self._call("start", name, lambda d: d.create())

    def shutdown(self, name: str, timeout: float) -> None:
        dom = self._dom(name, "shut down")
        try:
            dom.shutdown()
            deadline = self._clock() + timeout
            while _state(dom.state()[0]) is not DomainState.SHUTOFF:
                if self._clock() >= deadline:
                    raise ShutdownTimeoutError(
                        "shut down",
                        name,
                        f"the guest is still running after {timeout:g} s",
                        hint="it may ignore ACPI power-off; 'destroy' stops it at once",
                    )
                self._sleep(self._poll)
        except libvirt.libvirtError as e:
            if e.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                return  # a transient domain vanishes when it stops
            raise map_error(e, "shut down", name, self.uri) from None

    def destroy(self, name: str) -> None:
        self._call("destroy", name, lambda d: d.destroy())

    def suspend(self, name: str) -> None:
        self._call("suspend", name, lambda d: d.suspend())

    def resume(self, name: str) -> None:
        self._call("resume", name, lambda d: d.resume())

    def attach_device(self, name: str, device_xml: bytes, live: bool, config: bool) -> None:
        op = "attach device to"
        text, flags = _decode(device_xml, op, name), _flags(live, config)
        self._call(op, name, lambda d: d.attachDeviceFlags(text, flags))

    def detach_device(self, name: str, device_xml: bytes, live: bool, config: bool) -> None:
        op = "detach device from"
        text, flags = _decode(device_xml, op, name), _flags(live, config)
        self._call(op, name, lambda d: d.detachDeviceFlags(text, flags))

    def get_metadata(self, name: str, uri: str, inactive: bool = False) -> bytes | None:
        flags = libvirt.VIR_DOMAIN_AFFECT_CONFIG if inactive else 0
        dom = self._dom(name, "read metadata of")
        try:
            text = dom.metadata(METADATA_ELEMENT, uri, flags)
        except libvirt.libvirtError as e:
            if e.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN_METADATA:
                return None
            raise map_error(e, "read metadata of", name, self.uri) from None
        return str(text).encode("utf-8")

    def set_metadata(
        self, name: str, uri: str, key: str, xml: bytes | None, live: bool, config: bool
    ) -> None:
        op = "set metadata of"
        text = None if xml is None else _decode(xml, op, name)
        prefix = None if text is None else key
        flags = _flags(live, config)
        self._call(op, name, lambda d: d.setMetadata(METADATA_ELEMENT, text, prefix, uri, flags))

    def migrate_live(
        self,
        name: str,
        dst: Hypervisor,
        how: LiveMigration,
        switch_over: SwitchOver | None = None,
    ) -> MigrationStats:
        """``migrateToURI3(dst.uri, params, LIVE | PEER2PEER [| PERSIST_DEST]
        [| UNDEFINE_SOURCE])``: the source libvirtd connects to ``dst.uri`` itself; the
        memory goes to ``how.migration_uri`` (``VIR_MIGRATE_PARAM_URI``) when given."""
        op = "migrate"
        if switch_over is not None:
            raise UnsupportedOperationError(
                op,
                name,
                "libvirt calls nothing at the switch-over, so a remote device cannot stay"
                " plugged; move the VM with its devices unplugged",
            )
        flags = migrate_flags(how)
        params = migrate_params(how, name)
        self._call(op, name, lambda d: d.migrateToURI3(dst.uri, params, flags))
        return MigrationStats(downtime=_completed_downtime(dst, name))

    def host_uuid(self) -> str:
        try:
            caps = self.conn.getCapabilities()
        except libvirt.libvirtError as e:
            raise DomainOperationError("identify", self.uri, one_line(e)) from None
        from lxml import etree

        found = etree.fromstring(caps.encode()).findtext("host/uuid")
        if not found:
            try:  # the SMBIOS system UUID, where the driver reports sysinfo
                sysinfo = etree.fromstring(self.conn.getSysinfo(0).encode())
                found = sysinfo.findtext("system/entry[@name='uuid']")
            except (libvirt.libvirtError, etree.XMLSyntaxError):
                found = None
        return (found or "").strip()

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except libvirt.libvirtError as e:  # closing twice or a dead daemon: nothing to do
                log.debug("closing %s: %s", self.uri, one_line(e))
            self._conn = None
