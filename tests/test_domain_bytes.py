"""Byte preservation: unchanged documents round-trip exactly; rewrites touch only their lines."""

from __future__ import annotations

import difflib
import uuid

import pytest

from tests.domain_support import DATA
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
from vmlend.domain.preserve import keep_original_lines

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


def test_line_keeping_falls_back_when_it_would_change_meaning():
    # Quote-insensitive matching would pick the original line, whose text differs.
    original = b"<d>\n  <t>it's</t>\n</d>"
    serialised = b'<d>\n  <t>it"s</t>\n</d>'
    assert keep_original_lines(original, serialised) == serialised


def test_line_keeping_takes_unchanged_lines_from_the_original():
    original = b"<d>\n  <a x='1'/>\n  <b y='2'></b>\n</d>"
    serialised = b'<d>\n  <a x="1"/>\n  <b y="2"/>\n  <c/>\n</d>'
    assert keep_original_lines(original, serialised) == (
        b"<d>\n  <a x='1'/>\n  <b y='2'></b>\n  <c/>\n</d>"
    )


def test_new_lines_follow_the_documents_quote_style():
    src = (DATA / "add-virsh-in.xml").read_bytes()  # libvirt style: single quotes
    out = add_device(DomainDocument.parse(src), 0x12, templates=T).to_bytes()
    added = [line for line in out.splitlines() if line not in src.splitlines()]
    assert added and all(b'="' not in line for line in added), added
    src = (DATA / "add-second-in.xml").read_bytes()  # double quotes
    out = add_device(DomainDocument.parse(src), 0x12, templates=T).to_bytes()
    assert b'uuid="' + str(mdev_uuid(U, 0x12)).encode() + b'"' in out


def test_restyling_that_would_change_text_falls_back_to_lxml():
    original = b"<d>\n  <a x='1'/>\n</d>"
    serialised = b'<d>\n  <a x="1"/>\n  <e> k="v"</e>\n</d>'
    assert keep_original_lines(original, serialised) == serialised
