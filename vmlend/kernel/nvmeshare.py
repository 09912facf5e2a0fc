"""What the SmartIO driver says about queue-level sharing of an NVMe drive, and the share
children's files (docs/smartio-contract.md section 7).

``smartio-<fdid>/nvme_share`` is one line: ``supported <queue_pairs> <vectors> <dstrd>`` when
the lender's driver can run the manager for that controller (and the controller has the guard
and per-queue DMA tagging), ``unsupported <reason>`` when it cannot. A driver without the
attribute predates sharing: the drive can only be lent whole.

A share child (type ``smartio-nvme_share``) has ``smartio/nvme_share``, which vmlend writes
(the text from ``vmlend.kernel.sharefiles``), and ``smartio/nvme_share_state``, which the
driver fills; the device's ``nvme_shares`` lists what its manager runs.
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import msgspec

from vmlend.errors import (
    FabricError,
    NvmeShareError,
    SharingUnsupportedError,
    StaleTokenError,
    SysfsAttributeError,
)
from vmlend.kernel import sharefiles
from vmlend.kernel.driver import CHECK, SmartioDriver, device_name
from vmlend.kernel.sysfsattr import read_text
from vmlend.topology.model import format_fdid

log = logging.getLogger(__name__)


class ShareSupport(msgspec.Struct, frozen=True):
    fdid: int
    supported: bool
    why: str = ""  # when not supported
    queue_pairs: int = 0
    vectors: int = 0
    dstrd: int = 0


def share_support(driver: SmartioDriver, fdid: int) -> ShareSupport:
    path = driver.base / device_name(fdid) / "nvme_share"
    try:
        words = read_text(path, CHECK).split()
    except FileNotFoundError:
        return ShareSupport(
            fdid, False, "the SmartIO driver offers no queue-level sharing (no nvme_share)"
        )
    except SysfsAttributeError as e:
        return ShareSupport(fdid, False, f"unreadable nvme_share: {e.problem}")
    if words[:1] == ["supported"] and len(words) == 4:
        try:
            pairs, vectors, dstrd = (int(w, 0) for w in words[1:])
        except ValueError:
            pass
        else:
            return ShareSupport(fdid, True, "", pairs, vectors, dstrd)
    if words[:1] == ["unsupported"]:
        return ShareSupport(fdid, False, " ".join(words[1:]) or "the driver gives no reason")
    return ShareSupport(fdid, False, f"unreadable nvme_share {' '.join(words)!r}")


# --- a share child's files (section 7, "Per share") -----------------------------------------
def share_file(driver: SmartioDriver, uuid: str) -> Path:
    return driver.child_group(uuid) / sharefiles.SHARE_FILE


def lacking_share_files(driver: SmartioDriver, uuid: str) -> str:
    """Which of section 7's files share child ``uuid`` lacks ("" none; the child exists)."""
    group = driver.child_group(uuid)
    missing = [
        f"smartio/{name}"
        for name in (sharefiles.SHARE_FILE, sharefiles.SHARE_STATE_FILE)
        if not (group / name).is_file()
    ]
    return " and ".join(missing)


def write_share(driver: SmartioDriver, fdid: int, uuid: str, text: str, epoch: int) -> None:
    """Write share child ``uuid``'s ``nvme_share`` (``text`` from ``sharefiles``); the
    driver's refusals become the errors section 7 names. ``SharingUnsupportedError`` naming
    the file when the driver lacks it (one older than section 7's share files)."""
    path = share_file(driver, uuid)
    try:
        driver.writer.write(path, text)
    except FileNotFoundError:
        if not (driver.env.mdev_devices / uuid).is_dir():
            raise FabricError(
                f"share mdev {uuid} of device {format_fdid(fdid)} went away before its share"
                " was written (its lender may be unreachable); start the VM again"
            ) from None
        raise SharingUnsupportedError(
            fdid,
            f"the SmartIO driver's share child has no {lacking_share_files(driver, uuid)}"
            " (it predates docs/smartio-contract.md section 7's share files); lend it whole",
        ) from None
    except OSError as e:
        raise _share_error(driver, fdid, uuid, path, epoch, e.errno or 0) from None
    log.info("smartio nvme_share %s %s epoch %d", format_fdid(fdid), uuid, epoch)


