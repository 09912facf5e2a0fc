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
    bus/mdev/devices/<uuid>/smartio/         per child (section 8): dma_windows (rw),
                                             dma_state (r)
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
    LayoutError,
    LenderUnavailableError,
    StaleTokenError,
    SysfsAttributeError,
    UnknownDeviceError,
)
from vmlend.hostenv import HostEnv
from vmlend.kernel import dmafiles
from vmlend.kernel.dmafiles import DmaReport
from vmlend.kernel.mdev import KernelWriter, SysfsWriter
from vmlend.kernel.sysfsattr import is_directory, parse_number, read_number, read_text, read_value
from vmlend.topology.model import BarKind, BarSpec, format_fdid
from vmlend.topology.parse import BDF_RE, MAX_ADDRESS

log = logging.getLogger(__name__)

MODULE = "smartio"
MDEV_TYPE = "smartio-lend"
# Lower-case hex without leading zeros, so one fdid has one name.
_NAME_RE = re.compile(r"^smartio-(0|[1-9a-f][0-9a-f]{0,7})$")
#: Whom a damaged attribute blames, for messages.
CHECK = "the SmartIO driver against docs/smartio-contract.md ('dmesg')"
# The widths the contract's attributes have (PCI ids; node ids and adapter indexes as the
# topology allows them).
FDID_MAX = 0xFFFFFFFF
NODE_ID_MIN, NODE_ID_MAX = 1, 0xFFFF
ADAPTER_MAX = 15
DMA_BITS_MIN, DMA_BITS_MAX = 32, 64


def device_name(fdid: int) -> str:
    """The driver's name for ``fdid``: its class device and, once registered, its mdev parent."""
    return f"smartio-{fdid:x}"


def stale_token(
    smartio: Path, fdid: int, token: int, refused: str, unknown: int = -1
) -> StaleTokenError:
    """The driver refused ``token`` for ``fdid`` (``ESTALE``) in ``refused``: the error,
    naming the device's token now, read from its directory under ``smartio`` (``unknown``
    when the file is gone)."""
    path = smartio / device_name(fdid) / "token"
    current = read_number(path, 0, 1 << 63, "fencing token") if path.exists() else unknown
    return StaleTokenError(fdid, token, current, refused)


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


