"""A new domain from the templates: ``vmlend xml new``."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Sequence
from pathlib import PurePath

import msgspec
from lxml import etree

from vmlend.domain.address import PciAddress
from vmlend.domain.document import DomainDocument
from vmlend.domain.indent import insert_child
from vmlend.domain.metadata import NvmeShareRequest
from vmlend.domain.model import DomainXML
from vmlend.domain.rewrite import add_device, set_vm_interrupts
from vmlend.domain.templates import MACHINES, TemplateSet
from vmlend.domain.xmlprop import XMLNode, XMLProperty
from vmlend.errors import ConfigError
from vmlend.topology.model import InterruptPath

#: Checks that a fabric device id exists (raises ``UnknownDeviceError`` or similar); the CLI
#: passes one backed by the fabric when a state exists.
FdidValidator = Callable[[int], object]

VIRT_TYPES = ("kvm", "qemu")
#: Root ports fit the free slots of pcie-root (libvirt fills slots 1-0x1e, 8 functions each).
MAX_HOTPLUG_SLOTS = 64
_NAME = re.compile(r"^[^/\x00-\x1f]{1,200}$")


class DiskXML(XMLNode):
    driver_type = XMLProperty("./driver/@type")
    file = XMLProperty("./source/@file")


class DeviceRequest(msgspec.Struct, frozen=True):
    fdid: int
    address: PciAddress | None = None
    share: NvmeShareRequest | None = None  # a queue-level share of an NVMe drive
    interrupts: InterruptPath | None = None  # the device's own; None: the VM's default


class DomainSpec(msgspec.Struct, frozen=True):
    name: str
    memory_bytes: int
    vcpus: int = 1
    machine: str = "q35"
    virt_type: str = "kvm"
    uuid: uuid.UUID | None = None
    disk: PurePath | None = None
    devices: Sequence[DeviceRequest] = msgspec.field(default=())
    #: Empty pcie-root-ports (q35) to hot-plug devices into later; libvirt numbers them.
    hotplug_slots: int = 0
    #: The VM's default interrupt path for its devices (None: vmlend's, the NTB if admissible).
    interrupts: InterruptPath | None = None

    def validate(self) -> None:
        """Checks separate from building: every problem is the user's to fix."""
        if not _NAME.match(self.name) or self.name.strip() != self.name:
            raise ConfigError(
                f"bad domain name {self.name!r}: 1-200 characters, no '/', no control characters"
            )
        if self.memory_bytes < 1 << 20 or self.memory_bytes % 1024:
            raise ConfigError("memory must be at least 1M and a multiple of 1K")
        if not 1 <= self.vcpus <= 4096:
            raise ConfigError(f"vcpus must be between 1 and 4096, not {self.vcpus}")
        if self.machine not in MACHINES:
            raise ConfigError(f"unknown machine type {self.machine!r}; choose q35 or pc")
        if self.virt_type not in VIRT_TYPES:
            raise ConfigError(f"unknown virt type {self.virt_type!r}; choose kvm or qemu (TCG)")
        if not 0 <= self.hotplug_slots <= MAX_HOTPLUG_SLOTS:
            raise ConfigError(f"--hotplug-slots must be 0..{MAX_HOTPLUG_SLOTS}")
        if self.hotplug_slots and self.machine != "q35":
            raise ConfigError(
                "--hotplug-slots is for q35 (PCIe needs a root port per hot-plugged device);"
                " pc hot-plugs into its root bus without one"
            )
        fdids = [d.fdid for d in self.devices]
        if len(set(fdids)) != len(fdids):
            raise ConfigError("a device is given twice")
        if self.interrupts is not None and not self.devices:
            raise ConfigError(
                "--interrupts is the interrupt path of the VM's remote devices: give a --device"
            )


def _add_root_ports(domain: DomainXML, count: int) -> None:
    """``count`` pcie-root-ports after the last PCI controller, indexes after the highest."""
    if not count:
        return
    devices = domain.devices_element(create=True)
    assert devices is not None
    controllers = devices.findall("controller[@type='pci']")
    indexes = [int(c.get("index", "0"), 0) for c in controllers]
    first = max(indexes, default=0) + 1
    at = devices.index(controllers[-1]) + 1 if controllers else 0
    for n in range(count):
        port = etree.Element("controller", type="pci", index=str(first + n), model="pcie-root-port")
        insert_child(devices, port, at + n)


def _disk_format(path: PurePath) -> str:
    return "qcow2" if path.suffix == ".qcow2" else "raw"


def new_domain(
    spec: DomainSpec,
    *,
    templates: TemplateSet,
    validate_fdid: FdidValidator | None = None,
) -> DomainDocument:
    """A complete domain for ``spec`` (a random UUID unless given)."""
    spec.validate()
    for d in spec.devices:
        if validate_fdid is not None:
            validate_fdid(d.fdid)
    root = templates.domain(spec.machine)
    domain = DomainXML(root)
    domain.virt_type = spec.virt_type
    domain.name = spec.name
    domain.uuid = spec.uuid or uuid.uuid4()
    domain.set_memory(spec.memory_bytes)
    domain.vcpus = spec.vcpus
    if spec.disk is not None:
        disk_el = templates.disk()
        disk = DiskXML(disk_el)
        disk.file = str(spec.disk)
        disk.driver_type = _disk_format(spec.disk)
        devices = domain.devices_element(create=True)
        assert devices is not None
        insert_child(devices, disk_el, 0)
    _add_root_ports(domain, spec.hotplug_slots)
    doc = DomainDocument.from_element(root)
    for d in spec.devices:
        doc = add_device(
            doc,
            d.fdid,
            templates=templates,
            address=d.address,
            share=d.share,
            interrupts=d.interrupts,
        )
    return set_vm_interrupts(doc, spec.interrupts)
