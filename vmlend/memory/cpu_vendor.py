"""The guest vCPU's vendor string, as QEMU sets it for a libvirt domain (the AMD 1 TiB rule).

QEMU moves high RAM above 1 TiB only when the vCPU vendor is exactly ``AuthenticAMD``
(``IS_AMD_CPU`` in target/i386/cpu.h; Hygon's ``HygonGenuine`` does not count). Where the
vendor comes from (QEMU 7.2, target/i386/cpu.c, checked with ``query-cpu-model-expansion``):

- ``<model vendor_id='…'>``: libvirt passes ``vendor=`` to QEMU, which uses it verbatim.
- KVM (``<domain type='kvm'>``): ``x86_cpu_load_model`` gives every named model the *host's*
  vendor, and ``host-passthrough``/``host-model``/``maximum`` are the host CPU too: the guest
  vendor is the host's, whatever the model.
- TCG (``<domain type='qemu'>``): a named model has its table vendor (below); no model at all
  is QEMU's default ``qemu64`` (AuthenticAMD); ``maximum`` is ``max`` (AuthenticAMD under
  TCG). ``host-passthrough`` needs KVM (libvirt refuses it for TCG) and ``host-model`` is a
  model libvirt picks from its TCG capabilities: vmlend cannot know those, and says so.

``<vendor>`` under ``<cpu>`` is not passed to QEMU (libvirt only checks it), so it decides
nothing; a TCG model whose table vendor contradicts it is treated as unknown.
"""

from __future__ import annotations

import re

from lxml import etree

from vmlend.memory.layout import CpuVendor

AMD_VENDOR = "AuthenticAMD"
INTEL_VENDOR = "GenuineIntel"
HYGON_VENDOR = "HygonGenuine"

# QEMU 7.2's x86 CPU models (``-cpu help``) by vendor, without their ``-vN`` versions.
_AMD_MODELS = frozenset(
    {
        "EPYC",
        "EPYC-IBPB",
        "EPYC-Milan",
        "EPYC-Rome",
        "Opteron_G1",
        "Opteron_G2",
        "Opteron_G3",
        "Opteron_G4",
        "Opteron_G5",
        "athlon",
        "phenom",
        "qemu64",
    }
)
_HYGON_MODELS = frozenset({"Dhyana"})
_INTEL_MODELS = frozenset(
    {
        "486",
        "Broadwell",
        "Broadwell-IBRS",
        "Broadwell-noTSX",
        "Broadwell-noTSX-IBRS",
        "Cascadelake-Server",
        "Cascadelake-Server-noTSX",
        "Conroe",
        "Cooperlake",
        "Denverton",
        "Haswell",
        "Haswell-IBRS",
        "Haswell-noTSX",
        "Haswell-noTSX-IBRS",
        "Icelake-Server",
        "Icelake-Server-noTSX",
        "IvyBridge",
        "IvyBridge-IBRS",
        "KnightsMill",
        "Nehalem",
        "Nehalem-IBRS",
        "Penryn",
        "SandyBridge",
        "SandyBridge-IBRS",
        "Skylake-Client",
        "Skylake-Client-IBRS",
        "Skylake-Client-noTSX-IBRS",
        "Skylake-Server",
        "Skylake-Server-IBRS",
        "Skylake-Server-noTSX-IBRS",
        "Snowridge",
        "Westmere",
        "Westmere-IBRS",
        "core2duo",
        "coreduo",
        "kvm32",
        "kvm64",
        "n270",
        "pentium",
        "pentium2",
        "pentium3",
        "qemu32",
    }
)
_VERSION = re.compile(r"-v\d+$")
_TCG_DEFAULT_MODEL = "qemu64"
_TCG_MAX_VENDOR = AMD_VENDOR
_LIBVIRT_VENDOR_NAMES = {"amd": AMD_VENDOR, "intel": INTEL_VENDOR, "hygon": HYGON_VENDOR}


def tcg_model_vendor(model: str) -> str | None:
    """The vendor string QEMU 7.2 gives CPU model ``model`` under TCG, None if unknown."""
    if model == "max":
        return _TCG_MAX_VENDOR
    base = _VERSION.sub("", model)
    if base in _AMD_MODELS:
        return AMD_VENDOR
    if base in _INTEL_MODELS:
        return INTEL_VENDOR
    if base in _HYGON_MODELS:
        return HYGON_VENDOR
    return None


def vendor_of(cpuid_vendor: str | None) -> CpuVendor:
    """What a CPUID vendor string means for the AMD rule."""
    if cpuid_vendor is None:
        return CpuVendor.UNKNOWN
    if cpuid_vendor == AMD_VENDOR:
        return CpuVendor.AMD
    if cpuid_vendor == INTEL_VENDOR:
        return CpuVendor.INTEL
    return CpuVendor.OTHER


def guest_cpu_vendor(domain: etree._Element, host_vendor: CpuVendor | None) -> CpuVendor:
    """The vendor of the vCPUs QEMU gives ``domain`` (UNKNOWN when it cannot be known)."""
    cpu = domain.find("cpu")
    model_el = cpu.find("model") if cpu is not None else None
    if model_el is not None and model_el.get("vendor_id"):
        return vendor_of(model_el.get("vendor_id"))
    virt = domain.get("type")
    if virt == "kvm":
        return host_vendor or CpuVendor.UNKNOWN
    if virt != "qemu":
        return CpuVendor.UNKNOWN
    model = (model_el.text or "").strip() if model_el is not None else ""
    mode = cpu.get("mode", "custom") if cpu is not None else "custom"
    if mode == "maximum":
        return vendor_of(_TCG_MAX_VENDOR)
    if mode != "custom":
        return CpuVendor.UNKNOWN  # host-passthrough (KVM only) or host-model (libvirt's pick)
    vendor = tcg_model_vendor(model or _TCG_DEFAULT_MODEL)
    declared = (cpu.findtext("vendor") or "").strip().lower() if cpu is not None else ""
    if declared and _LIBVIRT_VENDOR_NAMES.get(declared, declared) != vendor:
        return CpuVendor.UNKNOWN
    return vendor_of(vendor)
