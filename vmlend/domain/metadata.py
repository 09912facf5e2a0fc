"""vmlend's own ``<metadata>`` element, in its own namespace.

::

    <metadata>
      <vmlend:vmlend xmlns:vmlend="http://vmlend.org/xmlns/domain/1.0">
        <vmlend:device fdid="0x10" mdev="…uuid…" address="0000:00:05.0"/>
        <vmlend:device fdid="0x12" mdev="…uuid…" nvme-queues="2" nvme-size="64G" nvme-paths="2"/>
        <vmlend:device fdid="0x14" mdev="…uuid…" interrupts="relay"/>
        <vmlend:host node="beta"/>
      </vmlend:vmlend>
    </metadata>

One top-level element per namespace, as libvirt's metadata API expects (key ``vmlend``); other
tools' elements under ``<metadata>`` are never touched. ``address`` is optional (libvirt then
assigns one). ``host`` records the node the XML was last rewritten for (migration).
``nvme-queues`` and ``nvme-size`` (together) ask for a queue-level share of an NVMe drive
instead of the whole drive; ``nvme-paths="2"`` (optional, default 1) gives the share a backup
queue pair per queue pair through another adapter of the VM's host.
``interrupts`` (``ntb`` or ``relay``) picks how a device's MSI/MSI-X reach the VM; on
``<vmlend:vmlend>`` it is the VM's default for devices that do not say. Absent everywhere: the
NTB when its window has room, else the relay (docs/interrupts.md).
``metadata='kept'`` marks a ``<metadata>`` that existed, empty, before vmlend's element;
``devices='absent'|'empty'`` a ``<devices>`` that libvirt would have written otherwise.
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
from lxml import etree

from vmlend.domain.address import PciAddress
from vmlend.domain.units import parse_size
from vmlend.domain.xmlprop import XMLNode, XMLProperty
from vmlend.errors import ConfigError, DomainXMLError
from vmlend.topology.model import InterruptPath, format_fdid, parse_fdid
from vmlend.units import format_size_exact

#: Stable namespace URI of vmlend's domain metadata. Bump the version only for incompatible
#: changes; readers then refuse the unknown version instead of guessing.
NAMESPACE_URI = "http://vmlend.org/xmlns/domain/1.0"
#: Prefix used when vmlend writes the element (readers go by URI, never by prefix).
PREFIX = "vmlend"
#: Key for virDomainSetMetadata / virDomainGetMetadata.
METADATA_KEY = PREFIX
ROOT_TAG = f"{{{NAMESPACE_URI}}}vmlend"
DEVICE_TAG = f"{{{NAMESPACE_URI}}}device"
HOST_TAG = f"{{{NAMESPACE_URI}}}host"

_NS = {PREFIX: NAMESPACE_URI}
# Any version of our namespace: a newer one is refused rather than ignored (ignoring it would
# make the hook treat a vmlend domain as foreign and start it without its devices).
_NAMESPACE_FAMILY = "{" + NAMESPACE_URI.rsplit("/", 1)[0] + "/"


#: An NVMe namespace's size and LBAs are 64-bit (NSZE, SLBA): no share has 2^64 blocks or more.
MAX_NVME_BLOCKS = 1 << 64


class NvmeShareRequest(msgspec.Struct, frozen=True):
    """A share of an NVMe drive instead of the whole drive (docs/nvme-sharing.md): I/O queue
    pairs and the size of the one namespace the VM sees."""

    queue_pairs: int
    size: int  # bytes
    paths: int = 1  # 2: a backup queue pair per queue pair, through another adapter

    def __post_init__(self) -> None:
        if self.paths not in (1, 2):
            raise DomainXMLError(
                f"an NVMe share has 1 or 2 paths (a primary and a backup), not {self.paths}"
            )
        if not 1 <= self.queue_pairs <= 0xFFFE:
            raise DomainXMLError(f"an NVMe share has 1..65534 queue pairs, not {self.queue_pairs}")
        if self.size < 512 or self.size % 512:
            raise DomainXMLError(f"an NVMe share's size is whole 512-byte blocks, not {self.size}")
        if self.size // 512 >= MAX_NVME_BLOCKS:
            raise DomainXMLError(
                f"an NVMe share of {self.size} bytes has more blocks than an NVMe namespace can"
                " (2^64)"
            )


class VmlendDevice(msgspec.Struct, frozen=True):
    """One remote device of a domain, as its metadata lists it."""

    fdid: int
    mdev: uuid.UUID
    address: PciAddress | None = None
    share: NvmeShareRequest | None = None  # a queue-level share, not the whole device
    #: The device's own choice of interrupt path; None: the VM's default applies.
    interrupts: InterruptPath | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "fdid": format_fdid(self.fdid),
            "mdev": str(self.mdev),
            "address": None if self.address is None else str(self.address),
        }
        if self.share is not None:
            out["nvme_share"] = {
                "queue_pairs": self.share.queue_pairs,
                "size": self.share.size,
                "paths": self.share.paths,
            }
        if self.interrupts is not None:
            out["interrupts"] = self.interrupts.value
        return out


def _parse_fdid(text: str) -> int:
    try:
        return parse_fdid(text)
    except ConfigError as e:
        raise DomainXMLError(str(e)) from None


def _parse_address(text: str) -> PciAddress:
    try:
        return PciAddress.parse(text)
    except ConfigError as e:
        raise DomainXMLError(str(e)) from None


def _parse_queues(text: str) -> int:
    try:
        return int(text, 10)
    except ValueError:
        raise DomainXMLError(f"bad nvme-queues {text!r}: expected a number such as 2") from None


def _parse_paths(text: str) -> int:
    try:
        return int(text, 10)
    except ValueError:
        raise DomainXMLError(f"bad nvme-paths {text!r}: expected 1 or 2") from None


def _parse_share_size(text: str) -> int:
    try:
        return parse_size(text, limit=None)  # storage: NvmeShareRequest bounds its blocks
    except ConfigError as e:
        raise DomainXMLError(f"bad nvme-size: {e}") from None


def _parse_interrupts(text: str) -> InterruptPath:
    try:
        return InterruptPath.parse(text)
    except ConfigError as e:
        raise DomainXMLError(str(e)) from None


def _parse_mdev(text: str) -> uuid.UUID:
    try:
        return uuid.UUID(text)
    except ValueError:
        raise DomainXMLError(f"bad mdev UUID {text!r}") from None


class DeviceEntryXML(XMLNode):
    NAMESPACES = _NS
    fdid = XMLProperty("./@fdid", parse=_parse_fdid, format=format_fdid)
    mdev = XMLProperty("./@mdev", parse=_parse_mdev)
    address = XMLProperty("./@address", parse=_parse_address)
    nvme_queues = XMLProperty("./@nvme-queues", parse=_parse_queues, format=str)
    nvme_size = XMLProperty("./@nvme-size", parse=_parse_share_size, format=format_size_exact)
    nvme_paths = XMLProperty("./@nvme-paths", parse=_parse_paths, format=str)
    interrupts = XMLProperty("./@interrupts", parse=_parse_interrupts, format=str)

    def get(self) -> VmlendDevice:
        fdid, mdev = self.fdid, self.mdev
        if fdid is None or mdev is None:
            raise DomainXMLError(
                "a <vmlend:device> in the domain metadata lacks its fdid or mdev attribute"
            )
        queues, size = self.nvme_queues, self.nvme_size
        if (queues is None) != (size is None):
            raise DomainXMLError(
                f"device {format_fdid(fdid)}: an NVMe share needs both nvme-queues and nvme-size"
            )
        paths = self.nvme_paths
        if paths is not None and queues is None:
            raise DomainXMLError(
                f"device {format_fdid(fdid)}: nvme-paths is for an NVMe share (with nvme-queues"
                " and nvme-size)"
            )
        share = (
            None
            if queues is None or size is None
            else NvmeShareRequest(queues, size, 1 if paths is None else paths)
        )
        return VmlendDevice(
            fdid=fdid, mdev=mdev, address=self.address, share=share, interrupts=self.interrupts
        )


class VmlendMetadataXML(XMLNode):
    """The ``<vmlend:vmlend>`` element."""

    NAMESPACES = _NS
    host_node = XMLProperty("./vmlend:host/@node")
    #: ``"kept"`` when the ``<metadata>`` element was there, empty, before vmlend added its
    #: own element: removing the last device then leaves it as it was instead of deleting it.
    metadata_container = XMLProperty("./@metadata")
    #: How ``<devices>`` was before vmlend's first hostdev, when libvirt would not have
    #: written it so: ``"absent"`` or ``"empty"`` (``<devices/>``); restored with the last one.
    devices_container = XMLProperty("./@devices")
    #: The VM's default interrupt path for devices that do not name one.
    interrupts = XMLProperty("./@interrupts", parse=_parse_interrupts, format=str)

    @staticmethod
    def new_element() -> etree._Element:
        return etree.Element(ROOT_TAG, nsmap={PREFIX: NAMESPACE_URI})

    def entries(self) -> list[DeviceEntryXML]:
        return [DeviceEntryXML(el) for el in self.element.findall(DEVICE_TAG)]

    def devices(self) -> list[VmlendDevice]:
        out = [e.get() for e in self.entries()]
        seen: set[int] = set()
        for d in out:
            if d.fdid in seen:
                raise DomainXMLError(
                    f"device {format_fdid(d.fdid)} is listed twice in the vmlend metadata"
                )
            seen.add(d.fdid)
        return out

    def entry(self, fdid: int) -> DeviceEntryXML | None:
        for e in self.entries():
            if e.fdid == fdid:
                return e
        return None

    def new_entry(self, device: VmlendDevice) -> etree._Element:
        el = etree.Element(DEVICE_TAG)
        entry = DeviceEntryXML(el)
        entry.fdid = device.fdid
        entry.mdev = device.mdev
        entry.address = device.address
        if device.share is not None:
            entry.nvme_queues = device.share.queue_pairs
            entry.nvme_size = device.share.size
            if device.share.paths != 1:
                entry.nvme_paths = device.share.paths
        entry.interrupts = device.interrupts
        return el


def find_metadata(domain: etree._Element) -> VmlendMetadataXML | None:
    """vmlend's element under ``<metadata>``, found by namespace URI (any prefix)."""
    meta = domain.find("metadata")
    if meta is None:
        return None
    found = meta.findall(ROOT_TAG)
    if len(found) > 1:
        raise DomainXMLError(
            f"domain metadata has {len(found)} vmlend elements; libvirt allows one per namespace"
        )
    if found:
        return VmlendMetadataXML(found[0])
    for child in meta:
        if isinstance(child.tag, str) and child.tag.startswith(_NAMESPACE_FAMILY):
            uri = child.tag.split("}")[0][1:]
            raise DomainXMLError(
                f"domain metadata uses an unsupported vmlend namespace {uri}"
                f" (this vmlend reads {NAMESPACE_URI}); upgrade vmlend"
            )
    return None
