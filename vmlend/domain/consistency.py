"""Do a domain's vmlend metadata and its mdev hostdevs agree? (Pure; reports, never edits.)

The metadata is the record of which remote device a domain uses; the hostdevs are what libvirt
hands to QEMU. A start or a rewrite on a document where they disagree would reserve one device
and attach another, so every writer checks first and aborts.
"""

from __future__ import annotations

import uuid

import msgspec

from vmlend.domain.document import DomainDocument
from vmlend.domain.metadata import VmlendDevice, find_metadata
from vmlend.domain.model import DomainXML, MdevHostdevXML
from vmlend.domain.uuids import mdev_uuid
from vmlend.errors import DomainXMLError
from vmlend.messages import plural
from vmlend.topology.model import format_fdid


class Problem(msgspec.Struct, frozen=True):
    """One disagreement. ``kind`` is stable for programs: missing-hostdev, duplicate-hostdev,
    address-mismatch, model-mismatch, not-derived."""

    kind: str
    fdid: int
    message: str


def _hostdevs_by_uuid(domain: DomainXML) -> dict[str, list[MdevHostdevXML]]:
    out: dict[str, list[MdevHostdevXML]] = {}
    for h in domain.mdev_hostdevs():
        raw = str(h.element.xpath("string(./source/address/@uuid)")).strip().lower()
        try:
            key = str(uuid.UUID(raw))
        except ValueError:
            key = raw  # matches nothing in the metadata: reported as missing-hostdev
        out.setdefault(key, []).append(h)
    return out


def pairing_problems(domain: DomainXML, devices: list[VmlendDevice]) -> list[Problem]:
    """Metadata entries without exactly one matching hostdev, or with a different address."""
    problems: list[Problem] = []
    by_uuid = _hostdevs_by_uuid(domain)
    for d in devices:
        fd = format_fdid(d.fdid)
        found = by_uuid.get(str(d.mdev), [])
        if not found:
            problems.append(
                Problem(
                    "missing-hostdev",
                    d.fdid,
                    f"device {fd} is in the vmlend metadata with mdev {d.mdev}, but the domain"
                    " has no mdev <hostdev> with that UUID",
                )
            )
            continue
        if len(found) > 1:
            problems.append(
                Problem(
                    "duplicate-hostdev",
                    d.fdid,
                    f"device {fd}: {len(found)} <hostdev> elements use mdev {d.mdev}",
                )
            )
        hostdev = found[0]
        if hostdev.model != "vfio-pci":
            problems.append(
                Problem(
                    "model-mismatch",
                    d.fdid,
                    f"device {fd}: its <hostdev> has model {hostdev.model!r}, expected 'vfio-pci'",
                )
            )
        if d.address is not None and hostdev.guest_address != d.address:
            problems.append(
                Problem(
                    "address-mismatch",
                    d.fdid,
                    f"device {fd}: the metadata puts it at guest address {d.address}, its"
                    f" <hostdev> at {hostdev.guest_address or 'no PCI address'}",
                )
            )
    return problems


def derivation_problems(domain: DomainXML, devices: list[VmlendDevice]) -> list[Problem]:
    """Metadata mdev UUIDs that are not the ones derived from this domain's UUID."""
    if not devices:
        return []
    dom_uuid = domain.require_uuid()
    problems = []
    for d in devices:
        want = mdev_uuid(dom_uuid, d.fdid)
        if d.mdev != want:
            problems.append(
                Problem(
                    "not-derived",
                    d.fdid,
                    f"device {format_fdid(d.fdid)} uses mdev {d.mdev}, but this domain's UUID"
                    f" gives {want} (XML copied from another domain?); re-add it with"
                    " 'vmlend xml remove-device' and 'vmlend xml add-device'",
                )
            )
    return problems


def find_problems(doc: DomainDocument) -> list[Problem]:
    """Every disagreement between the metadata and the hostdevs of ``doc``."""
    meta = find_metadata(doc.root)
    if meta is None:
        return []
    domain = DomainXML(doc.root)
    devices = meta.devices()
    return pairing_problems(domain, devices) + derivation_problems(domain, devices)


def raise_on(problems: list[Problem], what: str) -> None:
    if problems:
        more = f" (and {plural(len(problems) - 1, 'more problem')})" if len(problems) > 1 else ""
        raise DomainXMLError(f"{what}: {problems[0].message}{more}")


def check_consistency(doc: DomainDocument) -> DomainDocument:
    """``doc`` unchanged, or ``DomainXMLError`` naming the first disagreement."""
    name = DomainXML(doc.root).name or "?"
    raise_on(find_problems(doc), f"domain {name} is inconsistent")
    return doc
