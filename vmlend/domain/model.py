"""The parts of a libvirt domain vmlend reads and writes, declared as XML properties.

These classes only convert between XML and Python values; what to change, and whether a
document is consistent, is decided in ``rewrite``. Anything not declared here is left alone.
"""

from __future__ import annotations

from collections.abc import Callable
from uuid import UUID

from lxml import etree

from vmlend.domain.address import PciAddress
from vmlend.domain.indent import insert_child
from vmlend.domain.units import libvirt_bytes
from vmlend.domain.uuids import parse_uuid
from vmlend.domain.xmlprop import XMLNode, XMLProperty, elements
from vmlend.errors import ConfigError, DomainXMLError


def _int_any_base(text: str) -> int:
    # libvirt writes address parts as 0x.. but also accepts decimal.
    return int(text, 0)


def _hex(width: int) -> Callable[[int], str]:
    return lambda value: f"{value:#0{width + 2}x}"


class PciAddressXML(XMLNode):
    """``<address type='pci' domain= bus= slot= function=/>``."""

    type = XMLProperty("./@type")
    domain = XMLProperty("./@domain", parse=_int_any_base, format=_hex(4))
    bus = XMLProperty("./@bus", parse=_int_any_base, format=_hex(2))
    slot = XMLProperty("./@slot", parse=_int_any_base, format=_hex(2))
    function = XMLProperty("./@function", parse=_int_any_base, format=_hex(1))

    def get(self) -> PciAddress | None:
        if self.type != "pci":
            return None
        try:
            return PciAddress(self.domain or 0, self.bus or 0, self.slot or 0, self.function or 0)
        except ConfigError as e:
            raise DomainXMLError(str(e)) from None

    def set(self, address: PciAddress) -> None:
        self.type = "pci"
        self.domain = address.domain
        self.bus = address.bus
        self.slot = address.slot
        self.function = address.function


class MdevHostdevXML(XMLNode):
    """``<hostdev mode='subsystem' type='mdev' model='vfio-pci'>`` and its guest address."""

    mode = XMLProperty("./@mode")
    type = XMLProperty("./@type")
    model = XMLProperty("./@model")
    uuid = XMLProperty("./source/address/@uuid", parse=parse_uuid)

    @property
    def guest_address(self) -> PciAddress | None:
        el = self.element.find("address")
        return PciAddressXML(el).get() if el is not None else None

    def set_guest_address(self, address: PciAddress | None) -> None:
        el = self.element.find("address")
        if address is None:
            if el is not None:
                self.element.remove(el)
            return
        if el is None:
            # Laid out like its siblings, so a guest address reads like libvirt's own.
            el = insert_child(self.element, etree.Element("address"))
        PciAddressXML(el).set(address)


_AFTER_DEVICES = ("seclabel", "keywrap", "launchSecurity")


class DomainXML(XMLNode):
    """The ``<domain>`` root: what vmlend needs to know about a VM."""

    virt_type = XMLProperty("./@type")
    name = XMLProperty("./name")
    uuid = XMLProperty("./uuid", parse=parse_uuid)
    memory_text = XMLProperty("./memory")
    memory_unit = XMLProperty("./memory/@unit")
    current_memory_text = XMLProperty("./currentMemory")
    current_memory_unit = XMLProperty("./currentMemory/@unit")
    vcpus = XMLProperty("./vcpu", parse=int)
    machine = XMLProperty("./os/type/@machine")
    arch = XMLProperty("./os/type/@arch")

    @property
    def memory_bytes(self) -> int | None:
        text = self.memory_text
        return None if text is None else libvirt_bytes(text, self.memory_unit)

    def set_memory(self, size: int) -> None:
        """Set ``<memory>`` and ``<currentMemory>`` in KiB (libvirt's own unit)."""
        if size <= 0 or size % 1024:
            raise ConfigError(f"memory {size} bytes is not a positive multiple of 1 KiB")
        self.memory_text = str(size // 1024)
        self.memory_unit = "KiB"
        self.current_memory_text = str(size // 1024)
        self.current_memory_unit = "KiB"

    def require_uuid(self) -> UUID:
        value = self.uuid
        if value is None:
            raise DomainXMLError(
                f"domain {self.name or '?'} has no <uuid>; vmlend derives mdev UUIDs from it,"
                " so give the domain a <uuid> (or let 'vmlend xml new' generate one)"
            )
        return value

    def devices_element(self, *, create: bool = False) -> etree._Element | None:
        el = self.element.find("devices")
        if el is None and create:
            el = insert_child(self.element, etree.Element("devices"), self._devices_index())
        return el

    def _devices_index(self) -> int:
        """Where libvirt writes ``<devices>``: before the security labels and before the
        hypervisor namespaces' elements (``<qemu:commandline>``), else last."""
        for i, child in enumerate(self.element):
            tag = child.tag
            if isinstance(tag, str) and (tag in _AFTER_DEVICES or tag.startswith("{")):
                return i
        return len(self.element)

    def mdev_hostdevs(self) -> list[MdevHostdevXML]:
        path = "./devices/hostdev[@mode='subsystem'][@type='mdev']"
        return [MdevHostdevXML(el) for el in elements(self.element, path)]

    def metadata_element(self) -> etree._Element | None:
        return self.element.find("metadata")
