"""Which guest PCI addresses libvirt would accept for a new single-function device.

The rules are libvirt's (src/conf/domain_addr.c and src/qemu/qemu_domain_address.c):

- the root bus (``pci-root`` on pc, ``pcie-root`` on q35) has no slot 0 (the host bridge);
- pc (i440fx): slot 1 is the PIIX3 (ISA bridge, IDE, USB, ACPI), slot 2 the primary video
  card when the domain has one without an address;
- q35: slot 0x1f is the ICH9's (LPC/ISA bridge, SATA, SMBus), slot 1 the primary video card
  when the domain has one without an address;
- a ``pcie-root-port`` or a switch's downstream port has a single slot, 0;
- a function other than 0 needs a device at function 0 of that slot with
  ``multifunction='on'`` (QEMU: "single function device can't be populated in function"), and
  function 0 of a slot whose other functions are used would need ``multifunction`` itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from lxml import etree

from vmlend.domain.address import PciAddress
from vmlend.domain.model import DomainXML, PciAddressXML
from vmlend.domain.xmlprop import elements

_OLD_PC = re.compile(r"^pc-\d")  # pc-1.7, pc-0.15: i440fx types from before the "i440fx" name
_SINGLE_SLOT_PORTS = ("pcie-root-port", "pcie-switch-downstream-port")


def machine_family(machine: str | None) -> str | None:
    """``"pc"`` (i440fx), ``"q35"`` or None (another or unknown machine type)."""
    if not machine:
        return None
    if machine == "q35" or machine.startswith("pc-q35"):
        return "q35"
    if machine == "pc" or machine.startswith("pc-i440fx") or _OLD_PC.match(machine):
        return "pc"
    return None


def _pci_addresses(domain: DomainXML) -> Iterator[tuple[PciAddress, etree._Element]]:
    for el in elements(domain.element, "./devices/*/address[@type='pci']"):
        addr = PciAddressXML(el).get()
        if addr is not None:
            yield addr, el


def _has_unaddressed_video(domain: DomainXML) -> bool:
    for video in elements(domain.element, "./devices/video"):
        model = video.find("model")
        if model is not None and model.get("type") == "none":
            continue
        if video.find("address") is None:
            return True
    return False


def _controller_model(domain: DomainXML, bus: int) -> str | None:
    for el in elements(domain.element, "./devices/controller[@type='pci']"):
        try:
            index = int(el.get("index", "-1"))
        except ValueError:
            continue
        if index == bus:
            return el.get("model")
    return None


def _reserved(domain: DomainXML, address: PciAddress) -> str | None:
    """Why libvirt keeps ``address``'s slot for itself, if it does."""
    if address.domain != 0:
        return None
    if address.bus != 0:
        model = _controller_model(domain, address.bus)
        if model in _SINGLE_SLOT_PORTS and address.slot != 0:
            return f"a {model} (bus {address.bus:#04x}) has only slot 0"
        return None
    family = machine_family(domain.machine)
    video = _has_unaddressed_video(domain)
    if address.slot == 0:
        return "slot 0 of the root bus is the host bridge"
    if family == "pc" and address.slot == 1:
        return "slot 1 on a pc (i440fx) machine is the PIIX3 (ISA, IDE, USB, ACPI)"
    if family == "pc" and address.slot == 2 and video:
        return "slot 2 on a pc machine is the primary video card's"
    if family == "q35" and address.slot == 0x1F:
        return "slot 0x1f on a q35 machine is the ICH9's (ISA bridge, SATA, SMBus)"
    if family == "q35" and address.slot == 1 and video:
        return "slot 1 on a q35 machine is the primary video card's"
    return None


def address_problem(domain: DomainXML, address: PciAddress) -> str | None:
    """Why a new single-function device cannot have guest address ``address``, or None."""
    reserved = _reserved(domain, address)
    if reserved is not None:
        return f"guest PCI address {address} is reserved by libvirt: {reserved}"
    same_slot = {
        addr.function: el
        for addr, el in _pci_addresses(domain)
        if (addr.domain, addr.bus, addr.slot) == (address.domain, address.bus, address.slot)
    }
    if address.function in same_slot:
        user = same_slot[address.function].getparent()
        tag = user.tag if user is not None else "device"
        return f"guest PCI address {address} is already used by a <{tag!s}>"
    if address.function != 0:
        first = same_slot.get(0)
        if first is None or first.get("multifunction") != "on":
            return (
                f"guest PCI address {address} is function {address.function} of a slot whose"
                " function 0 is not a multifunction='on' device"
            )
    elif same_slot:
        return (
            f"guest PCI address {address} is function 0 of a slot whose other functions are"
            " used; that needs a multifunction device"
        )
    return None


def free_hotplug_ports(domain: DomainXML) -> int:
    """How many hot-pluggable PCIe ports (``pcie-root-port``, a switch's downstream port) have
    nothing in their one slot. On q35 libvirt hot-plugs a PCIe device (an mdev's vfio-pci)
    only into such a port, and cannot add a port to a running guest: with none free, a live
    hot-add fails with "No more available PCI slots"."""
    used = {addr.bus for addr, _el in _pci_addresses(domain) if addr.domain == 0}
    free = 0
    for el in elements(domain.element, "./devices/controller[@type='pci']"):
        if el.get("model") not in _SINGLE_SLOT_PORTS:
            continue
        target = el.find("target")
        if target is not None and target.get("hotplug") == "off":
            continue
        try:
            index = int(el.get("index", "-1"))
        except ValueError:
            continue
        if index > 0 and index not in used:
            free += 1
    return free
