"""The one exception hierarchy of vmlend.

Every error a user can cause or fix is a ``VmlendError``. Each carries its data as attributes and
renders a one-line message that says what is wrong and, where possible, what to do. Only the CLI
and the hook entry point turn these into text and exit codes.
"""

from __future__ import annotations

from vmlend.units import format_size_human


class VmlendError(Exception):
    """Base of all vmlend errors. ``str()`` is the one-line message shown to users."""


# --- configuration and input: what the user gave (files, options, arguments) --------------


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


# --- shared state: the SQLite file or the cluster registry, and the agent's lease ---------


class StateError(VmlendError):
    """The shared state database is missing, corrupt, foreign or cannot be used."""


class StateRecordError(StateError):
    """One record of the state cannot be decoded (a wrong type, a value out of its set, text
    that is not JSON). ``table`` and ``key`` name it; the rest of the state is usable."""

    def __init__(self, table: str, key: object, why: str) -> None:
        self.table = table
        self.key = key
        self.why = why
        super().__init__(
            f"the state's {table} record {key} is damaged ({why}); repair or delete that"
            " record (the rest of the state is fine)"
        )


class StateHostError(StateError):
    """The state file is sound but the host will not let vmlend use it (read-only, full,
    permissions, a lock). Never a reason to move the file away: fix the host and retry."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        super().__init__(message)


class StateReadOnlyError(StateHostError):
    def __init__(self, path: str) -> None:
        super().__init__(
            path,
            f"cannot change the vmlend state {path}: its file system is read-only; remount it"
            " read-write and retry (commands that only read, such as 'vmlend status', still work)",
        )


class StateDiskFullError(StateHostError):
    def __init__(self, path: str) -> None:
        super().__init__(
            path,
            f"cannot change the vmlend state {path}: its file system is full; free space there"
            " and retry (the state was not changed)",
        )


class StatePermissionError(StateHostError):
    def __init__(self, path: str, access: str) -> None:
        self.access = access  # "read" or "write"
        super().__init__(
            path,
            f"cannot {access} the vmlend state {path}: permission denied; run vmlend as a user"
            " who may (root for the system state) or fix the owner and mode of the file and its"
            " directory",
        )


class StateLockedError(StateHostError):
    def __init__(self, path: str, waited: float) -> None:
        self.waited = waited
        super().__init__(
            path,
            f"the vmlend state {path} is locked by another process (waited {waited:g} s);"
            f" retry when it is done ('fuser -v {path}' shows which process holds it)",
        )


class AgentNotRunningError(StateError):
    """A cluster registry write needs this host's agent lease, and there is none."""

    def __init__(self, where: str) -> None:
        self.where = where
        super().__init__(
            f"no vmlend agent runs on this host (no live lease at {where}); start 'vmlend agent'"
            " (see docs/cluster.md) and retry"
        )


class LeaseExpiredError(StateError):
    """etcd refused a write because the host's lease it was made under has ended (the agent
    froze, or etcd was away, past the TTL). Nothing was written; the device is not lost, the
    lease is: the agent takes a new one."""

    def __init__(self) -> None:
        super().__init__(
            "the host's etcd lease has expired, so etcd refused the write; nothing was written;"
            " restart 'vmlend agent' on this host"
        )


class RegistryUnreachableError(StateError):
    """The cluster registry cannot be reached, or answers without a quorum: nothing was read.
    A commit's outcome is unknown: etcd may have applied one it then answered with an error
    (a timeout inside raft), so a caller that must know reads again once it can (a hold
    carries its reserve's stamp; a release is journalled). ``where`` names its endpoints."""

    def __init__(self, where: str, message: str) -> None:
        self.where = where
        super().__init__(message)


class DamagedCopyError(StateError):
    """A chunk of this host's copy of the topology (``vmlend.registry.topocache``) does not
    hash to its digest, and the registry no longer holds that generation's pieces to read it
    from instead. Raised wherever the topology is read, so a caller that sorts errors into
    "not this check's" must let it through (it is about every check)."""


class RegistryAuthError(StateError):
    """etcd's authentication refused this host: it needs a user and none was given, or the
    user's password is wrong. Nothing was read or written. ``where`` names the endpoints,
    ``user`` the etcd user ("" when none was given)."""

    def __init__(self, where: str, user: str, message: str) -> None:
        self.where = where
        self.user = user
        super().__init__(message)


