"""Domain XML: vmlend's metadata, mdev hostdevs, templates and rewrites (lxml only).

The API other parts use:

- ``read_domain(xml) -> DomainInfo`` and ``has_vmlend_metadata(xml)`` (hook, CLI)
- ``rewrite_for_destination(xml, dest_node) -> bytes`` (the ``migrate`` hook)
- ``DomainDocument.parse`` / ``add_device`` / ``remove_device`` / ``new_domain`` (CLI)
- ``mdev_uuid(domain_uuid, fdid)`` (anything that must name a device's mdev)
"""

from vmlend.domain.address import PciAddress
from vmlend.domain.build import DeviceRequest, DomainSpec, FdidValidator, new_domain
from vmlend.domain.consistency import Problem, check_consistency, find_problems
from vmlend.domain.document import DomainDocument
from vmlend.domain.info import DomainInfo, has_vmlend_metadata, read_domain
from vmlend.domain.metadata import METADATA_KEY, NAMESPACE_URI, NvmeShareRequest, VmlendDevice
from vmlend.domain.rewrite import (
    add_device,
    drop_host_local_state,
    find_device,
    record_destination,
    rederive_mdev_uuids,
    remove_device,
    rewrite_for_destination,
)
from vmlend.domain.templates import TemplateSet
from vmlend.domain.uuids import mdev_uuid

__all__ = [
    "METADATA_KEY",
    "NAMESPACE_URI",
    "DeviceRequest",
    "DomainDocument",
    "DomainInfo",
    "DomainSpec",
    "FdidValidator",
    "NvmeShareRequest",
    "PciAddress",
    "Problem",
    "TemplateSet",
    "VmlendDevice",
    "add_device",
    "check_consistency",
    "drop_host_local_state",
    "find_device",
    "find_problems",
    "has_vmlend_metadata",
    "mdev_uuid",
    "new_domain",
    "read_domain",
    "record_destination",
    "rederive_mdev_uuids",
    "remove_device",
    "rewrite_for_destination",
]
