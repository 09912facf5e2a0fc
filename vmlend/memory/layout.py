"""Guest-physical RAM layout of a QEMU x86 guest (pc/i440fx and q35), computed from its config.

Pure logic, no I/O. The rules restate QEMU's own (hw/i386/pc_piix.c ``pc_init1``,
hw/i386/pc_q35.c ``pc_q35_init``, hw/i386/pc.c ``pc_memory_init`` / ``pc_pci_hole64_start`` /
``pc_get_device_memory_range``); docs/memory.md says which QEMU versions they were checked for.
Anything the rules cannot decide raises :class:`LayoutError`: a wrong layout would map the wrong
memory for a device, so refusing is always better than guessing.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence

import msgspec

from vmlend.errors import LayoutError
from vmlend.topology.model import GiB, GuestRange, MiB

PAGE = 4096
FOUR_GIB = 4 * GiB
#: x86 ``above_4g_mem_start``: high RAM starts here unless the AMD rule moves it.
ABOVE_4G_START = FOUR_GIB
#: AMD HyperTransport reserved range [AMD_HT_START, 1 TiB) (pc.c); the AMD rule moves high RAM
#: above it when the guest's highest used address would reach it.
AMD_HT_START = 0xFD_0000_0000
AMD_ABOVE_1TB_START = 0x100_0000_0000
#: Default size of the 64-bit PCI hole (q35: Q35_PCI_HOST_HOLE64_SIZE_DEFAULT, i440fx:
#: I440FX_PCI_HOST_HOLE64_SIZE_DEFAULT); libvirt's <pcihole64> overrides it.
PCI_HOLE64_DEFAULT = {"q35": 32 * GiB, "i440fx": 2 * GiB}
#: pc/i440fx default max-ram-below-4g (3.5 GiB) and its gigabyte-aligned cut (3 GiB).
PIIX_MAX_RAM_BELOW_4G = 0xE000_0000
PIIX_GB_ALIGNED_LOWMEM = 0xC000_0000
#: q35: RAM of at least this size is split at 2 GiB, smaller RAM may use up to 2.75 GiB low.
Q35_SPLIT_THRESHOLD = 0xB000_0000
Q35_LOWMEM_SMALL = 0xB000_0000
Q35_LOWMEM_LARGE = 0x8000_0000
#: Legacy window below 1 MiB that the flat view does not show as RAM.
LEGACY_VGA_START = 0xA_0000
LEGACY_ROM_START = 0xC_0000
#: pc-dimm placement alignment QEMU uses for RAM backends on x86-64 Linux hosts (2 MiB, the
#: transparent-huge-page size; QEMU also refuses DIMM sizes that are not multiples of it).
DIMM_ALIGN = 2 * MiB
#: Oldest machine versions we model; older ones have other historical quirks.
OLDEST_VERSION = (1, 4)


class Family(enum.StrEnum):
    I440FX = "i440fx"
    Q35 = "q35"


class CpuVendor(enum.StrEnum):
    INTEL = "intel"
    AMD = "amd"
    #: Another vendor string (HygonGenuine, ...): QEMU's AMD rule does not apply.
    OTHER = "other"
    UNKNOWN = "unknown"


class MachineType(msgspec.Struct, frozen=True):
    """What a machine type name tells the layout rules.

    ``version`` is None for the unversioned aliases ``pc`` / ``q35`` (assumed to be a QEMU of at
    least 7.1; libvirt expands the alias to the versioned name when it defines a domain).
    ``amd_1tb_hole`` is None when unknown (downstream types such as ``pc-q35-rhel9.2.0``).
    """

    name: str
    family: Family
    version: tuple[int, ...] | None
    gigabyte_align: bool = True
    aligned_dimm: bool = True
    has_reserved_memory: bool = True
    broken_reserved_end: bool = False
    amd_1tb_hole: bool | None = True


_VERSIONED = re.compile(r"^(?:pc-(?P<fam>i440fx|q35)-|pc-(?=\d))(?P<ver>\d+(?:\.\d+){1,2})$")
_DOWNSTREAM = re.compile(r"^pc-(?P<fam>i440fx|q35)-rhel\d+(?:\.\d+)*$")


def parse_machine_type(name: str) -> MachineType:
    """Map a machine type name to its layout flags; LayoutError for anything not modelled."""
    text = name.strip()
    if text in ("pc", "i440fx"):
        return MachineType(text, Family.I440FX, None)
    if text == "q35":
        return MachineType(text, Family.Q35, None)
    m = _DOWNSTREAM.match(text)
    if m:
        return MachineType(text, Family(m["fam"]), None, amd_1tb_hole=None)
    m = _VERSIONED.match(text)
    if not m:
        raise LayoutError(
            f"unknown machine type {name!r}: vmlend computes layouts for pc, q35, "
            "pc-i440fx-X.Y, pc-q35-X.Y and pc-X.Y only"
        )
    version = tuple(int(p) for p in m["ver"].split("."))
    family = Family(m["fam"]) if m["fam"] else Family.I440FX
    if version[:2] < OLDEST_VERSION:
        raise LayoutError(
            f"machine type {name!r} is older than {OLDEST_VERSION[0]}.{OLDEST_VERSION[1]}; "
            "its memory layout is not modelled — use a newer machine type"
        )
    v2 = version[:2]
    return MachineType(
        name=text,
        family=family,
        version=version,
        gigabyte_align=v2 > (1, 7),  # pc_compat_1_7: gigabyte_align = false
        aligned_dimm=v2 > (2, 1),  # pc_compat_2_1: enforce_aligned_dimm = false
        has_reserved_memory=v2 > (2, 0),  # pc-*-2.0: has_reserved_memory = false
        broken_reserved_end=v2 <= (2, 4),  # pc-*-2.4: broken_reserved_end = true
        amd_1tb_hole=v2 > (7, 0),  # pc-*-7.0: enforce_amd_1tb_hole = false
    )


class Dimm(msgspec.Struct, frozen=True):
    """A cold-plugged pc-dimm: ``size`` bytes, at ``base`` if the config fixes it."""

    size: int
    base: int | None = None
    node: int | None = None


class MemoryConfig(msgspec.Struct, frozen=True):
    """What decides a guest's layout. Sizes in bytes.

    ``ram`` is the initial (boot) RAM, QEMU's ``-m size``; DIMMs come on top. ``maxmem`` and
    ``slots`` are QEMU's ``-m maxmem=,slots=`` (0 = no hot-plug region). ``numa_cells`` are the
    per-node initial RAM sizes in node order (they must add up to ``ram``).
    """

    machine: str
    ram: int
    max_ram_below_4g: int | None = None
    maxmem: int = 0
    slots: int = 0
    dimms: tuple[Dimm, ...] = ()
    numa_cells: tuple[int, ...] = ()
    cpu_vendor: CpuVendor = CpuVendor.UNKNOWN
    pci_hole64_size: int | None = None


class Layout(msgspec.Struct, frozen=True):
    """The guest-physical RAM of one guest: low RAM at 0, high RAM, and cold-plugged DIMMs."""

    machine: MachineType
    below_4g: int
    above_4g: int
    above_4g_start: int
    device_memory: GuestRange | None = None
    dimms: tuple[GuestRange, ...] = ()
    numa_cells: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()  # why the layout is what it is; not part of it (see __eq__)

    # Two layouts with the same ranges are the same layout whatever their notes say: equality
    # and the hash (equal objects hash equal) leave ``notes`` out.
    def _compared(self) -> tuple[object, ...]:
        return tuple(getattr(self, f) for f in self.__struct_fields__ if f != "notes")

    def __eq__(self, other: object) -> bool:
        if type(other) is not Layout:
            return NotImplemented
        return self._compared() == other._compared()

    def __hash__(self) -> int:
        return hash(self._compared())

    @property
    def low(self) -> GuestRange:
        return GuestRange(0, self.below_4g)

    @property
    def high(self) -> GuestRange | None:
        if not self.above_4g:
            return None
        return GuestRange(self.above_4g_start, self.above_4g_start + self.above_4g)

    @property
    def ram_size(self) -> int:
        return self.below_4g + self.above_4g + sum(d.size for d in self.dimms)

    def ranges(self) -> list[GuestRange]:
        """Every RAM range, ascending; adjacent ranges (DIMMs after high RAM) are merged."""
        parts = [self.low]
        if self.high is not None:
            parts.append(self.high)
        parts.extend(self.dimms)
        return merge_ranges(parts)

    def flat_ram(self, vga: bool = False) -> list[GuestRange]:
        """RAM as QEMU's flat view shows it right after reset.

        Below 1 MiB the legacy window is not RAM in the flat view: 0xc0000-0xfffff are ROM
        (PAM registers in their reset state), and 0xa0000-0xbffff belong to the VGA device when
        there is one (without VGA they stay RAM).
        """
        low_end = LEGACY_VGA_START if vga else LEGACY_ROM_START
        parts: list[GuestRange] = []
        if self.below_4g <= low_end:
            parts.append(GuestRange(0, self.below_4g))
        else:
            parts.append(GuestRange(0, low_end))
            if self.below_4g > MiB:
                parts.append(GuestRange(MiB, self.below_4g))
        if self.high is not None:
            parts.append(self.high)
        parts.extend(self.dimms)
        return merge_ranges(parts)

    def node_ranges(self) -> list[list[GuestRange]]:
        """Guest-physical ranges of each NUMA node's initial RAM (nodes fill the RAM in order)."""
        result: list[list[GuestRange]] = []
        offset = 0  # offset into the one RAM block that low and high RAM alias
        for size in self.numa_cells:
            result.append(self._block_to_gpa(offset, offset + size))
            offset += size
        return result

    def _block_to_gpa(self, start: int, end: int) -> list[GuestRange]:
        out: list[GuestRange] = []
        if start < self.below_4g:
            out.append(GuestRange(start, min(end, self.below_4g)))
        if end > self.below_4g:
            lo = max(start, self.below_4g) - self.below_4g + self.above_4g_start
            out.append(GuestRange(lo, end - self.below_4g + self.above_4g_start))
        return out