class RegistryPermissionError(RegistryAuthError):
    """etcd refused a request of this host's user: its role may not write (or read) a key the
    request touches. Nothing was written."""

    def __init__(self, where: str, user: str) -> None:
        who = f"user {user!r}" if user else "this host (no user given)"
        super().__init__(
            where,
            user,
            f"etcd at {where} refused {who} permission for a request: its role may not write"
            " a key the request touches; nothing was written. Give the host its own role as"
            " 'vmlend registry roles' prints it (docs/cluster.md, 'Users and roles')",
        )


class ReleasePendingError(VmlendError):
    """A release could not reach the registry; it is recorded on the host and the agent
    retries it until it lands. ``what`` names the devices and shares it returns."""

    def __init__(self, vm: str, why: str, journal: str, what: str = "") -> None:
        self.vm = vm
        self.journal = journal
        pending = f" ({what})" if what else ""
        super().__init__(
            f"release of VM {vm!r} is pending{pending}: {why}; recorded in {journal}, and"
            " 'vmlend agent' retries it until it lands (nothing to run by hand)"
        )


class ReleaseJournalError(VmlendError):
    """A release could not reach the registry, and the host could not record it either (its
    journal directory is not usable): nothing returns the VM's devices by itself. They stay
    held, so no other VM can take them while this one's state is unsure."""

    def __init__(self, vm: str, what: str, directory: str, why: str) -> None:
        self.vm = vm
        self.directory = directory
        super().__init__(
            f"release of VM {vm!r} ({what}) could not reach the registry, nor be recorded in"
            f" {directory} ({why}); its devices stay held: make {directory} a directory of"
            " root's that only root can write, then run 'vmlend reconcile --fix' once the"
            " registry answers"
        )


# --- the fabric: nodes, devices, holds and their fencing ----------------------------------


class FabricError(VmlendError):
    """Something about the fabric (nodes, devices, paths, resources) prevents the operation."""


class DiscoveryConflictError(FabricError):
    """What a host's SmartIO driver says contradicts the topology (``vmlend fabric discover``):
    nothing is merged."""

    def __init__(self, conflicts: list[str] | tuple[str, ...]) -> None:
        self.conflicts = tuple(conflicts)
        n = len(self.conflicts)
        super().__init__(
            f"{n} conflict{'s' if n != 1 else ''} between the SmartIO driver and the topology,"
            f" nothing merged: {'; '.join(self.conflicts)}"
        )


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


class DeviceNotReservedError(FabricError):
    """An operation needs the holder's reservation of the device, and there is none."""

    def __init__(self, fdid: int, holder: str) -> None:
        self.fdid = fdid
        self.holder = holder
        super().__init__(
            f"device {fdid:#x} is not reserved by {holder}; it must be reserved first"
            " (starting or hot-adding to the VM does that)"
        )


class DeviceFencedError(FabricError):
    """The device's last holder lost its lease (its host died or was cut off) and the lender
    has not yet taken the device back, so nobody may borrow it yet."""

    def __init__(self, fdid: int, lender: str, holder: str) -> None:
        self.fdid = fdid
        self.lender = lender
        self.holder = holder
        super().__init__(
            f"device {fdid:#x} is fenced: its holder {holder} lost its lease and the lender"
            f" {lender} has not taken it back yet; retry once the vmlend agent on {lender}"
            " has reset it"
        )


class BorrowTeardownError(FabricError):
    """Ending a borrow could not remove every mapping of the device: it stays fenced under
    its old borrow (no bus mastering, no decoding) until a retried give-back succeeds."""

    def __init__(self, fdid: int, node: str, vm: str, why: str) -> None:
        self.fdid = fdid
        self.node = node
        self.vm = vm
        self.why = why
        super().__init__(
            f"device {fdid:#x} stays fenced by {node}/{vm}: its mappings could not be torn "
            f"down ({why}); fix the cause and give it back again"
        )


