"""Domain XML: vmlend's metadata, mdev hostdevs, templates and rewrites (lxml only).

The API other parts use:

- ``read_domain(xml) -> DomainXMLInfo`` and ``has_vmlend_metadata(xml)`` (hook, CLI)
- ``rewrite_for_destination(xml, dest_node) -> bytes`` (the ``migrate`` hook)
- ``DomainDocument.parse`` / ``add_device`` / ``remove_device`` / ``new_domain`` (CLI)
- ``mdev_uuid(domain_uuid, fdid)`` (anything that must name a device's mdev)
"""

import importlib
from typing import TYPE_CHECKING

# Loaded on first use (PEP 562): the hook reads a domain with ``vmlend.domain.info`` alone and
# must not pay for templates, builders and rewrites it does not use.
_EXPORTS: dict[str, str] = {
    "PciAddress": "address",
    "DeviceRequest": "build",
    "DomainSpec": "build",
    "FdidValidator": "build",
    "new_domain": "build",
    "Problem": "consistency",
    "check_consistency": "consistency",
    "find_problems": "consistency",
    "DomainDocument": "document",
    "DomainXMLInfo": "info",
    "has_vmlend_metadata": "info",
    "read_domain": "info",
    "METADATA_KEY": "metadata",
    "NAMESPACE_URI": "metadata",
    "NvmeShareRequest": "metadata",
    "VmlendDevice": "metadata",
    "add_device": "rewrite",
    "drop_host_local_state": "rewrite",
    "find_device": "rewrite",
    "record_destination": "rewrite",
    "rederive_mdev_uuids": "rewrite",
    "remove_device": "rewrite",
    "rewrite_for_destination": "rewrite",
    "TemplateSet": "templates",
    "mdev_uuid": "uuids",
}

if TYPE_CHECKING:
    # What a type checker sees; at run time __getattr__ below loads each name on first use.
    # tests check that this block and _EXPORTS name the same things.
    from vmlend.domain.address import PciAddress
    from vmlend.domain.build import DeviceRequest, DomainSpec, FdidValidator, new_domain
    from vmlend.domain.consistency import Problem, check_consistency, find_problems
    from vmlend.domain.document import DomainDocument
    from vmlend.domain.info import DomainXMLInfo, has_vmlend_metadata, read_domain
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
    "DomainSpec",
    "DomainXMLInfo",
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


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