def parse_bars(text: str, where: Path | str) -> tuple[BarSpec, ...]:
    """``bars``: one line per implemented BAR, ``<index> <size> <mem32|mem64|io> [prefetch]``,
    each as the PCI spec allows it: index 0..5 (a 64-bit BAR also takes the next slot), a size
    that is a power of two, at least 16 bytes for memory and 4 for I/O, at most 2 GiB for a
    32-bit BAR and 2^52 bytes (``MAX_ADDRESS``) for any."""
    bars: list[BarSpec] = []
    used: set[int] = set()
    for n, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words:
            continue

        def bad(problem: str, line: str = line, n: int = n) -> SysfsAttributeError:
            return SysfsAttributeError(where, f"line {n} {line[:60]!r}: {problem}", CHECK)

        if len(words) not in (3, 4) or (len(words) == 4 and words[3] != "prefetch"):
            raise bad("expected '<index> <size> <mem32|mem64|io> [prefetch]'")
        try:
            index = parse_number(Path(where), words[0], 0, 5, "a BAR index", CHECK)
            size = parse_number(Path(where), words[1], 1, MAX_ADDRESS, "a size in bytes", CHECK)
        except SysfsAttributeError as e:
            raise bad(e.problem) from None
        try:
            kind = BarKind(words[2])
        except ValueError:
            raise bad("the kind must be mem32, mem64 or io") from None
        if size & (size - 1):
            raise bad("a BAR size is a power of two")
        if size < (4 if kind is BarKind.IO else 16):
            raise bad("an I/O BAR is at least 4 bytes, a memory BAR at least 16")
        if kind is BarKind.MEM32 and size > 1 << 31:
            raise bad("a 32-bit BAR is at most 2 GiB")
        slots = {index, index + 1} if kind is BarKind.MEM64 else {index}
        if 6 in slots:
            raise bad("a 64-bit BAR at index 5 has no second slot")
        if slots & used:
            raise bad(f"BAR slot {min(slots & used)} is listed twice")
        used |= slots
        bars.append(BarSpec(index=index, size=size, kind=kind, prefetch=len(words) == 4))
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
        return read_number(self.base / "node_id", NODE_ID_MIN, NODE_ID_MAX, "a node id", CHECK)

    def fdids(self) -> list[int]:
        if not self.base.is_dir():
            return []
        return sorted(f for p in self.base.iterdir() if (f := fdid_of(p.name)) is not None)

    def devices(self) -> list[SmartioDevice]:
        """Every device the driver describes soundly; damaged ones are logged and left out
        (``scan`` returns them too)."""
        return self.scan()[0]

    def scan(self) -> tuple[list[SmartioDevice], list[SysfsAttributeError]]:
        """Every device of the fabric, and one error per device whose attributes are damaged:
        one bad device must not hide the others."""
        found, damaged = [], []
        for fdid in self.fdids():
            try:
                found.append(self.device(fdid))
            except UnknownDeviceError:
                log.debug("SmartIO device %s vanished while listing", format_fdid(fdid))
            except SysfsAttributeError as e:
                log.info("SmartIO device %s left out: %s", format_fdid(fdid), e)
                damaged.append(e)
        return found, damaged

    def device(self, fdid: int) -> SmartioDevice:
        d = self.base / device_name(fdid)
        if not is_directory(d, CHECK):
            raise UnknownDeviceError(fdid)
        try:
            return self._read_device(fdid, d)
        except FileNotFoundError as e:
            if not d.is_dir():
                raise UnknownDeviceError(fdid) from None
            raise SysfsAttributeError(
                e.filename,
                f"missing: SmartIO device {format_fdid(fdid)} lacks attribute"
                f" {Path(e.filename).name}",
                CHECK,
            ) from None

    def _read_device(self, fdid: int, d: Path) -> SmartioDevice:
        def number(attr: str, lo: int, hi: int, what: str) -> int:
            return read_number(d / attr, lo, hi, what, CHECK)

        said = number("fdid", 0, FDID_MAX, "an fdid")
        if said != fdid:
            raise SysfsAttributeError(
                d / "fdid", f"says {format_fdid(said)}, but its directory is {d.name}", CHECK
            )
        borrower = number("borrower_node_id", -1, NODE_ID_MAX, "a node id or -1")
        if borrower == 0:
            raise SysfsAttributeError(
                d / "borrower_node_id", "0 is no node id (-1 means no borrower)", CHECK
            )
        physfn_text = read_value(d / "physfn", CHECK)
        physfn = (
            parse_number(d / "physfn", physfn_text, 0, FDID_MAX, "a PF's fdid or nothing", CHECK)
            if physfn_text
            else None
        )
        if physfn == fdid:
            raise SysfsAttributeError(d / "physfn", "a function cannot be its own PF", CHECK)
        availability = read_value(d / "availability", CHECK)
        try:
            avail = Availability(availability)
        except ValueError:
            raise SysfsAttributeError(
                d / "availability",
                f"unknown value {availability[:40]!r} (expected one of"
                f" {', '.join(a.value for a in Availability)})",
                CHECK,
            ) from None
        bdf = read_value(d / "lender_bdf", CHECK)
        if not BDF_RE.fullmatch(bdf):
            raise SysfsAttributeError(
                d / "lender_bdf",
                f"expected a PCI address like 0000:41:00.0, got {bdf[:40]!r}",
                CHECK,
            )
        return SmartioDevice(
            fdid=fdid,
            lender_node_id=number("lender_node_id", NODE_ID_MIN, NODE_ID_MAX, "a node id"),
            lender_adapter=number("lender_adapter", 0, ADAPTER_MAX, "an adapter index"),
            lender_bdf=bdf,
            vendor_id=number("vendor", 0, 0xFFFF, "a 16-bit vendor id"),
            device_id=number("device", 0, 0xFFFF, "a 16-bit device id"),
            class_code=number("class", 0, 0xFFFFFF, "a 24-bit class code"),
            dma_bits=number("dma_bits", DMA_BITS_MIN, DMA_BITS_MAX, "a DMA address width"),
            bars=parse_bars(read_text(d / "bars", CHECK), d / "bars"),
            availability=avail,
            borrower_node_id=None if borrower < 0 else borrower,
            physfn=physfn,
            parent_registered=(self.env.mdev_bus / device_name(fdid)).exists(),
        )

    def msi_capable(self, fdid: int) -> bool:
        """Whether the driver can map ``fdid``'s MSI/MSI-X over the NTB
        (``msi/capable``, docs/smartio-contract.md section 6). A driver without that
        directory predates it: the relay."""
        path = self.base / device_name(fdid) / "msi" / "capable"
        try:
            return read_number(path, 0, 1, "0 or 1", CHECK) == 1
        except FileNotFoundError:
            return False

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

    def take_back(self, fdid: int, token: int) -> None:
        """Take ``fdid`` back from a holder that vanished (docs/smartio-contract.md, "Taking a
        device back"): the driver ends any borrow of it, unmaps its NTB and IOMMU mappings and
        resets it, refusing (``ESTALE``) a token older than the device's."""
        self.require()
        path = self.base / "take_back"
        try:
            self.writer.write(path, f"{format_fdid(fdid)} {token}")
        except OSError as e:
            if e.errno == errno.ESTALE:
                raise StaleTokenError(fdid, token, -1, "a take-back") from None
            raise self._error("take_back", fdid, e.errno or 0) from None
        log.info("smartio take_back %s %d", format_fdid(fdid), token)

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
                raise stale_token(self.base, fdid, token, "a step", unknown=0) from None
            raise self._error("token", fdid, e.errno or 0) from None
        log.info("smartio token %s %d", format_fdid(fdid), token)

    def spend(self, fdid: int, token: int) -> bool:
        """The hold of ``token`` ended (a release): the driver spends the token, served yet or
        not, so a step made for that hold that is still in flight in another process is
        refused when it comes (docs/smartio-contract.md, "The fencing token"). False when
        the driver has no ``spent`` attribute (one older than the contract's §4): the release
        goes on without that protection, with a warning."""
        self.require()
        path = self.base / device_name(fdid) / "spent"
        try:
            self.writer.write(path, str(token))
        except FileNotFoundError:
            if (self.base / device_name(fdid)).is_dir():
                log.warning(
                    "the SmartIO driver has no %s: a step in flight for the released hold of"
                    " %s (token %d) is not refused; update the driver", path, format_fdid(fdid),
                    token,
                )  # fmt: skip
                return False
            raise UnknownDeviceError(fdid) from None
        except OSError as e:
            raise self._error("spend the token of", fdid, e.errno or 0) from None
        log.info("smartio spent %s %d", format_fdid(fdid), token)
        return True

    def spent(self, fdid: int) -> int:
        """The newest token the device spent (0: none, or a driver without ``spent``)."""
        path = self.base / device_name(fdid) / "spent"
        if not path.exists():
            return 0
        return read_number(path, 0, 1 << 63, "spent fencing token")

    # --- the data path of one mdev child (section 8) --------------------------------------------
    def child_group(self, uuid: str) -> Path:
        """The child's ``smartio/`` attribute group (``uuid`` as ``MdevBus`` checked it)."""
        return self.env.mdev_devices / uuid / dmafiles.GROUP

    def write_dma_windows(self, fdid: int, uuid: str, token: int, text: str) -> bool:
        """Write ``dma_windows`` of child ``uuid`` (``text`` from ``dmafiles.format_windows``).
        False, with one warning, for a driver without the child's ``smartio/`` group (one
        older than section 8): the device then maps no window, as before. The driver's
        refusals become the errors section 8 names."""
        group = self.child_group(uuid)
        path = group / dmafiles.WINDOWS_FILE
        try:
            self.writer.write(path, text)
        except FileNotFoundError:
            if not (self.env.mdev_devices / uuid).is_dir():
                raise FabricError(
                    f"mdev {uuid} of device {format_fdid(fdid)} went away before its DMA windows"
                    " were written (its lender may be unreachable); start the VM again"
                ) from None
            log.warning(
                "the SmartIO driver has no %s: device %s maps no DMA window for mdev %s;"
                " update the driver (docs/smartio-contract.md section 8)",
                path, format_fdid(fdid), uuid,
            )  # fmt: skip
            return False
        except OSError as e:
            raise self._windows_error(fdid, uuid, token, path, e.errno or 0) from None
        log.info("smartio dma_windows %s %s token %d", format_fdid(fdid), uuid, token)
        return True

    def _windows_error(self, fdid: int, uuid: str, token: int, path: Path, code: int) -> Exception:
        f = format_fdid(fdid)
        if code == errno.ESTALE:
            return stale_token(self.base, fdid, token, "the DMA windows")
        if code == errno.E2BIG:
            return LayoutError(
                f"device {f} refused the DMA windows of mdev {uuid}: more than"
                f" {dmafiles.MAX_RANGES} ranges; give the guest fewer memory devices"
            )
        if code == errno.ERANGE:
            return FabricError(
                f"device {f} refused the DMA windows of mdev {uuid} (ERANGE): the guest's RAM"
                " ends past the device's DMA reach or needs more segments than its lender"
                " adapter's window has; give the guest less RAM or lend another device"
            )
        if code == errno.EBUSY:
            return FabricError(
                f"device {f} refused new DMA windows for mdev {uuid} (EBUSY): the guest has Bus"
                " Master on and other windows mapped; stop the VM and start it again"
            )
        if code == errno.EINVAL:
            return FabricError(
                f"device {f} refused the DMA windows written to {path} (EINVAL): vmlend wrote"
                " what the driver does not take, or the topology's segment size is not the"
                " lender adapter's; check both ('dmesg')"
            )
        return self._error("write the DMA windows of", fdid, code)

    def dma_report(self, uuid: str) -> DmaReport | None:
        """What the driver says of child ``uuid``'s data path; None when it has no
        ``smartio/`` group (a driver older than section 8, or the child is gone). A damaged
        file is a report with ``damaged`` set, so one child cannot hide the others."""
        group = self.child_group(uuid)
        if not group.is_dir():
            return None
        try:
            written = dmafiles.parse_windows(
                read_text(group / dmafiles.WINDOWS_FILE, dmafiles.CHECK),
                group / dmafiles.WINDOWS_FILE,
            )
            state = dmafiles.parse_state(
                read_text(group / dmafiles.STATE_FILE, dmafiles.CHECK), group / dmafiles.STATE_FILE
            )
        except FileNotFoundError as e:
            if not group.is_dir():
                return None
            return DmaReport(damaged=f"{e.filename}: missing ({dmafiles.CHECK})")
        except SysfsAttributeError as e:
            return DmaReport(damaged=str(e))
        return DmaReport(written, state)

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
