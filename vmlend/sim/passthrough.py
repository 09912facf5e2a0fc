"""A pass-through session: one borrowed device as one VM's guest sees it (the mdev/VFIO device).

The guest's configuration space is a view over the physical one:

- BAR registers (0x10..0x27) are virtual. The guest sizes them and programs guest-physical
  addresses into a shadow copy with the same masks; the physical device keeps its lender
  addresses, which is what the lender's decoders answer to.
- everything else (command, status, MSI/MSI-X capabilities, PCI Express device control with
  FLR) is read from and written to the physical ``ConfigSpace``, so its listeners (the
  interrupt relay) see the guest's writes as they happen.

Reactions to the guest's writes (docs/design.md mechanisms 4-5, 8):

- the first enable (memory or I/O decoding, bus master, or a function level reset) does the
  deferred hardware borrow through the fabric (``borrow(fdid, holder)``);
- Bus Master on: the VM's DMA windows are mapped (pin, probe, plan, map) *before* the bit
  reaches the device, so the device never masters into nothing. A refusal is kept in
  ``refusal`` and the write reaches the device with Bus Master cleared: the guest reads the bit
  back as 0 and its DMA faults at the ``bus-master`` hop, as when a real VFIO config write fails;
- Bus Master off, a reset of the device, removal or VM stop: the windows are unmapped (and the
  guest unpinned by the last device);
- memory BAR addresses, while the guest has memory decoding on, are reported to an optional
  observer (peer-to-peer mapping) as ``program_bar(fdid, index, gpa, size)``; ``gpa`` 0 means
  the BAR is no longer decoded at any address. ``remove_device(fdid)`` when the session ends.

Only the session of the device's current borrow reaches the physical device (the hand-over
rule, docs/simulator.md). The session opens its mdev on the hardware (one VM at a time); when
the borrow or the hold ends by any path (lender reclaim, a release after a crash, the fabric's
give-back, the lender going down) the hardware revokes it, and from then on it reads all ones
and its writes are dropped, as for a removed device. Before the first borrow the guest may read
the (reset, unborrowed) device to discover it, but nothing it writes reaches the device: its
config writes are kept (and read back from a view of their own) until the enabling write
borrows the device, then written to it in order. While another VM borrows the device the
session reads all ones too.
"""

from __future__ import annotations

import logging
from typing import Protocol

from vmlend.errors import DeviceHeldError, DeviceRevokedError, FabricError, VmlendError
from vmlend.sim.device import SimDevice
from vmlend.sim.dmawin import VmDmaWindows
from vmlend.sim.pci import regs
from vmlend.sim.pci.config import EXP_OFFSET, ConfigSpace, write_hits
from vmlend.topology.model import BarKind, Holder

log = logging.getLogger(__name__)

_BAR_START = regs.BASE_ADDRESS_0
_BAR_END = regs.BASE_ADDRESS_0 + 4 * regs.BAR_COUNT
_ENABLE_BITS = regs.COMMAND_IO | regs.COMMAND_MEMORY | regs.COMMAND_MASTER


class BarObserver(Protocol):
    """Told where the guest put a device's memory BARs (the peer-to-peer mapper)."""

    def program_bar(self, fdid: int, bar_index: int, gpa: int, size: int) -> None: ...

    def remove_device(self, fdid: int) -> None: ...


class BorrowFabric(Protocol):
    """The deferred borrow (``SimFabric``): hardware and registry phase in one transaction."""

    def borrow(self, fdid: int, holder: Holder) -> object: ...

    def give_back(self, fdid: int, holder: Holder) -> object: ...


def clear_bits(offset: int, size: int, value: int, reg: int, bits: int) -> int:
    """``value`` of a write at ``offset`` with ``bits`` of register ``reg`` cleared."""
    out = value
    for bit in range(bits.bit_length()):
        if not bits >> bit & 1:
            continue
        at = reg + bit // 8
        if offset <= at < offset + size:
            out &= ~(1 << (8 * (at - offset) + bit % 8))
    return out


