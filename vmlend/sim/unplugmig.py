"""Unplugged live migration of a VM's queue-level NVMe shares in the simulator
(docs/migration.md, "NVMe shares"): the share controllers leave the guest, the VM moves while
it runs, they come back on the destination; each share keeps its identity, so the guest finds
its disk (its blocks) as it left it. Steps, each followed by the invariant checker (``check``):

1. **claimed**: each share's path into the destination is admitted and claimed beside the
   source's, before anything is unplugged (``vmlend.ledger.shareunplug.claim``). Refused:
   nothing changed.
2. **unplugged**: each share's controller leaves the guest (``vmlend.sim.shareunplug``): its
   queues, windows and relay rings go; the share stays allocated on the drive.
3. **handed over**: each share becomes the destination's under a newer epoch.
4. **migrated**: the guest's RAM is copied to the destination (nothing DMAs into it now) and
   the source's freed; the VM runs there.
5. **source released**: the source's claims go.
6. **plugged back**: each share opens again on the destination under its new epoch, with its
   mdev there.

At no step are a share's blocks free: the drive keeps the share allocated throughout, and the
registry's record is the source's or the destination's at every commit. A VM that borrows
whole devices is moved hot (``vmlend.sim.hotmig``); this simulation moves shares only.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from vmlend.errors import FabricError
from vmlend.ledger import shareunplug
from vmlend.ledger.admission import vm_share
from vmlend.ledger.nvmeshares import interrupt_windows
from vmlend.lending.shares import ShareFabric
from vmlend.registry import Registry
from vmlend.sim.dmawin import VmDmaWindows
from vmlend.sim.hostmem import FRAME
from vmlend.sim.nvmeshare import SharedNvmeDrive
from vmlend.sim.shareunplug import UnpluggedShare, replug_share, unplug_share
from vmlend.sim.simvm import SimVm, VmFabric
from vmlend.topology.model import Holder

Check = Callable[[str], None]


def _nocheck(_step: str) -> None:
    pass


class UnplugMigration(msgspec.Struct, frozen=True):
    """What an unplugged migration did: each share's new epoch, the guest pages copied."""

    vm: str
    source: str
    destination: str
    epochs: dict[int, int]
    pages: int


def unplug_migrate(
    vm: SimVm, dst: VmFabric, registry: Registry, *, check: Check = _nocheck
) -> UnplugMigration:
    """Move the running ``vm`` (with NVMe shares, no borrowed devices) to
    ``dst.local_node``, its share controllers unplugged meanwhile (the module docstring says
    how); ``check``: the invariant checker, run after every step with its name."""
    hw, name, source, dest = vm.hw, vm.name, vm.node, dst.local_node
    if dest == source:
        raise FabricError(f"VM {name} already runs on {dest}")
    if vm.sessions():
        raise FabricError(
            f"VM {name} borrows devices {', '.join(f'{f:#x}' for f in vm.sessions())}: move it"
            " hot (vmlend.sim.hotmig); this simulation moves NVMe shares only"
        )
    drives = vm.shares()
    by_drive: dict[int, SharedNvmeDrive] = {}
    for fdid in drives:
        vms = vm.nvme_share(fdid)
        if vms.revoked or not vms.open:
            raise FabricError(f"VM {name}'s NVMe share of {fdid:#x} was taken from it")
        by_drive[fdid] = vms.drive
    src_holder = vm.holder
    dst_holder = Holder(dest, name, src_holder.vm_uuid)
    shareunplug.claim(registry, drives, src_holder, dst_holder, vm.guest_ram)
    check("claimed")
    gone: dict[int, UnpluggedShare] = {}
    for fdid in drives:
        gone[fdid] = unplug_share(by_drive[fdid], vm.share_unplugged(fdid))
        mdev = gone[fdid].mdev
        if mdev is not None and isinstance(vm.fabric, ShareFabric):
            vm.fabric.remove_mdev(mdev)
    check("unplugged")
    epochs = shareunplug.hand_over(registry, drives, src_holder, dst_holder, time.time())
    check("handed over")
    guest = hw.create_guest(dest, name, vm.layout.ranges(), backing=vm.guest.backing)
    pages = vm.guest.stored_pages()
    for page in pages:
        if vm.guest.is_ram(page * FRAME):
            guest.load(page * FRAME, vm.guest.read(page * FRAME, FRAME))
    windows = VmDmaWindows(hw, guest, vm.layout, vm.windows.ledger, vm_share(dst_holder))
    vm.windows.close()
    hw.destroy_guest(source, name)
    vm.moved(dst, guest, windows, vm.p2p)
    check("migrated")
    shareunplug.finish(registry, drives, src_holder, dst_holder, time.time())
    check("source released")
    with registry.read() as tx:  # the interrupt windows handed over with each share
        irq = {f: interrupt_windows(tx, f, dst_holder) for f in drives}
    for fdid in drives:
        mdev = gone[fdid].mdev
        if mdev is not None and isinstance(dst, ShareFabric):
            dst.ensure_mdev_parent(fdid)  # the first of the drive's mdevs on this node
            dst.create_share_mdev(fdid, mdev, dst_holder)
        plugged = replug_share(by_drive[fdid], gone[fdid], dest, epochs[fdid], irq[fdid])
        vm.share_plugged(fdid, plugged)
    check("plugged back")
    return UnplugMigration(name, source, dest, epochs, len(pages))
