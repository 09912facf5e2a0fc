"""The SmartIO driver's sysfs contract, as docs/smartio-contract.md specifies it.

This module only reads and writes that contract (under ``HostEnv.sys``) and turns the
driver's errnos into vmlend errors; deciding who may hold what is the backend's job.

    class/smartio/node_id                    this host's fabric node id (read)
    class/smartio/{lend,unlend}              write an fdid: offer / withdraw a local device
    class/smartio/{borrow,unborrow}          write an fdid: register / unregister its mdev parent
    class/smartio/smartio-<fdid hex>/        one per device of the fabric, with attributes
        fdid lender_node_id lender_adapter lender_bdf vendor device class dma_bits physfn
        bars availability borrower_node_id
    class/mdev_bus/smartio-<fdid hex>        appears once registered; its only type is
                                             ``smartio-lend``
"""

from __future__ import annotations

import enum
import errno
import logging
import re
from pathlib import Path

import msgspec

from vmlend.errors import (
    DeviceNotLentError,
    FabricError,
    HostError,
    LenderUnavailableError,
    StaleTokenError,
    UnknownDeviceError,
)
from vmlend.fabric.model import BarKind, BarSpec, format_fdid
from vmlend.hostenv import HostEnv
from vmlend.mdev import KernelWriter, SysfsWriter

log = logging.getLogger(__name__)

MODULE = "smartio"
MDEV_TYPE = "smartio-lend"
_NAME_RE = re.compile(r"^smartio-([0-9a-f]{1,8})$")


def device_name(fdid: int) -> str:
    """The driver's name for ``fdid``: its class device and, once registered, its mdev parent."""
    return f"smartio-{fdid:x}"


def fdid_of(name: str) -> int | None:
    """The fdid a SmartIO device / mdev parent name stands for; None for any other name."""
    m = _NAME_RE.match(name)
    return int(m.group(1), 16) if m else None


class Availability(enum.StrEnum):
    AVAILABLE = "available"  # lent by its lender, lender reachable
    UNLENT = "unlent"  # known, not offered
    UNREACHABLE = "unreachable"  # the lender (or the NTB path to it) is down


class SmartioDevice(msgspec.Struct, frozen=True):
    """One device as the driver describes it."""

    fdid: int
    lender_node_id: int
    lender_adapter: int
    lender_bdf: str
    vendor_id: int
    device_id: int
    class_code: int
    dma_bits: int
    bars: tuple[BarSpec, ...]
    availability: Availability
    borrower_node_id: int | None  # who has the hardware borrow now
    physfn: int | None  # the PF's fdid when this is an SR-IOV VF
    parent_registered: bool  # its mdev parent exists on this host

    @property
    def kind(self) -> str:
        if self.physfn is not None:
            return "vf"
        return _KINDS.get(self.class_code >> 8, _KINDS.get(self.class_code >> 16, "pci"))


# class code (base<<8 | sub, or base) -> the words the topology uses
_KINDS = {0x0108: "nvme", 0x03: "gpu", 0x12: "accel", 0x02: "nic"}


def parse_bars(text: str, where: str) -> tuple[BarSpec, ...]:
    """``bars``: one line per implemented BAR, ``<index> <size> <mem32|mem64|io> [prefetch]``."""
    bars = []
    for n, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words:
            continue
        try:
            if len(words) not in (3, 4) or (len(words) == 4 and words[3] != "prefetch"):
                raise ValueError
            bars.append(
                BarSpec(
                    index=int(words[0], 0),
                    size=int(words[1], 0),
                    kind=BarKind(words[2]),
                    prefetch=len(words) == 4,
                )
            )
        except ValueError:
            raise HostError(
                f"{where} line {n}: cannot read BAR {line!r} (expected '<index> <size>"
                " <mem32|mem64|io> [prefetch]'); the SmartIO driver does not match"
                " docs/smartio-contract.md"
            ) from None
    return tuple(bars)


