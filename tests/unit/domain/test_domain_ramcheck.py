"""A memory layout vmlend cannot compute is refused, never guessed (docs/memory.md): at the hook,
at ``vmlend xml new``/``add-device`` and at ``attach``, with one line and nothing changed.

Before, such a domain was admitted as if it were a plain q35 guest of its ``<memory>`` size (an
nvdimm guest got windows for RAM it does not have there), and a domain without ``<memory>``
claimed no window segments at all."""

from __future__ import annotations

import io

import pytest
from click.testing import CliRunner
from lxml import etree

from tests.support.simfabric import make_fabric
from vmlend.cli import main
from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, new_domain, read_domain
from vmlend.errors import LayoutError
from vmlend.hook.main import run
from vmlend.topology.model import MiB
from vmlend.wiring.fabric import open_fabric

GPU = 0x10


def _domain(fdids=(GPU,)) -> bytes:
    spec = DomainSpec(name="odd", memory_bytes=512 * MiB, devices=[DeviceRequest(f) for f in fdids])
    return new_domain(spec, templates=TemplateSet()).to_bytes()


def _edit(xml: bytes, how: str) -> bytes:
    root = etree.fromstring(xml)
    if how == "nvdimm":
        devices = root.find("devices")
        dev = etree.SubElement(devices, "memory", model="nvdimm")
        etree.SubElement(etree.SubElement(dev, "source"), "path").text = "/tmp/nvdimm"
        target = etree.SubElement(dev, "target")
        etree.SubElement(target, "size", unit="MiB").text = "512"
    elif how == "virtio-mem":
        dev = etree.SubElement(root.find("devices"), "memory", model="virtio-mem")
        target = etree.SubElement(dev, "target")
        etree.SubElement(target, "size", unit="GiB").text = "1"
        etree.SubElement(target, "block", unit="MiB").text = "2"
    elif how == "aarch64":
        root.find("os/type").set("arch", "aarch64")
        root.find("os/type").set("machine", "virt")
    elif how == "no-memory":
        for tag in ("memory", "currentMemory"):
            el = root.find(tag)
            if el is not None:
                root.remove(el)
    else:
        raise AssertionError(how)
    return etree.tostring(root)


CASES = ["nvdimm", "virtio-mem", "aarch64", "no-memory"]


@pytest.mark.parametrize("how", CASES)
def test_the_hook_refuses_a_layout_it_cannot_compute(state_path, how):
    make_fabric(state_path).close()
    xml = _edit(_domain(), how)
    err = io.StringIO()
    env = {"VMLEND_STATE": str(state_path)}
    argv = ["odd", "prepare", "begin", "-"]
    code = run(argv, stdin=io.BytesIO(xml), stdout=io.BytesIO(), stderr=err, environ=env)
    assert code == 1
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1 and "never guesses" in lines[0] and "Traceback" not in lines[0]
    fabric = open_fabric(state_path)
    assert all(d.holder is None for d in fabric.devices()) and fabric.mdevs() == []


@pytest.mark.parametrize("how", CASES)
def test_guest_ram_of_such_a_domain_is_an_error_not_a_q35_guess(how):
    dom = read_domain(_edit(_domain(), how), strict=False)
    with pytest.raises(LayoutError, match="never guesses"):
        _ = dom.guest_ram


@pytest.mark.parametrize("how", CASES)
def test_xml_add_device_refuses_and_leaves_the_file(state_path, tmp_path, how):
    make_fabric(state_path).close()
    path = tmp_path / "odd.xml"
    path.write_bytes(_edit(_domain(fdids=()), how))
    before = path.read_bytes()
    r = CliRunner().invoke(main, ["xml", "add-device", str(path), "0x10"])
    assert r.exit_code == 1, r.output
    assert "never guesses" in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1
    assert path.read_bytes() == before


def test_xml_add_device_leaves_what_the_host_decides_to_the_hook(state_path, tmp_path):
    """A kvm domain whose layout depends on the host's CPU vendor (the AMD 1 TiB rule) and one
    libvirt has not given a machine type yet are accepted: the hook computes them on the host."""
    make_fabric(state_path).close()
    path = tmp_path / "big.xml"
    root = etree.fromstring(_domain(fdids=()))
    root.find("memory").text = str(1000 << 20)  # KiB: ~1000 GiB reaches the AMD hole
    root.find("currentMemory").text = str(1000 << 20)
    path.write_bytes(etree.tostring(root))
    r = CliRunner().invoke(main, ["xml", "add-device", str(path), "0x10"])
    assert r.exit_code == 0, r.output
    root = etree.fromstring(_domain(fdids=()))
    del root.find("os/type").attrib["machine"]
    path.write_bytes(etree.tostring(root))
    r = CliRunner().invoke(main, ["xml", "add-device", str(path), "0x10"])
    assert r.exit_code == 0, r.output


def test_attach_refuses_before_it_reserves(state_path, tmp_path):
    make_fabric(state_path).close()
    path = tmp_path / "odd.xml"
    path.write_bytes(_edit(_domain(fdids=()), "nvdimm"))
    cli = CliRunner()
    assert cli.invoke(main, ["-c", "sim:///gamma", "vm", "define", str(path)]).exit_code == 0
    r = cli.invoke(main, ["-c", "sim:///gamma", "attach", "odd", "0x10", "--config"])
    assert r.exit_code == 1, r.output
    assert "never guesses" in r.output and len(r.output.strip().splitlines()) == 1
    fabric = open_fabric(state_path)
    assert all(d.holder is None for d in fabric.devices()) and fabric.mdevs() == []
