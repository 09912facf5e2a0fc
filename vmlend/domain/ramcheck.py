"""Whether a domain's guest memory layout can be computed at all, for the commands that add
remote devices to domain XML (``vmlend xml new``/``add-device``).

A remote device's DMA windows map exactly the guest's RAM, so a domain whose layout no host
could compute (a memory device vmlend does not model, a non-x86 guest, no ``<memory>``) is
refused when the device is added, not admitted later on a guessed layout. What only the host
decides (the CPU vendor under KVM) and what libvirt fills in at define (the machine type) are
left to the hook, which computes the exact layout on the host.
"""

from __future__ import annotations

import copy

from lxml import etree

from vmlend.domain.document import DomainDocument
from vmlend.errors import LayoutError, VmlendError
from vmlend.memory.domain_memory import domain_layout
from vmlend.memory.layout import CpuVendor


def require_computable_layout(doc: DomainDocument) -> None:
    """A remote device needs the guest's exact memory layout (its DMA windows map exactly the
    RAM): refuse a domain whose layout vmlend cannot compute rather than guess one."""
    root = doc.root
    type_el = root.find("os/type")
    if type_el is None or not type_el.get("machine"):
        # libvirt fills in the machine type when the domain is defined: judge the rest now
        root = copy.deepcopy(root)
        os_el = root.find("os")
        if os_el is None:
            os_el = etree.SubElement(root, "os")
        type_el = os_el.find("type")
        if type_el is None:
            type_el = etree.SubElement(os_el, "type")
        type_el.set("machine", "q35")
    # Under KVM the layout may depend on the host's CPU vendor, which the host's hook knows:
    # only a domain no host could compute the layout of is refused here.
    first: VmlendError | None = None
    for vendor in (None, *CpuVendor):
        try:
            layout = domain_layout(root, vendor)
            break
        except VmlendError as e:
            first = first or e
    else:
        raise LayoutError(
            f"cannot add a remote device: {first} (vmlend maps exactly the guest's RAM and"
            " never guesses its layout)"
        )
    if not layout.ranges():
        raise LayoutError("cannot add a remote device: the domain has no guest RAM (<memory>)")
