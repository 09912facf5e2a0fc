"""Byte-exact edits on a large generated corpus of libvirt-formatted domain XML (see
``tests/support/domain_corpus.py``): parse-and-write is the identity, add-then-remove gives back the
original bytes, and adding a device changes only vmlend's own lines."""

from __future__ import annotations

import difflib
import re
import subprocess

import pytest

from tests.support.domain_corpus import EDITS, corpus
from tests.support.hypothesis_tiers import examples
from vmlend.domain import (
    DomainDocument,
    PciAddress,
    TemplateSet,
    add_device,
    read_domain,
    remove_device,
)

T = TemplateSet()
CORPUS = list(corpus(400))
#: The documents the edits run on: all 400 in make test, the first fifth of the seeds in make
#: test-fast (tests/support/hypothesis_tiers.py), every kind of edit among them.
EDITED = CORPUS[: examples(len(CORPUS))]
FDID = 0x12
FREE = PciAddress.parse("0000:00:1e.0")  # the generator never uses slot 0x1e
# Lines an add may turn into an open/close pair: a container that was empty.
_EMPTY_CONTAINER = re.compile(r"^\s*<(devices|metadata)\s*/>\r?$")


def _ids(doc):
    return doc.name


def test_the_corpus_is_large_and_varied():
    names = " ".join(d.name for d in CORPUS)
    assert len(CORPUS) >= 400
    for feature in (
        "crlf",
        "comments",
        "cdata",
        "spaced-empty",
        "double-quotes",
        "four-spaces",
        "devices-elsewise",
        "no-final-newline",
    ):
        assert names.count(feature) >= 20, feature
    edited = " ".join(d.name for d in EDITED)
    assert all(feature in edited for feature in EDITS), edited  # in every tier
    data = [d.data for d in CORPUS]
    for needle in (
        b"xmlns:qemu=",
        b"&apos;",
        b"&quot;",
        b"<metadata/>",
        b"<![CDATA[",
        b"<devices>\n  </devices>",
        b"' />",
        b"\r\n",
        b"id='",
        b"type='mdev'",
        b"type='pci' managed",
        b"libosinfo",
    ):
        assert sum(needle in x for x in data) >= 10, needle
    assert sum(b"<devices/>" in x for x in data) >= 5
    assert sum(b"<devices" not in x for x in data) >= 5


@pytest.mark.parametrize("doc", EDITED, ids=_ids)
def test_add_then_remove_gives_back_the_original_bytes(doc):
    parsed = DomainDocument.parse(doc.data)
    assert parsed.to_bytes() == doc.data
    added = add_device(parsed, FDID, templates=T, address=FREE).to_bytes()
    assert [d.fdid for d in read_domain(added).devices] == [FDID]
    # A separate parse, as two CLI runs would do.
    assert remove_device(DomainDocument.parse(added), FDID).to_bytes() == doc.data


def _vmlend_lines(out: bytes) -> set[bytes]:
    """The lines of vmlend's own element and of its hostdev in ``out``."""
    lines = out.split(b"\n")
    mdev = str(read_domain(out).devices[0].mdev).encode()
    own: set[bytes] = set()
    inside = False
    for i, line in enumerate(lines):
        if b"<vmlend:vmlend" in line:
            inside = True
        if inside:
            own.add(line)
        if b"</vmlend:vmlend>" in line:
            inside = False
        if mdev in line and b"<address uuid" in line:
            start = max(j for j in range(i) if b"<hostdev " in lines[j])
            end = next(j for j in range(i, len(lines)) if b"</hostdev>" in lines[j])
            own.update(lines[start : end + 1])
    return own


@pytest.mark.parametrize("doc", EDITED, ids=_ids)
def test_adding_changes_only_vmlends_lines(doc):
    out = add_device(DomainDocument.parse(doc.data), FDID, templates=T, address=FREE).to_bytes()
    own = {line.decode() for line in _vmlend_lines(out)}
    containers = {"<metadata>", "</metadata>", "<devices>", "</devices>"}
    diff = difflib.ndiff(doc.data.decode().split("\n"), out.decode().split("\n"))
    for line in diff:
        kind, text = line[:2], line[2:]
        if kind == "- ":
            assert _EMPTY_CONTAINER.match(text), text
        elif kind == "+ ":
            assert text in own or text.strip() in containers, text
    if b"\r\n" in doc.data:
        assert out.count(b"\n") == out.count(b"\r\n")


def test_libvirt_written_documents_are_schema_valid(tmp_path):
    sample = [d for d in CORPUS if d.libvirt_written][:12]
    for doc in sample:
        for data in (
            doc.data,
            add_device(DomainDocument.parse(doc.data), FDID, templates=T, address=FREE).to_bytes(),
        ):
            path = tmp_path / f"{doc.name}.xml"
            path.write_bytes(data)
            r = subprocess.run(
                ["virt-xml-validate", str(path), "domain"],
                capture_output=True,
                text=True,
                check=False,
            )
            assert r.returncode == 0, (doc.name, r.stderr)
