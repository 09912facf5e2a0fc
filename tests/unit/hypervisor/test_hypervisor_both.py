"""The Hypervisor contract, run against libvirt's test driver and the simulated hypervisor."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from lxml import etree

from tests.support.paths import DATA
from vmlend.errors import (
    DomainDefinitionError,
    DomainStateError,
    LibvirtError,
    UnknownDomainError,
)
from vmlend.hypervisor import DomainState, Hypervisor
from vmlend.wiring.hypervisor import open_hypervisor

DATA = DATA / "hypervisor"
DOMAIN_XML = (DATA / "domain.xml").read_bytes()
UUID = "6d1f3c1e-8a52-4c52-9a3e-0b9f4b7f2a11"
NS = "http://vmlend.example/ns/1"


@pytest.fixture(params=["libvirt", "sim"])
def hv(request, tmp_path) -> Iterator[Hypervisor]:
    # A fresh test-driver connection from a node file per test: test:///default would keep
    # domains for the whole process.
    uri = f"test://{DATA / 'node.xml'}" if request.param == "libvirt" else "sim:///gamma"
    h = open_hypervisor(uri, state_dir=tmp_path, hook_command=None)
    yield h
    h.close()


def _with(xml: bytes, **changes: str) -> bytes:
    root = etree.fromstring(xml)
    for path, text in changes.items():
        root.find(path).text = text
    return etree.tostring(root)


def test_define_start_stop_undefine_cycle(hv):
    info = hv.define(DOMAIN_XML)
    assert (info.name, info.uuid, info.state, info.persistent) == (
        "vm1",
        UUID,
        DomainState.SHUTOFF,
        True,
    )
    assert [d.name for d in hv.list_domains()] == ["vm1"]

    hv.start("vm1")
    assert hv.lookup("vm1").state is DomainState.RUNNING
    assert etree.fromstring(hv.xml("vm1")).get("id") is not None
    assert etree.fromstring(hv.xml("vm1", inactive=True)).get("id") is None

    hv.shutdown("vm1", timeout=2)
    assert hv.lookup("vm1").state is DomainState.SHUTOFF
    hv.start("vm1")
    hv.destroy("vm1")
    assert hv.lookup(UUID).state is DomainState.SHUTOFF

    hv.undefine("vm1")
    assert hv.list_domains() == []
    with pytest.raises(UnknownDomainError):
        hv.lookup("vm1")


def test_define_keeps_the_mdev_hostdev_and_marks_it_unmanaged(hv):
    hv.define(DOMAIN_XML)
    root = etree.fromstring(hv.xml("vm1", inactive=True))
    (hostdev,) = root.findall("devices/hostdev")
    assert hostdev.find("source/address").get("uuid") == "0b3c2a9e-1d44-4f5e-8c77-aa01b2c3d4e5"
    assert hostdev.get("managed") == "no"


def test_define_without_uuid_generates_one(hv):
    root = etree.fromstring(DOMAIN_XML)
    root.remove(root.find("uuid"))
    info = hv.define(etree.tostring(root))
    assert len(info.uuid) == 36 and info.uuid != UUID


def test_redefine_same_uuid_updates_the_definition(hv):
    hv.define(DOMAIN_XML)
    hv.define(_with(DOMAIN_XML, memory="131072"))
    assert etree.fromstring(hv.xml("vm1")).findtext("memory") == "131072"
    assert len(hv.list_domains()) == 1


def test_redefine_running_domain_changes_only_the_persistent_xml(hv):
    hv.define(DOMAIN_XML)
    hv.start("vm1")
    hv.define(_with(DOMAIN_XML, memory="131072"))
    assert etree.fromstring(hv.xml("vm1")).findtext("memory") == "65536"
    assert etree.fromstring(hv.xml("vm1", inactive=True)).findtext("memory") == "131072"


def test_same_name_with_another_uuid_is_refused(hv):
    hv.define(DOMAIN_XML)
    with pytest.raises(DomainDefinitionError, match=f"already exists with uuid {UUID}"):
        hv.define(_with(DOMAIN_XML, uuid="11111111-2222-3333-4444-555555555555"))


def test_another_name_with_the_same_uuid_is_refused(hv):
    hv.define(DOMAIN_XML)
    with pytest.raises(DomainDefinitionError, match="'vm1' is already defined with uuid"):
        hv.define(_with(DOMAIN_XML, name="vm2"))
    assert [d.name for d in hv.list_domains()] == ["vm1"]


@pytest.mark.parametrize(
    ("xml", "reason"),
    [
        # libvirt words parser errors in its own way; they must still be one line.
        (b"<domain type='qemu'><name>vm1", None),
        (b"not xml at all", None),
        (b"<dom type='qemu'><name>x</name></dom>", "expecting root element of 'domain'"),
        (
            b"<domain type='qemu'><memory>1024</memory><os><type>hvm</type></os></domain>",
            "missing name",
        ),
        (
            b"<domain><name>x</name><memory>1024</memory><os><type>hvm</type></os></domain>",
            "missing domain type",
        ),
        (b"<domain type='qemu'><name>x</name><os><type>hvm</type></os></domain>", "Memory size"),
        (
            b"<domain type='qemu'><name>x</name><uuid>nope</uuid><memory>1024</memory>"
            b"<os><type>hvm</type></os></domain>",
            "malformed uuid",
        ),
    ],
)
def test_bad_domain_xml_is_refused_in_one_line(hv, xml, reason):
    with pytest.raises(DomainDefinitionError, match=reason) as exc:
        hv.define(xml)
    assert "\n" not in str(exc.value)
    assert hv.list_domains() == []


def test_a_name_with_a_newline_is_refused_as_libvirt_does(hv):
    # libvirt refuses it (the test driver runs libvirt's parser); the simulated hypervisor,
    # whose names reach the hook, vmlend's tables and logs, must not take what libvirt never
    # would.
    xml = _with(DOMAIN_XML, name="vm1\nvm2")
    with pytest.raises(DomainDefinitionError, match="invalid char in name"):
        hv.define(xml)
    assert hv.list_domains() == []
    hv.define(_with(DOMAIN_XML, name="vm1\tvm2"))  # a tab, libvirt takes
    assert [d.name for d in hv.list_domains()] == ["vm1\tvm2"]


@pytest.mark.parametrize(
    "call",
    [
        lambda h: h.lookup("ghost"),
        lambda h: h.start("ghost"),
        lambda h: h.destroy("ghost"),
        lambda h: h.undefine("ghost"),
        lambda h: h.xml("ghost"),
        lambda h: h.get_metadata("ghost", NS),
        lambda h: h.set_metadata("ghost", NS, "vl", b"<x/>", live=False, config=True),
    ],
)
def test_unknown_domain(hv, call):
    with pytest.raises(UnknownDomainError, match="'ghost'") as exc:
        call(hv)
    assert hv.uri in str(exc.value)


def test_state_errors(hv):
    hv.define(DOMAIN_XML)
    with pytest.raises(DomainStateError, match="not running"):
        hv.destroy("vm1")
    with pytest.raises(LibvirtError):
        hv.shutdown("vm1", timeout=1)
    hv.start("vm1")
    with pytest.raises(LibvirtError, match="already running"):
        hv.start("vm1")
    assert hv.lookup("vm1").state is DomainState.RUNNING


def test_undefine_running_domain_leaves_it_transient_until_it_stops(hv):
    hv.define(DOMAIN_XML)
    hv.start("vm1")
    hv.undefine("vm1")
    info = hv.lookup("vm1")
    assert (info.state, info.persistent) == (DomainState.RUNNING, False)
    assert etree.fromstring(hv.xml("vm1", inactive=True)).findtext("name") == "vm1"
    hv.destroy("vm1")
    assert hv.list_domains() == []


def test_metadata_set_get_remove(hv):
    hv.define(DOMAIN_XML)
    assert hv.get_metadata("vm1", NS) is None
    hv.set_metadata("vm1", NS, "vl", b"<vm><dev fdid='0x10'/></vm>", live=False, config=True)

    got = etree.fromstring(hv.get_metadata("vm1", NS))
    assert got.tag == "vm"  # returned without the namespace, as libvirt does
    assert got.find("dev").get("fdid") == "0x10"
    # In the domain XML it sits under <metadata> in its namespace with the given prefix.
    meta = etree.fromstring(hv.xml("vm1")).find("metadata")
    (el,) = list(meta)
    assert el.tag == f"{{{NS}}}vm" and el.prefix == "vl"
    assert el.find(f"{{{NS}}}dev") is not None

    hv.set_metadata("vm1", NS, "vl", b"<vm/>", live=False, config=True)  # replaces
    assert etree.fromstring(hv.get_metadata("vm1", NS)).find("dev") is None
    hv.set_metadata("vm1", NS, "vl", None, live=False, config=True)
    assert hv.get_metadata("vm1", NS) is None


def test_metadata_other_namespaces_are_untouched(hv):
    hv.define(DOMAIN_XML)
    hv.set_metadata("vm1", "http://other/ns", "o", b"<keep/>", live=False, config=True)
    hv.set_metadata("vm1", NS, "vl", b"<vm/>", live=False, config=True)
    hv.set_metadata("vm1", NS, "vl", None, live=False, config=True)
    assert hv.get_metadata("vm1", "http://other/ns") is not None


def test_metadata_live_and_config_are_separate(hv):
    hv.define(DOMAIN_XML)
    with pytest.raises(DomainStateError, match="not running"):
        hv.set_metadata("vm1", NS, "vl", b"<vm/>", live=True, config=False)
    hv.start("vm1")
    hv.set_metadata("vm1", NS, "vl", b"<live/>", live=True, config=False)
    assert etree.fromstring(hv.get_metadata("vm1", NS)).tag == "live"
    assert hv.get_metadata("vm1", NS, inactive=True) is None
    hv.set_metadata("vm1", NS, "vl", b"<both/>", live=True, config=True)
    assert etree.fromstring(hv.get_metadata("vm1", NS, inactive=True)).tag == "both"


def test_malformed_metadata_is_refused(hv):
    hv.define(DOMAIN_XML)
    with pytest.raises(DomainDefinitionError) as exc:
        hv.set_metadata("vm1", NS, "vl", b"<vm", live=False, config=True)
    assert "\n" not in str(exc.value)
    assert hv.get_metadata("vm1", NS) is None


def test_metadata_keeps_foreign_namespaces_inside_the_element(hv):
    hv.define(DOMAIN_XML)
    given = b"<vm xmlns:o='http://other/ns' k='v'><o:tag/><dev>t</dev></vm>"
    hv.set_metadata("vm1", NS, "vl", given, live=False, config=True)
    got = etree.fromstring(hv.get_metadata("vm1", NS))
    assert got.get("k") == "v"
    assert got.find("{http://other/ns}tag") is not None
    assert got.findtext("dev") == "t"
    assert got.find("{http://other/ns}tag").prefix == "o"
