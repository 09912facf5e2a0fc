"""The XML properties, units, addresses, UUID derivation and the read API."""

from __future__ import annotations

import uuid

import pytest
from click.testing import CliRunner
from lxml import etree

from tests.support.domain_support import DATA
from vmlend.cli import main
from vmlend.domain import (
    NAMESPACE_URI,
    PciAddress,
    has_vmlend_metadata,
    mdev_uuid,
    read_domain,
)
from vmlend.domain.build import DiskXML
from vmlend.domain.metadata import DeviceEntryXML, VmlendMetadataXML
from vmlend.domain.model import DomainXML, MdevHostdevXML, PciAddressXML
from vmlend.domain.units import libvirt_bytes, parse_cli_size, parse_size
from vmlend.domain.xmlprop import XMLNode, XMLProperty
from vmlend.errors import ConfigError, DomainXMLError
from vmlend.topology.model import InterruptPath

U = uuid.UUID("c7a5fdbd-edaf-9455-926a-d65c16db1809")

# A value to write through every declared property (virtinst's rule: a property no test
# exercises fails the suite, see test_every_property_is_exercised).
SAMPLES: dict[tuple[type, str], object] = {
    (PciAddressXML, "type"): "pci",
    (PciAddressXML, "domain"): 0x1,
    (PciAddressXML, "bus"): 0x2,
    (PciAddressXML, "slot"): 0x1F,
    (PciAddressXML, "function"): 7,
    (MdevHostdevXML, "mode"): "subsystem",
    (MdevHostdevXML, "type"): "mdev",
    (MdevHostdevXML, "model"): "vfio-pci",
    (MdevHostdevXML, "uuid"): U,
    (DomainXML, "virt_type"): "qemu",
    (DomainXML, "name"): "vm",
    (DomainXML, "uuid"): U,
    (DomainXML, "memory_text"): "1024",
    (DomainXML, "memory_unit"): "MiB",
    (DomainXML, "current_memory_text"): "512",
    (DomainXML, "current_memory_unit"): "MiB",
    (DomainXML, "vcpus"): 3,
    (DomainXML, "machine"): "pc",
    (DomainXML, "arch"): "x86_64",
    (DeviceEntryXML, "fdid"): 0x10,
    (DeviceEntryXML, "mdev"): U,
    (DeviceEntryXML, "address"): PciAddress(0, 0, 5, 0),
    (DeviceEntryXML, "nvme_queues"): 2,
    (DeviceEntryXML, "nvme_size"): 64 << 30,
    (DeviceEntryXML, "nvme_paths"): 2,
    (DeviceEntryXML, "interrupts"): InterruptPath.RELAY,
    (VmlendMetadataXML, "interrupts"): InterruptPath.NTB,
    (VmlendMetadataXML, "host_node"): "beta",
    (VmlendMetadataXML, "metadata_container"): "kept",
    (VmlendMetadataXML, "devices_container"): "absent",
    (DiskXML, "driver_type"): "qcow2",
    (DiskXML, "file"): "vm.qcow2",
}


def _all_node_classes() -> list[type[XMLNode]]:
    out, todo = [], list(XMLNode.__subclasses__())
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


def _declared() -> list[tuple[type, str]]:
    return sorted(
        (
            (cls, name)
            for cls in _all_node_classes()
            for name in vars(cls)
            if isinstance(vars(cls)[name], XMLProperty)
        ),
        key=lambda k: (k[0].__name__, k[1]),
    )


def test_every_property_is_exercised():
    missing = [f"{c.__name__}.{n}" for c, n in _declared() if (c, n) not in SAMPLES]
    assert not missing, f"XML properties without a round-trip sample: {missing}"


@pytest.mark.parametrize(("cls", "name"), sorted(SAMPLES, key=lambda k: (k[0].__name__, k[1])))
def test_property_round_trips_and_removes(cls, name):
    el = etree.Element("x")
    node = cls(el)
    value = SAMPLES[(cls, name)]
    assert getattr(node, name) is None
    setattr(node, name, value)
    # Through the serialised XML, not the Python object: the value really is in the XML.
    again = cls(etree.fromstring(etree.tostring(el)))
    assert getattr(again, name) == value
    setattr(node, name, None)
    assert getattr(cls(el), name) is None


def test_setting_a_property_keeps_unknown_children():
    el = etree.fromstring("<domain><foo a='1'/><os><type>hvm</type><bar/></os></domain>")
    DomainXML(el).machine = "q35"
    assert el.find("foo").get("a") == "1"
    assert el.find("os/bar") is not None
    assert el.find("os/type").text == "hvm"


def test_bad_values_in_xml_name_the_path():
    el = etree.fromstring("<domain><vcpu>two</vcpu></domain>")
    with pytest.raises(DomainXMLError, match=r"\./vcpu"):
        _ = DomainXML(el).vcpus


