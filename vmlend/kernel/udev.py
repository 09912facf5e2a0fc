"""React to mdev parents coming and going, from kernel uevents.

Two halves, kept apart:

- a small adapter over pyudev (``PyudevSource``): pyudev always reads the running host's
  ``/sys`` and netlink socket, so it hides behind the ``UeventSource`` protocol (a pollable file
  descriptor plus ``receive()``); tests feed events through a real pipe instead;
- ``ParentWatcher``, pure event handling over ``MdevBus`` (which does honour ``HostEnv``):
  discovery reads sysfs, events only say *when* to look again.

What the kernel tells us: the mdev core sends ``change`` with ``MDEV_STATE=registered`` on the
parent device when it registers as an mdev parent and ``MDEV_STATE=unregistered`` when it
leaves (mdevctl's autostart hangs off the same event); the device itself sends ``add`` and
``remove``. A parent coming back (a lender rebooted) gets the children of the VMs that were
running re-created, mdevctl's autostart lesson; a parent leaving marks its children unavailable.
"""

from __future__ import annotations

import enum
import logging
import selectors
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import msgspec

from vmlend.errors import HostError, MdevError, VmlendError
from vmlend.hostenv import HostEnv
from vmlend.kernel.dmafiles import DmaWord
from vmlend.kernel.mdev import MdevBus, normalize_uuid

log = logging.getLogger(__name__)

MDEV_STATE = "MDEV_STATE"


class Uevent(msgspec.Struct, frozen=True):
    """One kernel uevent, reduced to what vmlend looks at."""

    action: str  # add, remove, change, bind, unbind, ...
    sys_name: str  # the kernel's device name (a parent's name, a child's UUID, ...)
    subsystem: str = ""
    properties: Mapping[str, str] = msgspec.field(default_factory=dict)


class UeventSource(Protocol):
    """Where uevents come from: a descriptor to wait on and a non-blocking read."""

    def fileno(self) -> int: ...

    def receive(self) -> Uevent | None:
        """The next pending event, or None when none is ready right now."""
        ...


class PyudevSource:
    """The live source: a pyudev netlink monitor. Only meaningful on the real root."""

    def __init__(self, monitor: Any = None, source: str = "udev") -> None:
        """``source``: pyudev's netlink group, ``udev`` (what udevd re-sends once it has
        processed an event) or ``kernel`` (the kernel's own events)."""
        if monitor is None:
            import pyudev  # imported here: the rest of vmlend never needs it

            monitor = pyudev.Monitor.from_netlink(pyudev.Context(), source=source)
        self._monitor = monitor
        self._monitor.start()

    @classmethod
    def for_host(cls, env: HostEnv) -> PyudevSource:
        if not env.is_real:
            raise HostError(
                f"live uevents exist only for the running host, not for root {env.root};"
                " drop --root / VMLEND_ROOT to watch this host"
            )
        return cls(source=cls.netlink_source(env))

    @staticmethod
    def netlink_source(env: HostEnv) -> str:
        """Where no udevd runs (an initramfs, a minimal container) nothing re-sends the
        kernel's events on udev's group, and a ``udev`` monitor would wait forever: listen to
        the kernel's. vmlend re-reads sysfs at every event, so udevd's processing (rules,
        symlinks) is never needed."""
        return "udev" if (env.run / "udev" / "control").exists() else "kernel"

    def fileno(self) -> int:
        return int(self._monitor.fileno())

    def receive(self) -> Uevent | None:
        device = self._monitor.poll(timeout=0)
        if device is None:
            return None
        return Uevent(
            action=device.action or "",
            sys_name=device.sys_name,
            subsystem=device.subsystem or "",
            properties=dict(device.properties),
        )


# --- deciding what an event means (pure) ------------------------------------------------------


class ParentChange(enum.StrEnum):
    APPEARED = "appeared"
    VANISHED = "vanished"


def classify(ev: Uevent, is_parent_now: bool, was_parent: bool) -> ParentChange | None:
    """What ``ev`` means for mdev parent ``ev.sys_name``.

    ``is_parent_now``: sysfs lists it under ``class/mdev_bus`` right now; ``was_parent``: it
    did when we last looked. The ``MDEV_STATE`` property is trusted first; without it (older
    kernels, or a driver's own add/remove) the sysfs state decides, so a missed or reordered
    event cannot leave us wrong for long.
    """
    state = ev.properties.get(MDEV_STATE)
    if ev.action == "change" and state == "registered":
        return ParentChange.APPEARED
    if ev.action == "change" and state == "unregistered":
        return ParentChange.VANISHED
    if ev.action == "remove" and was_parent:
        return ParentChange.VANISHED
    if ev.action in ("add", "change", "bind") and is_parent_now and not was_parent:
        return ParentChange.APPEARED
    if ev.action in ("change", "unbind") and was_parent and not is_parent_now:
        return ParentChange.VANISHED
    return None


