"""Byte preservation: unchanged documents round-trip exactly; rewrites touch only their lines."""

from __future__ import annotations

import difflib
import uuid

import pytest

from tests.support.domain_support import DATA
from vmlend.domain import (
    DeviceRequest,
    DomainDocument,
    DomainSpec,
    PciAddress,
    TemplateSet,
    add_device,
    mdev_uuid,
    new_domain,
    remove_device,
)

T = TemplateSet()
U = uuid.UUID("c7a5fdbd-edaf-9455-926a-d65c16db1809")
INPUTS = sorted(DATA.glob("*-in.xml"))
# Inputs a rewrite accepts (migrate-rederive-in.xml is deliberately inconsistent).
CONSISTENT = [p for p in INPUTS if p.name != "migrate-rederive-in.xml"]
MULTILINE = [p for p in CONSISTENT if b"\n" in p.read_bytes().strip()]


@pytest.mark.parametrize("path", INPUTS, ids=lambda p: p.name)
def test_parse_and_serialise_is_byte_identical(path):
    data = path.read_bytes()
    assert DomainDocument.parse(data).to_bytes() == data


@pytest.mark.parametrize(
    "data",
    [
        b"<domain><name>a</name></domain>",
        b"<domain><name>a</name></domain>\n\n",
        b'<?xml version="1.0"?>\n\n<domain>\n<name>a</name>\n</domain>\n',
        b"<?xml version='1.0' encoding='UTF-8'?><!--c--><?pi x?>\n<domain/>\n",
        b"\xef\xbb\xbf<domain><name>a</name></domain>\n",  # UTF-8 BOM
    ],
)
def test_declaration_comments_and_final_newline_are_kept(data):
    assert DomainDocument.parse(data).to_bytes() == data


@pytest.mark.parametrize("path", MULTILINE, ids=lambda p: p.name)
def test_adding_a_device_only_inserts_lines(path):
    data = path.read_bytes()
    out = add_device(DomainDocument.parse(data), 0x12, templates=T).to_bytes()
    diff = list(difflib.ndiff(data.decode().splitlines(), out.decode().splitlines()))
    removed = [line for line in diff if line.startswith("- ")]
    added = [line for line in diff if line.startswith("+ ")]
    assert not removed, removed
    assert len(added) >= 5  # a hostdev and a metadata entry


@pytest.mark.parametrize("path", CONSISTENT, ids=lambda p: p.name)
def test_add_then_remove_gives_back_the_original_bytes(path):
    data = path.read_bytes()
    doc = add_device(
        DomainDocument.parse(data), 0x12, templates=T, address=PciAddress.parse("0000:00:1e.0")
    )
    assert remove_device(doc, 0x12).to_bytes() == data


def test_generated_xml_round_trips_add_and_remove():
    spec = DomainSpec("vm", 1 << 30, uuid=uuid.uuid4(), devices=[DeviceRequest(1)])
    data = new_domain(spec, templates=T).to_bytes()
    again = remove_device(add_device(DomainDocument.parse(data), 2, templates=T), 2)
    assert again.to_bytes() == data


def test_new_lines_follow_the_documents_quote_style():
    src = (DATA / "add-virsh-in.xml").read_bytes()  # libvirt style: single quotes
    out = add_device(DomainDocument.parse(src), 0x12, templates=T).to_bytes()
    added = [line for line in out.splitlines() if line not in src.splitlines()]
    assert added and all(b'="' not in line for line in added), added
    src = (DATA / "add-second-in.xml").read_bytes()  # double quotes
    out = add_device(DomainDocument.parse(src), 0x12, templates=T).to_bytes()
    assert b'uuid="' + str(mdev_uuid(U, 0x12)).encode() + b'"' in out


def _doc(middle: str, *, head: str = "<domain type='kvm'>", nl: str = "\n") -> bytes:
    lines = [head, "  <name>a</name>", f"  <uuid>{U}</uuid>", *middle.split("\n"), "</domain>"]
    return (nl.join(line for line in lines if line) + nl).encode()


_DEVICES = "  <devices>\n    <emulator>/usr/bin/qemu-system-x86_64</emulator>\n  </devices>"
# Each of these came back changed from add-then-remove (or lost bytes on add) before.
LIBVIRT_SPELLINGS = {
    "root namespaces": _doc(
        _DEVICES + "\n  <qemu:commandline>\n    <qemu:arg value='-s'/>\n  </qemu:commandline>",
        head="<domain type='kvm' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>",
    ),
    "entities": _doc("  <description>it&apos;s &quot;x&quot; &amp; y</description>\n" + _DEVICES),
    "entities in attributes": _doc(
        "  <devices>\n    <disk type='file' device='disk'>\n"
        "      <source file='/srv/it&apos;s &quot;x&quot;.img'/>\n    </disk>\n  </devices>"
    ),
    "self-closing with a space": _doc(
        "  <devices>\n    <video>\n      <model type='none' />\n    </video>\n  </devices>"
    ),
    "emptied devices": _doc("  <devices>\n  </devices>"),
    "self-closing devices": _doc("  <devices/>"),
    "missing devices": _doc(""),
    "comment after the root": _doc(_DEVICES) + b"<!-- kept -->\n",
    "cdata": _doc("  <description><![CDATA[a <b> & c]]></description>\n" + _DEVICES),
    "crlf": _doc(_DEVICES, nl="\r\n"),
    "empty metadata": _doc("  <metadata/>\n" + _DEVICES),
}


@pytest.mark.parametrize("data", LIBVIRT_SPELLINGS.values(), ids=LIBVIRT_SPELLINGS.keys())
def test_add_then_remove_keeps_every_spelling(data):
    added = add_device(DomainDocument.parse(data), 0x12, templates=T).to_bytes()
    assert remove_device(DomainDocument.parse(added), 0x12).to_bytes() == data


@pytest.mark.parametrize("data", LIBVIRT_SPELLINGS.values(), ids=LIBVIRT_SPELLINGS.keys())
def test_adding_keeps_every_other_byte(data):
    added = add_device(DomainDocument.parse(data), 0x12, templates=T).to_bytes()
    containers = (b"devices", b"metadata")
    kept = [line for line in data.split(b"\n") if not any(c in line for c in containers)]
    out_lines = added.split(b"\n")
    assert all(line in out_lines for line in kept)
    if b"\r\n" in data:
        assert added.count(b"\n") == added.count(b"\r\n")


def test_a_created_devices_element_is_indented_like_its_siblings():
    added = add_device(DomainDocument.parse(_doc("")), 0x12, templates=T).to_bytes()
    assert b"\n  <devices>\n    <hostdev " in added
    assert b"\n    </hostdev>\n  </devices>\n</domain>" in added