class StaleTokenError(FabricError):
    """A step on a device for a hold older than the one the device last served (the fencing
    token check): the hold it was made for has ended and a newer holder took the device."""

    def __init__(self, fdid: int, token: int, current: int, what: str) -> None:
        self.fdid = fdid
        self.token = token
        self.current = current
        if current > token:
            why = f"the device has since served a newer hold (token {current})"
        elif current < 0:  # the driver's refusal does not say which token it has
            why = "the device has since served a newer hold"
        else:
            why = "its hold was released or taken back (the device spent its token)"
        super().__init__(
            f"device {fdid:#x}: {what} for an ended hold (fencing token {token}) refused: {why};"
            " nothing was changed; reserve the device again (a new hold) to use it"
        )


class DeviceRevokedError(FabricError):
    """A VM's device was taken from it (lender reclaim, a release or give-back behind its
    back): its mdev and config space are dead for that VM, as after a surprise removal."""

    def __init__(self, fdid: int, holder: str) -> None:
        self.fdid = fdid
        self.holder = holder
        super().__init__(
            f"device {fdid:#x} is no longer {holder}'s (its borrow or hold ended): hot-remove"
            " it from the VM, then attach it again if it is free"
        )


class LenderUnavailableError(FabricError):
    def __init__(self, fdid: int, lender: str, why: str = "is unreachable") -> None:
        self.fdid = fdid
        self.lender = lender
        super().__init__(f"lender {lender} of device {fdid:#x} {why}")


class LenderIommuOffError(FabricError):
    """A device lent from a host whose IOMMU is off: a VM cannot take it (its lender's IOMMU
    mirrors the guest's memory layout, IOVA = guest-physical)."""

    def __init__(self, fdid: int, lender: str) -> None:
        self.fdid = fdid
        self.lender = lender
        super().__init__(
            f"device {fdid:#x} cannot go to a VM: its lender {lender} has its IOMMU off, and a"
            f" VM's device needs it; set iommu = true for {lender} in the topology and run"
            " 'vmlend fabric init --topology FILE', or borrow a device of another lender"
        )


class NoPathError(FabricError):
    def __init__(self, src: str, dst: str) -> None:
        self.src = src
        self.dst = dst
        super().__init__(f"no NTB path from {src} to {dst}; check the fabric links")


class NoDeviceToChooseError(FabricError):
    """Fewer available devices of a wanted kind than asked for (``--device gpu:2``)."""

    def __init__(self, wish: str, node: str, available: int, busy: list[str]) -> None:
        self.wish = wish
        self.node = node
        self.available = available
        self.busy = busy
        others = f" ({', '.join(busy)})" if busy else ""
        super().__init__(
            f"cannot choose {wish} for a VM on {node}: {available} available{others};"
            " ask for fewer, lend more ('vmlend devices' lists them) or name fdids"
        )


# --- fabric resources: LUT entries, NTB windows, segments, DMA reach ----------------------


def _unit(count: int, unit: str) -> str:
    """``unit`` (a plural: segments, entries, bytes) in the singular for a count of one."""
    if count != 1 or not unit.endswith("s"):
        return unit
    return unit[:-3] + "y" if unit.endswith("ies") else unit[:-1]


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

        def n(count: int) -> str:
            return f"{count} {_unit(count, unit)}" if unit else str(count)

        super().__init__(
            f"{what} on {where} is short by {n(short)} (need {n(need)}, have {n(have)})"
        )


class SwitchPortFullError(ResourceExhaustedError):
    """A cluster switch port's requester table has no entry left for a crossing's requester
    (one line naming the switch and the port)."""

    def __init__(self, switch: str, port: str, requester: str, entries: int) -> None:
        super().__init__("switch port requester table", port, 1, 0, "entries")
        self.switch = switch
        self.port = port
        self.requester = requester
        self.entries = entries
        self.args = (
            f"switch {switch} port {port}: its requester table is full ({entries} of"
            f" {entries} entries used), no room for requester {requester}; release a device"
            f" that crosses it, or give [[switch]] {switch!r} more requester_entries if the"
            " hardware has them",
        )


class CmbFullError(ResourceExhaustedError):
    """A shared drive's controller memory buffer has no extent left for a share's submission
    queues; ``need``/``have`` are bytes (one line, saying what to do)."""

    def __init__(self, drive: str, need: int, have: int, size: int) -> None:
        super().__init__("controller memory buffer", drive, need, have, "bytes")
        self.args = (
            f"{drive}: its controller memory buffer has no room for the share's submission"
            f" queues (need {format_size_human(need)}, largest free extent"
            f" {format_size_human(have)} of {format_size_human(size)}); release a share of"
            " it, ask for fewer queue pairs (--queues), or share the drive again with a larger"
            " --cmb",
        )