def merge_ranges(parts: Sequence[GuestRange]) -> list[GuestRange]:
    """Sort and merge touching or overlapping ranges; drop empty ones."""
    out: list[GuestRange] = []
    for r in sorted((p for p in parts if p.size > 0), key=lambda p: p.start):
        if out and r.start <= out[-1].end:
            out[-1] = GuestRange(out[-1].start, max(out[-1].end, r.end))
        else:
            out.append(r)
    return out


def _round_up(value: int, align: int) -> int:
    return -(-value // align) * align


def split_low_high(machine: MachineType, ram: int, max_ram_below_4g: int | None) -> int:
    """Bytes of RAM below 4 GiB (the rest goes above), by the family's rule."""
    if machine.family is Family.Q35:
        if ram >= Q35_SPLIT_THRESHOLD:
            lowmem = Q35_LOWMEM_LARGE if machine.gigabyte_align else Q35_LOWMEM_SMALL
        else:
            lowmem = Q35_LOWMEM_SMALL
        limit = FOUR_GIB if max_ram_below_4g is None else max_ram_below_4g
        lowmem = min(lowmem, limit)
    else:
        limit = PIIX_MAX_RAM_BELOW_4G if max_ram_below_4g is None else max_ram_below_4g
        lowmem = limit
        if ram >= limit and machine.gigabyte_align:
            lowmem = min(lowmem, PIIX_GB_ALIGNED_LOWMEM)
    return lowmem if ram >= lowmem else ram


def _check_config(cfg: MemoryConfig, machine: MachineType) -> None:
    if cfg.ram <= 0:
        raise LayoutError(f"guest RAM must be positive, got {cfg.ram} bytes")
    if cfg.ram % PAGE:
        raise LayoutError(f"guest RAM {cfg.ram} bytes is not a multiple of the 4 KiB page")
    mrb = cfg.max_ram_below_4g
    if mrb is not None and not 0 < mrb <= FOUR_GIB:
        raise LayoutError(f"max-ram-below-4g must be between 1 byte and 4 GiB, got {mrb:#x}")
    if cfg.numa_cells and sum(cfg.numa_cells) != cfg.ram:
        raise LayoutError(
            f"NUMA cells add up to {sum(cfg.numa_cells)} bytes but the initial RAM is {cfg.ram}"
        )
    hotplug = cfg.maxmem > cfg.ram
    if cfg.dimms and not hotplug:
        raise LayoutError("DIMMs need a maximum memory larger than the initial RAM (maxMemory)")
    if hotplug and not machine.has_reserved_memory:
        raise LayoutError(f"machine type {machine.name} has no memory hot-plug region")
    if hotplug and len(cfg.dimms) > cfg.slots:
        raise LayoutError(f"{len(cfg.dimms)} DIMMs but only {cfg.slots} memory slots")
    plugged = cfg.ram + sum(d.size for d in cfg.dimms)
    if hotplug and plugged > cfg.maxmem:
        raise LayoutError(
            f"initial RAM plus DIMMs ({plugged} bytes) exceed the maximum memory ({cfg.maxmem})"
        )
    for d in cfg.dimms:
        if d.size <= 0 or d.size % DIMM_ALIGN:
            raise LayoutError(f"DIMM size {d.size} bytes is not a positive multiple of 2 MiB")


def _device_memory(machine: MachineType, cfg: MemoryConfig, high_end: int) -> GuestRange | None:
    """QEMU's hot-plug region (pc_get_device_memory_range), or None without one."""
    if not (machine.has_reserved_memory and cfg.maxmem > cfg.ram):
        return None
    base = _round_up(high_end, GiB)
    size = cfg.maxmem - cfg.ram
    if machine.aligned_dimm:
        size += GiB * cfg.slots  # room to align each slot to a 1 GiB page
    return GuestRange(base, base + size)


def _max_used_gpa(machine: MachineType, cfg: MemoryConfig, high_end: int) -> int:
    """Highest guest-physical address in use, the 64-bit PCI hole included (pc_max_used_gpa)."""
    dev = _device_memory(machine, cfg, high_end)
    if dev is not None:
        hole64_start = dev.start if machine.broken_reserved_end else dev.end
    else:
        hole64_start = high_end
    hole64 = cfg.pci_hole64_size
    if hole64 is None:
        hole64 = PCI_HOLE64_DEFAULT[machine.family]
    return _round_up(hole64_start, GiB) + hole64 - 1


def _place_dimms(dimms: Sequence[Dimm], region: GuestRange) -> tuple[GuestRange, ...]:
    """Place DIMMs in config order: a fixed base as given, others first-fit (2 MiB aligned)."""
    placed: list[GuestRange] = []
    for d in dimms:
        if d.base is not None:
            spot = GuestRange(d.base, d.base + d.size)
            if spot.start % DIMM_ALIGN:
                raise LayoutError(f"DIMM base {d.base:#x} is not 2 MiB aligned")
        else:
            addr = region.start
            for other in sorted(placed, key=lambda r: r.start):
                if addr + d.size <= other.start:
                    break
                addr = max(addr, _round_up(other.end, DIMM_ALIGN))
            spot = GuestRange(addr, addr + d.size)
        if spot.start < region.start or spot.end > region.end:
            raise LayoutError(
                f"DIMM of {d.size} bytes at {spot.start:#x} does not fit the hot-plug region "
                f"{region.start:#x}-{region.end:#x}"
            )
        if any(spot.start < o.end and o.start < spot.end for o in placed):
            raise LayoutError(f"DIMM at {spot.start:#x} overlaps another DIMM")
        placed.append(spot)
    return tuple(sorted(placed, key=lambda r: r.start))


def compute_layout(cfg: MemoryConfig) -> Layout:
    """The guest-physical RAM layout QEMU gives ``cfg``; LayoutError if it cannot be known."""
    machine = parse_machine_type(cfg.machine)
    _check_config(cfg, machine)
    below = split_low_high(machine, cfg.ram, cfg.max_ram_below_4g)
    above = cfg.ram - below
    start = ABOVE_4G_START
    notes: list[str] = []
    not_amd = cfg.cpu_vendor in (CpuVendor.INTEL, CpuVendor.OTHER)
    if machine.amd_1tb_hole is not False and not not_amd:
        reaches_ht = _max_used_gpa(machine, cfg, start + above) >= AMD_HT_START
        if reaches_ht and (cfg.cpu_vendor is CpuVendor.UNKNOWN or machine.amd_1tb_hole is None):
            raise LayoutError(
                f"the guest's address space reaches the AMD HyperTransport hole at "
                f"{AMD_HT_START:#x} and whether QEMU moves high RAM to 1 TiB cannot be "
                f"decided (vCPU vendor {cfg.cpu_vendor}, machine type {machine.name}); "
                "name the CPU model (type='qemu') or run vmlend where it knows the host's"
                " CPU vendor (type='kvm'); see docs/memory.md"
            )
        if reaches_ht:
            start = AMD_ABOVE_1TB_START
            notes.append("AMD vCPU: high RAM moved above the 1 TiB HyperTransport hole")
    dev = _device_memory(machine, cfg, start + above)
    dimms = _place_dimms(cfg.dimms, dev) if dev is not None else ()
    return Layout(
        machine=machine,
        below_4g=below,
        above_4g=above,
        above_4g_start=start,
        device_memory=dev,
        dimms=dimms,
        numa_cells=cfg.numa_cells,
        notes=tuple(notes),
    )
