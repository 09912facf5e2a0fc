"""Consistency checks and the pure rewrites: they abort rather than write a wrong domain."""

from __future__ import annotations

import uuid

import pytest
from lxml import etree

from tests.support.domain_support import DATA
from vmlend.domain import (
    DomainDocument,
    PciAddress,
    TemplateSet,
    add_device,
    check_consistency,
    drop_host_local_state,
    find_problems,
    mdev_uuid,
    read_domain,
    record_destination,
    rederive_mdev_uuids,
    remove_device,
    rewrite_for_destination,
)
from vmlend.errors import DomainXMLError

T = TemplateSet()
U = uuid.UUID("c7a5fdbd-edaf-9455-926a-d65c16db1809")
REMOVE_IN = (DATA / "remove-in.xml").read_bytes()
MIGRATE_IN = (DATA / "migrate-in.xml").read_bytes()
OTHER_MDEV = b"8f7e3d2c-1b0a-4c5d-9e8f-7a6b5c4d3e2f"


def _doc(xml: bytes = REMOVE_IN) -> DomainDocument:
    return DomainDocument.parse(xml)


def _edit(xml: bytes, old: bytes, new: bytes) -> bytes:
    assert old in xml, old
    return xml.replace(old, new, 1)


# Each way the metadata and the hostdevs can disagree, from the same consistent input.
mdev10 = str(mdev_uuid(U, 0x10)).encode()
mdev11 = str(mdev_uuid(U, 0x11)).encode()
DISAGREEMENTS = {
    "missing-hostdev": _edit(REMOVE_IN, b"uuid='" + mdev11, b"uuid='" + OTHER_MDEV),
    "address-mismatch": _edit(REMOVE_IN, b"slot='0x06'", b"slot='0x07'"),
    "duplicate-hostdev": _edit(REMOVE_IN, b"uuid='" + mdev11, b"uuid='" + mdev10),
    "model-mismatch": _edit(REMOVE_IN, b"model='vfio-pci'", b"model='vfio-ap'"),
    "not-derived": _edit(
        REMOVE_IN,
        b"<uuid>c7a5fdbd-edaf-9455-926a-d65c16db1809</uuid>",
        b"<uuid>0b7e0a43-3f8e-4c1e-9d64-3a3f5f2a9e11</uuid>",
    ),
}


def test_the_consistent_input_has_no_problems():
    assert find_problems(_doc()) == []
    assert check_consistency(_doc()).root is not None


@pytest.mark.parametrize("kind", sorted(DISAGREEMENTS))
def test_each_disagreement_is_found(kind):
    problems = find_problems(_doc(DISAGREEMENTS[kind]))
    assert kind in {p.kind for p in problems}
    info = read_domain(DISAGREEMENTS[kind], strict=False)
    assert info.problems


@pytest.mark.parametrize("kind", sorted(DISAGREEMENTS))
def test_every_writer_refuses_an_inconsistent_domain(kind):
    xml = DISAGREEMENTS[kind]
    with pytest.raises(DomainXMLError, match="inconsistent"):
        read_domain(xml)
    with pytest.raises(DomainXMLError, match="inconsistent"):
        add_device(_doc(xml), 0x12, templates=T)
    with pytest.raises(DomainXMLError, match="inconsistent"):
        remove_device(_doc(xml), 0x10)


@pytest.mark.parametrize("kind", ["missing-hostdev", "address-mismatch", "duplicate-hostdev"])
def test_migration_refuses_metadata_that_disagrees_with_hostdevs(kind):
    with pytest.raises(DomainXMLError, match="inconsistent"):
        rewrite_for_destination(DISAGREEMENTS[kind], "beta")


def test_migration_rederives_uuids_copied_from_another_domain():
    out = rewrite_for_destination(DISAGREEMENTS["not-derived"], "beta")
    info = read_domain(out)
    dom = uuid.UUID("0b7e0a43-3f8e-4c1e-9d64-3a3f5f2a9e11")
    assert [d.mdev for d in info.devices] == [mdev_uuid(dom, 0x10), mdev_uuid(dom, 0x11)]