def _share_error(
    driver: SmartioDriver, fdid: int, uuid: str, path: Path, epoch: int, code: int
) -> Exception:
    f = format_fdid(fdid)
    if code == errno.ESTALE:
        return StaleTokenError(fdid, epoch, -1, f"the NVMe share of mdev {uuid}")
    if code == errno.EINVAL:
        return FabricError(
            f"device {f} refused the share written to {path} (EINVAL): vmlend wrote what the"
            " driver does not take; check both ('dmesg')"
        )
    if code in (errno.ERANGE, errno.EEXIST):
        why = "beyond what the controller has" if code == errno.ERANGE else "over another share"
        return NvmeShareError(
            f"device {f} refused the share of mdev {uuid} ({errno.errorcode[code]}): the"
            f" registry's queues, vectors or LBA window are {why} at the driver; compare"
            " 'vmlend nvme status' with the device's nvme_shares"
        )
    if code == errno.EBUSY:
        return FabricError(
            f"device {f} runs another share for mdev {uuid} (EBUSY); stop the VM and start it again"
        )
    if code == errno.ENOSPC:
        return NvmeShareError(
            f"device {f} could not create the I/O queues of mdev {uuid}'s share now (ENOSPC);"
            " return another share or lend the drive whole"
        )
    if code == errno.EOPNOTSUPP:
        return SharingUnsupportedError(fdid, "its SmartIO driver refuses shares of it now")
    return driver._error("write the NVMe share of", fdid, code)


def clear_share(driver: SmartioDriver, fdid: int, uuid: str) -> bool:
    """End child ``uuid``'s share at the driver under the epoch it was written with (read
    back from its file), before the child goes. False when there was nothing to clear (no
    file, nothing written, the child gone) or a newer epoch runs it now (the share moved:
    not this child's to end)."""
    path = share_file(driver, uuid)
    try:
        epoch, values = sharefiles.parse_share(read_text(path, sharefiles.CHECK), path)
    except FileNotFoundError:
        return False
    if values is None:
        return False
    try:
        driver.writer.write(path, sharefiles.format_clear(epoch))
    except FileNotFoundError:
        return False
    except OSError as e:
        if e.errno == errno.ESTALE:
            log.info("share of mdev %s runs under a newer epoch now: left to it", uuid)
            return False
        raise _share_error(driver, fdid, uuid, path, epoch, e.errno or 0) from None
    log.info("smartio nvme_share %s %s cleared (epoch %d)", format_fdid(fdid), uuid, epoch)
    return True


def share_state(driver: SmartioDriver, uuid: str) -> sharefiles.ShareState | None:
    """What the driver runs for share child ``uuid`` (None: no such file)."""
    path = driver.child_group(uuid) / sharefiles.SHARE_STATE_FILE
    try:
        return sharefiles.parse_share_state(read_text(path, sharefiles.CHECK), path)
    except FileNotFoundError:
        return None


def drive_shares(driver: SmartioDriver, fdid: int) -> dict[str, sharefiles.ShareValues] | None:
    """The device's ``nvme_shares``: what its manager runs, per share child (None: no file)."""
    path = driver.base / device_name(fdid) / sharefiles.SHARES_FILE
    try:
        return sharefiles.parse_shares(read_text(path, sharefiles.CHECK), path)
    except FileNotFoundError:
        return None


def share_report(driver: SmartioDriver, uuid: str) -> sharefiles.ShareReport | None:
    """Share child ``uuid``'s ``nvme_share`` and ``nvme_share_state`` as read (None: it has no
    ``nvme_share``: gone, or a driver from before section 7's share files, which
    ``vmlend doctor`` names). A malformed file is reported, not raised."""
    path = share_file(driver, uuid)
    try:
        epoch, written = sharefiles.parse_share(read_text(path, sharefiles.CHECK), path)
        state = share_state(driver, uuid)
    except FileNotFoundError:
        return None
    except SysfsAttributeError as e:
        return sharefiles.ShareReport(damaged=f"{e.path}: {e.problem}")
    return sharefiles.ShareReport(epoch, written, state)