@pytest.mark.parametrize(
    ("value", "unit", "expected"),
    [
        ("4", "GiB", 4 << 30),
        ("4", "G", 4 << 30),
        ("4", "GB", 4 * 10**9),
        ("2097152", "KiB", 2 << 30),
        ("2097152", None, 2 << 30),  # libvirt's default unit is KiB
        ("64", "MiB", 64 << 20),
        ("1000", "bytes", 1000),
        ("1", "KB", 1000),
    ],
)
def test_libvirt_memory_units(value, unit, expected):
    assert libvirt_bytes(value, unit) == expected


@pytest.mark.parametrize(("value", "unit"), [("4", "parsecs"), ("four", "KiB"), ("-1", "KiB")])
def test_bad_libvirt_memory(value, unit):
    with pytest.raises(DomainXMLError):
        libvirt_bytes(value, unit)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4G", 4 << 30),
        ("512M", 512 << 20),
        ("512MiB", 512 << 20),
        ("1048576k", 1 << 30),
        ("2048", 2048),
        ("1T", 1 << 40),
        ("3gb", 3 << 30),
    ],
)
def test_vmlends_own_sizes_are_binary(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512", 512 << 20),  # a bare number is MiB, as virt-install reads --memory
        ("4G", 4 << 30),
        ("4GiB", 4 << 30),
        ("4gib", 4 << 30),
        ("4GB", 4 * 10**9),  # libvirt's GB is decimal
        ("4 MB", 4 * 10**6),
        ("1048576k", 1 << 30),
        ("1048576KiB", 1 << 30),
        ("1000KB", 10**6),
        ("4096B", 4096),
        ("4096bytes", 4096),
        ("1T", 1 << 40),
    ],
)
def test_command_line_sizes_speak_libvirts_units(text, expected):
    assert parse_cli_size(text) == expected


@pytest.mark.parametrize("text", ["", "G", "4X", "-4G", "4.5G", "4 G B", "4GiBB", "0x10M"])
def test_bad_command_line_sizes_name_the_units(text):
    with pytest.raises(ConfigError, match="bad size") as e:
        parse_cli_size(text)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text", ["", "G", "4X", "-4G", "4.5G", "4 G B"])
def test_bad_cli_sizes(text):
    with pytest.raises(ConfigError, match="bad size"):
        parse_size(text)


@pytest.mark.parametrize("text", ["\u0664G", "\u096c\u096a", "4\u0660M", "\uff14G", "\u0664"])
def test_sizes_in_other_scripts_digits_are_refused(text):
    for parse in (parse_cli_size, parse_size):
        with pytest.raises(ConfigError, match="bad size"):
            parse(text)
    with pytest.raises(DomainXMLError, match="not an integer in ASCII digits"):
        libvirt_bytes(text.rstrip("GM"), "KiB")
    with pytest.raises(DomainXMLError, match="not an integer"):
        libvirt_bytes("1_024", "KiB")  # int() takes it, libvirt does not


@pytest.mark.parametrize("text", ["99999999999999999999T", "4097T", str(1 << 33) + "M"])
def test_sizes_beyond_what_a_host_addresses_are_refused(text):
    for parse in (parse_cli_size, parse_size):
        with pytest.raises(ConfigError, match="is more than 4096 TiB, the most a host can address"):
            parse(text)
    assert parse_cli_size("4096T") == 1 << 52  # the limit itself is a size


def test_a_domain_memory_beyond_what_a_host_addresses_is_refused():
    with pytest.raises(DomainXMLError, match="is more than 4096 TiB"):
        libvirt_bytes("99999999999999999999", "KiB")


def test_the_cli_refuses_such_sizes_in_one_line(tmp_path):
    for memory in ("99999999999999999999T", "\u0664G"):
        r = CliRunner().invoke(main, ["xml", "new", "vm1", "--memory", memory])
        assert r.exit_code == 2, r.output
        (error,) = [line for line in r.output.splitlines() if line.startswith("Error:")]
        assert "--memory" in error and ("4096 TiB" in error or "bad size" in error), r.output


def test_pci_address_parse_and_format():
    assert PciAddress.parse("0000:00:05.0") == PciAddress(0, 0, 5, 0)
    assert PciAddress.parse("01:1f.7") == PciAddress(0, 1, 0x1F, 7)
    assert str(PciAddress(0, 0, 5, 0)) == "0000:00:05.0"


@pytest.mark.parametrize("text", ["00:05", "0000:00:20.0", "0000:00:05.8", "zz:00.0", ""])
def test_bad_pci_address(text):
    with pytest.raises(ConfigError, match="guest PCI address"):
        PciAddress.parse(text)


