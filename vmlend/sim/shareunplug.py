"""The simulated drive's side of an unplugged live migration of a queue-level NVMe share
(``vmlend.sim.unplugmig``; the registry's side is ``vmlend.ledger.shareunplug``).

``unplug_share``: the share's controller leaves its guest (a hot-unplug: the guest's driver
let go). Its real queues are deleted, its DMA windows, pins and (two paths) relay rings go,
its mdev closes; but the share stays allocated on the drive (its queue ids, LBA extent,
vectors, address space and CMB extent, still guarded), so no other VM can be given its blocks.
``replug_share``: the same share opens again for its VM on another node under a newer epoch,
named after that node: a new virtual controller in the destination's RAM (a two-path share's
relay rings made again in the destination host's memory); the guest's driver starts it as a
new controller and finds its namespace, its blocks, as it left them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import msgspec

from vmlend.errors import FabricError, StaleTokenError
from vmlend.ledger.admission import vm_share
from vmlend.nvme.shares import Share
from vmlend.registry import Claim
from vmlend.sim.nvmeshare import SharedNvmeDrive, VmNvmeShare, msi_paths
from vmlend.topology.model import Holder

log = logging.getLogger(__name__)


class UnpluggedShare(msgspec.Struct, frozen=True):
    """A share whose controller left its guest: what ``replug_share`` needs."""

    fdid: int
    vm: str
    share: Share
    epoch: int
    mdev: str | None
    #: The paths whose interrupts crossed the NTB (``nvmeshare.msi_paths``).
    msi: frozenset[int] = frozenset()


def unplug_share(drive: SharedNvmeDrive, vms: VmNvmeShare) -> UnpluggedShare:
    """``vms``'s controller leaves its guest; the share stays the VM's on the drive."""
    if not vms.open or vms.revoked or vms.name not in drive.shares:
        raise FabricError(f"NVMe share {vms.name} of {drive.fdid:#x} is closed")
    if vms.mdev is not None:
        drive.hw.close_mdev(vms.mdev, vms.node)
    drive.manager.delete_queues(vms.name)
    drive.manager.disconnect(vms.name)
    vms.open = False
    vms.windows.close()  # its windows, pins and crossing use
    vms.drop_cpu_windows()  # its CPU's windows onto the drive (CMB extent, doorbell page)
    vms._free_rings()
    del drive.shares[vms.name]
    log.info("NVMe share %s of %#x: controller unplugged, share kept", vms.name, drive.fdid)
    return UnpluggedShare(drive.fdid, vms.vm, vms.share, vms.epoch, vms.mdev, vms.msi_paths)


def replug_share(
    drive: SharedNvmeDrive,
    gone: UnpluggedShare,
    node: str,
    token: int,
    interrupts: Sequence[Claim] | None = None,
) -> VmNvmeShare:
    """``gone``'s share opens again for its VM on ``node`` (its guest running there) under
    epoch ``token``: ``StaleTokenError`` for one not newer than its last; all or nothing.
    ``interrupts``: the interrupt windows admitted for it on ``node`` (None: as it had)."""
    if token <= gone.epoch:
        raise StaleTokenError(drive.fdid, token, gone.epoch, "an NVMe share's unplugged move")
    old, new = gone.share.name, vm_share(Holder(node, gone.vm))
    share = drive.manager.rename_share(old, new) if new != old else gone.share
    vms: VmNvmeShare | None = None
    try:
        msi = gone.msi if interrupts is None else msi_paths(interrupts)
        vms = VmNvmeShare(drive, node, gone.vm, share, msi)
        drive.connect(vms)
        vms.place_cpu_windows()  # from ``node``'s adapter
        if gone.mdev is not None:
            drive.hw.open_mdev(gone.mdev, drive.fdid, node, gone.vm, vms.revoke, share=True)
    except Exception:
        if vms is not None:
            vms.drop_cpu_windows()
            vms._free_rings()  # a two-path share's relay rings, made in the node's memory
        drive.manager.disconnect(new)
        if new != old:
            drive.manager.rename_share(new, old)
        raise
    vms.mdev, vms.epoch = gone.mdev, token
    drive.shares[new] = vms
    log.info("NVMe share %s of %#x plugged back on %s (epoch %d)", new, drive.fdid, node, token)
    return vms
