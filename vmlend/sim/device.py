"""A simulated PCIe function on its lender: config space, BAR memory, interrupts, addresses.

The lender's firmware assigned each BAR a physical address (``bar_phys``, fixed for the life of
the simulation) and the config space BARs start out programmed with it. A guest may later write
its own guest-physical BAR addresses into config space (the mdev view); ``bar_phys`` is what the
lender's address decoders answer to, so peer-to-peer DMA is resolved against it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from vmlend.sim.pci import regs
from vmlend.sim.pci.bar import BarMemory
from vmlend.sim.pci.config import EXP_OFFSET, ConfigSpace, parse_bdf, write_hits
from vmlend.topology.model import BarKind, DeviceSpec

log = logging.getLogger(__name__)

InterruptSink = Callable[[int], None]


class SimDevice:
    """One function. ``bar_phys`` maps BAR index -> lender physical base (I/O BARs: port)."""

    def __init__(self, spec: DeviceSpec, bar_phys: dict[int, int]) -> None:
        missing = [b.index for b in spec.bars if b.index not in bar_phys]
        if missing:
            raise ValueError(f"device {spec.fdid:#x}: no lender address for BAR(s) {missing}")
        self.spec = spec
        self.config = ConfigSpace.from_spec(spec)
        self.bars = BarMemory(spec.bars, spec.msix)
        self.requester_id = parse_bdf(spec.bdf)
        self.bar_phys = dict(bar_phys)
        self._sinks: list[InterruptSink] = []
        #: The VM (node, vm) each sink delivers to, where its maker said (the checker's).
        self._sink_owners: dict[int, tuple[str, str]] = {}
        self._reset_listeners: list[Callable[[], None]] = []
        self.resets = 0
        self.blocked_messages = 0  # MSI/MSI-X not sent because Bus Master was off
        #: Vectors raised while the device was stopped for a switch-over (None: it is not),
        #: in order: sent once it runs again, as MSI-X's function mask latches pending bits
        self._latched: list[int] | None = None
        self._program_bars()
        self.config.add_listener(self._on_config_write)

    def __repr__(self) -> str:
        return f"SimDevice({self.fdid:#x} {self.spec.kind} {self.lender}/{self.spec.bdf})"

    @property
    def fdid(self) -> int:
        return self.spec.fdid

    @property
    def lender(self) -> str:
        return self.spec.lender

    @property
    def dma_limit(self) -> int:
        return self.spec.dma_limit

    def _program_bars(self) -> None:
        # What the lender's firmware (and later Linux's pci_restore_state) does.
        for bar in self.spec.bars:
            off = regs.BASE_ADDRESS_0 + 4 * bar.index
            base = self.bar_phys[bar.index]
            self.config.write(off, 4, base & 0xFFFFFFFF, notify=False)
            if bar.kind is BarKind.MEM64:
                self.config.write(off + 4, 4, base >> 32, notify=False)
        has_io = any(b.kind is BarKind.IO for b in self.spec.bars)
        self.config.write(regs.COMMAND, 2, regs.COMMAND_MEMORY | (regs.COMMAND_IO if has_io else 0))

    def bar_range(self, index: int) -> tuple[int, int]:
        """Lender physical [start, end) of BAR ``index``."""
        for bar in self.spec.bars:
            if bar.index == index:
                return self.bar_phys[index], self.bar_phys[index] + bar.size
        raise ValueError(f"device {self.fdid:#x} has no BAR {index}")

    # --- reset ---------------------------------------------------------------------------------
    def _on_config_write(self, offset: int, size: int, value: int) -> None:
        hit = write_hits(offset, size, value, EXP_OFFSET + regs.EXP_DEVCTL, 2)
        if hit is not None and hit & regs.EXP_DEVCTL_BCR_FLR:
            self.reset()

    def reset(self) -> None:
        """Function level reset: config space and BAR memory to power-on state (MSI-X vectors
        masked), then the BARs restored to their lender addresses as the lender's kernel does.
        Interrupt sinks stay registered: they belong to whoever relays interrupts."""
        self.config.reset()
        self.bars.reset()
        self._program_bars()
        self.resets += 1
        log.debug("device %#x reset", self.fdid)
        for fn in list(self._reset_listeners):
            fn()

    def on_reset(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Call ``fn()`` after every function level reset; returns a remover."""
        self._reset_listeners.append(fn)

        def remove() -> None:
            if fn in self._reset_listeners:
                self._reset_listeners.remove(fn)

        return remove

    # --- interrupts ----------------------------------------------------------------------------
    @property
    def vectors(self) -> int:
        """Interrupt vectors the device can raise: the largest of MSI-X, MSI and INTx (1)."""
        n = 1 if self.spec.intx_pin else 0
        if self.spec.msi is not None:
            n = max(n, self.spec.msi.vectors)
        if self.spec.msix is not None:
            n = max(n, self.spec.msix.vectors)
        return n

    def on_interrupt(
        self, fn: InterruptSink, owner: tuple[str, str] | None = None
    ) -> Callable[[], None]:
        """Call ``fn(vector)`` whenever the device raises ``vector``; returns a remover.
        ``owner``: the (node, VM) the route delivers to, so the invariant checker can tell a
        route of an old owner from one of the device's current borrower."""
        self._sinks.append(fn)
        if owner is not None:
            self._sink_owners[id(fn)] = owner

        def remove() -> None:
            if fn in self._sinks:
                self._sinks.remove(fn)
                self._sink_owners.pop(id(fn), None)

        return remove

    def interrupt_route_owners(self) -> list[tuple[str, str]]:
        """The (node, VM) of every route whose maker named it."""
        return [self._sink_owners[id(f)] for f in self._sinks if id(f) in self._sink_owners]

    @property
    def interrupt_routes(self) -> int:
        """How many sinks receive this device's interrupts (relays, the lender's vfio)."""
        return len(self._sinks)

    def _message_blocked(self) -> bool:
        if self.config.bus_master:
            return False
        msi, msix = self.config.msi(), self.config.msix()
        return bool((msix is not None and msix.enabled) or (msi is not None and msi.enabled))

    def raise_interrupt(self, vector: int) -> int:
        """The device signals ``vector``. Whether that is INTx, MSI or MSI-X and whether it is
        masked is for the sinks to decide from config and MSI-X state. Returns how many sinks
        were called (0: nobody listens, the interrupt is lost as on unbound hardware; or MSI or
        MSI-X is enabled while Bus Master is off, so the message write cannot be sent: counted
        in ``blocked_messages``)."""
        if not 0 <= vector < self.vectors:
            raise ValueError(
                f"device {self.fdid:#x} has {self.vectors} interrupt vector(s); got {vector}"
            )
        if self._latched is not None:
            self._latched.append(vector)  # pending, sent after the switch-over (``unlatch``)
            return 0
        if self._message_blocked():
            # MSI and MSI-X are memory writes: without Bus Master the device cannot send them
            self.blocked_messages += 1
            log.debug("device %#x: vector %d not sent, Bus Master is off", self.fdid, vector)
            return 0
        sinks = list(self._sinks)
        for fn in sinks:
            fn(vector)
        if not sinks:
            log.debug("device %#x raised vector %d with no sink", self.fdid, vector)
        return len(sinks)

    # --- stopped for a switch-over -------------------------------------------------------------
    def latch(self) -> None:
        """Stop sending interrupts: each one raised from now on is kept pending (a function
        mask's pending bits) until ``unlatch``, so none crosses a switch-over in flight."""
        if self._latched is None:
            self._latched = []

    def unlatch(self) -> int:
        """Send the interrupts kept since ``latch``, each once, to whoever listens now; returns
        how many sinks were called."""
        pending, self._latched = self._latched or [], None
        return sum(self.raise_interrupt(v) for v in pending)

    @property
    def latched(self) -> list[int]:
        return list(self._latched or [])
