"""What the domain XML layer costs the hook, for a VM with 4 remote devices.

Prints each operation's time per call next to a bare lxml parse of the same document, measured
in one run. Never asserts a time.
"""

from __future__ import annotations

import timeit
import uuid

from lxml import etree

from vmlend.domain import (
    DeviceRequest,
    DomainDocument,
    DomainSpec,
    TemplateSet,
    add_device,
    has_vmlend_metadata,
    new_domain,
    read_domain,
    remove_device,
    rewrite_for_destination,
)


def main() -> None:
    templates = TemplateSet()
    spec = DomainSpec(
        "bench",
        4 << 30,
        uuid=uuid.UUID(int=1),
        devices=[DeviceRequest(f) for f in (0x10, 0x11, 0x12, 0x13)],
    )
    xml = new_domain(spec, templates=templates).to_bytes()
    # libvirt's own spelling (single quotes), as the hook receives it.
    xml_libvirt = xml.replace(b'"', b"'")
    cases = {
        "lxml parse (baseline)": lambda: etree.fromstring(xml_libvirt),
        "has_vmlend_metadata": lambda: has_vmlend_metadata(xml_libvirt),
        "read_domain (strict)": lambda: read_domain(xml_libvirt),
        "rewrite_for_destination": lambda: rewrite_for_destination(xml_libvirt, "beta"),
        "add+remove device, to_bytes": lambda: remove_device(
            add_device(DomainDocument.parse(xml_libvirt), 0x14, templates=templates), 0x14
        ).to_bytes(),
    }
    base = None
    print(f"domain XML: {len(xml_libvirt)} bytes, 4 vmlend devices")
    for name, fn in cases.items():
        n, _total = timeit.Timer(fn).autorange()
        per = min(timeit.repeat(fn, number=n, repeat=3)) / n
        base = base or per
        print(f"{name:30s} {per * 1e6:9.1f} us  {per / base:6.1f}x")


if __name__ == "__main__":
    main()