class WindowExhaustedError(ResourceExhaustedError):
    """An NTB window has too little free room; ``need``/``have`` are bytes."""

    def __init__(self, where: str, need: int, have: int, purpose: str = "") -> None:
        super().__init__("NTB window", where, need, have, "bytes")
        self.purpose = purpose
        why = f" ({purpose})" if purpose else ""
        self.args = (
            f"NTB window {where} short by {format_size_human(need - have)}:"
            f" need {format_size_human(need)}, have {format_size_human(have)}{why}",
        )


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


# --- the data path: DMA, IOMMU, pinning, peer-to-peer, guest memory layout, interrupts ----


class DmaFault(FabricError):
    """A simulated DMA could not be resolved. ``hop`` names the translation stage that faulted."""

    def __init__(self, hop: str, address: int, why: str) -> None:
        self.hop = hop
        self.address = address
        self.why = why
        super().__init__(f"DMA fault at {hop} for address {address:#x}: {why}")


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


class LayoutError(VmlendError):
    """A guest memory layout cannot be computed or disagrees with what was probed."""


class RelayError(VmlendError):
    """The interrupt relay could not set up or deliver a vector."""


# --- the Linux mdev ABI (vmlend.kernel.mdev): each names the parent and type and what to do


class MdevError(VmlendError):
    """The Linux mdev ABI refused an operation."""


class MdevParentNotFoundError(MdevError):
    def __init__(self, parent: str) -> None:
        self.parent = parent
        super().__init__(
            f"no mdev parent {parent!r}; 'vmlend mdev types' lists the parents"
            " (is the parent's driver loaded?)"
        )


class MdevTypeNotFoundError(MdevError):
    def __init__(self, parent: str, type_id: str, known: tuple[str, ...] = ()) -> None:
        self.parent = parent
        self.type_id = type_id
        self.known = known
        have = ", ".join(known) if known else "none"
        super().__init__(f"mdev parent {parent} has no type {type_id!r} (it offers: {have})")


class MdevBadUuidError(MdevError):
    def __init__(self, uuid: str, parent: str = "", type_id: str = "") -> None:
        self.uuid = uuid
        self.parent = parent
        self.type_id = type_id
        where = f" for {parent}/{type_id}" if parent else ""
        super().__init__(
            f"invalid mdev UUID {uuid!r}{where}: use the form"
            " 8-4-4-4-12 hex digits, e.g. 83b8f4f2-509f-382f-3c1e-e6bfe0fa1001"
        )


class MdevBadNameError(MdevError):
    """A parent, type or device name from the registry, the topology or sysfs that the kernel
    would never give, or whose path leaves the sysfs tree: never used to build a path."""

    def __init__(self, kind: str, name: str, why: str) -> None:
        self.kind = kind
        self.name = name
        self.why = why
        super().__init__(
            f"refusing mdev {kind} name {name!r}: {why}; the record naming it is damaged"
            " (check the registry with 'vmlend reconcile')"
        )


class MdevUuidInUseError(MdevError):
    """The UUID exists already, but under another parent or type."""

    def __init__(self, uuid: str, parent: str, type_id: str, other_parent: str, other_type: str):
        self.uuid = uuid
        self.parent = parent
        self.type_id = type_id
        self.other_parent = other_parent
        self.other_type = other_type
        super().__init__(
            f"cannot create mdev {uuid} on {parent}/{type_id}: that UUID already exists on"
            f" {other_parent}/{other_type}; remove it first ('vmlend mdev remove {uuid}')"
        )


class MdevOwnedError(MdevError):
    """A domain names an mdev that the registry says serves another VM (a copied or forged
    domain XML)."""

    def __init__(self, uuid: str, owner: str, vm: str) -> None:
        self.uuid = uuid
        self.owner = owner
        self.vm = vm
        super().__init__(
            f"mdev {uuid} serves VM {owner}, not {vm}: the domain's vmlend metadata names"
            " another VM's mdev (a copied XML?); give the domain its own UUID, then remove"
            " the device and add it again ('vmlend xml remove-device', 'add-device')"
        )


