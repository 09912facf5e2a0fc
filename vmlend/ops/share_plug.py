"""The guest's side of an unplugged live migration of a queue-level NVMe share
(``vmlend.ops.live_migrate``; the registry's side is ``vmlend.ledger.shareunplug``): the
share's controller is hot-unplugged from the guest on the source (its mdev removed, the share
itself kept: its blocks stay the VM's), and plugged back at the same guest address once the
share is the VM's on the destination, through a new mdev there. Plugging back never makes a
share: one that is not the VM's on this node is refused, since a new one would be given other
blocks than the guest's disk.
"""

from __future__ import annotations

from collections.abc import Callable

from vmlend.domain import (
    METADATA_KEY,
    NAMESPACE_URI,
    DomainDocument,
    NvmeShareRequest,
    PciAddress,
    TemplateSet,
    add_device,
    find_device,
    read_domain,
)
from vmlend.errors import ConfigError, FabricError, VmlendError
from vmlend.fabric.base import Fabric
from vmlend.hypervisor import Hypervisor
from vmlend.lending.devices import UndoJournal, holder_for
from vmlend.lending.shares import ShareFabric, acquire_share
from vmlend.ops.definitions import hostdev_xml, plain_metadata
from vmlend.ops.detach import detach
from vmlend.ops.unplug import DetachWait
from vmlend.topology.model import format_fdid

Progress = Callable[[str], None]


def unplug_controller(
    hv: Hypervisor,
    fabric: Fabric,
    vm: str,
    fdid: int,
    progress: Progress,
    wait: DetachWait,
) -> None:
    """Unplug ``vm``'s share controller of drive ``fdid`` (waiting for the guest to let go)
    and remove its mdev; the share stays the VM's. Idempotent: a re-run after a kill
    finishes it."""
    name = hv.lookup(vm).name
    dom = read_domain(hv.xml(name), strict=False)
    holder = holder_for(fabric, name, dom.uuid)
    if any(d.fdid == fdid for d in dom.devices):
        # detach returns holds, never shares (the drive's hold is its manager's)
        detach(hv, fabric, name, fdid, live=True, config=False, progress=progress, wait=wait)
        return
    for m in fabric.mdev_records():  # unplugged by an earlier run: its mdev may be left
        if m.fdid == fdid and m.node == holder.node and m.vm == holder.vm:
            fabric.remove_mdev(m.uuid)


def plug_share(
    hv: Hypervisor,
    fabric: Fabric,
    vm: str,
    fdid: int,
    request: NvmeShareRequest,
    progress: Progress,
    *,
    address: PciAddress | None = None,
) -> None:
    """Plug ``vm``'s share of drive ``fdid`` (the VM's on this node already) back in: its
    mdev made and its controller hot-plugged at ``address``. ``FabricError`` (nothing made)
    when the VM has no share of the drive here; refused or failed: nothing left."""
    name = hv.lookup(vm).name
    xml = hv.xml(name)
    dom = read_domain(xml, strict=False)
    if any(d.fdid == fdid for d in dom.devices):
        return  # plugged by an earlier run
    if dom.uuid is None:
        raise ConfigError(f"VM {name!r} has no UUID; its share's mdev is named after it")
    holder = holder_for(fabric, name, dom.uuid)
    if not isinstance(fabric, ShareFabric) or fabric.share_of(fdid, holder) is None:
        raise FabricError(
            f"VM {name!r} has no NVMe share of {format_fdid(fdid)} on {holder.node} to plug"
            " back (a new one would not hold its disk's blocks)"
        )
    doc = DomainDocument.parse(xml, source=f"live XML of {name}")
    after = add_device(doc, fdid, templates=TemplateSet(), address=address, share=request)
    device = find_device(after, fdid)
    assert device is not None  # just added
    journal = UndoJournal()
    try:
        # the VM's share already: the ledger gives the same one back, and nothing to undo
        acquire_share(
            fabric, holder, fdid, device.mdev, request, journal, progress, guest_ram=dom.guest_ram
        )
        dev = hostdev_xml(after, device)
        hv.attach_device(name, dev, live=True, config=False)
        journal.push("live hostdev", lambda: hv.detach_device(name, dev, live=True, config=False))
        hv.set_metadata(
            name, NAMESPACE_URI, METADATA_KEY, plain_metadata(after), live=True, config=False
        )
    except VmlendError:
        journal.rollback(progress)
        raise
