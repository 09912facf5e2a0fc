"""Show that libvirt accepts the demo's domain XML: define it on a fresh connection to
libvirt's test driver, from a small host description shipped with the package."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from lxml import etree

from vmlend.domain import read_domain
from vmlend.wiring.hypervisor import open_hypervisor

#: The test driver's host (in ``vmlend.data``): 8 CPUs, 64 GiB, no domains.
TEST_NODE = "demo-test-node.xml"


def libvirt_accepts(xml: bytes) -> dict[str, Any]:
    """Define ``xml`` with libvirt's test driver; what libvirt kept and added. Raises the
    hypervisor's ``DomainDefinitionError`` when libvirt refuses it."""
    node = resources.files("vmlend.data").joinpath(TEST_NODE)
    with resources.as_file(node) as path:
        uri = f"test://{Path(path).resolve()}"
        # A fresh connection: its domains live and die with it (test:///default is shared).
        hv = open_hypervisor(uri, state_dir=Path(path).parent, hook_command=None)
        try:
            info = hv.define(xml)
            kept = hv.xml(info.name, inactive=True)
        finally:
            hv.close()
    dom = read_domain(kept, strict=False)
    hostdevs = etree.fromstring(kept).findall("devices/hostdev")
    return {
        "uri": uri,
        "name": info.name,
        "uuid": info.uuid,
        "persistent": info.persistent,
        "metadata_fdids": [f"{d.fdid:#x}" for d in dom.devices],
        "mdevs": [_mdev_uuid(h) for h in hostdevs],
        "hostdevs": [
            {k: h.get(k) for k in ("type", "model", "managed", "display") if h.get(k) is not None}
            for h in hostdevs
        ],
    }


def _mdev_uuid(hostdev: etree._Element) -> str | None:
    address = hostdev.find("source/address")
    return None if address is None else address.get("uuid")