def test_removing_a_device_whose_hostdev_libvirt_already_unplugged():
    gone = DISAGREEMENTS["missing-hostdev"]  # 0x11's hostdev is not there
    out = read_domain(remove_device(_doc(gone), 0x11, unplugged=True).to_bytes())
    assert [d.fdid for d in out.devices] == [0x10]
    # Only the device being removed may lack its hostdev.
    with pytest.raises(DomainXMLError, match="inconsistent"):
        remove_device(_doc(gone), 0x10, unplugged=True)
    with pytest.raises(DomainXMLError, match="inconsistent"):
        remove_device(_doc(DISAGREEMENTS["address-mismatch"]), 0x10, unplugged=True)


def test_a_foreign_mdev_hostdev_is_not_vmlends_business():
    doc = _doc(MIGRATE_IN)  # has an mdev hostdev vmlend does not list
    assert find_problems(doc) == []
    out = remove_device(doc, 0x10)
    assert OTHER_MDEV in out.to_bytes()


def test_rewrites_do_not_modify_their_input():
    doc = _doc(MIGRATE_IN)
    before = etree.tostring(doc.root)
    add_device(doc, 0x12, templates=T)
    remove_device(doc, 0x10)
    rederive_mdev_uuids(doc)
    drop_host_local_state(doc)
    record_destination(doc, "beta")
    assert etree.tostring(doc.root) == before


def test_add_device_is_idempotent():
    doc = _doc()
    again = add_device(doc, 0x11, templates=T)
    assert again.to_bytes() == doc.to_bytes()
    again = add_device(doc, 0x11, templates=T, address=PciAddress.parse("0000:00:06.0"))
    assert again.to_bytes() == doc.to_bytes()


def test_moving_a_present_device_needs_remove_first():
    with pytest.raises(DomainXMLError, match="already in the domain at guest address"):
        add_device(_doc(), 0x11, templates=T, address=PciAddress.parse("0000:00:09.0"))


def test_a_used_guest_address_is_refused():
    with pytest.raises(DomainXMLError, match=r"0000:00:05\.0 is already used by a <hostdev>"):
        add_device(_doc(), 0x12, templates=T, address=PciAddress.parse("0000:00:05.0"))


def test_a_domain_without_uuid_cannot_get_devices():
    xml = b"<domain type='kvm'><name>x</name><devices/></domain>"
    with pytest.raises(DomainXMLError, match="has no <uuid>"):
        add_device(_doc(xml), 0x10, templates=T)


def test_a_domain_without_devices_element_gets_one():
    xml = f"<domain type='kvm'><name>x</name><uuid>{U}</uuid></domain>".encode()
    out = add_device(_doc(xml), 0x10, templates=T)
    assert [d.fdid for d in read_domain(out.to_bytes()).devices] == [0x10]


def test_removing_an_absent_device_is_an_error():
    with pytest.raises(DomainXMLError, match="has no vmlend device 0x12"):
        remove_device(_doc(), 0x12)
    with pytest.raises(DomainXMLError, match="has no vmlend device 0x10"):
        remove_device(_doc((DATA / "add-virsh-in.xml").read_bytes()), 0x10)


def test_other_metadata_survives_add_and_remove_untouched():
    src = (DATA / "add-virsh-in.xml").read_bytes()
    doc = add_device(_doc(src), 0x10, templates=T)
    doc = add_device(doc, 0x11, templates=T)
    doc = remove_device(remove_device(doc, 0x10), 0x11)
    assert doc.to_bytes() == src


def test_migration_rewrite():
    out = rewrite_for_destination(MIGRATE_IN, "beta")
    root = etree.fromstring(out)
    assert root.get("id") is None  # the source host's running instance
    assert read_domain(out).host_node == "beta"
    # Kept: guest addresses, aliases, the foreign mdev, other metadata.
    assert root.xpath("count(//hostdev/address[@type='pci'])") == 2
    assert root.xpath("count(//alias)") == 4
    assert root.xpath("count(//*[local-name()='tags'])") == 1


