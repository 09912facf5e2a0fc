"""What the SmartIO driver says about queue-level sharing of an NVMe drive (contract section 6).

``smartio-<fdid>/nvme_share`` is one line: ``supported <queue_pairs> <vectors> <dstrd>`` when
the lender's driver can run the manager for that controller (and the controller has the guard
and per-queue DMA tagging), ``unsupported <reason>`` when it cannot. A driver without the
attribute predates sharing: the drive can only be lent whole.
"""

from __future__ import annotations

import msgspec

from vmlend.errors import SysfsAttributeError
from vmlend.kernel.driver import CHECK, SmartioDriver, device_name
from vmlend.kernel.sysfsattr import read_text


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
