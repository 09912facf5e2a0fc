"""The borrower side: the VM's eventfds (irqfds) per device and vector, fed by the transport.

Registration mirrors VFIO_DEVICE_SET_IRQS as a VMM issues it: trigger eventfds per (index,
vector), -1 de-assigns, DATA_NONE|ACTION_TRIGGER with count 0 tears an index down, and for INTx
an unmask eventfd — KVM's irqfd resampler, which fires when the guest has handled the level
interrupt — whose firing is sent back to the lender to re-arm the line.

An interrupt for a vector with no irqfd yet is held (per vector, as a count) and signalled
when the VMM assigns one; tearing the index down discards what is held for it.
"""

from __future__ import annotations

import logging
import select
import socket
from collections.abc import Sequence

import msgspec

from vmlend.errors import RelayError
from vmlend.irq.control import close_fds
from vmlend.irq.eventfd import EventFd
from vmlend.irq.relay import Reactor
from vmlend.irq.transport import Channel, Kind, Record
from vmlend.irq.vectors import IrqIndex
from vmlend.irq.vfio import (
    ACTION_UNMASK,
    DATA_NONE,
    DISABLE,
    TRIGGER_EVENTFDS,
    UNMASK_EVENTFD,
    check_flags,
)

log = logging.getLogger(__name__)

VectorKey = tuple[int, int]  # index, vector


class BorrowerDevice(msgspec.Struct):
    fdid: int
    channel: Channel
    irqfds: dict[VectorKey, EventFd] = msgspec.field(default_factory=dict)
    resample: EventFd | None = None
    held: dict[VectorKey, int] = msgspec.field(default_factory=dict)
    delivered: int = 0
    unmasks: int = 0

    def status(self) -> dict[str, object]:
        return {
            "fdid": self.fdid,
            "vectors": [
                {"index": IrqIndex(i).name, "vector": v, "fd": e.fileno()}
                for (i, v), e in sorted(self.irqfds.items())
            ],
            "resample": self.resample is not None,
            "held": sum(self.held.values()),
            "delivered": self.delivered,
            "unmasks": self.unmasks,
            "transport": "up" if self.channel.alive else "down",
        }


