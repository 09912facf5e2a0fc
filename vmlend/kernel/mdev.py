"""The Linux mediated-device (mdev) sysfs ABI, for any parent driver.

As the kernel documents it (Documentation/driver-api/vfio-mediated-device.rst):

- ``class/mdev_bus/<parent>`` links to every device registered as an mdev parent;
- ``<parent>/mdev_supported_types/<type-id>/`` holds ``name`` (optional), ``description``
  (optional), ``device_api``, ``available_instances``, ``devices/`` and the write-only
  ``create``;
- writing a UUID to ``create`` makes ``bus/mdev/devices/<uuid>`` (links ``mdev_type`` and
  ``iommu_group``); writing ``1`` to its ``remove`` destroys it.

Reads go to the files directly. Writes go through an injected ``SysfsWriter`` so that tests can
put the kernel's semantics behind the same call (``tests/support/fake_sysfs.py``); the real one
is one ``write(2)`` per attribute, because that is what a sysfs ``store`` handler sees. Kernel
errnos become ``MdevError`` subclasses that name the parent and type.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from pathlib import Path
from typing import Protocol

import msgspec

from vmlend.errors import (
    MdevBadNameError,
    MdevBadUuidError,
    MdevBusyError,
    MdevError,
    MdevKernelError,
    MdevNoInstancesError,
    MdevParentGoneError,
    MdevParentNotFoundError,
    MdevTypeNotFoundError,
    MdevUuidInUseError,
    SysfsAttributeError,
    VmlendError,
)
from vmlend.hostenv import HostEnv
from vmlend.kernel.sysfsattr import is_directory, parse_number, read_text, read_value

log = logging.getLogger(__name__)

_UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$", re.I)

#: errnos with which the mdev core or a vendor driver says "no instances left": the core
#: returns EUSERS when its count is exhausted, drivers that count themselves (mtty) ENOSPC.
_NO_INSTANCES = {errno.EUSERS, errno.ENOSPC, errno.EDQUOT}
#: errnos meaning the parent went away under us (directory gone, or device unregistering).
_GONE = {errno.ENOENT, errno.ENODEV, errno.ENXIO}


#: NAME_MAX: the longest name a sysfs directory entry can have.
_NAME_MAX = 255


def sysfs_name(kind: str, name: object) -> str:
    """``name`` when the kernel could have given it to an mdev parent or type directory, else
    ``MdevBadNameError``. The kernel's rules for a kobject name: not empty, no ``/``, not ``.``
    or ``..``, at most NAME_MAX bytes. vmlend also wants printable ASCII without spaces, which
    every mdev driver uses (``nvidia-63``, ``i915-GVTg_V5_4``, ``smartio-lend``, PCI
    addresses): a name from the registry is data, and data must not steer root's writes."""
    if not isinstance(name, str):
        raise MdevBadNameError(kind, repr(name), f"a {type(name).__name__}, not a name")
    if not name or name in (".", "..") or "/" in name:
        raise MdevBadNameError(kind, name, "not a directory name (empty, '.', '..' or a '/')")
    if len(name.encode()) > _NAME_MAX:
        raise MdevBadNameError(kind, name[:40] + "...", f"longer than {_NAME_MAX} bytes")
    if not (name.isascii() and name.isprintable()) or any(c.isspace() for c in name):
        raise MdevBadNameError(kind, name, "not printable ASCII without spaces")
    return name


def normalize_uuid(text: str) -> str:
    """The kernel's canonical spelling (lower case); ``MdevBadUuidError`` for anything else.

    Checked before any path is built from it, so a hostile string cannot walk the tree."""
    value = str(text).strip()
    if not _UUID_RE.match(value):
        raise MdevBadUuidError(value)
    return value.lower()


class SysfsWriter(Protocol):
    """Writes one value to one sysfs attribute; raises ``OSError`` carrying the kernel's errno."""

    def write(self, path: Path, text: str) -> None: ...


class KernelWriter:
    """The real writer: one unbuffered ``write(2)``, as a sysfs ``store`` handler expects."""

    def write(self, path: Path, text: str) -> None:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)


class MdevType(msgspec.Struct, frozen=True):
    parent: str
    type_id: str
    name: str
    description: str
    device_api: str
    available_instances: int
    devices: tuple[str, ...] = ()


class MdevParent(msgspec.Struct, frozen=True):
    name: str
    types: tuple[MdevType, ...]

    def type(self, type_id: str) -> MdevType:
        for t in self.types:
            if t.type_id == type_id:
                return t
        raise MdevTypeNotFoundError(self.name, type_id, tuple(t.type_id for t in self.types))


