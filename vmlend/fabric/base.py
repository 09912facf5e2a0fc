"""The fabric interface: the one view of the cluster that the hook, the CLI and the daemon use.

Two backends implement it: ``vmlend.sim`` (the simulated SmartIO cluster, the embedded
default) and ``vmlend.kernel`` (the kernel: Linux mdev sysfs plus the SmartIO driver's
attributes). Both keep "who holds what" in the shared state (``vmlend.registry``), so separate
processes (hook, CLI, daemon) see one truth.

Life of a device for a VM (docs/design.md, mechanisms 1-4):
    lend -> reserve (prepare hook) -> create_mdev -> [guest enables] borrow
         -> [guest releases] give_back -> remove_mdev -> release (release hook) -> unlend
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, Self, runtime_checkable

from vmlend.ledger.admission import AdapterUsage, PortUsage
from vmlend.topology.model import (
    Check,
    DeviceStatus,
    GuestRam,
    Holder,
    MdevInfo,
    NodeSpec,
    Reservation,
    Topology,
)

if TYPE_CHECKING:
    from vmlend.kernel.dmafiles import DmaReport, Window
    from vmlend.kernel.p2pfiles import P2PDifference, P2PReport
    from vmlend.kernel.sharefiles import ShareReport, ShareValues
    from vmlend.registry.api import Registry
    from vmlend.registry.records import (
        Claim,
        ExpectedHold,
        FenceRecord,
        HoldRecord,
        RuntimeRecord,
    )


@runtime_checkable
class Fabric(Protocol):
    """What every backend offers. All methods raise ``VmlendError`` subclasses on failure."""

    #: The node this process runs on (the borrower when a VM here uses a remote device).
    local_node: str

    def topology(self) -> Topology:
        """Nodes, adapters, links and devices as currently known."""
        ...

    def nodes(self) -> list[NodeSpec]: ...

    def devices(self, lender: str | None = None) -> list[DeviceStatus]:
        """Every device of the fabric with its state and holder (only node ``lender``'s
        devices when given: read without reading the others)."""
        ...

    def device(self, fdid: int) -> DeviceStatus:
        """Raises ``UnknownDeviceError``."""
        ...

    def usage(self) -> dict[str, AdapterUsage]:
        """Per adapter ref ("node:index"): LUT entries and NTB window segments in use."""
        ...

    def port_usage(self) -> list[PortUsage]:
        """The cluster switch ports with requester entries in use, by name."""
        ...

    # --- lender side ---------------------------------------------------------------------
    def lend(self, fdid: int) -> DeviceStatus:
        """Offer a device to the fabric. Idempotent."""
        ...

    def lend_many(
        self, fdids: Sequence[int], progress: Callable[[int], None] | None = None
    ) -> list[DeviceStatus]:
        """``lend`` for many devices in few transactions (``vmlend lend --all``); ``progress``
        is told how many are done as batches land."""
        ...

    def unlend(self, fdid: int) -> DeviceStatus:
        """Withdraw a device. Refused with ``DeviceHeldError`` while anyone holds it."""
        ...

    # --- borrower side -------------------------------------------------------------------
    def admission(
        self,
        fdid: int,
        borrower: str,
        guest_ram: GuestRam | int = 0,
        *,
        holder: Holder | None = None,
        msi_over_ntb: bool = False,
    ) -> list[Check]:
        """Check, without changing anything, that ``borrower`` could take ``fdid`` for a guest
        with RAM ``guest_ram`` (its layout's ranges; a bare byte count stands for a q35 guest of
        that size): device exists and is lent, not held, within the device's DMA reach, an NTB
        path to the lender exists, a LUT entry is free, the NTB window has room for the DMA
        windows (the planner's segment count) and the BARs, and peer-to-peer with the VM's other
        devices fits. Returns every check; callers fail on the first ``ok=False``. With
        ``holder`` (the VM), DMA windows that VM already has through the same lender adapter
        count as there, and a device that VM already holds passes. ``msi_over_ntb`` adds the
        interrupt window check ``reserve`` would make (which never refuses: without room the
        device's MSI/MSI-X take the relay)."""
        ...

    def vm_admission(
        self,
        fdids: list[int],
        borrower: str,
        guest_ram: GuestRam | int,
        *,
        holder: Holder,
        leaving: Holder | None = None,
    ) -> dict[int, list[Check]]:
        """Admission of a whole VM (all of ``fdids`` together, summed per adapter) on
        ``borrower``, as if ``leaving`` (the same VM where it runs now) held nothing: what a
        migration checks before it stops the VM. Changes nothing."""
        ...

    def reserve(
        self,
        fdid: int,
        holder: Holder,
        *,
        guest_ram: GuestRam | int = 0,
        msi_over_ntb: bool = False,
    ) -> Reservation:
        """Exclusively reserve ``fdid`` for ``holder``. Idempotent for the same holder;
        ``DeviceHeldError`` for another; ``DeviceNotLentError`` if not lent. Atomic across
        processes: of two racing reservers exactly one wins, and ``Reservation.created`` says
        whether this call made the hold. Admission control happens here: the reservation claims
        the LUT entry and the NTB window room (DMA windows for ``guest_ram``, the device's BARs,
        peer-to-peer) or fails with ``ResourceExhaustedError`` / ``DmaLimitError`` /
        ``NoPathError`` / ``LenderUnavailableError`` and changes nothing. ``msi_over_ntb``
        also claims an interrupt window when the lender's window has room (never a reason to
        refuse: without room the device's MSI/MSI-X use the relay)."""
        ...

    def interrupt_window(self, fdid: int) -> Claim | None:
        """The interrupt window (MSI/MSI-X over the NTB) ``fdid``'s hold was admitted with;
        None: its interrupts use the relay."""
        ...

    def release(self, fdid: int, holder: Holder, *, expected: ExpectedHold | None = None) -> bool:
        """End ``holder``'s reservation (and hardware borrow, if any). Idempotent: returns
        False when ``holder`` held nothing. Never releases another holder's device. With
        ``expected`` (a release recorded earlier, landed late), only a hold it admits, judged
        in the same transaction that ends it: False for a newer hold."""
        ...

    def holds_of(self, holder: Holder) -> dict[int, HoldRecord]:
        """The holds of ``holder``'s VM (same VM: ``same_holder``), each with its start and
        fencing token."""
        ...

    def borrow(self, fdid: int, holder: Holder) -> DeviceStatus:
        """The deferred hardware borrow: take exclusive control and set up the NTB path
        (LUT entry, BAR mappings). Requires a reservation by ``holder``. Idempotent."""
        ...

    def give_back(self, fdid: int, holder: Holder) -> DeviceStatus:
        """Undo ``borrow``; the reservation stays. Idempotent."""
        ...

    # --- mdevs on this node ----------------------------------------------------------------
    def ensure_mdev_parent(self, fdid: int) -> str:
        """Make sure the SmartIO mdev parent for ``fdid`` exists on this node; return its
        name. Idempotent."""
        ...

    def create_mdev(self, fdid: int, uuid: str, holder: Holder) -> MdevInfo:
        """Create the mdev child ``uuid`` under ``fdid``'s parent. Idempotent for the same
        uuid and device; ``MdevInfo.created`` says whether this call created it (atomically)."""
        ...

    def remove_mdev(self, uuid: str) -> bool:
        """Remove the mdev child. Idempotent: False when it did not exist."""
        ...

    def mdevs(self) -> list[MdevInfo]:
        """mdev children on this node: what the host has, whoever made them (on the kernel
        backend, children of any type under the SmartIO parents)."""
        ...

    def mdev_records(self) -> list[MdevInfo]:
        """The mdevs vmlend recorded on this node, each with the VM it was made for, whether
        or not the host has the child (yet, or still): ``create_mdev`` records one before it
        creates the child. Releases and repairs remove only these (``lending.devices``)."""
        ...

    # --- every backend holds its registry open until closed ------------------------------
    def close(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: object) -> None: ...


@runtime_checkable
class RegistryFabric(Protocol):
    """A backend whose bookkeeping lives in a registry it can hand out (what ``vmlend agent``
    needs to hold the host's lease on it)."""

    @property
    def registry(self) -> Registry: ...


@runtime_checkable
class TakesBack(Protocol):
    """A lender's capability to take back the devices whose holder vanished with its lease
    (docs/cluster.md, "Fencing"): ``fenced`` lists this node's fenced devices, ``take_back``
    unmaps and resets one through whatever drives the hardware, then lifts its fence."""

    def fenced(self) -> list[FenceRecord]: ...

    def take_back(self, fence: FenceRecord) -> bool: ...


@runtime_checkable
class Repoints(Protocol):
    """A backend whose borrowed device can be re-pointed at its VM's new node without its
    borrow ending: a hot migration's switch-over (docs/migration.md, "Hot"). The kernel
    backend cannot (the SmartIO driver implements no mdev migration states): its VMs move
    with their devices unplugged."""

    def repoint(self, fdid: int, holder: Holder, token: int) -> None:
        """Device ``fdid`` serves ``holder``'s hold, of fencing token ``token``, from now on
        (the registry moved the hold there). ``StaleTokenError`` (nothing changed) when the
        device already serves a newer token."""
        ...


@runtime_checkable
class WritesDmaWindows(Protocol):
    """A backend whose driver maps each borrowed device's DMA windows itself, from windows
    vmlend writes to the device's mdev child (docs/smartio-contract.md section 8): the kernel
    backend. The simulated fabric plans and maps them itself and has no such files."""

    def expected_windows(self, fdid: int, ram: GuestRam) -> tuple[Window, ...]:
        """The windows vmlend computes for ``fdid`` and a guest with RAM ``ram``."""
        ...

    def write_dma_windows(
        self, fdid: int, uuid: str, ram: GuestRam, *, holder: Holder
    ) -> tuple[Window, ...] | None:
        """Write them to child ``uuid`` with the hold's token, only while ``holder``'s VM
        holds ``fdid`` on this node (else ``DeviceHeldError`` / ``DeviceNotReservedError``);
        None: the driver has no place for them (it predates section 8)."""
        ...

    def dma_report(self, uuid: str) -> DmaReport | None:
        """What the driver reports for child ``uuid``; None: nothing to report."""
        ...

    def record_dma(self, uuid: str) -> str | None:
        """Keep child ``uuid``'s ``dma_state`` as its device's runtime records; the state's one
        line, or None when the child is none of this host's holding VMs' (nothing kept)."""
        ...

    def dma_claimed(self, holder: Holder) -> dict[str, int]:
        """The segments ``holder``'s VM's DMA-window claims hold, per lender adapter."""
        ...

    def dma_records(self, fdid: int) -> list[RuntimeRecord]:
        """``fdid``'s ``dma-window`` runtime records."""
        ...

@runtime_checkable
class ChecksShares(Protocol):
    """A backend whose driver runs each queue-level NVMe share from a file vmlend writes to
    the share's child (docs/smartio-contract.md section 7, "Per share"): the kernel backend.
    The simulated fabric runs the registry's shares itself and has no such files."""

    def share_report(self, uuid: str) -> ShareReport | None:
        """Share child ``uuid``'s ``nvme_share`` and ``nvme_share_state`` as read; None: the
        child has no ``nvme_share``."""
        ...

    def registry_share(self, fdid: int, holder: Holder) -> ShareValues | None:
        """What ``holder``'s share child of ``fdid`` is to be written; None: no share."""
        ...

    def local_shares(self) -> list[tuple[int, Holder]]:
        """Every share the registry has for a VM of this node: (drive, its VM)."""
        ...

    def rewrite_share(self, fdid: int, uuid: str, holder: Holder) -> None:
        """Write the registry's share to child ``uuid`` again under the same epoch."""
        ...


@runtime_checkable
class MapsP2P(Protocol):
    """A backend whose driver maps peer-to-peer between a VM's devices from ``p2p`` files
    vmlend writes to each child (docs/smartio-contract.md section 8): the kernel backend."""

    def p2p_report(self, uuid: str, fdid: int) -> P2PReport | None:
        """What the driver reports for child ``uuid`` of device ``fdid``; None: nothing."""
        ...

    def p2p_drift(self, holder: Holder) -> list[P2PDifference]:
        """Where the driver's maps of ``holder``'s VM differ from what vmlend plans."""
        ...

    def sync_p2p(self, holder: Holder) -> object:
        """Plan and write the VM's maps again."""
        ...