#: The SmartIO driver's event on a child (docs/smartio-contract.md section 8, "The guest event").
SMARTIO_DMA = "SMARTIO_DMA"


class DmaChange(msgspec.Struct, frozen=True):
    """A child's ``dma_state`` changed its first word: read it again. ``word`` is what the
    event said; the file, read after, is what vmlend keeps (an event may be stale)."""

    uuid: str
    word: DmaWord


def dma_change(ev: Uevent) -> DmaChange | None:
    """Whether ``ev`` is the driver's ``SMARTIO_DMA`` change of an mdev child (pure). None for
    every other event; ``ValueError`` for one that carries ``SMARTIO_DMA`` but breaks the
    contract (a value other than its four words, a name that is not a child's UUID)."""
    value = ev.properties.get(SMARTIO_DMA)
    if ev.subsystem != "mdev" or ev.action != "change" or value is None:
        return None
    try:
        word = DmaWord(value)
    except ValueError:
        raise ValueError(
            f"SMARTIO_DMA={value[:40]!r} on mdev {ev.sys_name[:40]!r} is none of"
            f" {', '.join(w.value for w in DmaWord)}"
        ) from None
    try:
        uuid = normalize_uuid(ev.sys_name)
    except MdevError:
        raise ValueError(f"SMARTIO_DMA on {ev.sys_name[:40]!r}, which is no mdev's UUID") from None
    return DmaChange(uuid, word)


# --- acting on it -----------------------------------------------------------------------------


class WantedMdev(msgspec.Struct, frozen=True):
    """A child that must exist while its VM runs (from the registry, or the caller)."""

    uuid: str
    parent: str
    type_id: str
    vm: str = ""


class Outcome(enum.StrEnum):
    RECREATED = "recreated"
    PRESENT = "present"  # it was still there
    FAILED = "failed"
    UNAVAILABLE = "unavailable"  # its parent vanished
    DMA_RECORDED = "dma-recorded"  # the driver's dma_state, kept as runtime records


class Reaction(msgspec.Struct, frozen=True):
    parent: str
    outcome: Outcome
    uuid: str = ""
    vm: str = ""
    detail: str = ""


