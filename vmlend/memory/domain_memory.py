"""Read what the guest memory layout depends on from libvirt domain XML (lxml, read-only).

Accepted forms (anything else that matters is a DomainXMLError, never a guess):

- machine type: ``/domain/os/type/@machine`` (required; libvirt fills it in on define), arch
  x86_64 or i686. A ``-machine``/``-M`` argument in ``<qemu:commandline>`` whose first option
  has no ``=`` overrides the type, as QEMU merges later ``-machine`` options over earlier ones.
- memory: ``<memory unit=...>`` (total, DIMMs included, as libvirt keeps it) with libvirt's
  units (b/bytes, KB, k/KiB, MB, M/MiB, GB, G/GiB, TB, T/TiB, PB, P/PiB, EB, E/EiB; default KiB).
  The initial RAM is the sum of the NUMA cells when there are any, else ``<memory>`` minus the
  DIMMs. Like libvirt (qemuDomainAlignMemorySizes) it is rounded up to 1 MiB, from the
  DIMM sizes as written; each DIMM is then rounded up to 2 MiB (libvirt's memory-module
  alignment on x86, qemuDomainGetMemoryModuleSizeAlignment), so a 523264 KiB DIMM is 512 MiB.
- NUMA: ``/domain/cpu/numa/cell/@memory`` (+ ``@unit``), in ``@id`` order.
- hot-plug: ``<maxMemory slots=N unit=...>`` and ``<devices><memory model='dimm'>`` with
  ``<target><size>`` and optionally ``<address type='dimm' base='0x...'/>``. Other memory
  device models (nvdimm, virtio-mem, ...) are refused.
- ``max-ram-below-4g``: libvirt has no element for it; accepted as a ``-machine``/``-M``
  option in ``<qemu:commandline>`` (``<qemu:arg value='-machine'/><qemu:arg
  value='pc,max-ram-below-4g=2G'/>`` or ``-machine=...``), with QEMU's size suffixes.
- 64-bit PCI hole: ``<controller type='pci' model='pcie-root|pci-root'><pcihole64>``.
- vCPU vendor (for the AMD 1 TiB rule): as QEMU sets it, see ``cpu_vendor``; under KVM it is
  the host's (``host_vendor``, which the caller knows), under TCG the model's.
"""

from __future__ import annotations

import logging
import re

from lxml import etree

from vmlend.errors import DomainXMLError
from vmlend.memory.cpu_vendor import guest_cpu_vendor
from vmlend.memory.layout import CpuVendor, Dimm, Layout, MemoryConfig, compute_layout

log = logging.getLogger(__name__)

QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"
_ALIGN = 1 << 20  # libvirt aligns x86 guest memory sizes to 1 MiB
_DIMM_ALIGN = 2 << 20  # ... and memory modules (DIMMs) to 2 MiB

_UNITS = {
    "b": 1,
    "bytes": 1,
    "kb": 10**3,
    "k": 1 << 10,
    "kib": 1 << 10,
    "mb": 10**6,
    "m": 1 << 20,
    "mib": 1 << 20,
    "gb": 10**9,
    "g": 1 << 30,
    "gib": 1 << 30,
    "tb": 10**12,
    "t": 1 << 40,
    "tib": 1 << 40,
    "pb": 10**15,
    "p": 1 << 50,
    "pib": 1 << 50,
    "eb": 10**18,
    "e": 1 << 60,
    "eib": 1 << 60,
}
# QEMU size options: a plain number is bytes; binary suffixes as shifts (qemu_strtosz).
_QEMU_SUFFIX = {"": 0, "b": 0, "k": 10, "m": 20, "g": 30, "t": 40, "p": 50, "e": 60}


