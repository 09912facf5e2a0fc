"""Pure domain-XML rules of the simulated hypervisor: what libvirt checks and adds on define,
how it edits ``<metadata>`` and hot-plugged devices. No I/O; every function works on lxml trees.

Only behaviour observed from libvirt is mimicked (docs/testing.md): define
generates a missing UUID and marks mdev hostdevs ``managed='no'`` (and ``display='off'`` for
vfio-pci); a running domain's XML carries ``id``. Errors reuse libvirt's wording.
"""

from __future__ import annotations

import copy
import uuid as uuidlib
from collections.abc import Callable

from lxml import etree

from vmlend.errors import DomainDefinitionError, DomainStateError, UnsupportedOperationError

_PARSER = etree.XMLParser(
    remove_blank_text=True, resolve_entities=False, no_network=True, huge_tree=False
)

Element = etree._Element


def parse(xml: bytes, op: str, what: str, root_tag: str | None = None) -> Element:
    """Parse ``xml``; refuse malformed XML and (given ``root_tag``) another root element."""
    try:
        root = etree.fromstring(xml, _PARSER)
    except etree.XMLSyntaxError as e:
        raise DomainDefinitionError(op, what, f"XML error: {e}") from None
    if root_tag is not None and root.tag != root_tag:
        raise DomainDefinitionError(
            op, what, f"XML error: expecting root element of '{root_tag}', not '{root.tag!s}'"
        )
    return root


def serialize(root: Element) -> bytes:
    return etree.tostring(root, encoding="unicode", pretty_print=True).encode("utf-8")


# --- domains -------------------------------------------------------------------------------


def name_of(root: Element) -> str:
    return (root.findtext("name") or "").strip()


def uuid_of(root: Element) -> str:
    return (root.findtext("uuid") or "").strip()


def parse_domain(xml: bytes) -> Element:
    """Parse and check a domain definition the way libvirt's parser does, then add libvirt's
    defaults. Raises ``DomainDefinitionError`` with libvirt's reason."""
    root = parse(xml, "define", "domain XML", root_tag="domain")
    name = name_of(root)

    def refuse(reason: str) -> DomainDefinitionError:
        return DomainDefinitionError("define", name or "domain XML", reason)

    if not root.get("type"):
        raise refuse("missing domain type attribute")
    if not name:
        raise refuse("missing name information")
    if "/" in name or name.startswith("."):
        # libvirt forbids '/'; a leading dot would hide the sim's state file.
        raise refuse(f"name {name!r} cannot contain '/' or start with '.'")
    if "\n" in name:
        # libvirt's own check (virXMLCheckIllegalChars): a name is one line in every listing
        # and log. Its message prints the character itself; here it is escaped.
        raise refuse("invalid char in name: \\n")
    if root.find("memory") is None:
        raise refuse("XML error: Memory size must be specified via <memory>")
    if root.find("os/type") is None:
        raise refuse("XML error: an os <type> must be specified")
    uuid_el = root.find("uuid")
    if uuid_el is None:
        uuid_el = etree.Element("uuid")
        name_el = root.find("name")
        assert name_el is not None  # name_of() read its text above
        name_el.addnext(uuid_el)
        uuid_el.text = str(uuidlib.uuid4())
    else:
        try:
            uuid_el.text = str(uuidlib.UUID((uuid_el.text or "").strip()))
        except ValueError:
            raise refuse("malformed uuid element") from None
    for hostdev in root.iterfind("devices/hostdev"):
        hostdev_defaults(hostdev)
    return root


def hostdev_defaults(hostdev: Element) -> None:
    """What libvirt's post-parse adds to an mdev hostdev on this machine kind."""
    if hostdev.get("type") != "mdev":
        return
    hostdev.set("managed", hostdev.get("managed", "no"))
    if hostdev.get("model") == "vfio-pci":
        hostdev.set("display", hostdev.get("display", "off"))


def live_copy(root: Element, domid: int) -> Element:
    """The XML of the running domain made from its definition."""
    live = copy.deepcopy(root)
    live.set("id", str(domid))
    return live


def inactive_copy(root: Element) -> Element:
    inactive = copy.deepcopy(root)
    inactive.attrib.pop("id", None)
    return inactive


# --- metadata ------------------------------------------------------------------------------


def _local(el: Element) -> str:
    return etree.QName(el).localname


def _namespace(el: Element) -> str | None:
    return etree.QName(el).namespace


def _rebuild(
    el: Element, rename: Callable[[Element], str], uri: str, root_nsmap: dict[str, str]
) -> Element:
    """A copy of ``el`` with every element renamed by ``rename``, keeping the prefixes of other
    namespaces (``uri``'s own prefix is replaced by ``root_nsmap``, given to the top only)."""
    nsmap = {p: u for p, u in el.nsmap.items() if p is not None and u != uri} | root_nsmap
    new = etree.Element(rename(el), attrib=dict(el.attrib), nsmap=nsmap)
    new.text = el.text
    for child in el:
        if isinstance(child.tag, str):
            copied = _rebuild(child, rename, uri, {})
        else:  # comments and processing instructions stay as they are
            copied = copy.copy(child)
        copied.tail = child.tail
        new.append(copied)
    return new