class MdevNoInstancesError(MdevError):
    def __init__(self, parent: str, type_id: str) -> None:
        self.parent = parent
        self.type_id = type_id
        super().__init__(
            f"mdev parent {parent} has no {type_id} instances left; remove an unused mdev"
            " ('vmlend mdev list') or use another parent"
        )


class MdevParentGoneError(MdevError):
    """The parent disappeared between looking it up and using it (driver unloaded, lender
    rebooted)."""

    def __init__(self, parent: str, type_id: str = "") -> None:
        self.parent = parent
        self.type_id = type_id
        what = f"{parent}/{type_id}" if type_id else parent
        super().__init__(
            f"mdev parent {what} vanished while vmlend was using it; check its driver"
            " (or the lender) and retry"
        )


class MdevBusyError(MdevError):
    def __init__(self, uuid: str, parent: str = "", type_id: str = "") -> None:
        self.uuid = uuid
        self.parent = parent
        self.type_id = type_id
        super().__init__(
            f"mdev {uuid} ({parent}/{type_id}) is in use, probably by a running VM;"
            " stop or detach it first"
        )


class MdevKernelError(MdevError):
    """Any other refusal by the kernel; carries the errno."""

    def __init__(self, op: str, parent: str, type_id: str, errno_: int, reason: str) -> None:
        self.op = op
        self.parent = parent
        self.type_id = type_id
        self.errno = errno_
        self.reason = reason
        super().__init__(
            f"kernel refused to {op} on mdev parent {parent}/{type_id}: {reason}"
            " (see the kernel log, 'dmesg', for the driver's reason)"
        )


# --- NVMe sharing (queue level) -----------------------------------------------------------


class NvmeShareError(FabricError):
    """A shared NVMe drive (queue-level sharing) cannot do what was asked."""


class NotSharedError(NvmeShareError):
    def __init__(self, fdid: int) -> None:
        self.fdid = fdid
        super().__init__(
            f"device {fdid:#x} is not lent for sharing; run 'vmlend nvme share {fdid:#x}' "
            "on its lender first"
        )


class SharesActiveError(NvmeShareError):
    def __init__(self, fdid: int, shares: list[str]) -> None:
        self.fdid = fdid
        self.shares = shares
        super().__init__(
            f"device {fdid:#x} still has {len(shares)} share(s) ({', '.join(shares)}); "
            "stop those VMs first"
        )


class NoBackupPathError(NvmeShareError):
    """A share with a backup path (``--paths 2``) needs a second adapter of the VM's host
    with a route from the drive's lender; ``missing`` says what is not there."""

    def __init__(self, fdid: int, node: str, missing: str) -> None:
        self.fdid = fdid
        self.node = node
        self.missing = missing
        super().__init__(f"no backup path for {node}'s share of {fdid:#x}: {missing}")


class SharingUnsupportedError(NvmeShareError):
    def __init__(self, fdid: int, why: str) -> None:
        self.fdid = fdid
        self.why = why
        super().__init__(f"device {fdid:#x} cannot be shared at the queue level: {why}")


# --- the host: missing pieces, sysfs, unsafe paths ----------------------------------------


class HostError(VmlendError):
    """The host lacks something vmlend needs (a module, a path, a daemon)."""


class SysfsAttributeError(HostError):
    """A sysfs attribute is not what the kernel makes it: a directory or a loop where a file
    belongs, bytes that are not ASCII text, or a value outside what the attribute can hold.
    ``path`` names it, ``problem`` says what is wrong and ``check`` whom to blame."""

    def __init__(self, path: object, problem: str, check: str = "its driver ('dmesg')") -> None:
        self.path = str(path)
        self.problem = problem
        self.check = check
        super().__init__(f"sysfs attribute {self.path}: {problem}; check {check}")


class UnsafePathError(VmlendError):
    """vmlend, often running as root, will not use ``path`` as it is: a symbolic link where a
    file is expected, not a regular file, too large, owned or writable by someone other than
    root, or a name that would leave the tree it belongs to. ``why`` says which."""

    def __init__(self, path: str, why: str) -> None:
        self.path = path
        self.why = why
        super().__init__(f"refusing {path}: {why}")