def test_mdev_uuid_is_deterministic_and_distinct():
    a = mdev_uuid(U, 0x10)
    assert a == mdev_uuid(str(U), 0x10) == mdev_uuid(str(U).upper(), 16)
    assert a != mdev_uuid(U, 0x11)
    assert a != mdev_uuid(uuid.UUID(int=U.int ^ 1), 0x10)
    # The published formula (docs/domain-xml.md): hosts running other versions must agree.
    ns = uuid.uuid5(uuid.NAMESPACE_URL, NAMESPACE_URI)
    assert a == uuid.uuid5(ns, f"{U}/0x10")
    assert str(a) == "e441daa3-a267-5e5c-b8bb-d7c80710e3a7"


def test_read_domain():
    info = read_domain((DATA / "remove-in.xml").read_bytes())
    assert (info.name, info.uuid, info.memory_bytes, info.machine, info.virt_type) == (
        "gpu1",
        U,
        1 << 30,
        "pc",
        "kvm",
    )
    assert [(d.fdid, str(d.address) if d.address else None) for d in info.devices] == [
        (0x10, None),
        (0x11, "0000:00:06.0"),
    ]
    assert info.devices[0].mdev == mdev_uuid(U, 0x10)


def test_read_domain_gives_memory_in_any_unit():
    assert read_domain((DATA / "add-second-in.xml").read_bytes()).memory_bytes == 4 << 30


def test_has_vmlend_metadata():
    assert has_vmlend_metadata((DATA / "remove-in.xml").read_bytes())
    assert not has_vmlend_metadata((DATA / "add-virsh-in.xml").read_bytes())


def test_metadata_is_found_by_namespace_not_prefix():
    xml = (
        (DATA / "remove-in.xml")
        .read_bytes()
        .replace(b"vmlend:", b"vl:")
        .replace(b"xmlns:vmlend", b"xmlns:vl")
    )
    assert [d.fdid for d in read_domain(xml).devices] == [0x10, 0x11]


@pytest.mark.parametrize(
    ("xml", "match"),
    [
        (b"<domain><name>x</name>", r"not well-formed XML \(line 1\)"),
        (b"", "empty"),
        (b"   \n", "empty"),
        (b"<network/>", "root element <network>"),
        (b"<domain><uuid>x</uuid></domain>", "no <name>"),
        (
            b"<!DOCTYPE d [<!ENTITY e SYSTEM 'file:///etc/passwd'>]><domain><name>&e;</name></domain>",
            "has a DOCTYPE",
        ),
    ],
)
def test_bad_domain_xml_is_one_clear_line(xml, match):
    with pytest.raises(DomainXMLError, match=match) as e:
        read_domain(xml)
    assert "\n" not in str(e.value)


def _meta(devices: str) -> bytes:
    return (
        f"<domain><name>v</name><uuid>{U}</uuid><metadata>"
        f"<vmlend xmlns='{NAMESPACE_URI}'>{devices}</vmlend></metadata></domain>"
    ).encode()


@pytest.mark.parametrize(
    ("devices", "match"),
    [
        ("<device mdev='e441daa3-a267-5e5c-b8bb-d7c80710e3a7'/>", "lacks its fdid"),
        ("<device fdid='0x10'/>", "lacks its fdid or mdev"),
        (
            "<device fdid='ten' mdev='e441daa3-a267-5e5c-b8bb-d7c80710e3a7'/>",
            "bad fabric device id",
        ),
        ("<device fdid='0x10' mdev='nope'/>", "bad mdev UUID"),
        (
            "<device fdid='0x10' mdev='e441daa3-a267-5e5c-b8bb-d7c80710e3a7' address='5'/>",
            "guest PCI address",
        ),
        (
            "<device fdid='0x10' mdev='e441daa3-a267-5e5c-b8bb-d7c80710e3a7'/>"
            "<device fdid='16' mdev='e441daa3-a267-5e5c-b8bb-d7c80710e3a7'/>",
            "listed twice",
        ),
    ],
)
def test_bad_metadata(devices, match):
    with pytest.raises(DomainXMLError, match=match):
        read_domain(_meta(devices), strict=False)


def test_two_vmlend_elements_are_refused():
    xml = _meta("").replace(
        b"</metadata>", f"<v xmlns='{NAMESPACE_URI}' />".encode() + b"</metadata>"
    )
    xml = xml.replace(b"<v ", b"<vmlend ")
    with pytest.raises(DomainXMLError, match="2 vmlend elements"):
        read_domain(xml)


def test_a_newer_metadata_version_is_refused_not_ignored():
    xml = _meta("").replace(NAMESPACE_URI.encode(), b"http://vmlend.org/xmlns/domain/2.0")
    with pytest.raises(DomainXMLError, match="upgrade vmlend"):
        has_vmlend_metadata(xml)
