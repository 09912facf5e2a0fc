"""The mdev UUID of a remote device in a domain: the same on every host of the fabric.

``mdev_uuid(domain_uuid, fdid) = uuid5(MDEV_NAMESPACE, "<domain uuid>/<fdid as 0x hex>")`` with
the domain UUID in lower-case canonical form. Deterministic, so a VM's XML names the same mdev
wherever it starts, and two VMs (different domain UUIDs) never collide on one device.
"""

from __future__ import annotations

import uuid

from vmlend.domain.metadata import NAMESPACE_URI
from vmlend.errors import DomainXMLError

#: Derived from the metadata namespace URI, so the one published name fixes both.
MDEV_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, NAMESPACE_URI)


def parse_uuid(text: str) -> uuid.UUID:
    """Accept the forms libvirt accepts for a UUID (with or without dashes)."""
    try:
        return uuid.UUID(text.strip())
    except (ValueError, AttributeError):
        raise DomainXMLError(f"bad UUID {text!r}") from None


def mdev_uuid(domain_uuid: uuid.UUID | str, fdid: int) -> uuid.UUID:
    """The mdev UUID device ``fdid`` has in the domain ``domain_uuid``."""
    dom = domain_uuid if isinstance(domain_uuid, uuid.UUID) else parse_uuid(domain_uuid)
    return uuid.uuid5(MDEV_NAMESPACE, f"{dom}/{fdid:#x}")
