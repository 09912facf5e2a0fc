"""Layout inputs from libvirt domain XML: units, NUMA, DIMMs, qemu:commandline, bad input."""

from __future__ import annotations

import pytest
from lxml import etree

from vmlend.errors import DomainXMLError, LayoutError
from vmlend.memory.domain_memory import memory_config, parse_libvirt_size, parse_qemu_size
from vmlend.memory.layout import CpuVendor, Dimm, compute_layout
from vmlend.topology.model import GiB, GuestRange, MiB

QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"


def domain(
    memory: str | None = "<memory unit='GiB'>4</memory>",
    machine: str | None = "pc-q35-7.2",
    cpu: str = "",
    devices: str = "",
    extra: str = "",
) -> str:
    mattr = f" machine='{machine}'" if machine is not None else ""
    return f"""<domain type='qemu' xmlns:qemu='{QEMU_NS}'>
  <name>g</name>
  {memory or ""}
  {extra}
  <os><type arch='x86_64'{mattr}>hvm</type></os>
  {cpu}
  <devices>{devices}</devices>
</domain>"""


@pytest.mark.parametrize(
    ("value", "unit", "expected"),
    [
        ("4194304", None, 4 * GiB),
        ("4194304", "KiB", 4 * GiB),
        ("4096", "MiB", 4 * GiB),
        ("4096", "M", 4 * GiB),
        ("4", "G", 4 * GiB),
        ("4", "GiB", 4 * GiB),
        ("4294967296", "bytes", 4 * GiB),
        ("4294967296", "b", 4 * GiB),
        ("1", "TiB", 1 << 40),
        ("1000", "KB", 10**6),
        ("2", "GB", 2 * 10**9),
    ],
)
def test_libvirt_units(value: str, unit: str | None, expected: int) -> None:
    assert parse_libvirt_size(value, unit, "x") == expected


@pytest.mark.parametrize(
    ("value", "unit"), [("4", "furlongs"), ("-4", "GiB"), ("4.5", "GiB"), ("", "GiB"), (None, None)]
)
def test_bad_libvirt_sizes(value: str | None, unit: str | None) -> None:
    with pytest.raises(DomainXMLError):
        parse_libvirt_size(value, unit, "x")


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1G", GiB), ("3584M", 3584 * MiB), ("1073741824", GiB), ("1.5G", 3 * GiB // 2)],
)
def test_qemu_sizes(text: str, expected: int) -> None:
    assert parse_qemu_size(text, "x") == expected


def test_qemu_size_rejects_garbage() -> None:
    with pytest.raises(DomainXMLError):
        parse_qemu_size("lots", "x")


def test_plain_domain() -> None:
    cfg = memory_config(domain())
    assert (cfg.machine, cfg.ram, cfg.maxmem, cfg.dimms) == ("pc-q35-7.2", 4 * GiB, 0, ())
    assert compute_layout(cfg).ranges() == [GuestRange(0, 2 * GiB), GuestRange(4 * GiB, 6 * GiB)]


def test_default_unit_is_kib_and_rounded_to_mib() -> None:
    cfg = memory_config(domain(memory="<memory>1048577</memory>"))
    assert cfg.ram == GiB + MiB


def test_accepts_parsed_tree() -> None:
    assert memory_config(etree.fromstring(domain())).ram == 4 * GiB


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"memory": None}, "no <memory>"),
        ({"memory": "<memory unit='GiB'>0</memory>"}, "larger than zero"),
        ({"memory": "<memory unit='parsecs'>4</memory>"}, "unknown unit"),
        ({"memory": "<memory unit='GiB'>four</memory>"}, "not a non-negative integer"),
        ({"machine": None}, "no machine type"),
    ],
)
def test_bad_domains(kw: dict[str, str | None], match: str) -> None:
    with pytest.raises(DomainXMLError, match=match):
        memory_config(domain(**kw))  # type: ignore[arg-type]


def test_not_xml() -> None:
    with pytest.raises(DomainXMLError, match="well-formed"):
        memory_config("<domain>")
    with pytest.raises(DomainXMLError, match="<domain>"):
        memory_config("<network/>")


def test_non_x86_refused() -> None:
    xml = domain().replace("arch='x86_64'", "arch='aarch64'")
    with pytest.raises(DomainXMLError, match="x86"):
        memory_config(xml)


def test_numa_cells_make_the_initial_ram() -> None:
    cpu = """<cpu><numa>
      <cell id='1' cpus='1' memory='3' unit='GiB'/>
      <cell id='0' cpus='0' memory='1048576'/>
    </numa></cpu>"""
    cfg = memory_config(domain(cpu=cpu))
    assert cfg.numa_cells == (GiB, 3 * GiB)
    assert cfg.ram == 4 * GiB