class SmartioDriver:
    """This host's view of the SmartIO driver."""

    def __init__(self, env: HostEnv, writer: SysfsWriter | None = None) -> None:
        self.env = env
        self.writer: SysfsWriter = writer or KernelWriter()

    @property
    def base(self) -> Path:
        return self.env.smartio

    def loaded(self) -> bool:
        return (self.base / "node_id").is_file()

    def require(self) -> None:
        if not self.loaded():
            raise HostError(
                f"the SmartIO driver is not loaded ({self.base / 'node_id'} is missing):"
                f" 'modprobe {MODULE}', or use the simulated fabric"
            )

    def node_id(self) -> int:
        self.require()
        return self._int(self.base / "node_id")

    def fdids(self) -> list[int]:
        if not self.base.is_dir():
            return []
        return sorted(f for p in self.base.iterdir() if (f := fdid_of(p.name)) is not None)

    def devices(self) -> list[SmartioDevice]:
        found = []
        for fdid in self.fdids():
            try:
                found.append(self.device(fdid))
            except UnknownDeviceError:
                log.debug("SmartIO device %s vanished while listing", format_fdid(fdid))
        return found

    def device(self, fdid: int) -> SmartioDevice:
        d = self.base / device_name(fdid)
        if not d.is_dir():
            raise UnknownDeviceError(fdid)
        try:
            borrower = self._int(d / "borrower_node_id")
            physfn = (d / "physfn").read_text().strip()
            availability = (d / "availability").read_text().strip()
            try:
                avail = Availability(availability)
            except ValueError:
                raise HostError(
                    f"{d / 'availability'}: unknown value {availability!r} (expected one of"
                    f" {', '.join(a.value for a in Availability)})"
                ) from None
            return SmartioDevice(
                fdid=self._int(d / "fdid"),
                lender_node_id=self._int(d / "lender_node_id"),
                lender_adapter=self._int(d / "lender_adapter"),
                lender_bdf=(d / "lender_bdf").read_text().strip(),
                vendor_id=self._int(d / "vendor"),
                device_id=self._int(d / "device"),
                class_code=self._int(d / "class"),
                dma_bits=self._int(d / "dma_bits"),
                bars=parse_bars((d / "bars").read_text(), str(d / "bars")),
                availability=avail,
                borrower_node_id=None if borrower < 0 else borrower,
                physfn=int(physfn, 0) if physfn else None,
                parent_registered=(self.env.mdev_bus / device_name(fdid)).exists(),
            )
        except FileNotFoundError as e:
            if not d.is_dir():
                raise UnknownDeviceError(fdid) from None
            raise HostError(
                f"SmartIO device {format_fdid(fdid)} lacks attribute {Path(e.filename).name};"
                " the driver does not match docs/smartio-contract.md"
            ) from None

    def msi_capable(self, fdid: int) -> bool:
        """Whether the driver can map ``fdid``'s MSI/MSI-X over the NTB
        (``msi/capable``, docs/smartio-contract.md section 6). A driver without that
        directory predates it: the relay."""
        path = self.base / device_name(fdid) / "msi" / "capable"
        try:
            return self._int(path) == 1
        except FileNotFoundError:
            return False

    @staticmethod
    def _int(path: Path) -> int:
        text = path.read_text().strip()
        try:
            return int(text, 0)
        except ValueError:
            raise HostError(f"{path}: expected a number, got {text!r}") from None

    # --- asking the driver to act ---------------------------------------------------------------
    def lend(self, fdid: int) -> None:
        self._command("lend", fdid)

    def unlend(self, fdid: int) -> None:
        self._command("unlend", fdid)

    def register_parent(self, fdid: int) -> str:
        """Ask for ``fdid``'s mdev parent on this host; returns the parent's name."""
        self._command("borrow", fdid)
        return device_name(fdid)

    def unregister_parent(self, fdid: int) -> None:
        self._command("unborrow", fdid)

    def _command(self, attr: str, fdid: int) -> None:
        self.require()
        try:
            self.writer.write(self.base / attr, format_fdid(fdid))
        except OSError as e:
            raise self._error(attr, fdid, e.errno or 0) from None
        log.info("smartio %s %s", attr, format_fdid(fdid))

    def set_token(self, fdid: int, token: int) -> None:
        """Give the device the fencing token of the hold the next step is made for
        (docs/smartio-contract.md, "The fencing token"): the driver keeps the largest and
        refuses an older one with ``ESTALE`` (``StaleTokenError``)."""
        self.require()
        path = self.base / device_name(fdid) / "token"
        try:
            self.writer.write(path, str(token))
        except OSError as e:
            if e.errno == errno.ESTALE:
                current = self._int(path) if path.exists() else 0
                raise StaleTokenError(fdid, token, current, "a step") from None
            raise self._error("token", fdid, e.errno or 0) from None
        log.info("smartio token %s %d", format_fdid(fdid), token)

    def _error(self, attr: str, fdid: int, code: int) -> Exception:
        f = format_fdid(fdid)
        if code == errno.ENODEV:
            return UnknownDeviceError(fdid)
        lender = self._lender_label(fdid)
        if code == errno.EPERM:
            return DeviceNotLentError(fdid, lender)
        if code == errno.EHOSTUNREACH:
            return LenderUnavailableError(fdid, lender)
        if code == errno.EREMOTE:
            return FabricError(
                f"device {f} is installed in {lender}, not here: run 'vmlend {attr}' there"
            )
        if code == errno.EBUSY:
            what = "it has mdev children" if attr == "unborrow" else "it is borrowed"
            return FabricError(f"SmartIO refused to {attr} device {f}: {what}; release it first")
        if code == errno.ENOSPC:
            return FabricError(
                f"SmartIO cannot {attr} device {f}: the NTB adapter has no free LUT entry or"
                " window space; return another device first"
            )
        return FabricError(
            f"SmartIO refused to {attr} device {f}: {errno.errorcode.get(code, code)} (see 'dmesg')"
        )

    def _lender_label(self, fdid: int) -> str:
        try:
            return f"node {self.device(fdid).lender_node_id}"
        except (UnknownDeviceError, HostError):
            return "its lender"
