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


# --- hypervisor (libvirt and the simulated one) ---------------------------------------------


class UnknownDomainError(LibvirtError):
    def __init__(self, name: str, uri: str) -> None:
        self.name = name
        self.uri = uri
        super().__init__(f"no domain {name!r} on {uri}; 'vmlend status' lists the VMs")


class DomainOperationError(LibvirtError):
    """The hypervisor refused ``op`` on ``domain``; ``reason`` is its own one-line reason and
    ``code`` libvirt's error number (``virErrorNumber``; 0 when not from libvirt)."""

    def __init__(self, op: str, domain: str, reason: str, code: int = 0, hint: str = "") -> None:
        self.op = op
        self.domain = domain
        self.reason = reason
        self.code = code
        tail = f"; {hint}" if hint else ""
        super().__init__(f"{op} {domain} refused: {reason}{tail}")


class DomainStateError(DomainOperationError):
    """The operation is not valid in the domain's current state (e.g. start a running one)."""


class UnsupportedOperationError(DomainOperationError):
    """The hypervisor driver or this host cannot do it (no such API, no VFIO, ...)."""


class DomainDefinitionError(DomainOperationError):
    """Domain or device XML rejected: malformed, incomplete, or conflicting name/UUID."""


class HookFailedError(DomainOperationError):
    """A libvirt hook script exited non-zero and so aborted the operation."""


class ShutdownTimeoutError(DomainOperationError):
    """A graceful shutdown did not finish in time; the domain is still running."""