def test_dimms_and_max_memory() -> None:
    devices = """
      <memory model='dimm'><target><size unit='MiB'>512</size><node>0</node></target></memory>
      <memory model='dimm'><target><size unit='GiB'>1</size><node>0</node></target>
        <address type='dimm' slot='1' base='0x140000000'/></memory>"""
    cpu = "<cpu><numa><cell id='0' cpus='0' memory='2' unit='GiB'/></numa></cpu>"
    extra = "<maxMemory slots='4' unit='GiB'>16</maxMemory>"
    xml = domain(memory="<memory unit='MiB'>3584</memory>", cpu=cpu, devices=devices, extra=extra)
    cfg = memory_config(xml)
    assert cfg.ram == 2 * GiB
    assert (cfg.maxmem, cfg.slots) == (16 * GiB, 4)
    assert cfg.dimms == (Dimm(512 * MiB, None, 0), Dimm(GiB, 5 * GiB, 0))
    lay = compute_layout(cfg)
    assert lay.dimms == (GuestRange(4 * GiB, 4 * GiB + 512 * MiB), GuestRange(5 * GiB, 6 * GiB))


def test_dimms_without_numa_come_out_of_memory() -> None:
    devices = "<memory model='dimm'><target><size unit='GiB'>1</size></target></memory>"
    extra = "<maxMemory slots='2' unit='GiB'>8</maxMemory>"
    cfg = memory_config(domain(devices=devices, extra=extra))
    assert cfg.ram == 3 * GiB


def test_dimm_without_max_memory_refused() -> None:
    devices = "<memory model='dimm'><target><size unit='GiB'>1</size></target></memory>"
    with pytest.raises(DomainXMLError, match="maxMemory"):
        memory_config(domain(devices=devices))


def test_other_memory_models_refused() -> None:
    devices = "<memory model='virtio-mem'><target><size unit='GiB'>1</size></target></memory>"
    with pytest.raises(DomainXMLError, match="virtio-mem"):
        memory_config(domain(devices=devices, extra="<maxMemory slots='1'>8388608</maxMemory>"))


def _cmdline(*args: str) -> str:
    inner = "".join(f"<qemu:arg value='{a}'/>" for a in args)
    return f"<qemu:commandline>{inner}</qemu:commandline>"


@pytest.mark.parametrize(
    "args",
    [
        ("-machine", "max-ram-below-4g=1G"),
        ("-M", "pc-q35-7.2,max-ram-below-4g=1073741824"),
        ("-machine=max-ram-below-4g=1024M",),
        ("-global", "x=y", "-machine", "type=pc-q35-7.2,max-ram-below-4g=1G"),
    ],
)
def test_max_ram_below_4g_from_commandline(args: tuple[str, ...]) -> None:
    cfg = memory_config(domain(extra=_cmdline(*args)))
    assert cfg.max_ram_below_4g == GiB
    assert cfg.machine == "pc-q35-7.2"
    assert compute_layout(cfg).below_4g == GiB


def test_commandline_machine_type_overrides() -> None:
    cfg = memory_config(domain(extra=_cmdline("-machine", "pc-i440fx-7.2")))
    assert cfg.machine == "pc-i440fx-7.2"


def test_commandline_machine_without_value() -> None:
    with pytest.raises(DomainXMLError, match="without a value"):
        memory_config(domain(extra=_cmdline("-machine")))


def test_pcihole64() -> None:
    devices = (
        "<controller type='pci' index='0' model='pcie-root'>"
        "<pcihole64 unit='GiB'>64</pcihole64></controller>"
    )
    assert memory_config(domain(devices=devices)).pci_hole64_size == 64 * GiB


_AMD, _INTEL, _OTHER, _UNKNOWN = CpuVendor.AMD, CpuVendor.INTEL, CpuVendor.OTHER, CpuVendor.UNKNOWN


