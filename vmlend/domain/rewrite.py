"""Pure rewrites of a domain document: each takes a ``DomainDocument`` and returns a new one, or
raises ``DomainXMLError`` when it cannot do its part (abort rather than write a wrong domain).

Elements and metadata vmlend does not own are never touched.
"""

from __future__ import annotations

import logging
import re

from lxml import etree

from vmlend.domain.address import PciAddress
from vmlend.domain.consistency import (
    check_consistency,
    derivation_problems,
    find_problems,
    pairing_problems,
    raise_on,
)
from vmlend.domain.document import DomainDocument
from vmlend.domain.indent import insert_child, is_indented, remove_child
from vmlend.domain.metadata import (
    HOST_TAG,
    NvmeShareRequest,
    VmlendDevice,
    VmlendMetadataXML,
    find_metadata,
)
from vmlend.domain.model import DomainXML, MdevHostdevXML
from vmlend.domain.slots import address_problem
from vmlend.domain.templates import TemplateSet
from vmlend.domain.uuids import mdev_uuid
from vmlend.errors import DomainXMLError
from vmlend.topology.model import InterruptPath, format_fdid

log = logging.getLogger(__name__)

# Where libvirt itself puts <metadata>: after the identity elements.
_BEFORE_METADATA = ("name", "uuid", "genid", "title", "description")
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def find_device(doc: DomainDocument, fdid: int) -> VmlendDevice | None:
    """The metadata entry of ``fdid``, if the domain has it."""
    meta = find_metadata(doc.root)
    if meta is None:
        return None
    entry = meta.entry(fdid)
    return entry.get() if entry is not None else None


_KEPT = "kept"
_ABSENT = "absent"
_EMPTY = "empty"


def _ensure_metadata(domain: DomainXML) -> VmlendMetadataXML:
    meta = find_metadata(domain.element)
    if meta is not None:
        return meta
    container = domain.metadata_element()
    was_empty = container is not None and len(container) == 0
    if container is None:
        index = 0
        for i, child in enumerate(domain.element):
            if child.tag in _BEFORE_METADATA:
                index = i + 1
        container = insert_child(domain.element, etree.Element("metadata"), index)
    meta = VmlendMetadataXML(insert_child(container, VmlendMetadataXML.new_element()))
    if was_empty:
        meta.metadata_container = _KEPT
    return meta


def _devices_spelling(domain: DomainXML) -> str | None:
    """How ``<devices>`` is, when it is not as libvirt writes it (present, with a line
    break before ``</devices>`` in an indented document)."""
    devices = domain.devices_element()
    if devices is None:
        return _ABSENT
    if len(devices) == 0 and not devices.text and is_indented(domain.element):
        return _EMPTY
    return None


def _restore_devices(domain: DomainXML, spelling: str | None) -> None:
    devices = domain.devices_element()
    if devices is None or len(devices) or (devices.text or "").strip():
        return
    if spelling == _ABSENT:
        remove_child(devices)
    elif spelling == _EMPTY:
        devices.text = None


def _drop_metadata(meta: VmlendMetadataXML) -> None:
    """Remove vmlend's element, and the ``<metadata>`` it leaves empty unless that was there
    before vmlend (then it goes back to libvirt's empty ``<metadata/>``)."""
    container = meta.element.getparent()
    kept = meta.metadata_container == _KEPT
    remove_child(meta.element)
    if container is None or len(container) or (container.text or "").strip():
        return
    if kept:
        container.text = None
    else:
        remove_child(container)


def add_device(
    doc: DomainDocument,
    fdid: int,
    *,
    templates: TemplateSet,
    address: PciAddress | None = None,
    share: NvmeShareRequest | None = None,
    interrupts: InterruptPath | None = None,
) -> DomainDocument:
    """Add remote device ``fdid`` (metadata entry + mdev hostdev), or with ``share`` a
    queue-level share of that NVMe drive; ``interrupts`` is the device's own interrupt path
    (None: the VM's default). Adding a device the domain already has returns an unchanged
    copy; asking for a different address or interrupt path for it raises."""
    check_consistency(doc)
    present = find_device(doc, fdid)
    if present is not None:
        if address is not None and present.address != address:
            raise DomainXMLError(
                f"device {format_fdid(fdid)} is already in the domain at guest address"
                f" {present.address or '(assigned by libvirt)'}; remove it first to move it"
            )
        if interrupts is not None and present.interrupts != interrupts:
            said = present.interrupts.value if present.interrupts else "the VM's default"
            raise DomainXMLError(
                f"device {format_fdid(fdid)} is already in the domain with interrupts {said};"
                " remove it first to change its interrupt path"
            )
        return doc.copy()
    out = doc.copy()
    domain = DomainXML(out.root)
    dom_uuid = domain.require_uuid()
    if address is not None:
        problem = address_problem(domain, address)
        if problem is not None:
            raise DomainXMLError(f"{problem}; pick a free slot or omit --address")
    device = VmlendDevice(
        fdid=fdid,
        mdev=mdev_uuid(dom_uuid, fdid),
        address=address,
        share=share,
        interrupts=interrupts,
    )
    for hostdev in domain.mdev_hostdevs():
        if hostdev.uuid == device.mdev:
            # Not listed in the metadata (check_consistency passed), yet it is this device's.
            raise DomainXMLError(
                f"the domain already has an mdev <hostdev> with UUID {device.mdev}, the one"
                f" vmlend derives for device {format_fdid(fdid)}, but vmlend's metadata does"
                " not list it; remove that <hostdev> first"
            )

    devices_before = _devices_spelling(domain)
    meta = _ensure_metadata(domain)
    if devices_before is not None and not meta.entries():
        meta.devices_container = devices_before
    entries = meta.entries()
    index = meta.element.index(entries[-1].element) + 1 if entries else 0
    insert_child(meta.element, meta.new_entry(device), index)

    hostdev_el = templates.hostdev()
    hostdev = MdevHostdevXML(hostdev_el)
    hostdev.uuid = device.mdev
    hostdev.set_guest_address(address)
    devices = domain.devices_element(create=True)
    assert devices is not None
    existing = devices.findall("hostdev")
    index = devices.index(existing[-1]) + 1 if existing else len(devices)
    insert_child(devices, hostdev_el, index)
    log.debug("added device %s as mdev %s", format_fdid(fdid), device.mdev)
    check_consistency(out)  # never hand back a document vmlend itself would refuse
    return out


