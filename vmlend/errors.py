"""The one exception hierarchy of vmlend.

Every error a user can cause or fix is a ``VmlendError``. Each carries its data as attributes and
renders a one-line message that says what is wrong and, where possible, what to do. Only the CLI
and the hook entry point turn these into text and exit codes.
"""

from __future__ import annotations


class VmlendError(Exception):
    """Base of all vmlend errors. ``str()`` is the one-line message shown to users."""


# --- configuration and input -------------------------------------------------------------


class ConfigError(VmlendError):
    """Bad input the user supplied: a file, an option, an argument."""


class TopologyError(ConfigError):
    """A topology file is invalid. ``where`` names the file and line or field."""

    def __init__(self, where: str, problem: str) -> None:
        self.where = where
        self.problem = problem
        super().__init__(f"{where}: {problem}")


class DomainXMLError(ConfigError):
    """Domain XML that vmlend cannot read or rewrite."""


# --- the fabric ----------------------------------------------------------------------------


class FabricError(VmlendError):
    """Something about the fabric (nodes, devices, paths, resources) prevents the operation."""


class UnknownNodeError(FabricError):
    def __init__(self, node: str) -> None:
        self.node = node
        super().__init__(f"unknown node {node!r}; 'vmlend fabric show' lists the nodes")


class UnknownDeviceError(FabricError):
    def __init__(self, fdid: int) -> None:
        self.fdid = fdid
        super().__init__(
            f"unknown device fdid {fdid:#x}; 'vmlend devices' lists the devices of the fabric"
        )


class DeviceNotLentError(FabricError):
    def __init__(self, fdid: int, lender: str) -> None:
        self.fdid = fdid
        self.lender = lender
        super().__init__(
            f"device {fdid:#x} is not lent by {lender}; run 'vmlend lend {fdid:#x}' first"
        )


class DeviceHeldError(FabricError):
    """The device is reserved or borrowed by someone else."""

    def __init__(self, fdid: int, node: str, vm: str) -> None:
        self.fdid = fdid
        self.node = node
        self.vm = vm
        super().__init__(f"device {fdid:#x} is held by {node}/{vm}")


class LenderUnavailableError(FabricError):
    def __init__(self, fdid: int, lender: str, why: str = "is unreachable") -> None:
        self.fdid = fdid
        self.lender = lender
        super().__init__(f"lender {lender} of device {fdid:#x} {why}")


class NoPathError(FabricError):
    def __init__(self, src: str, dst: str) -> None:
        self.src = src
        self.dst = dst
        super().__init__(f"no NTB path from {src} to {dst}; check the fabric links")


class ResourceExhaustedError(FabricError):
    """A finite fabric resource (LUT entries, NTB window, segments) is short.

    ``need`` and ``have`` are in the resource's unit (entries, bytes, segments).
    """

    def __init__(self, what: str, where: str, need: int, have: int, unit: str = "") -> None:
        self.what = what
        self.where = where
        self.need = need
        self.have = have
        self.unit = unit
        short = need - have
        u = f" {unit}" if unit else ""
        super().__init__(
            f"{what} on {where} is short by {short}{u} (need {need}{u}, have {have}{u})"
        )


class DmaFault(FabricError):
    """A simulated DMA could not be resolved. ``hop`` names the translation stage that faulted."""

    def __init__(self, hop: str, address: int, why: str) -> None:
        self.hop = hop
        self.address = address
        self.why = why
        super().__init__(f"DMA fault at {hop} for address {address:#x}: {why}")


# --- state, mdevs, host --------------------------------------------------------------------


class StateError(VmlendError):
    """The shared state database is missing, corrupt, foreign or locked."""


class MdevError(VmlendError):
    """The Linux mdev ABI refused an operation."""


class HostError(VmlendError):
    """The host lacks something vmlend needs (a module, a path, a daemon)."""


class LibvirtError(VmlendError):
    """libvirt refused an operation; the message carries libvirt's own reason."""