def get_metadata(root: Element, uri: str) -> bytes | None:
    """The first ``<metadata>`` child in namespace ``uri``, returned without that namespace."""
    for el in root.iterfind("metadata/*"):
        if isinstance(el.tag, str) and _namespace(el) == uri:

            def strip(e: Element) -> str:
                return _local(e) if _namespace(e) == uri else str(e.tag)

            plain = _rebuild(el, strip, uri, {})
            etree.cleanup_namespaces(plain)
            return serialize(plain)
    return None


def set_metadata(root: Element, uri: str, key: str, xml: bytes | None, op: str) -> None:
    """Replace (``xml=None``: remove) the element of namespace ``uri`` under ``<metadata>``.
    Elements without a namespace move into ``uri`` with prefix ``key``, as libvirt does."""
    name = name_of(root)
    if not uri:
        raise DomainDefinitionError(op, name, "metadata namespace URI must not be empty")
    new = None
    if xml is not None:
        try:
            etree.Element("probe", nsmap={key: uri})  # lxml checks the prefix is an NCName
        except ValueError:
            raise DomainDefinitionError(op, name, f"invalid metadata prefix {key!r}") from None
        given = parse(xml, op, name)

        def into(e: Element) -> str:
            return f"{{{uri}}}{_local(e)}" if _namespace(e) is None else str(e.tag)

        new = _rebuild(given, into, uri, {key: uri})
        etree.cleanup_namespaces(new)
    meta = root.find("metadata")
    if meta is not None:
        for el in list(meta):
            if isinstance(el.tag, str) and _namespace(el) == uri:
                meta.remove(el)
    if new is not None:
        if meta is None:
            meta = etree.Element("metadata")
            anchor = root.find("uuid")
            if anchor is None:
                anchor = root.find("name")
            assert anchor is not None  # a stored domain has a name (parse_domain)
            anchor.addnext(meta)
        meta.append(new)
    elif meta is not None and len(meta) == 0:
        root.remove(meta)


# --- hot-plugged devices --------------------------------------------------------------------


def parse_device(xml: bytes, op: str, domain: str) -> Element:
    """Parse device XML for attach/detach; the simulator plugs only ``<hostdev>`` (all vmlend
    needs) and says so for anything else."""
    dev = parse(xml, op, domain)
    if dev.tag != "hostdev":
        raise UnsupportedOperationError(
            op, domain, f"the simulated hypervisor hot-plugs only <hostdev>, not <{dev.tag!s}>"
        )
    if device_key(dev) is None:
        raise DomainDefinitionError(
            op, domain, "hostdev needs <source><address uuid=…/> (mdev) or a PCI address"
        )
    hostdev_defaults(dev)
    return dev


def device_key(dev: Element) -> tuple[str, ...] | None:
    """What identifies a host device, as libvirt matches it: the mdev UUID or the PCI
    address (numbers compared by value, so 0x01 == 0x1)."""
    addr = dev.find("source/address")
    if addr is None:
        return None
    kind = dev.get("type")
    if kind == "mdev" and addr.get("uuid"):
        try:
            return ("mdev", str(uuidlib.UUID(addr.get("uuid", ""))))
        except ValueError:
            return None
    if kind == "pci":
        try:
            parts = [int(addr.get(k, "0"), 0) for k in ("domain", "bus", "slot", "function")]
        except ValueError:
            return None
        return ("pci", *(str(p) for p in parts))
    return None


def describe(dev: Element) -> str:
    key = device_key(dev)
    return " ".join(key) if key else f"<{dev.tag!s}>"


def add_device(root: Element, dev: Element, op: str) -> None:
    key = device_key(dev)
    devices = root.find("devices")
    if devices is None:
        devices = etree.SubElement(root, "devices")
    for other in devices.iterfind("hostdev"):
        if device_key(other) == key:
            raise DomainStateError(
                op, name_of(root), f"device {describe(dev)} is already in the domain configuration"
            )
    devices.append(copy.deepcopy(dev))


def remove_device(root: Element, dev: Element, op: str) -> Element:
    """Remove the hostdev matching ``dev``; return the removed element (as the domain had it)."""
    key = device_key(dev)
    for other in root.iterfind("devices/hostdev"):
        if device_key(other) == key:
            parent = other.getparent()
            assert parent is not None  # found under devices/
            parent.remove(other)
            return other
    raise DomainStateError(
        op, name_of(root), f"device {describe(dev)} not present in domain configuration"
    )