class PassthroughSession:
    """``device`` passed through to the VM ``holder`` whose DMA windows are ``windows``, through
    mdev ``mdev`` (opened on the hardware here: ``MdevError`` when another VM has it open)."""

    def __init__(
        self,
        device: SimDevice,
        holder: Holder,
        fabric: BorrowFabric,
        windows: VmDmaWindows,
        observer: BarObserver | None = None,
        mdev: str | None = None,
    ) -> None:
        self.device = device
        self.holder = holder
        self.fabric = fabric
        self.windows = windows
        self.hw = windows.hw
        self.observer = observer
        self.mdev = mdev
        self.shadow = ConfigSpace.from_spec(device.spec)  # only its BAR registers are used
        #: Before the first borrow: the guest's config writes (replayed onto the device right
        #: after it is borrowed) and the view of config space they make (the device itself is
        #: not the VM's yet and stays untouched).
        self._pending: list[tuple[int, int, int]] = []
        self._pre: ConfigSpace | None = None
        self.closed = False
        #: The device was taken from this VM (its borrow or hold ended): a removed device.
        self.revoked = False
        if mdev is not None:
            self.hw.open_mdev(mdev, device.fdid, holder.node, holder.vm, self._revoke)
        #: Why the latest enabling write (borrow or bus master) was refused, else None.
        self.refusal: VmlendError | None = None
        #: The last error the observer raised (peer-to-peer mapping), for the operator.
        self.observer_error: VmlendError | None = None
        self._memory_on = False  # the guest's memory decoding, as it last wrote it
        self._reported: dict[int, int] = {}  # BAR index -> GPA told to the observer
        self._remove_reset = device.on_reset(self._on_reset)

    @property
    def fdid(self) -> int:
        return self.device.fdid

    @property
    def dma_active(self) -> bool:
        return self.windows.active(self.fdid)

    def guest_bar(self, index: int) -> int | None:
        """The guest-physical address the guest programmed into BAR ``index``."""
        return self.shadow.bar_address(index)

    # --- config space ---------------------------------------------------------------------------
    def _ours(self) -> bool:
        """The device is under this VM's current borrow."""
        borrow = self.hw.borrowed(self.fdid)
        return (
            not self.revoked
            and borrow is not None
            and (borrow.node, borrow.vm) == (self.holder.node, self.holder.vm)
        )

    def _cut_off(self) -> bool:
        """This VM may not see the device: it was taken from it, or another VM borrows it."""
        return self.revoked or (self.hw.borrowed(self.fdid) is not None and not self._ours())

    @property
    def borrowed(self) -> bool:
        """The device is under this VM's current borrow (the deferred borrow happened)."""
        return self._ours()

    @property
    def cut_off(self) -> bool:
        """The guest sees a removed device here: all ones, its writes dropped."""
        return self._cut_off()

    def config_read(self, offset: int, size: int) -> int:
        self._check_open()
        if self._cut_off():
            return (1 << 8 * size) - 1  # a removed device
        if _BAR_START <= offset < _BAR_END:
            return self.shadow.read(offset, size)
        if self._pre is not None and not self._ours():
            return self._pre.read(offset, size)
        return self.device.config.read(offset, size)

    def config_write(self, offset: int, size: int, value: int) -> None:
        self._check_open()
        self.windows.settle()
        cmd = write_hits(offset, size, value, regs.COMMAND, 2)
        covers_low = offset <= regs.COMMAND < offset + size  # the byte holding IO/MEM/MASTER
        flr = write_hits(offset, size, value, EXP_OFFSET + regs.EXP_DEVCTL, 2)
        enables = bool(cmd and cmd & _ENABLE_BITS) or bool(flr and flr & regs.EXP_DEVCTL_BCR_FLR)
        if enables:
            self.refusal = None  # it describes the latest enable only
        if self._cut_off():
            if enables:
                self._refuse(self.cut_off_error(), "enable")
            return  # dropped, as a write to a removed device
        if _BAR_START <= offset < _BAR_END:
            self.shadow.write(offset, size, value, notify=False)
            self._sync_bars()
            return
        if enables and not self._ours():
            try:
                self.fabric.borrow(self.fdid, self.holder)
            except VmlendError as e:
                self._refuse(e, "borrow")
            else:
                self._replay_pending()
        if not self._ours():
            # nothing of the device is the guest's yet: no decoding, no reset, no DMA, and
            # nothing it writes reaches the device now; what it configures (device control,
            # MSI, INTx disable) is kept and written once the device is borrowed
            if not enables:
                self._keep_pending(offset, size, value)
            if covers_low and cmd is not None:
                self._memory_on = False
                self._sync_bars()
            return
        want_master = covers_low and cmd is not None and bool(cmd & regs.COMMAND_MASTER)
        if want_master and not self.dma_active:
            try:
                self.windows.enable(self.fdid)
            except VmlendError as e:
                self._refuse(e, "bus master")
                value = clear_bits(offset, size, value, regs.COMMAND, regs.COMMAND_MASTER)
        self.hw.config_write(self.fdid, (self.holder.node, self.holder.vm), offset, size, value)
        self.windows.settle()  # after a reset the write caused
        if covers_low and cmd is not None:
            if not cmd & regs.COMMAND_MASTER and self.dma_active:
                self.windows.disable(self.fdid)  # the device stopped mastering first
            self._memory_on = bool(cmd & regs.COMMAND_MEMORY) and self._ours()
            self._sync_bars()

    def _keep_pending(self, offset: int, size: int, value: int) -> None:
        if self._pre is None:
            self._pre = ConfigSpace.from_spec(self.device.spec)  # the reset device's view
        self._pre.write(offset, size, value, notify=False)
        self._pending.append((offset, size, value))

    def _replay_pending(self) -> None:
        """Just borrowed: the guest's earlier config writes reach the device, in order."""
        owner = (self.holder.node, self.holder.vm)
        pending, self._pending, self._pre = self._pending, [], None
        for offset, size, value in pending:
            self.hw.config_write(self.fdid, owner, offset, size, value)

    def cut_off_error(self) -> VmlendError:
        borrow = self.hw.borrowed(self.fdid)
        if not self.revoked and borrow is not None:
            return DeviceHeldError(self.fdid, borrow.node, borrow.vm)
        return DeviceRevokedError(self.fdid, str(self.holder))

    def _revoke(self) -> None:
        # the hardware cut this VM off (inside the step that ended the borrow or the hold):
        # no decoding, no DMA windows, nothing the guest does reaches the device again
        self.revoked = True
        self._pending, self._pre = [], None
        self.windows.disable(self.fdid, forget=False)
        self._memory_on = False
        self._sync_bars()
        log.warning("device %#x was taken from %s: its mdev is revoked", self.fdid, self.holder)

    def _refuse(self, error: VmlendError, what: str) -> None:
        self.refusal = error
        log.warning("device %#x of %s: %s refused: %s", self.fdid, self.holder, what, error)

    def _check_open(self) -> None:
        if self.closed:
            raise FabricError(f"device {self.fdid:#x} was removed from {self.holder}")

    # --- BARs for peer-to-peer --------------------------------------------------------------
    def decoded_bars(self) -> dict[int, int]:
        """Memory BAR index -> guest-physical base, for the BARs the guest decodes now."""
        if not self._memory_on:
            return {}
        out = {}
        for index, bar in self.shadow.bars.items():
            if bar.kind is BarKind.IO:
                continue
            gpa = self.shadow.bar_address(index)
            if gpa is not None:
                out[index] = gpa
        return out

    def _sync_bars(self) -> None:
        now = self.decoded_bars()
        changes = [(i, now.get(i, 0)) for i in sorted(set(now) | set(self._reported))]
        for index, gpa in changes:
            if self._reported.get(index, 0) == gpa:
                continue
            if gpa:
                self._reported[index] = gpa
            else:
                self._reported.pop(index, None)
            self._notify_bar(index, gpa)

    def _notify_bar(self, index: int, gpa: int) -> None:
        if self.observer is None:
            return
        try:
            self.observer.program_bar(self.fdid, index, gpa, self.shadow.bars[index].size)
            self.observer_error = None
        except VmlendError as e:
            self.observer_error = e
            log.warning(
                "device %#x BAR %d at %#x: peer mapping failed: %s", self.fdid, index, gpa, e
            )

    # --- resets and the end ---------------------------------------------------------------------
    def _on_reset(self) -> None:
        # A function level reset stops the device mastering and clears its BARs; the lender
        # kernel restores the physical BARs, the guest must program its own again. The reset
        # may come from the fabric giving the device back inside its registry transaction:
        # the records are removed later (settle), and the borrow may be over.
        self.windows.disable(self.fdid, forget=False)
        self.shadow.reset()
        self._memory_on = False
        self._sync_bars()

    # --- a hot migration ------------------------------------------------------------------------
    def leave(self) -> bool:
        """A hot migration's switch-over, on the source: the device (quiesced) stays this
        VM's, but its DMA windows into this node's RAM and the peer maps made here go; the
        borrow itself is moved by the caller (``SimHardware.move_borrow``). Returns whether
        the device was mastering (its windows must be mapped again on arrival)."""
        self._check_open()
        mastering = self.dma_active
        if self.observer is not None:
            self.observer.remove_device(self.fdid)
        self._reported.clear()
        self.windows.disable(self.fdid)
        return mastering

    def arrive(
        self,
        holder: Holder,
        fabric: BorrowFabric,
        windows: VmDmaWindows,
        observer: BarObserver | None,
        *,
        mastering: bool,
    ) -> None:
        """The same switch-over, on the destination: the session is ``holder``'s now (the
        VM on its new node), its mdev is open there, the new guest's RAM is mapped for the
        device when it was mastering, and the new node's peer mapper learns its BARs. The
        device's own state (config space, BAR registers, queues) is untouched: the guest's
        driver goes on where it was. Raises (the caller undoes the migration) when a mapping
        is refused."""
        self._check_open()
        if self.mdev is not None:
            self.hw.close_mdev(self.mdev, self.holder.node)
            self.hw.open_mdev(self.mdev, self.fdid, holder.node, holder.vm, self._revoke)
        self.holder, self.fabric, self.windows, self.observer = holder, fabric, windows, observer
        if mastering:
            self.windows.enable(self.fdid)
        self._sync_bars()

    def close(self) -> None:
        """The device leaves the VM (hot-remove, VM stop): unmap its windows (the last device
        unpins the guest), tell the observer, give the hardware back. Idempotent."""
        if self.closed:
            return
        self._remove_reset()
        if self.mdev is not None:
            self.hw.close_mdev(self.mdev, self.holder.node)
        self.windows.disable(self.fdid)
        self._memory_on = False
        self._reported.clear()
        if self.observer is not None:
            try:
                self.observer.remove_device(self.fdid)
            except VmlendError as e:
                self.observer_error = e
                log.warning("device %#x: peer unmapping failed: %s", self.fdid, e)
        if self._ours():
            self.fabric.give_back(self.fdid, self.holder)
        self.closed = True
