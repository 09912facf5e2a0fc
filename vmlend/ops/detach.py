"""Detach: hot-remove a remote device from a domain, or remove it from its definition; a live
detach returns the device to the fabric once the guest has let go of it."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from lxml import etree

from vmlend.domain import (
    METADATA_KEY,
    NAMESPACE_URI,
    DomainDocument,
    find_device,
    read_domain,
    remove_device,
)
from vmlend.domain.model import DomainXML
from vmlend.errors import ConfigError
from vmlend.fabric.base import Fabric
from vmlend.faults import fault_point
from vmlend.hypervisor import Hypervisor
from vmlend.lending.devices import held_by, holder_for, recorded_for, return_device
from vmlend.ops.definitions import (
    LIVE,
    find_hostdev,
    plain_metadata,
    read_targets,
    resolve_targets,
)
from vmlend.ops.unplug import DetachWait, wait_unplugged
from vmlend.topology.model import format_fdid


class DetachResult(msgspec.Struct):
    name: str
    fdid: int
    targets: tuple[str, ...]
    returned: bool


def detach(
    hv: Hypervisor,
    fabric: Fabric,
    vm: str,
    fdid: int,
    *,
    live: bool,
    config: bool,
    progress: Callable[[str], None],
    wait: DetachWait | None = None,
) -> DetachResult:
    """Remove ``fdid`` from the chosen definitions; a live detach returns the device once the
    guest has let go of it (``DetachTimeoutError``, device still held, when it does not)."""
    wait = wait or DetachWait()
    info = hv.lookup(vm)
    targets = resolve_targets(info, live, config)
    before = read_targets(hv, info.name, targets)
    docs = {t: DomainDocument.parse(x, source=f"{t} XML of {info.name}") for t, x in before.items()}
    present = {t: find_device(d, fdid) for t, d in docs.items()}
    todo = tuple(t for t in targets if present[t] is not None)
    fd = format_fdid(fdid)
    if not todo and LIVE in targets:
        # An earlier detach that stopped after libvirt unplugged the device: finish returning it.
        dom = read_domain(before[LIVE], strict=False)
        holder = holder_for(fabric, info.name, dom.uuid or info.uuid)
        if fdid in held_by(fabric, holder):
            leftover = next(
                (
                    m.uuid
                    for m in fabric.mdev_records()
                    if m.fdid == fdid and recorded_for(m, holder)
                ),
                None,
            )
            if leftover is not None:
                _unplug_orphan(hv, info.name, docs[LIVE], fdid, leftover, wait, progress)
            return_device(fabric, holder, fdid, leftover, progress)
            return DetachResult(info.name, fdid, (), True)
    if not todo:
        raise ConfigError(
            f"device {fd} is not attached to VM {info.name!r} ({'+'.join(targets)});"
            " 'vmlend status' lists its devices"
        )
    returned = False
    for t in todo:
        is_live = t == LIVE
        device = present[t]
        assert device is not None
        dev = find_hostdev(docs[t], device)
        if dev is None:
            # An earlier detach stopped after libvirt unplugged it: finish the rest.
            progress(f"{t} hostdev mdev {device.mdev}: already gone")
        else:
            hv.detach_device(info.name, dev, live=is_live, config=not is_live)
            if is_live:
                wait_unplugged(hv, info.name, fdid, device.mdev, wait)
            progress(f"detach {t} hostdev mdev {device.mdev}: ok")
            fault_point("detach:after-unplug")
        # From the XML as it is now, not as read before the unplug: another writer (the
        # agent's recovery, an attach) may have changed the metadata meanwhile.
        now = DomainDocument.parse(
            hv.xml(info.name, inactive=not is_live), source=f"{t} XML of {info.name}"
        )
        if find_device(now, fdid) is not None:
            after = remove_device(now, fdid, unplugged=True)
            hv.set_metadata(
                info.name,
                NAMESPACE_URI,
                METADATA_KEY,
                plain_metadata(after),
                live=is_live,
                config=not is_live,
            )
        progress(f"{t} metadata: ok")
        fault_point("detach:after-metadata")
        if is_live:
            dom = read_domain(before[t], strict=False)
            holder = holder_for(fabric, info.name, dom.uuid or info.uuid)
            returned = return_device(fabric, holder, fdid, device.mdev, progress)
    return DetachResult(info.name, fdid, todo, returned)


def _unplug_orphan(
    hv: Hypervisor,
    name: str,
    doc: DomainDocument,
    fdid: int,
    mdev: str,
    wait: DetachWait,
    progress: Callable[[str], None],
) -> None:
    """A hostdev the metadata no longer names (an attach rolled back while the guest still
    had it): unplug it before its mdev goes."""
    for h in DomainXML(doc.root).mdev_hostdevs():
        if str(h.uuid) == mdev:
            hv.detach_device(
                name, etree.tostring(h.element, with_tail=False), live=True, config=False
            )
            wait_unplugged(hv, name, fdid, mdev, wait)
            progress(f"detach live hostdev mdev {mdev}: ok")
