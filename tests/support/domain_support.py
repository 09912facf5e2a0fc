"""Helpers for the domain XML tests: expected-output files, libvirt's schema and test driver."""

from __future__ import annotations

import difflib
import os
import shutil
import subprocess
from pathlib import Path

import libvirt
import pytest
from lxml import etree

from tests.support.needs import need
from tests.support.paths import DATA

DATA = DATA / "domain"
NODE_XML = DATA / "test-node.xml"
#: Set VMLEND_REGEN=1 to rewrite the expected -out.xml files (then review the diff).
REGEN = os.environ.get("VMLEND_REGEN") == "1"


def canonical(xml: bytes) -> str:
    """Structure only: C14N 2.0 without comments or indentation, re-indented for diffs."""
    root = etree.fromstring(xml)
    flat = etree.tostring(root, method="c14n2", with_comments=False, strip_text=True)
    tree = etree.fromstring(flat)
    etree.indent(tree)
    return etree.tostring(tree, encoding="unicode")


def assert_matches_file(got: bytes, expected: Path) -> None:
    """Compare structurally with ``expected``; with VMLEND_REGEN=1 write it instead."""
    if REGEN or not expected.exists():
        if not REGEN:
            pytest.fail(f"{expected.name} is missing; run with VMLEND_REGEN=1 and review it")
        expected.write_bytes(got)
        return
    want, have = canonical(expected.read_bytes()), canonical(got)
    if want != have:
        diff = "\n".join(
            difflib.unified_diff(
                want.splitlines(), have.splitlines(), expected.name, "got", lineterm=""
            )
        )
        pytest.fail(f"XML differs from {expected.name}:\n{diff}")


def validate_with_libvirt_schema(xml: bytes, tmp_path: Path) -> None:
    tool = shutil.which("virt-xml-validate")
    need(tool is not None, "virt-xml-validate is not installed (libvirt-clients, libxml2-utils)")
    assert tool is not None
    path = tmp_path / "validate.xml"
    path.write_bytes(xml)
    r = subprocess.run([tool, str(path), "domain"], capture_output=True, text=True, check=False)
    assert r.returncode == 0, f"libvirt's schema rejects the XML:\n{r.stderr}{r.stdout}"


def _quiet(_ctx: object, _err: object) -> None:
    """libvirt prints every error to stderr by default; the tests check exceptions instead."""


def define_in_test_driver(xml: bytes) -> bytes:
    """Define ``xml`` on a fresh test-driver connection; return the XML libvirt kept."""
    libvirt.registerErrorHandler(_quiet, None)
    conn = libvirt.open(f"test://{NODE_XML}")
    try:
        dom = conn.defineXML(xml.decode())
        return dom.XMLDesc(0).encode()
    finally:
        conn.close()
