"""The read API the hook and the CLI use: what a domain XML says about its remote devices."""

from __future__ import annotations

import uuid

import msgspec

from vmlend.domain.consistency import Problem, find_problems, raise_on
from vmlend.domain.document import DomainDocument
from vmlend.domain.metadata import VmlendDevice, find_metadata
from vmlend.domain.model import DomainXML
from vmlend.errors import DomainXMLError, LayoutError, VmlendError
from vmlend.memory.domain_memory import domain_layout
from vmlend.topology.model import DEFAULT_INTERRUPTS, GuestRam, InterruptPath


class DomainXMLInfo(msgspec.Struct, frozen=True):
    name: str
    uuid: uuid.UUID | None
    memory_bytes: int | None
    machine: str | None
    virt_type: str | None
    devices: tuple[VmlendDevice, ...] = ()
    #: The node the XML was last rewritten for by a migration, if any.
    host_node: str | None = None
    problems: tuple[Problem, ...] = msgspec.field(default=())
    #: The guest's RAM ranges by QEMU's layout rules (None when the XML does not decide them,
    #: e.g. no machine type yet, or a memory device vmlend does not model: ``layout_error``).
    ram: GuestRam | None = None
    #: Why the layout cannot be computed (None: it can).
    layout_error: str | None = None
    #: The VM's default interrupt path (``<vmlend:vmlend interrupts=…>``); None: not given.
    interrupts: InterruptPath | None = None

    def interrupts_of(self, device: VmlendDevice) -> InterruptPath:
        """The path ``device``'s MSI/MSI-X ask for: its own, else the VM's, else the NTB."""
        return device.interrupts or self.interrupts or DEFAULT_INTERRUPTS

    @property
    def guest_ram(self) -> GuestRam:
        """What admission counts: the guest's RAM ranges by QEMU's rules. ``LayoutError`` when
        the XML does not decide them: vmlend never admits a device on a guessed layout (a
        plain q35 guest of the same size could have other ranges, or none)."""
        if self.ram is not None:
            return self.ram
        why = self.layout_error or "its memory layout is unknown"
        raise LayoutError(
            f"domain {self.name}: {why}; vmlend computes the DMA windows from the guest's exact"
            " memory layout and never guesses it, so it admits no remote device for this domain"
        )

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "uuid": None if self.uuid is None else str(self.uuid),
            "memory_bytes": self.memory_bytes,
            "machine": self.machine,
            "virt_type": self.virt_type,
            "host_node": self.host_node,
            "interrupts": None if self.interrupts is None else self.interrupts.value,
            "devices": [d.to_json() for d in self.devices],
            "problems": [p.message for p in self.problems],
        }


def info_of(doc: DomainDocument, *, strict: bool = True) -> DomainXMLInfo:
    domain = DomainXML(doc.root)
    name = domain.name
    if not name:
        raise DomainXMLError("domain XML has no <name>")
    meta = find_metadata(doc.root)
    devices = tuple(meta.devices()) if meta is not None else ()
    problems = tuple(find_problems(doc))
    if strict:
        raise_on(list(problems), f"domain {name} is inconsistent")
    ram: GuestRam | None = None
    layout_error: str | None = None
    try:
        ram = GuestRam(tuple(domain_layout(doc.root).ranges()))
        if not ram.ranges:
            ram, layout_error = None, "it has no guest RAM (<memory> is missing or 0)"
    except VmlendError as e:  # reported by whoever needs the layout (``guest_ram``)
        layout_error = str(e)
    return DomainXMLInfo(
        name=name,
        uuid=domain.uuid,
        memory_bytes=domain.memory_bytes,
        machine=domain.machine,
        virt_type=domain.virt_type,
        devices=devices,
        host_node=meta.host_node if meta is not None else None,
        problems=problems,
        ram=ram,
        layout_error=layout_error,
        interrupts=meta.interrupts if meta is not None else None,
    )


def read_domain(
    xml: bytes | str, *, strict: bool = True, source: str = "domain XML"
) -> DomainXMLInfo:
    """Parse domain XML and describe it. Malformed XML, bad metadata and (with ``strict``) any
    metadata/hostdev disagreement raise ``DomainXMLError`` with one line."""
    return info_of(DomainDocument.parse(xml, source=source), strict=strict)


def has_vmlend_metadata(xml: bytes | str, *, source: str = "domain XML") -> bool:
    """Whether the domain carries vmlend metadata (the hook ignores domains that do not).
    Malformed XML raises ``DomainXMLError``."""
    return find_metadata(DomainDocument.parse(xml, source=source).root) is not None
