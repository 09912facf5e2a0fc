"""Hot-plug and hot-unplug of a queue-level NVMe share in a running guest: an unplugged live
migration's way with a VM's shares (``vmlend.ops.live_migrate``): the share is returned on the
source with its controller unplugged, and made again on the destination (a new share of the
same size, queue pairs and paths, claimed there, all or nothing) with its controller plugged
back at the same guest address. The blocks are the drive's and stay where they are: the new
share is of the same drive, and what the guest wrote into its namespace is there again only
if the drive's manager gives it the same extent (docs/migration.md says what the guest sees).
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
from vmlend.errors import ConfigError, VmlendError
from vmlend.fabric.base import Fabric
from vmlend.hypervisor import Hypervisor
from vmlend.lending.devices import UndoJournal, holder_for
from vmlend.lending.shares import ShareFabric, acquire_share
from vmlend.ops.definitions import hostdev_xml, plain_metadata
from vmlend.ops.detach import detach
from vmlend.ops.unplug import DetachWait
from vmlend.topology.model import format_fdid

Progress = Callable[[str], None]


def unplug_share(
    hv: Hypervisor,
    fabric: Fabric,
    vm: str,
    fdid: int,
    progress: Progress,
    wait: DetachWait,
) -> None:
    """Unplug ``vm``'s share controller of drive ``fdid`` (waiting for the guest to let go),
    remove its mdev and return the share. Idempotent: a re-run after a kill finishes it."""
    name = hv.lookup(vm).name
    dom = read_domain(hv.xml(name), strict=False)
    holder = holder_for(fabric, name, dom.uuid)
    if any(d.fdid == fdid for d in dom.devices):
        detach(hv, fabric, name, fdid, live=True, config=False, progress=progress, wait=wait)
    else:  # unplugged by an earlier run: its mdev may be left
        for m in fabric.mdev_records():
            if m.fdid == fdid and m.node == holder.node and m.vm == holder.vm:
                fabric.remove_mdev(m.uuid)
    if isinstance(fabric, ShareFabric) and fabric.release_share(fdid, holder):
        progress(f"share of {format_fdid(fdid)}: returned")


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
    """Make ``vm`` a share of drive ``fdid`` as ``request`` says (claimed on this node, with
    its mdev) and hot-plug its controller at ``address``; refused or failed: nothing left
    (the ``VmlendError`` says why)."""
    name = hv.lookup(vm).name
    xml = hv.xml(name)
    dom = read_domain(xml, strict=False)
    if any(d.fdid == fdid for d in dom.devices):
        return  # plugged by an earlier run
    if dom.uuid is None:
        raise ConfigError(f"VM {name!r} has no UUID; its share's mdev is named after it")
    holder = holder_for(fabric, name, dom.uuid)
    doc = DomainDocument.parse(xml, source=f"live XML of {name}")
    after = add_device(doc, fdid, templates=TemplateSet(), address=address, share=request)
    device = find_device(after, fdid)
    assert device is not None  # just added
    journal = UndoJournal()
    try:
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