class LayoutError(VmlendError):
    """A guest memory layout cannot be computed or disagrees with what was probed."""


class RelayError(VmlendError):
    """The interrupt relay could not set up or deliver a vector."""


class DmaLimitError(ResourceExhaustedError):
    """Guest RAM lies beyond what a device can address (``need``/``have`` are end addresses)."""

    def __init__(self, device: str, dma_bits: int, gpa_end: int) -> None:
        super().__init__(f"{dma_bits}-bit DMA reach", device, gpa_end, 1 << dma_bits, "bytes")
        self.dma_bits = dma_bits
        self.gpa_end = gpa_end

    def __str__(self) -> str:
        return (
            f"device {self.where} addresses only {self.dma_bits} bits (below {self.have:#x}) but "
            f"guest RAM reaches {self.gpa_end:#x}: short by {self.need - self.have} bytes; give "
            "the guest less memory or keep its RAM below the limit (e.g. no AMD 1 TiB move)"
        )


# --- appended by the shared-state work ----------------------------------------------------


def _size_text(n: int) -> str:
    """Bytes in binary units for messages: 64 GiB, 32.05 GiB, 16 MiB."""
    for unit, name in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= unit:
            return f"{n / unit:.2f}".rstrip("0").rstrip(".") + f" {name}"
    return f"{n} bytes"


class WindowExhaustedError(ResourceExhaustedError):
    """An NTB window has too little free room; ``need``/``have`` are bytes."""

    def __init__(self, where: str, need: int, have: int, purpose: str = "") -> None:
        super().__init__("NTB window", where, need, have, "bytes")
        self.purpose = purpose
        why = f" ({purpose})" if purpose else ""
        self.args = (
            f"NTB window {where} short by {_size_text(need - have)}:"
            f" need {_size_text(need)}, have {_size_text(have)}{why}",
        )


class DeviceNotReservedError(FabricError):
    """An operation needs the holder's reservation of the device, and there is none."""

    def __init__(self, fdid: int, holder: str) -> None:
        self.fdid = fdid
        self.holder = holder
        super().__init__(
            f"device {fdid:#x} is not reserved by {holder}; it must be reserved first"
            " (starting or hot-adding to the VM does that)"
        )


class HookError(VmlendError):
    """A hook operation failed; the message names the VM, the device and the reason."""


class IommuMappingError(FabricError):
    """An IOMMU map/unmap request conflicts with the domain's page tables."""

    def __init__(self, domain: str, iova: int, size: int, why: str) -> None:
        self.domain = domain
        self.iova = iova
        self.size = size
        self.why = why
        super().__init__(f"IOMMU domain {domain}: cannot map/unmap {iova:#x}+{size:#x}: {why}")


class PinError(FabricError):
    """Guest memory could not be pinned (not RAM, or the guest's memory does not exist yet)."""

    def __init__(self, vm: str, gpa: int, why: str) -> None:
        self.vm = vm
        self.gpa = gpa
        self.why = why
        super().__init__(f"cannot pin guest {vm} memory at {gpa:#x}: {why}")


# --- appended by the peer-to-peer work ----------------------------------------------------


class P2PError(FabricError):
    """Peer-to-peer mappings between a VM's devices cannot be planned as asked (a bad BAR
    index, size or alignment, a device not passed to the VM)."""


class BarConflictError(P2PError):
    """A guest placed a device BAR over the VM's RAM or over another BAR of the VM."""

    def __init__(self, fdid: int, bar: int, gpa: int, size: int, other: str) -> None:
        self.fdid = fdid
        self.bar = bar
        self.gpa = gpa
        self.size = size
        self.other = other
        super().__init__(
            f"the guest placed BAR {bar} of device {fdid:#x} at {gpa:#x}+{size:#x}, over {other};"
            " no peer-to-peer mapping was changed (check the guest's PCI resource assignment)"
        )
