"""The definitions (live, config) an attach or detach changes, and the hostdev and metadata
pieces of a domain document that libvirt's device and metadata APIs take.

Like virsh, neither flag means "current": live on a running domain, config on a stopped one.
"""

from __future__ import annotations

from lxml import etree

from vmlend.domain import DomainDocument, VmlendDevice
from vmlend.domain.metadata import find_metadata
from vmlend.domain.model import DomainXML
from vmlend.errors import ConfigError, DomainStateError
from vmlend.hypervisor import DomainInfo, Hypervisor

LIVE, CONFIG = "live", "config"


def resolve_targets(info: DomainInfo, live: bool, config: bool) -> tuple[str, ...]:
    """Which definitions change: libvirt's rules, checked up front with a clear line."""
    if not live and not config:
        live, config = info.active, not info.active
    if live and not info.active:
        raise DomainStateError(
            "change",
            info.name,
            "domain is not running",
            hint="use --config to change its definition",
        )
    if config and not info.persistent:
        raise DomainStateError(
            "change", info.name, "transient domains have no persistent definition"
        )
    return tuple(t for t, on in ((LIVE, live), (CONFIG, config)) if on)


def read_targets(hv: Hypervisor, name: str, targets: tuple[str, ...]) -> dict[str, bytes]:
    return {t: hv.xml(name, inactive=t == CONFIG) for t in targets}


def plain_metadata(doc: DomainDocument) -> bytes | None:
    """vmlend's metadata element in the form libvirt's metadata API takes (no namespace: the
    API puts it in ``NAMESPACE_URI`` under prefix ``METADATA_KEY``); None when there is none."""
    meta = find_metadata(doc.root)
    if meta is None:
        return None

    def plain(el: etree._Element) -> etree._Element:
        out = etree.Element(
            etree.QName(el).localname, attrib={str(k): str(v) for k, v in el.attrib.items()}
        )
        for child in el:
            if isinstance(child.tag, str):
                out.append(plain(child))
        return out

    return etree.tostring(plain(meta.element))


def find_hostdev(doc: DomainDocument, device: VmlendDevice) -> bytes | None:
    """The hostdev element of ``device``'s mdev in ``doc``; None when the domain has none."""
    for h in DomainXML(doc.root).mdev_hostdevs():
        if h.uuid == device.mdev:
            return etree.tostring(h.element, with_tail=False)
    return None


def hostdev_xml(doc: DomainDocument, device: VmlendDevice) -> bytes:
    found = find_hostdev(doc, device)
    if found is None:
        raise ConfigError(f"the domain has no hostdev for mdev {device.mdev}")
    return found
