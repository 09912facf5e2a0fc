"""Reading and writing a child's peer-to-peer files (docs/smartio-contract.md section 8), and
turning the driver's refusals of a ``p2p`` write into the errors that section names.

The text is ``vmlend.kernel.p2pfiles``'s; deciding what to write is ``vmlend.kernel.p2psync``'s.
"""

from __future__ import annotations

import enum
import errno
import logging
from collections.abc import Sequence
from pathlib import Path

import msgspec

from vmlend.errors import (
    BarConflictError,
    FabricError,
    P2PError,
    ResourceExhaustedError,
    SysfsAttributeError,
    UnknownDeviceError,
)
from vmlend.hostenv import HostEnv
from vmlend.kernel import dmafiles, p2pfiles
from vmlend.kernel.driver import device_name, stale_token
from vmlend.kernel.mdev import KernelWriter, SysfsWriter
from vmlend.kernel.p2pfiles import MapState, P2PLine, P2PReport
from vmlend.kernel.sysfsattr import read_text
from vmlend.p2p import GuestBar
from vmlend.topology.model import GuestRange, format_fdid

log = logging.getLogger(__name__)


class Written(enum.StrEnum):
    WRITTEN = "written"
    #: ``ENOTCONN`` / ``EAGAIN``: not now; the next ``SMARTIO_BARS`` says when to try again.
    WAIT = "wait"
    #: The child has no ``smartio/`` group (a driver from before section 8).
    NO_GROUP = "no-group"


class WriteResult(msgspec.Struct, frozen=True):
    outcome: Written
    detail: str = ""


def first_overlap(
    lines: Sequence[P2PLine], windows: Sequence[GuestRange]
) -> tuple[P2PLine, str] | None:
    """The first line overlapping a DMA window or another line, with what it overlaps (pure:
    names the culprit of an ``EEXIST``)."""
    for i, ln in enumerate(lines):
        for r in windows:
            if ln.gpa < r.end and r.start < ln.gpa + ln.size:
                return ln, f"the DMA window range {r.start:#x}-{r.end:#x}"
        for other in lines[i + 1 :]:
            if ln.gpa < other.gpa + other.size and other.gpa < ln.gpa + ln.size:
                return ln, f"the map to {other.describe()}"
    return None