def test_migration_leaves_domains_without_vmlend_metadata_byte_identical():
    src = (DATA / "add-virsh-in.xml").read_bytes()
    assert rewrite_for_destination(src, "beta") is src


def test_migration_twice_gives_the_same_xml():
    once = rewrite_for_destination(MIGRATE_IN, "beta")
    assert rewrite_for_destination(once, "beta") == once


@pytest.mark.parametrize("node", ["", "bad node", "../x", "-a"])
def test_bad_destination_node(node):
    with pytest.raises(DomainXMLError, match="bad destination node"):
        rewrite_for_destination(MIGRATE_IN, node)


def test_malformed_xml_on_migration_is_one_line():
    with pytest.raises(DomainXMLError, match="not well-formed") as e:
        rewrite_for_destination(b"<domain><name>x</domain>", "beta")
    assert "\n" not in str(e.value)


def _machine_doc(machine: str, devices: str) -> DomainDocument:
    return _doc(
        f"""<domain type='kvm'>
  <name>m</name>
  <uuid>{U}</uuid>
  <os>
    <type arch='x86_64' machine='{machine}'>hvm</type>
  </os>
  <devices>
{devices}
  </devices>
</domain>
""".encode()
    )


_NET = "<interface type='bridge'><address type='pci' domain='0x0000' bus='0x00' slot='0x03'"
_PORT = "<controller type='pci' index='1' model='pcie-root-port'/>"


@pytest.mark.parametrize(
    ("machine", "devices", "address", "match"),
    [
        ("pc-i440fx-7.2", "", "00:00.0", "host bridge"),
        ("pc", "", "00:01.0", "PIIX3"),
        ("pc-1.7", "", "00:01.3", "PIIX3"),
        ("pc-i440fx-7.2", "<video><model type='vga'/></video>", "00:02.0", "video"),
        ("pc-q35-7.2", "", "00:1f.0", "ICH9"),
        ("q35", "<video><model type='virtio'/></video>", "00:01.0", "video"),
        ("q35", _PORT, "01:01.0", "only slot 0"),
        ("q35", _NET + " function='0x0'/></interface>", "00:03.1", "multifunction"),
        ("q35", _NET + " function='0x1'/></interface>", "00:03.0", "multifunction"),
        ("q35", "", "00:04.2", "multifunction"),
    ],
)
def test_addresses_libvirt_keeps_for_itself_are_refused(machine, devices, address, match):
    doc = _machine_doc(machine, devices)
    with pytest.raises(DomainXMLError, match=match):
        add_device(doc, 0x12, templates=T, address=PciAddress.parse(address))


@pytest.mark.parametrize(
    ("machine", "devices", "address"),
    [
        ("pc-i440fx-7.2", "", "00:02.0"),  # no video: slot 2 is free
        ("pc-q35-7.2", "", "00:01.0"),
        ("q35", "<video><model type='none'/></video>", "00:01.0"),
        ("q35", _PORT, "01:00.0"),
        ("q35", _NET + " function='0x0' multifunction='on'/></interface>", "00:03.1"),
        ("pc", "", "00:1f.0"),
    ],
)
def test_free_addresses_are_accepted(machine, devices, address):
    doc = _machine_doc(machine, devices)
    out = add_device(doc, 0x12, templates=T, address=PciAddress.parse(address))
    assert read_domain(out.to_bytes()).devices[0].address == PciAddress.parse(address)


def test_an_unlisted_hostdev_with_the_derived_uuid_is_not_duplicated():
    derived = mdev_uuid(U, 0x12)
    doc = _machine_doc(
        "q35",
        "<hostdev mode='subsystem' type='mdev' model='vfio-pci'><source>"
        f"<address uuid='{derived}'/></source></hostdev>",
    )
    with pytest.raises(DomainXMLError, match=f"already has an mdev <hostdev> with UUID {derived}"):
        add_device(doc, 0x12, templates=T)
