"""Expected outputs: each case turns an -in.xml (or a spec) into XML that must equal -out.xml
structurally, validate against libvirt's schema and be accepted by libvirt's test driver with
its vmlend devices intact."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import PurePath

import pytest

from tests.support.domain_support import (
    DATA,
    assert_matches_file,
    define_in_test_driver,
    validate_with_libvirt_schema,
)
from vmlend.domain import (
    DeviceRequest,
    DomainDocument,
    DomainSpec,
    PciAddress,
    TemplateSet,
    add_device,
    new_domain,
    read_domain,
    remove_device,
    rewrite_for_destination,
)

TEMPLATES = TemplateSet()
FIXED = uuid.UUID("c7a5fdbd-edaf-9455-926a-d65c16db1809")


def _add(fdid: int, address: str | None = None) -> Callable[[bytes], bytes]:
    addr = PciAddress.parse(address) if address else None

    def op(xml: bytes) -> bytes:
        return add_device(
            DomainDocument.parse(xml), fdid, templates=TEMPLATES, address=addr
        ).to_bytes()

    return op


def _remove(*fdids: int) -> Callable[[bytes], bytes]:
    def op(xml: bytes) -> bytes:
        doc = DomainDocument.parse(xml)
        for fdid in fdids:
            doc = remove_device(doc, fdid)
        return doc.to_bytes()

    return op


def _migrate(node: str) -> Callable[[bytes], bytes]:
    return lambda xml: rewrite_for_destination(xml, node)


def _new(spec: DomainSpec) -> Callable[[bytes], bytes]:
    return lambda _xml: new_domain(spec, templates=TEMPLATES).to_bytes()


CASES: dict[str, tuple[str | None, Callable[[bytes], bytes]]] = {
    "add-virsh": ("add-virsh", _add(0x10, "0000:00:05.0")),
    "add-compact": ("add-compact", _add(0x10)),
    "add-second": ("add-second", _add(0x11)),
    "remove-one": ("remove", _remove(0x11)),
    "remove-last": ("remove", _remove(0x11, 0x10)),
    "migrate": ("migrate", _migrate("beta")),
    "migrate-rederive": ("migrate-rederive", _migrate("alpha")),
    "new-q35": (
        None,
        _new(
            DomainSpec(
                "vm-q35",
                4 << 30,
                vcpus=2,
                uuid=FIXED,
                devices=[DeviceRequest(0x10), DeviceRequest(0x11, PciAddress.parse("00:05.0"))],
            )
        ),
    ),
    "new-pc": (
        None,
        _new(DomainSpec("vm-pc", 1 << 30, machine="pc", uuid=FIXED, devices=[DeviceRequest(0x10)])),
    ),
    "new-tcg-disk": (
        None,
        _new(
            DomainSpec(
                "vm-tcg",
                64 << 20,
                virt_type="qemu",
                uuid=FIXED,
                disk=PurePath("/var/lib/libvirt/images/vm-tcg.img"),
            )
        ),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_case_matches_expected_output(case, tmp_path):
    source, op = CASES[case]
    xml_in = (DATA / f"{source}-in.xml").read_bytes() if source else b""
    got = op(xml_in)
    assert_matches_file(got, DATA / f"{case}-out.xml")
    validate_with_libvirt_schema(got, tmp_path)


@pytest.mark.parametrize("case", sorted(CASES))
def test_test_driver_accepts_output_and_keeps_devices(case):
    source, op = CASES[case]
    got = op((DATA / f"{source}-in.xml").read_bytes() if source else b"")
    kept = define_in_test_driver(got)
    mine, theirs = read_domain(got), read_domain(kept)
    assert theirs.devices == mine.devices
    assert (theirs.name, theirs.uuid, theirs.memory_bytes) == (
        mine.name,
        mine.uuid,
        mine.memory_bytes,
    )


def test_every_input_file_validates_too(tmp_path):
    """The inputs are real libvirt XML, so the cases test what users have."""
    for path in sorted(DATA.glob("*-in.xml")):
        validate_with_libvirt_schema(path.read_bytes(), tmp_path)