def set_vm_interrupts(doc: DomainDocument, interrupts: InterruptPath | None) -> DomainDocument:
    """The VM's default interrupt path for its devices that name none (None: vmlend's
    default). It lives on vmlend's metadata element, so the domain needs a remote device."""
    out = doc.copy()
    meta = find_metadata(out.root)
    if meta is None:
        if interrupts is None:
            return out
        raise DomainXMLError(
            "the domain has no remote device to set an interrupt path for; add one first"
        )
    meta.interrupts = interrupts
    return out


def remove_device(doc: DomainDocument, fdid: int, *, unplugged: bool = False) -> DomainDocument:
    """Remove remote device ``fdid``; ``DomainXMLError`` if the domain does not have it. When
    the last device goes, vmlend's metadata element goes too (and an emptied ``<metadata>``).
    ``unplugged``: its hostdev may already be gone (libvirt unplugged it, then a detach was
    interrupted before the metadata update); only that one disagreement is accepted."""
    if unplugged:
        name = DomainXML(doc.root).name or "?"
        problems = find_problems(doc)
        others = [p for p in problems if not (p.fdid == fdid and p.kind == "missing-hostdev")]
        raise_on(others, f"domain {name} is inconsistent")
    else:
        check_consistency(doc)
    out = doc.copy()
    domain = DomainXML(out.root)
    meta = find_metadata(out.root)
    entry = meta.entry(fdid) if meta is not None else None
    if meta is None or entry is None:
        raise DomainXMLError(
            f"domain {domain.name or '?'} has no vmlend device {format_fdid(fdid)};"
            " 'vmlend xml show FILE' lists its devices"
        )
    device = entry.get()
    for hostdev in domain.mdev_hostdevs():
        if hostdev.uuid == device.mdev:
            remove_child(hostdev.element)
    remove_child(entry.element)
    if not meta.entries():
        _restore_devices(domain, meta.devices_container)
        _drop_metadata(meta)
    return out


def rederive_mdev_uuids(doc: DomainDocument) -> DomainDocument:
    """Make every device's mdev UUID the one derived from the domain UUID and its fdid, in the
    metadata and in its hostdev. Raises when metadata and hostdevs disagree to begin with."""
    meta = find_metadata(doc.root)
    if meta is None:
        return doc.copy()
    domain = DomainXML(doc.root)
    devices = meta.devices()
    raise_on(pairing_problems(domain, devices), f"domain {domain.name or '?'} is inconsistent")
    out = doc.copy()
    domain = DomainXML(out.root)
    dom_uuid = domain.require_uuid()
    meta = find_metadata(out.root)
    assert meta is not None
    hostdevs = domain.mdev_hostdevs()
    for entry in meta.entries():
        d = entry.get()
        want = mdev_uuid(dom_uuid, d.fdid)
        if d.mdev == want:
            continue
        log.warning("device %s: mdev %s re-derived as %s", format_fdid(d.fdid), d.mdev, want)
        for h in hostdevs:
            if h.uuid == d.mdev:
                h.uuid = want
        entry.mdev = want
    raise_on(derivation_problems(domain, meta.devices()), "re-deriving mdev UUIDs failed")
    return out


def drop_host_local_state(doc: DomainDocument) -> DomainDocument:
    """Remove what belongs to the source host's run of the domain and must not follow it: the
    ``id`` of the running instance. Guest PCI addresses, aliases and everything else stay (see
    docs/domain-xml.md for why)."""
    out = doc.copy()
    if "id" in out.root.attrib:
        del out.root.attrib["id"]
    return out


def record_destination(doc: DomainDocument, node: str) -> DomainDocument:
    """Note in vmlend's metadata that the XML is now meant for ``node``."""
    if not _NODE_NAME.match(node or ""):
        raise DomainXMLError(f"bad destination node name {node!r}")
    out = doc.copy()
    meta = find_metadata(out.root)
    if meta is None:
        raise DomainXMLError("the domain has no vmlend metadata to record a destination in")
    host = meta.element.find(HOST_TAG)
    if host is None:
        host = insert_child(meta.element, etree.Element(HOST_TAG))
    host.set("node", node)
    return out


def rewrite_for_destination(xml: bytes, dest_node: str, *, source: str = "domain XML") -> bytes:
    """The domain XML a migration to ``dest_node`` should use. Domains without vmlend metadata
    come back byte-identical. Raises ``DomainXMLError`` rather than return a wrong domain."""
    doc = DomainDocument.parse(xml, source=source)
    if find_metadata(doc.root) is None:
        return xml
    for step in (
        rederive_mdev_uuids,
        check_consistency,
        drop_host_local_state,
        lambda d: record_destination(d, dest_node),
    ):
        doc = step(doc)
    return doc.to_bytes()