@pytest.mark.parametrize(
    ("virt", "cpu", "host", "vendor"),
    [
        # TCG: the model's own vendor; no model is QEMU's default qemu64 (AuthenticAMD).
        ("qemu", "", None, _AMD),
        ("qemu", "<cpu><numa><cell id='0' cpus='0' memory='4194304'/></numa></cpu>", None, _AMD),
        ("qemu", "<cpu mode='custom'><model>qemu64</model></cpu>", None, _AMD),
        ("qemu", "<cpu mode='custom'><model>EPYC-Rome-v2</model></cpu>", None, _AMD),
        ("qemu", "<cpu mode='custom'><model>Skylake-Server</model></cpu>", _AMD, _INTEL),
        ("qemu", "<cpu><model>kvm64</model></cpu>", None, _INTEL),
        ("qemu", "<cpu><model>Dhyana</model></cpu>", None, _OTHER),  # HygonGenuine
        ("qemu", "<cpu mode='maximum'/>", _INTEL, _AMD),  # TCG 'max' is AuthenticAMD
        ("qemu", "<cpu mode='host-passthrough'/>", _AMD, _UNKNOWN),  # KVM only
        ("qemu", "<cpu mode='host-model'/>", _AMD, _UNKNOWN),  # libvirt's pick
        ("qemu", "<cpu><model>NoSuchModel</model></cpu>", None, _UNKNOWN),
        # <vendor> is not passed to QEMU; contradicting the model it leaves nothing certain.
        ("qemu", "<cpu><vendor>AMD</vendor><model>EPYC</model></cpu>", None, _AMD),
        ("qemu", "<cpu><vendor>AMD</vendor><model>Haswell</model></cpu>", None, _UNKNOWN),
        # vendor_id is passed verbatim.
        ("qemu", "<cpu><model vendor_id='AuthenticAMD'>Haswell</model></cpu>", None, _AMD),
        ("kvm", "<cpu><model vendor_id='GenuineIntel'>EPYC</model></cpu>", _AMD, _INTEL),
        # KVM: every model takes the host's vendor (x86_cpu_load_model).
        ("kvm", "<cpu mode='custom'><model>EPYC-Rome</model></cpu>", _INTEL, _INTEL),
        ("kvm", "<cpu mode='custom'><model>Skylake-Server</model></cpu>", _AMD, _AMD),
        ("kvm", "", _AMD, _AMD),
        ("kvm", "<cpu mode='host-passthrough'/>", _AMD, _AMD),
        ("kvm", "<cpu mode='host-model'/>", None, _UNKNOWN),
        ("kvm", "<cpu mode='custom'><model>EPYC</model></cpu>", None, _UNKNOWN),
    ],
)
def test_cpu_vendor(virt: str, cpu: str, host: CpuVendor | None, vendor: CpuVendor) -> None:
    xml = domain(cpu=cpu).replace("type='qemu'", f"type='{virt}'", 1)
    assert memory_config(xml, host_vendor=host).cpu_vendor is vendor


def test_domain_layout_shortcut() -> None:
    from vmlend.memory.domain_memory import domain_layout

    xml = domain(cpu="<cpu mode='host-passthrough'/>").replace("type='qemu'", "type='kvm'", 1)
    assert domain_layout(xml, host_vendor=CpuVendor.INTEL).high == GuestRange(4 * GiB, 6 * GiB)


def test_a_kvm_guest_with_an_unknown_host_vendor_is_refused_where_it_matters() -> None:
    from vmlend.memory.domain_memory import domain_layout

    extra = "<maxMemory slots='1' unit='GiB'>1000</maxMemory>"
    xml = domain(cpu="<cpu><model>EPYC</model></cpu>", extra=extra)
    assert domain_layout(xml).notes  # TCG EPYC: AMD, high RAM above 1 TiB
    with pytest.raises(LayoutError, match="host's"):
        domain_layout(xml.replace("type='qemu'", "type='kvm'", 1))


def test_dimms_larger_than_memory_refused() -> None:
    devices = "<memory model='dimm'><target><size unit='GiB'>4</size></target></memory>"
    extra = "<maxMemory slots='2' unit='GiB'>8</maxMemory>"
    with pytest.raises(DomainXMLError, match="larger than the DIMMs"):
        memory_config(domain(devices=devices, extra=extra))


def test_dimm_sizes_are_rounded_as_libvirt_rounds_them() -> None:
    # libvirt's own example DIMM (docs/kbase/memorydevices.rst): 523264 KiB = 511 MiB, which
    # libvirt rounds up to 2 MiB (memory-module alignment) before QEMU sees it.
    devices = "<memory model='dimm'><target><size unit='KiB'>523264</size></target></memory>"
    extra = "<maxMemory slots='2' unit='GiB'>8</maxMemory>"
    memory = "<memory unit='KiB'>4717568</memory>"  # 4 GiB + the DIMM as written
    cfg = memory_config(domain(memory=memory, devices=devices, extra=extra))
    assert cfg.dimms == (Dimm(512 * MiB, None, None),)
    assert cfg.ram == 4 * GiB  # initial RAM from the DIMM as written, rounded to 1 MiB
    lay = compute_layout(cfg)
    assert lay.dimms[0].end - lay.dimms[0].start == 512 * MiB


def test_initial_memory_is_rounded_after_taking_the_written_dimms_out() -> None:
    devices = "<memory model='dimm'><target><size unit='KiB'>1023</size></target></memory>"
    extra = "<maxMemory slots='2' unit='GiB'>8</maxMemory>"
    memory = f"<memory unit='KiB'>{GiB // 1024 + 1023 + 1}</memory>"  # 1 GiB + 1 KiB + DIMM
    cfg = memory_config(domain(memory=memory, devices=devices, extra=extra))
    assert cfg.ram == GiB + MiB
    assert cfg.dimms[0].size == 2 * MiB