class BorrowerRelay:
    """All borrowed devices of this node; thread-safe through the reactor's lock."""

    def __init__(self, reactor: Reactor) -> None:
        self._reactor = reactor
        self._devices: dict[int, BorrowerDevice] = {}
        self._channels: dict[Channel, set[int]] = {}
        self.dropped = 0

    @property
    def reactor(self) -> Reactor:
        return self._reactor

    def attach(self, fdids: Sequence[int], sock: socket.socket) -> Channel:
        """Devices ``fdids`` are relayed from the lender at the other end of ``sock``.

        Takes ownership of ``sock`` (closed on failure too).
        """
        with self._reactor.lock:
            taken = [f for f in fdids if f in self._devices]
            if taken or not fdids:
                sock.close()
                if not fdids:
                    raise RelayError("attach: name at least one device")
                raise RelayError(f"device {taken[0]:#x} is already attached; release it first")
            channel = Channel(sock, self._reactor, self._on_records, self._on_channel_closed)
            self._channels[channel] = set(fdids)
            for fdid in fdids:
                self._devices[fdid] = BorrowerDevice(fdid, channel)
            log.info("attached devices %s", ", ".join(f"{f:#x}" for f in fdids))
            return channel

    def devices(self) -> list[int]:
        return sorted(self._devices)

    def _device(self, fdid: int) -> BorrowerDevice:
        try:
            return self._devices[fdid]
        except KeyError:
            raise RelayError(
                f"device {fdid:#x} is not attached to the relay; attach it first"
            ) from None

    def set_irqs(
        self, fdid: int, index: int, flags: int, start: int, fds: Sequence[int]
    ) -> list[EventFd]:
        """Apply one SET_IRQS request. Takes ownership of every fd >= 0 in ``fds``, also when
        it fails (they are closed then). Returns the eventfds now owned for them."""
        owned: list[EventFd | None] = []
        try:
            for fd in fds:
                try:
                    owned.append(EventFd(fd) if fd >= 0 else None)
                except ValueError as e:
                    raise RelayError(f"SET_IRQS: {e}") from None
            check_flags(index, flags, len(fds), len(fds), start)
            with self._reactor.lock:
                device = self._device(fdid)
                if flags == DISABLE:
                    self._disable(device, index)
                elif flags == TRIGGER_EVENTFDS:
                    for i, efd in enumerate(owned):
                        self._assign(device, (index, start + i), efd)
                elif flags == UNMASK_EVENTFD:
                    self._assign_resample(device, owned[0])
                elif flags == DATA_NONE | ACTION_UNMASK:  # unmask now, as the VMM may ask
                    device.channel.post(Kind.UNMASK, IrqIndex.INTX, 0, fdid, 1)
        except RelayError:
            for efd in owned:
                if efd is not None:
                    efd.close()
            close_fds(fds[len(owned) :])
            raise
        return [e for e in owned if e is not None]

    def _assign(self, device: BorrowerDevice, key: VectorKey, efd: EventFd | None) -> None:
        old = device.irqfds.pop(key, None)
        if old is not None:
            old.close()
        if efd is None:
            return
        device.irqfds[key] = efd
        held = device.held.pop(key, 0)
        if held:
            device.delivered += held
            efd.signal(held)

    def _assign_resample(self, device: BorrowerDevice, efd: EventFd | None) -> None:
        if device.resample is not None:
            self._reactor.unregister(device.resample.fileno())
            device.resample.close()
            device.resample = None
        if efd is None:
            return
        device.resample = efd
        fdid = device.fdid

        def resampled(_events: int) -> None:
            if efd.drain():
                device.unmasks += 1
                device.channel.post(Kind.UNMASK, IrqIndex.INTX, 0, fdid, 1)

        self._reactor.register(efd.fileno(), select.EPOLLIN, resampled)

    def _disable(self, device: BorrowerDevice, index: int) -> None:
        for key in [k for k in device.irqfds if k[0] == index]:
            device.irqfds.pop(key).close()
        for key in [k for k in device.held if k[0] == index]:
            del device.held[key]
        if index == IrqIndex.INTX:
            self._assign_resample(device, None)

    def release_vectors(self, fdid: int, efds: Sequence[EventFd]) -> None:
        """De-assign exactly these eventfds if still registered (their VM went away)."""
        with self._reactor.lock:
            device = self._devices.get(fdid)
            if device is None:
                return
            ids = {id(e) for e in efds}
            for key in [k for k, e in device.irqfds.items() if id(e) in ids]:
                device.irqfds.pop(key).close()
            if device.resample is not None and id(device.resample) in ids:
                self._assign_resample(device, None)

    def release(self, fdid: int) -> None:
        """The device left this node (hot-remove, VM released it): close all it holds."""
        with self._reactor.lock:
            device = self._devices.pop(fdid, None)
            if device is None:
                raise RelayError(f"device {fdid:#x} is not attached to the relay")
            for index in IrqIndex:
                self._disable(device, index)
            fdids = self._channels.get(device.channel)
            if fdids is not None:
                fdids.discard(fdid)
                if not fdids:
                    del self._channels[device.channel]
                    device.channel.close()
            log.info("released device %#x", fdid)

    def _on_records(self, records: list[Record]) -> None:
        for kind, index, vector, fdid, count in records:
            if kind != Kind.IRQ:
                continue
            device = self._devices.get(fdid)
            if device is None:
                self.dropped += count
                continue
            key = (index, vector)
            efd = device.irqfds.get(key)
            if efd is None:
                device.held[key] = device.held.get(key, 0) + count
            else:
                device.delivered += count
                efd.signal(count)

    def _on_channel_closed(self, channel: Channel) -> None:
        # The lender hung up (device hot-removed there, lender stopped): release its devices.
        fdids = self._channels.get(channel, set())
        log.warning("lender of devices %s hung up", ", ".join(f"{f:#x}" for f in fdids))
        for fdid in sorted(fdids):
            self.release(fdid)

    def status(self) -> list[dict[str, object]]:
        with self._reactor.lock:
            return [self._devices[f].status() for f in sorted(self._devices)]

    def close(self) -> None:
        with self._reactor.lock:
            for fdid in list(self._devices):
                self.release(fdid)
