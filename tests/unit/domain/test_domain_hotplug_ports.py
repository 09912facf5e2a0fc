"""``free_hotplug_ports``: the hot-pluggable PCIe ports of a guest with nothing in their slot
(what a live hot-add on q35 needs one of)."""

from __future__ import annotations

import pytest
from lxml import etree

from vmlend.domain.model import DomainXML
from vmlend.domain.slots import free_hotplug_ports


def domain(devices: str) -> DomainXML:
    text = (
        "<domain type='kvm'><name>q</name><os><type machine='pc-q35-8.2'>hvm</type></os>"
        f"<devices><controller type='pci' index='0' model='pcie-root'/>{devices}</devices>"
        "</domain>"
    )
    return DomainXML(etree.fromstring(text))


def port(index: int, model: str = "pcie-root-port", extra: str = "") -> str:
    return (
        f"<controller type='pci' index='{index}' model='{model}'>{extra}"
        f"<address type='pci' domain='0x0000' bus='0x00' slot='0x{index + 1:02x}'"
        " function='0x0'/></controller>"
    )


def hostdev(bus: int) -> str:
    return (
        "<hostdev mode='subsystem' type='mdev' model='vfio-pci'><source>"
        "<address uuid='3b6c0000-0000-4000-8000-000000000001'/></source>"
        f"<address type='pci' domain='0x0000' bus='0x{bus:02x}' slot='0x00' function='0x0'/>"
        "</hostdev>"
    )


@pytest.mark.parametrize(
    ("devices", "free"),
    [
        ("", 0),  # pcie-root alone: its slots take no hot-plug
        (port(1) + port(2), 2),
        (port(1) + port(2) + hostdev(1), 1),  # a device in port 1's slot
        (port(1) + hostdev(1), 0),
        (port(1, extra="<target hotplug='off'/>"), 0),  # hot-plug turned off
        (port(3, model="pcie-switch-downstream-port"), 1),
        (port(1, model="pcie-to-pci-bridge"), 0),  # conventional PCI: no PCIe device there
        # a port holding a switch's upstream port is used, whatever is behind it
        (
            port(1)
            + "<controller type='pci' index='2' model='pcie-switch-upstream-port'>"
            "<address type='pci' domain='0x0000' bus='0x01' slot='0x00' function='0x0'/>"
            "</controller>",
            0,
        ),
    ],
)
def test_free_hotplug_ports(devices, free):
    assert free_hotplug_ports(domain(devices)) == free