def parse_libvirt_size(value: str | None, unit: str | None, what: str) -> int:
    """A libvirt scaled integer in bytes (unit default KiB); DomainXMLError when malformed."""
    if value is None or not value.strip():
        raise DomainXMLError(f"{what}: no size given")
    text = value.strip()
    if not text.isdigit():
        raise DomainXMLError(f"{what}: {text!r} is not a non-negative integer")
    key = (unit or "KiB").strip().lower()
    if key not in _UNITS:
        raise DomainXMLError(
            f"{what}: unknown unit {unit!r}; use one of b, KiB, MiB, GiB, TiB, KB, MB, GB, TB"
        )
    return int(text) * _UNITS[key]


def parse_qemu_size(text: str, what: str) -> int:
    """A QEMU size option (``2G``, ``3584M``, ``1073741824``) in bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([bkmgtpe]?)\s*", text, re.IGNORECASE)
    if not m:
        raise DomainXMLError(f"{what}: {text!r} is not a QEMU size such as 2G or 3584M")
    number, suffix = m.groups()
    shift = _QEMU_SUFFIX[suffix.lower()]
    if "." in number:  # QEMU accepts fractions with a suffix ("1.5G")
        return int(float(number) * (1 << shift))
    return int(number) << shift


def _round_up(value: int, align: int) -> int:
    return -(-value // align) * align


def _parse(xml: str | bytes | etree._Element) -> etree._Element:
    if isinstance(xml, etree._Element):
        return xml
    try:
        root = etree.fromstring(xml.encode() if isinstance(xml, str) else xml)
    except etree.XMLSyntaxError as exc:
        raise DomainXMLError(f"domain XML is not well-formed: {exc}") from None
    if root.tag != "domain":
        raise DomainXMLError(f"expected a <domain> document, got <{root.tag!s}>")
    return root


def _machine_args(root: etree._Element) -> list[str]:
    """Values following -machine/-M in <qemu:commandline>, in order."""
    args = [a.get("value", "") for a in root.iterfind(f"{{{QEMU_NS}}}commandline/{{{QEMU_NS}}}arg")]
    found: list[str] = []
    for i, arg in enumerate(args):
        if arg in ("-machine", "-M", "--machine"):
            if i + 1 >= len(args):
                raise DomainXMLError(f"<qemu:commandline>: {arg} without a value")
            found.append(args[i + 1])
        elif arg.startswith(("-machine=", "--machine=")):
            found.append(arg.split("=", 1)[1])
    return found


def _machine_and_below_4g(root: etree._Element) -> tuple[str, int | None]:
    type_el = root.find("os/type")
    machine = type_el.get("machine") if type_el is not None else None
    arch = type_el.get("arch") if type_el is not None else None
    if arch is not None and arch not in ("x86_64", "i686"):
        raise DomainXMLError(f"guest arch {arch!r}: vmlend models x86 guests only")
    below: int | None = None
    for value in _machine_args(root):
        for i, opt in enumerate(value.split(",")):
            if not opt:
                continue
            key, eq, val = opt.partition("=")
            if not eq and i == 0:
                machine = key
            elif not eq and key == "type":
                continue
            elif key == "type":
                machine = val
            elif key == "max-ram-below-4g":
                below = parse_qemu_size(val, "max-ram-below-4g in <qemu:commandline>")
    if not machine:
        raise DomainXMLError(
            "the domain XML names no machine type (<os><type machine=...>); define the domain "
            "with libvirt first so it fills in the machine type"
        )
    return machine, below


def _numa_cells(root: etree._Element) -> tuple[int, ...]:
    cells = root.findall("cpu/numa/cell")
    sized: list[tuple[int, int]] = []
    for n, cell in enumerate(cells):
        ident = cell.get("id", str(n))
        if not ident.isdigit():
            raise DomainXMLError(f"NUMA cell id {ident!r} is not a number")
        size = parse_libvirt_size(cell.get("memory"), cell.get("unit"), f"NUMA cell {ident}")
        sized.append((int(ident), _round_up(size, _ALIGN)))
    return tuple(size for _, size in sorted(sized))


def _dimms(root: etree._Element) -> tuple[Dimm, ...]:
    out: list[Dimm] = []
    for dev in root.iterfind("devices/memory"):
        model = dev.get("model")
        if model != "dimm":
            raise DomainXMLError(
                f"memory device model {model!r} is not supported; only model='dimm' is"
            )
        size_el = dev.find("target/size")
        if size_el is None:
            raise DomainXMLError("a <memory model='dimm'> device has no <target><size>")
        size = parse_libvirt_size(size_el.text, size_el.get("unit"), "DIMM size")
        node_text = dev.findtext("target/node")
        addr = dev.find("address")
        base = None
        if addr is not None and addr.get("base"):
            try:
                base = int(addr.get("base", ""), 0)
            except ValueError:
                raise DomainXMLError(f"DIMM base {addr.get('base')!r} is not a number") from None
        node = int(node_text) if node_text and node_text.strip().isdigit() else None
        out.append(Dimm(size=size, base=base, node=node))
    return tuple(out)


def _aligned(dimm: Dimm) -> Dimm:
    return Dimm(size=_round_up(dimm.size, _DIMM_ALIGN), base=dimm.base, node=dimm.node)


def _pci_hole64(root: etree._Element) -> int | None:
    for ctl in root.iterfind("devices/controller[@type='pci']"):
        if ctl.get("model") in ("pci-root", "pcie-root"):
            el = ctl.find("pcihole64")
            if el is not None:
                return parse_libvirt_size(el.text, el.get("unit"), "<pcihole64>")
    return None


def memory_config(
    xml: str | bytes | etree._Element, host_vendor: CpuVendor | None = None
) -> MemoryConfig:
    """Extract the layout inputs from domain XML; DomainXMLError for anything malformed."""
    root = _parse(xml)
    machine, below = _machine_and_below_4g(root)
    mem_el = root.find("memory")
    total = None
    if mem_el is not None:
        total = parse_libvirt_size(mem_el.text, mem_el.get("unit"), "<memory>")
    cells = _numa_cells(root)
    written = _dimms(root)
    if cells:
        ram = sum(cells)
    elif total is None:
        raise DomainXMLError("the domain XML has no <memory> element; give the guest memory")
    else:
        # libvirt: initial = <memory> minus the DIMMs as written, then aligned.
        ram = _round_up(total - sum(d.size for d in written), _ALIGN)
    dimms = tuple(_aligned(d) for d in written)
    dimm_total = sum(d.size for d in dimms)
    if ram <= 0:
        raise DomainXMLError(
            f"the guest's initial memory is {ram} bytes; <memory> must be larger than zero "
            "(and larger than the DIMMs)"
        )
    maxmem, slots = 0, 0
    max_el = root.find("maxMemory")
    if max_el is not None:
        maxmem = _round_up(
            parse_libvirt_size(max_el.text, max_el.get("unit"), "<maxMemory>"), _ALIGN
        )
        slots_text = max_el.get("slots", "0")
        if not slots_text.isdigit():
            raise DomainXMLError(f"<maxMemory slots={slots_text!r}> is not a number")
        slots = int(slots_text)
    elif dimms:
        raise DomainXMLError("DIMM memory devices need <maxMemory slots=...>")
    if total is not None and cells and total != ram + dimm_total:
        log.debug("<memory> %d != NUMA cells + DIMMs %d; using the cells", total, ram + dimm_total)
    return MemoryConfig(
        machine=machine,
        ram=ram,
        max_ram_below_4g=below,
        maxmem=maxmem,
        slots=slots,
        dimms=dimms,
        numa_cells=cells,
        cpu_vendor=guest_cpu_vendor(root, host_vendor),
        pci_hole64_size=_pci_hole64(root),
    )


def domain_layout(
    xml: str | bytes | etree._Element, host_vendor: CpuVendor | None = None
) -> Layout:
    """The guest RAM layout of a domain: :func:`memory_config` then :func:`compute_layout`."""
    return compute_layout(memory_config(xml, host_vendor))