class ParentWatcher:
    """Tracks mdev parents and restores the wanted children when a parent comes back.

    ``wanted`` is asked afresh at every event (the set of running VMs changes); the
    ``on_vanished`` / ``on_appeared`` callbacks let a backend mark devices unavailable or
    available again in shared state.
    """

    def __init__(
        self,
        bus: MdevBus,
        wanted: Callable[[], Iterable[WantedMdev]],
        on_vanished: Callable[[str], None] | None = None,
        on_appeared: Callable[[str], None] | None = None,
        *,
        on_recreated: Callable[[WantedMdev], None] | None = None,
        on_dma: Callable[[DmaChange], Reaction | None] | None = None,
        on_child: Callable[[Uevent], object] | None = None,
    ) -> None:
        self.bus = bus
        #: Called with each mdev child's event (the data path's, docs/smartio-contract.md
        #: section 8); what it returns is not a parent's reaction.
        self.on_child = on_child
        self.wanted = wanted
        self.on_vanished = on_vanished
        self.on_appeared = on_appeared
        #: Called for each child this watcher re-created (the backend writes its DMA windows);
        #: a ``VmlendError`` from it undoes the child.
        self.on_recreated = on_recreated
        #: Called for each ``SMARTIO_DMA`` event (the backend records ``dma_state``); None
        #: from it: the child is none of this host's VMs' (ignored).
        self.on_dma = on_dma
        self.known: set[str] = set()
        self.unavailable: set[str] = set()
        self.reactions: list[Reaction] = []

    def discover(self) -> list[str]:
        """Reconcile with sysfs now (at start, or after missing events): parents new since last
        time count as appeared, so wanted children missing from them are created (mdevctl's
        autostart); parents gone since count as vanished. Returns the parents present."""
        now = set(self.bus.parent_names())
        for gone in sorted(self.known - now):
            self.reactions.extend(self._vanished(gone))
        for new in sorted(now - self.known):
            self.reactions.extend(self._appeared(new))
        self.known = now
        return sorted(now)

    def handle(self, ev: Uevent) -> list[Reaction]:
        name = ev.sys_name
        if ev.subsystem == "mdev":
            # one event may carry several words (an FLR: SMARTIO_DMA and SMARTIO_BARS)
            if self.on_child is not None:
                self.on_child(ev)  # peer-to-peer: SMARTIO_BARS, SMARTIO_P2P
            return self._child_event(ev)  # SMARTIO_DMA
        is_parent_now = name in self.bus.parent_names()
        was_parent = name in self.known
        change = classify(ev, is_parent_now, was_parent)
        # One transition, one reaction: a driver's own event and the mdev core's MDEV_STATE
        # often report the same change. Only an explicit "registered" is acted on again,
        # since a parent may have left and come back while we were not listening.
        if change is ParentChange.VANISHED and not was_parent:
            return []
        if (
            change is ParentChange.APPEARED
            and was_parent
            and ev.properties.get(MDEV_STATE) != "registered"
        ):
            return []
        if change is ParentChange.APPEARED:
            self.known.add(name)
            reactions = self._appeared(name)
        elif change is ParentChange.VANISHED:
            self.known.discard(name)
            reactions = self._vanished(name)
        else:
            return []
        self.reactions.extend(reactions)
        return reactions

    def _child_event(self, ev: Uevent) -> list[Reaction]:
        try:
            change = dma_change(ev)
        except ValueError as e:
            log.warning("ignoring a SmartIO driver event: %s (docs/smartio-contract.md"
                        " section 8; update the driver)", e)  # fmt: skip
            return []
        if change is None or self.on_dma is None:
            log.debug("mdev child %s: %s", ev.sys_name, ev.action)
            return []
        try:
            reaction = self.on_dma(change)
        except VmlendError as e:
            # one child's record (the registry unreachable a moment) must not end the watch:
            # 'vmlend reconcile' finds the records apart from dma_state and --fix records again
            log.warning("could not record the DMA state of mdev %s: %s", change.uuid, e)
            return []
        if reaction is None:
            return []
        self.reactions.append(reaction)
        return [reaction]

    def _appeared(self, parent: str) -> list[Reaction]:
        log.info("mdev parent %s appeared", parent)
        self.unavailable.discard(parent)
        if self.on_appeared:
            self.on_appeared(parent)
        out = []
        for w in self.wanted():
            if w.parent != parent:
                continue
            try:
                existed = self.bus.device(w.uuid) is not None
                self.bus.create(parent, w.type_id, w.uuid)
            except MdevError as e:
                log.warning("could not re-create mdev %s of %s on %s: %s", w.uuid, w.vm, parent, e)
                out.append(Reaction(parent, Outcome.FAILED, w.uuid, w.vm, str(e)))
                continue
            outcome = Outcome.PRESENT if existed else Outcome.RECREATED
            detail = ""
            if outcome is Outcome.RECREATED:
                log.info("re-created mdev %s of %s on %s", w.uuid, w.vm, parent)
                detail = self._after_create(w)
                if detail:
                    outcome = Outcome.FAILED
            out.append(Reaction(parent, outcome, normalize_uuid(w.uuid), w.vm, detail))
        return out

    def _after_create(self, w: WantedMdev) -> str:
        """Run ``on_recreated`` for a child just made; "" when it went well, else why the
        child was removed again. As ``acquire_device`` undoes a child whose DMA windows the
        driver refused, so does the watcher: such a child is one the VM could not have
        started with (a newer hold's token, windows that can never fit), its device would
        reach no guest RAM, and the registry's record stays, so ``vmlend reconcile`` reports
        the child missing and its ``--fix`` tries again with the domain's own layout, saying
        why it fails."""
        if self.on_recreated is None:
            return ""
        try:
            self.on_recreated(w)
        except VmlendError as e:
            log.warning("re-created mdev %s of %s: %s; removed again", w.uuid, w.vm, e)
            try:
                self.bus.remove(w.uuid)
            except MdevError as gone:
                log.warning("could not remove mdev %s again: %s", w.uuid, gone)
            return str(e)
        return ""

    def _vanished(self, parent: str) -> list[Reaction]:
        log.warning("mdev parent %s vanished; its devices are unavailable", parent)
        self.unavailable.add(parent)
        if self.on_vanished:
            self.on_vanished(parent)
        return [
            Reaction(parent, Outcome.UNAVAILABLE, normalize_uuid(w.uuid), w.vm)
            for w in self.wanted()
            if w.parent == parent
        ]

    def run(
        self, source: UeventSource, stop_fd: int | None = None, timeout: float | None = None
    ) -> int:
        """Handle events until ``stop_fd`` becomes readable or ``timeout`` seconds pass with
        nothing to do. Returns the number of events handled."""
        handled = 0
        with selectors.DefaultSelector() as sel:
            sel.register(source.fileno(), selectors.EVENT_READ, "events")
            if stop_fd is not None:
                sel.register(stop_fd, selectors.EVENT_READ, "stop")
            while True:
                ready = sel.select(timeout)
                if not ready:
                    return handled
                # Drain events before honouring stop, so a stop sent after events loses none.
                if any(key.data == "events" for key, _ in ready):
                    while (ev := source.receive()) is not None:
                        self.handle(ev)
                        handled += 1
                if any(key.data == "stop" for key, _ in ready):
                    return handled
