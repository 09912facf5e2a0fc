"""Computed layouts against real QEMU (paused TCG guests, `info mtree -f` over QMP).

The flat-view parser is also tested on captured text without QEMU.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.needs import in_ci
from vmlend.errors import HostError, LayoutError
from vmlend.memory.domain_memory import memory_config
from vmlend.memory.layout import CpuVendor, Dimm, MemoryConfig, compute_layout
from vmlend.memory.qmp import QemuProcess, parse_flat_view, qemu_memory_args, ram_ranges
from vmlend.topology.model import GiB, GuestRange, MiB

G4 = 4 * GiB

MTREE = """\
FlatView #0
 AS "I/O", root: io
 Root memory region: io
  0000000000000000-0000000000000007 (prio 0, i/o): dma-chan

FlatView #1
 AS "memory", root: system
 AS "cpu-memory-0", root: system
 Root memory region: system
  0000000000000000-00000000000bffff (prio 0, ram): n0
  00000000000c0000-00000000000dffff (prio 1, rom): pc.rom
  00000000000e0000-00000000000fffff (prio 0, rom): pc.bios @0000000000020000
  0000000000100000-000000003fffffff (prio 0, ram): n0 @0000000000100000
  0000000040000000-000000007fffffff (prio 0, ram): n1
  00000000fec00000-00000000fec00fff (prio 0, i/o): ioapic
  00000000fffc0000-00000000ffffffff (prio 0, rom): pc.bios
  0000000100000000-000000017fffffff (prio 0, ram): n1 @0000000040000000

FlatView #2
 AS "pci-bridge", root: bus master container
 Root memory region: (none)
  0000000000000000-00000000000fffff (prio 0, ram): elsewhere