class MdevDevice(msgspec.Struct, frozen=True):
    uuid: str
    parent: str
    type_id: str
    iommu_group: int | None = None


#: Whom a damaged mdev attribute blames, for messages.
CHECK = "the parent's driver ('dmesg')"
#: ``available_instances`` is the kernel's ``%d`` of a non-negative count.
_INSTANCES_MAX = 0x7FFFFFFF


def _read(path: Path, default: str | None = None, lines: bool = False) -> str:
    try:
        return read_text(path, CHECK).strip() if lines else read_value(path, CHECK)
    except FileNotFoundError:
        if default is not None:
            return default
        if path.parent.is_dir():  # still there: a required attribute is missing, not gone
            raise SysfsAttributeError(path, "missing: the mdev ABI requires it", CHECK) from None
        raise


def _resolve(link: Path) -> Path | None:
    """Where the kernel's link ``link`` leads; None when it does not exist (the device went
    away), ``SysfsAttributeError`` for a loop."""
    try:
        return link.resolve(strict=True)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, RuntimeError):
        # Python 3.11 reports a link loop as RuntimeError, later versions as OSError (ELOOP).
        raise SysfsAttributeError(link, "a symbolic link loop", CHECK) from None


class MdevBus:
    """The mdev parents and children of one host (``env``)."""

    def __init__(self, env: HostEnv, writer: SysfsWriter | None = None) -> None:
        self.env = env
        self.writer: SysfsWriter = writer or KernelWriter()
        #: What the last ``parents()`` or ``devices()`` left out because sysfs was damaged.
        self.unreadable: list[VmlendError] = []

    # --- reading -------------------------------------------------------------------------------
    def parent_names(self) -> list[str]:
        base = self.env.mdev_bus
        if not base.is_dir():
            return []
        return sorted(p.name for p in base.iterdir())

    def parents(self) -> list[MdevParent]:
        """Every registered parent; one that vanishes while being read is left out, and so is
        one whose attributes are damaged (kept in ``unreadable``): it must not hide the rest."""
        found = []
        self.unreadable = []
        for name in self.parent_names():
            try:
                found.append(self.parent(name))
            except (MdevParentNotFoundError, FileNotFoundError):
                log.debug("mdev parent %s vanished while listing", name)
            except SysfsAttributeError as e:
                log.info("mdev parent %s left out: %s", name, e)
                self.unreadable.append(e)
        return found

    def parent(self, name: str) -> MdevParent:
        types_dir = self._parent_dir(name) / "mdev_supported_types"
        if not is_directory(types_dir, CHECK):
            raise MdevParentNotFoundError(name)
        types = tuple(self._read_type(name, d) for d in sorted(types_dir.iterdir()))
        return MdevParent(name=name, types=types)

    def _parent_dir(self, name: str) -> Path:
        if not name or "/" in name or name in (".", ".."):
            raise MdevParentNotFoundError(name)
        return self.env.mdev_bus / name

    def _inside_sys(self, path: Path, kind: str, name: str) -> Path:
        """``path`` when, with every link resolved, it stays under this host's sysfs root (a
        parent link pointing elsewhere would take root's write there)."""
        if not path.resolve().is_relative_to(self.env.sys.resolve()):
            raise MdevBadNameError(kind, name, f"{path} leads outside {self.env.sys}")
        return path

    def _read_type(self, parent: str, d: Path) -> MdevType:
        devices_dir = d / "devices"
        devices = (
            tuple(sorted(p.name for p in devices_dir.iterdir())) if devices_dir.is_dir() else ()
        )
        path = d / "available_instances"
        available = parse_number(path, _read(path), 0, _INSTANCES_MAX, "a count", CHECK)
        return MdevType(
            parent=parent,
            type_id=d.name,
            name=_read(d / "name", d.name),
            description=_read(d / "description", "", lines=True),
            device_api=_read(d / "device_api", ""),
            available_instances=available,
            devices=devices,
        )

    def find_type(self, type_id: str) -> list[MdevType]:
        """Every parent's ``type_id``, e.g. all SmartIO parents' ``smartio-lend``."""
        found: list[MdevType] = []
        for p in self.parents():
            found.extend(t for t in p.types if t.type_id == type_id)
        return found

    def devices(self) -> list[MdevDevice]:
        base = self.env.mdev_devices
        if not base.is_dir():
            return []
        found = []
        self.unreadable = []
        for link in sorted(base.iterdir()):
            try:
                dev = self.device(link.name)
            except (MdevBadUuidError, SysfsAttributeError) as e:
                log.info("mdev device %s left out: %s", link.name, e)
                self.unreadable.append(e)
                continue
            if dev is not None:
                found.append(dev)
        return found

    def device(self, uuid: str) -> MdevDevice | None:
        """The child ``uuid``, or None when it does not exist."""
        u = normalize_uuid(uuid)
        link = self.env.mdev_devices / u
        type_dir = _resolve(link / "mdev_type")  # -> <parent>/mdev_supported_types/<type-id>
        if type_dir is None:
            return None
        group_dir = _resolve(link / "iommu_group")
        group = None
        if group_dir is not None and group_dir.name.isascii() and group_dir.name.isdigit():
            group = int(group_dir.name)
        return MdevDevice(
            uuid=u, parent=type_dir.parent.parent.name, type_id=type_dir.name, iommu_group=group
        )

    # --- changing ------------------------------------------------------------------------------
    def create(self, parent: str, type_id: str, uuid: str) -> MdevDevice:
        """Create child ``uuid`` of ``parent``/``type_id``. Idempotent when it exists already
        with the same parent and type; ``MdevUuidInUseError`` when it exists elsewhere."""
        u = normalize_uuid(uuid)
        sysfs_name("parent", parent)
        sysfs_name("type", type_id)
        existing = self.device(u)
        if existing is not None:
            return self._same_or_raise(existing, parent, type_id)
        type_dir = self._parent_dir(parent) / "mdev_supported_types" / type_id
        self._inside_sys(type_dir, "type", type_id)
        if not type_dir.is_dir():
            # Tell "no such parent" from "no such type" for the message.
            self.parent(parent).type(type_id)
            raise MdevParentGoneError(parent, type_id)
        try:
            self.writer.write(self._inside_sys(type_dir / "create", "type", type_id), u)
        except OSError as e:
            if e.errno == errno.EEXIST:
                # Lost a race with another creator of the same UUID: judge what is there now.
                raced = self.device(u)
                if raced is not None:
                    return self._same_or_raise(raced, parent, type_id)
            raise self._create_error(e, u, parent, type_id) from None
        created = self.device(u)
        if created is None:
            raise MdevKernelError(
                "create", parent, type_id, 0, f"the kernel accepted {u} but no device appeared"
            )
        log.info("created mdev %s on %s/%s", u, parent, type_id)
        return created

    @staticmethod
    def _same_or_raise(dev: MdevDevice, parent: str, type_id: str) -> MdevDevice:
        if dev.parent == parent and dev.type_id == type_id:
            log.debug("mdev %s already exists on %s/%s", dev.uuid, parent, type_id)
            return dev
        raise MdevUuidInUseError(dev.uuid, parent, type_id, dev.parent, dev.type_id)

    @staticmethod
    def _create_error(e: OSError, uuid: str, parent: str, type_id: str) -> MdevError:
        code = e.errno or 0
        if code == errno.EINVAL:
            return MdevBadUuidError(uuid, parent, type_id)
        if code in _NO_INSTANCES:
            return MdevNoInstancesError(parent, type_id)
        if code in _GONE:
            return MdevParentGoneError(parent, type_id)
        if code == errno.EEXIST:
            return MdevKernelError(
                "create", parent, type_id, code, f"{uuid} exists but could not be read back"
            )
        reason = f"{os.strerror(code)} ({errno.errorcode.get(code, code)})"
        return MdevKernelError("create", parent, type_id, code, reason)

    def remove(self, uuid: str) -> bool:
        """Remove child ``uuid``. Returns False when it did not exist (or vanished meanwhile)."""
        u = normalize_uuid(uuid)
        dev = self.device(u)
        if dev is None:
            return False
        try:
            remove = self._inside_sys(self.env.mdev_devices / u / "remove", "device", u)
            self.writer.write(remove, "1")
        except OSError as e:
            code = e.errno or 0
            if code in _GONE:
                return False
            if code == errno.EBUSY:
                raise MdevBusyError(u, dev.parent, dev.type_id) from None
            reason = f"{os.strerror(code)} ({errno.errorcode.get(code, code)})"
            raise MdevKernelError(f"remove {u}", dev.parent, dev.type_id, code, reason) from None
        log.info("removed mdev %s from %s/%s", u, dev.parent, dev.type_id)
        return True