class P2PFiles:
    """The three files of each child under ``env``; ``writer`` writes (tests pass a fake)."""

    def __init__(self, env: HostEnv, writer: SysfsWriter | None = None) -> None:
        self.env = env
        self.writer = writer or KernelWriter()

    def group(self, uuid: str) -> Path:
        return self.env.mdev_devices / uuid / dmafiles.GROUP

    def _read(self, uuid: str, name: str) -> str:
        return read_text(self.group(uuid) / name, dmafiles.CHECK)

    def guest_bars(self, uuid: str, fdid: int) -> tuple[GuestBar, ...] | None:
        """Where the guest decodes child ``uuid``'s BARs; None without the file (a driver
        from before section 8, or the child went away)."""
        try:
            text = self._read(uuid, p2pfiles.GUEST_BARS_FILE)
        except FileNotFoundError:
            return None
        return p2pfiles.parse_guest_bars(text, fdid, self.group(uuid) / p2pfiles.GUEST_BARS_FILE)

    def state(self, uuid: str) -> tuple[MapState, ...] | None:
        """``p2p_state`` of child ``uuid``; None without the file."""
        try:
            text = self._read(uuid, p2pfiles.P2P_STATE_FILE)
        except FileNotFoundError:
            return None
        return p2pfiles.parse_p2p_state(text, self.group(uuid) / p2pfiles.P2P_STATE_FILE)

    def report(self, uuid: str, fdid: int) -> P2PReport | None:
        """All three files of child ``uuid``; None without a ``guest_bars`` (no section 8
        peer-to-peer in this driver). A damaged file is a report with ``damaged`` set."""
        group = self.group(uuid)
        try:
            bars = self.guest_bars(uuid, fdid)
            if bars is None:
                return None
            written = p2pfiles.parse_p2p(
                self._read(uuid, p2pfiles.P2P_FILE), group / p2pfiles.P2P_FILE
            )
            state = p2pfiles.parse_p2p_state(
                self._read(uuid, p2pfiles.P2P_STATE_FILE), group / p2pfiles.P2P_STATE_FILE
            )
        except FileNotFoundError as e:
            if not group.is_dir():
                return None
            return P2PReport(damaged=f"{e.filename}: missing ({dmafiles.CHECK})")
        except SysfsAttributeError as e:
            return P2PReport(damaged=str(e))
        return P2PReport(bars, written, state)

    def write(
        self,
        fdid: int,
        uuid: str,
        token: int,
        lines: Sequence[P2PLine],
        windows: Sequence[GuestRange] = (),
    ) -> WriteResult:
        """Write source ``fdid``'s child ``uuid``'s ``p2p``: ``token`` and ``lines``.
        ``windows``: the child's DMA-window ranges, to name the culprit of an overlap."""
        path = self.group(uuid) / p2pfiles.P2P_FILE
        text = p2pfiles.format_p2p(token, lines)
        try:
            self.writer.write(path, text)
        except FileNotFoundError:
            if not (self.env.mdev_devices / uuid).is_dir():
                raise FabricError(
                    f"mdev {uuid} of device {format_fdid(fdid)} went away before its"
                    " peer-to-peer maps were written (its lender may be unreachable)"
                ) from None
            return WriteResult(Written.NO_GROUP, f"the SmartIO driver has no {path}")
        except OSError as e:
            code = e.errno or 0
            if code in (errno.ENOTCONN, errno.EAGAIN):
                why = (
                    "a device is not borrowed now"
                    if code == errno.ENOTCONN
                    else "the guest moved a BAR or turned decoding off"
                )
                log.info(
                    "smartio p2p %s %s: %s (%s); waiting for the next SMARTIO_BARS",
                    format_fdid(fdid), uuid, why, errno.errorcode[code],
                )  # fmt: skip
                return WriteResult(Written.WAIT, why)
            raise self._error(fdid, uuid, token, path, code, lines, windows) from None
        log.info("smartio p2p %s %s token %d: %d map(s)", format_fdid(fdid), uuid, token,
                 len(lines))  # fmt: skip
        return WriteResult(Written.WRITTEN)

    def _error(
        self,
        fdid: int,
        uuid: str,
        token: int,
        path: Path,
        code: int,
        lines: Sequence[P2PLine],
        windows: Sequence[GuestRange],
    ) -> Exception:
        f = format_fdid(fdid)
        if code == errno.ESTALE:
            return stale_token(self.env.smartio, fdid, token, "the peer-to-peer maps")
        if code == errno.E2BIG:
            return P2PError(
                f"device {f} refused the peer-to-peer maps of mdev {uuid}: more than"
                f" {p2pfiles.MAX_MAPS}; give the VM fewer devices"
            )
        if code == errno.ERANGE:
            return P2PError(
                f"device {f} refused the peer-to-peer maps of mdev {uuid} (ERANGE): a peer's BAR"
                " lies past the device's DMA reach; the guest must place its BARs lower"
            )
        if code == errno.ENOSPC:
            return ResourceExhaustedError(
                "free NTB segments or requester LUT entries for peer-to-peer",
                f"the lender adapter of device {f}",
                1,
                0,
            )
        if code == errno.EEXIST:
            hit = first_overlap(lines, windows)
            if hit is not None:
                ln, other = hit
                return BarConflictError(ln.target, ln.bar, ln.gpa, ln.size, other)
            return P2PError(
                f"device {f} refused the peer-to-peer maps of mdev {uuid} (EEXIST): a BAR"
                " overlaps its DMA windows or another BAR; check the guest's PCI resources"
            )
        if code == errno.ENODEV:
            gone = next(
                (
                    ln.target
                    for ln in lines
                    if not (self.env.smartio / device_name(ln.target)).exists()
                ),
                None,
            )
            if gone is not None:
                return UnknownDeviceError(gone)
        if code == errno.EXDEV:
            return P2PError(
                f"device {f} refused the peer-to-peer maps of mdev {uuid} (EXDEV): a target is"
                " not a device of this VM (no child of it in the VM's VFIO container); run"
                " 'vmlend reconcile'"
            )
        if code == errno.EINVAL:
            return FabricError(
                f"device {f} refused the peer-to-peer maps written to {path} (EINVAL): vmlend"
                " wrote what the driver does not take, or the topology's BARs are not the"
                " device's; check both ('dmesg')"
            )
        return FabricError(
            f"SmartIO refused the peer-to-peer maps of device {f} (mdev {uuid}):"
            f" {errno.errorcode.get(code, code)} (see 'dmesg')"
        )