# --- the hypervisor (libvirt and the simulated one) ---------------------------------------


class LibvirtError(VmlendError):
    """libvirt refused an operation; the message carries libvirt's own reason."""


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


class DetachTimeoutError(DomainOperationError):
    """A live detach was asked for, but the guest has not released the device in time (libvirt's
    live detach is asynchronous). It is still plugged, so vmlend keeps its reservation and mdev."""

    def __init__(self, domain: str, fdid: int, mdev: str, timeout: float) -> None:
        self.fdid = fdid
        self.mdev = mdev
        self.timeout = timeout
        super().__init__(
            "detach device from",
            domain,
            f"device {fdid:#x} (mdev {mdev}) is still attached after {timeout:g} s;"
            " the guest did not release it",
            hint=f"re-run 'vmlend detach {domain} {fdid:#x}' once it has"
            " (the device stays reserved until then)",
        )


class MigrationError(LibvirtError):
    """A cold-migration step failed; the message says where the VM is defined now."""


class SimulatedDevicesError(LibvirtError):
    """A domain with remote devices would start (or get one hot-added) on a real libvirt
    hypervisor while the fabric is the simulated one: only a ``sim:///`` node can run
    simulated devices (libvirt would refuse "Mediated host device assignment requires VFIO
    support", or pass through a device nobody lent)."""

    def __init__(self, op: str, domain: str, uri: str) -> None:
        self.domain = domain
        self.uri = uri
        super().__init__(
            f"cannot {op} VM {domain!r} on {uri}: its remote devices come from the simulated"
            " fabric (no SmartIO driver is loaded on this host, so the backend defaults to"
            " sim), and only a simulated node (-c sim:///<node>) can run those; load the"
            " SmartIO driver to use real devices, or pass --backend sim to try anyway"
            " (docs/real-hardware.md)"
        )


# --- the hook and the demo ----------------------------------------------------------------


class HookError(VmlendError):
    """A hook operation failed; the message names the VM, the device and the reason."""


class SimulatedDevicesHookError(HookError):
    """libvirtd's prepare hook for a VM whose remote devices exist only in vmlend's simulator
    (the backend is "sim" because no SmartIO driver is loaded, not because anyone chose it):
    libvirt would go on to fail with "Mediated host device assignment requires VFIO support"
    or "mediated device ... not found", which says nothing of why. The hook refuses first, and
    libvirt ends its error (what ``virsh start`` prints) with this line."""

    def __init__(self, domain: str) -> None:
        self.domain = domain
        super().__init__(
            f"cannot start VM {domain!r} on this host's libvirtd: its remote devices exist only"
            " in vmlend's simulator (no SmartIO driver is loaded on this host, so the backend"
            " defaults to sim), and only a simulated node can run them"
            " ('vmlend -c sim:///<node> vm start'); load the SmartIO driver to use"
            ' real devices, or set backend = "sim" in vmlend\'s configuration file to let'
            " libvirt try anyway (docs/real-hardware.md)"
        )


class DemoError(VmlendError):
    """A step of ``vmlend demo`` did not show what it should: the data path misbehaved."""


# --- the host agent: which host a node is, one agent per host ------------------------------


class AgentIdentityError(ConfigError):
    """The agent cannot say which host it runs on, or the node name it was given belongs to
    another host. Nothing was changed."""


class AgentRunningError(ConfigError):
    """Another vmlend agent runs on this host (it holds the host's agent lock)."""

    def __init__(self, lock: str, pid: int | None) -> None:
        self.lock = lock
        self.pid = pid
        who = f" (pid {pid})" if pid else ""
        super().__init__(
            f"another vmlend agent runs on this host{who}: it holds {lock}; one agent serves a"
            " host (stop it first, e.g. 'systemctl stop vmlend-agent')"
        )


class QuiesceError(VmlendError):
    """A device's driver cannot stop it for a hot migration's switch-over (it cannot complete
    what it has outstanding, or does not implement the migration states): the migration
    keeps the VM on its source, or falls back to unplugging the device."""

    def __init__(self, fdid: int, kind: str, why: str) -> None:
        self.fdid, self.kind, self.why = fdid, kind, why
        super().__init__(f"device {fdid:#x} ({kind}) cannot be quiesced: {why}")