"""


def test_parse_flat_view_memory_only() -> None:
    flat = parse_flat_view(MTREE)
    assert flat[0].kind == "ram" and flat[0].end == 0xC0000 and flat[0].name == "n0"
    assert {r.kind for r in flat} == {"ram", "rom", "i/o"}
    assert ram_ranges(flat) == [
        GuestRange(0, 0xC0000),
        GuestRange(MiB, 2 * GiB),
        GuestRange(G4, 6 * GiB),
    ]
    assert len(ram_ranges(flat, merge=False)) == 4  # NUMA pieces kept apart on request


def test_parse_flat_view_missing_address_space() -> None:
    with pytest.raises(LayoutError, match="no flat view"):
        parse_flat_view(MTREE, "nonesuch")


# --- real QEMU ------------------------------------------------------------------------------

# Skipped without QEMU, except in CI, where it then fails (tests.support.needs).
needs_qemu = pytest.mark.skipif(
    shutil.which("qemu-system-x86_64") is None and not in_ci(),
    reason="qemu-system-x86_64 not installed",
)

SIZES = [1 * GiB, 2816 * MiB, 3 * GiB, 3583 * MiB, 3584 * MiB, 4 * GiB, 8 * GiB]
CASES = [MemoryConfig(m, s) for m in ("pc", "q35") for s in SIZES]
CASES += [
    MemoryConfig("pc", 4 * GiB, max_ram_below_4g=1 * GiB),
    MemoryConfig("q35", 4 * GiB, max_ram_below_4g=1 * GiB),
    MemoryConfig("pc-i440fx-7.2", 3584 * MiB),
    MemoryConfig("pc-q35-7.2", 2816 * MiB),
    MemoryConfig("pc-i440fx-5.2", 4 * GiB),
    MemoryConfig("pc-q35-4.0.1", 2815 * MiB),
    MemoryConfig("pc-i440fx-1.7", 4 * GiB),  # not gigabyte aligned: 3.5 GiB low
    MemoryConfig("q35", 4 * GiB, numa_cells=(1 * GiB, 3 * GiB)),
    MemoryConfig(
        "q35", 2 * GiB, maxmem=8 * GiB, slots=3, dimms=(Dimm(512 * MiB), Dimm(GiB), Dimm(2 * MiB))
    ),
    MemoryConfig(
        "pc",
        3584 * MiB,
        maxmem=8 * GiB,
        slots=3,
        dimms=(Dimm(2 * MiB), Dimm(4 * MiB, base=6 * GiB), Dimm(2 * MiB)),
    ),
    # AMD 1 TiB rule: a large hot-plug region makes the address space reach the HT hole
    MemoryConfig("q35", 4 * GiB, maxmem=1000 * GiB, slots=1, cpu_vendor=CpuVendor.AMD),
    MemoryConfig("q35", 4 * GiB, maxmem=1000 * GiB, slots=1, cpu_vendor=CpuVendor.INTEL),
    MemoryConfig("pc-q35-7.0", 4 * GiB, maxmem=1000 * GiB, slots=1, cpu_vendor=CpuVendor.AMD),
    MemoryConfig("pc", 8 * GiB, maxmem=1010 * GiB, slots=1, cpu_vendor=CpuVendor.AMD),
    # the 64-bit PCI hole decides: 32 GiB on q35 reaches the HT range, 2 GiB on pc does not
    MemoryConfig("q35", 4 * GiB, maxmem=990 * GiB, slots=1, cpu_vendor=CpuVendor.AMD),
    MemoryConfig("pc", 4 * GiB, maxmem=990 * GiB, slots=1, cpu_vendor=CpuVendor.AMD),
    MemoryConfig(
        "q35", 4 * GiB, maxmem=990 * GiB, slots=1, cpu_vendor=CpuVendor.AMD, pci_hole64_size=GiB
    ),
]


def _id(cfg: MemoryConfig) -> str:
    parts = [cfg.machine, f"{cfg.ram // MiB}M"]
    if cfg.max_ram_below_4g:
        parts.append(f"below{cfg.max_ram_below_4g // MiB}M")
    if cfg.numa_cells:
        parts.append(f"numa{len(cfg.numa_cells)}")
    if cfg.dimms:
        parts.append(f"dimms{len(cfg.dimms)}")
    if cfg.maxmem:
        parts.append(f"max{cfg.maxmem // GiB}G")
    if cfg.cpu_vendor is not CpuVendor.UNKNOWN:
        parts.append(str(cfg.cpu_vendor))
    if cfg.pci_hole64_size is not None:
        parts.append(f"hole64-{cfg.pci_hole64_size // GiB}G")
    return "-".join(parts)


@needs_qemu
@pytest.mark.qemu
@pytest.mark.parametrize("cfg", CASES, ids=_id)
def test_layout_matches_qemu(cfg: MemoryConfig, tmp_path: Path) -> None:
    layout = compute_layout(cfg)
    with QemuProcess(tmp_path, qemu_memory_args(cfg)) as qemu:
        reported = qemu.ram_ranges()
    assert reported == layout.flat_ram(vga=False)


@needs_qemu
@pytest.mark.qemu
def test_flat_view_with_vga(tmp_path: Path) -> None:
    cfg = MemoryConfig("pc", 1 * GiB)
    with QemuProcess(tmp_path, [*qemu_memory_args(cfg), "-vga", "std"]) as qemu:
        reported = qemu.ram_ranges()
    assert reported == compute_layout(cfg).flat_ram(vga=True)


@needs_qemu
@pytest.mark.qemu
def test_domain_xml_to_qemu(tmp_path: Path) -> None:
    """From libvirt XML (NUMA, DIMMs, max-ram-below-4g) to the layout QEMU reports."""
    xml = """<domain type='qemu' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>
      <name>g</name>
      <maxMemory slots='2' unit='GiB'>16</maxMemory>
      <memory unit='MiB'>5632</memory>
      <os><type arch='x86_64' machine='pc-i440fx-7.2'>hvm</type></os>
      <cpu><model>Skylake-Client</model><numa>
        <cell id='0' cpus='0' memory='1' unit='GiB'/>
        <cell id='1' cpus='0' memory='3' unit='GiB'/>
      </numa></cpu>
      <devices>
        <memory model='dimm'><target><size unit='MiB'>1536</size><node>1</node></target></memory>
      </devices>
      <qemu:commandline>
        <qemu:arg value='-machine'/><qemu:arg value='max-ram-below-4g=2G'/>
      </qemu:commandline>
    </domain>"""
    cfg = memory_config(xml)
    layout = compute_layout(cfg)
    assert layout.ranges() == [GuestRange(0, 2 * GiB), GuestRange(G4, 7 * GiB + 512 * MiB)]
    with QemuProcess(tmp_path, qemu_memory_args(cfg)) as qemu:
        assert qemu.ram_ranges() == layout.flat_ram()


@needs_qemu
@pytest.mark.qemu
def test_qemu_start_failure_is_reported(tmp_path: Path) -> None:
    proc = QemuProcess(tmp_path, ["-machine", "no-such-machine"])
    with pytest.raises(HostError, match="no-such-machine"):
        proc.start()
    assert proc.proc is None


def test_missing_binary(tmp_path: Path) -> None:
    with pytest.raises(HostError, match="not found"):
        QemuProcess(tmp_path, [], binary="qemu-system-nonesuch")


@needs_qemu
def test_socket_path_too_long(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    with pytest.raises(HostError, match="too long"):
        QemuProcess(deep, ["-machine", "pc"]).start()


@needs_qemu
@pytest.mark.qemu
def test_every_qemu_cpu_model_has_the_vendor_vmlend_expects(tmp_path: Path) -> None:
    """The AMD rule keys on QEMU's vendor string: compare vmlend's table with what this QEMU
    sets under TCG for every model it lists, and for its default CPU (no -cpu)."""
    from vmlend.memory.cpu_vendor import AMD_VENDOR, tcg_model_vendor

    with QemuProcess(tmp_path, ["-machine", "q35"]) as qemu:
        names = [d["name"] for d in qemu.qmp("query-cpu-definitions")]
        vendors = {}
        for name in names:
            if name in ("base", "host"):  # no vendor at all; the host CPU (KVM only)
                continue
            expansion = qemu.qmp(
                "query-cpu-model-expansion", {"type": "full", "model": {"name": name}}
            )
            vendors[name] = expansion["model"]["props"].get("vendor")
        cpu_path = qemu.qmp("query-cpus-fast")[0]["qom-path"]
        default_vendor = qemu.qmp("qom-get", {"path": cpu_path, "property": "vendor"})
    assert len(vendors) > 100
    wrong = {n: (v, tcg_model_vendor(n)) for n, v in vendors.items() if tcg_model_vendor(n) != v}
    assert not wrong
    assert default_vendor == AMD_VENDOR == tcg_model_vendor("qemu64")


@needs_qemu
@pytest.mark.qemu
def test_a_dimm_libvirt_rounds_lands_where_vmlend_puts_it(tmp_path: Path) -> None:
    xml = """<domain type='qemu'>
      <name>g</name>
      <maxMemory slots='2' unit='GiB'>8</maxMemory>
      <memory unit='KiB'>1571840</memory>
      <os><type arch='x86_64' machine='pc-q35-7.2'>hvm</type></os>
      <devices>
        <memory model='dimm'><target><size unit='KiB'>523264</size></target></memory>
      </devices>
    </domain>"""
    cfg = memory_config(xml)
    assert (cfg.ram, cfg.dimms[0].size) == (GiB, 512 * MiB)
    with QemuProcess(tmp_path, qemu_memory_args(cfg)) as qemu:
        assert qemu.ram_ranges() == compute_layout(cfg).flat_ram()
