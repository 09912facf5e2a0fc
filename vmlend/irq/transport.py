"""The channel between a lender and a borrower: a unix SOCK_SEQPACKET socket carrying batches.

Each message is a batch of fixed 12-byte records ``(kind, index, vector, fdid, count)``. The
lender sends IRQ records (count = interrupts since the last batch), the borrower sends UNMASK
records (the VM's INTx resample fired). Why this channel (measured, docs/interrupts.md): one
``send`` and one ``recv`` per batch, message boundaries kept by the kernel so a batch is never
torn, the peer's death is seen as EOF/EPIPE, and it carries descriptors, so it is handed to the
daemon over SCM_RIGHTS like any other fd. In a real cluster the NTB's shared memory and a
doorbell stand behind it.

Sending never blocks: what cannot be sent waits in a coalescing backlog (one counter per
vector, so it cannot grow without bound) and is sent when the socket is writable again. A dead
peer's interrupts are counted as dropped, never waited for.
"""

from __future__ import annotations

import logging
import select
import socket
import struct
from collections.abc import Callable
from enum import IntEnum

from vmlend.irq.relay import Reactor

log = logging.getLogger(__name__)

RECORD = struct.Struct("<BBHII")
# Keep a batch well under the socket's send buffer so one batch is always one message.
MAX_RECORDS = 4096
MAX_MESSAGE = RECORD.size * MAX_RECORDS
MAX_COUNT = 0xFFFF_FFFF


class Kind(IntEnum):
    IRQ = 1
    UNMASK = 2


# A record as a plain tuple (kind, index, vector, fdid, count): the hot path builds and parses
# one per interrupt batch, and named tuples or enums there cost more than the syscalls.
Record = tuple[int, int, int, int, int]
Key = tuple[int, int, int, int]  # kind, index, vector, fdid


def pack(records: list[Record]) -> bytes:
    return b"".join([RECORD.pack(*r) for r in records])


def unpack(data: bytes) -> list[Record]:
    """Records of a batch; kinds this version does not know are the receiver's to skip."""
    if len(data) % RECORD.size:
        raise ValueError(f"torn batch of {len(data)} bytes")
    return list(RECORD.iter_unpack(data))


class Channel:
    """One end of a lender-borrower transport, driven by a ``Reactor``.

    ``on_records`` gets every batch received; ``on_closed`` is called once when the peer hangs
    up (not when this end is closed).
    """

    def __init__(
        self,
        sock: socket.socket,
        reactor: Reactor,
        on_records: Callable[[list[Record]], None],
        on_closed: Callable[[Channel], None] | None = None,
    ) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._reactor = reactor
        self._on_records = on_records
        self._on_closed = on_closed
        self._backlog: dict[Key, int] = {}
        self._want_out = False
        self.alive = True
        self.sent = 0
        self.dropped = 0
        self._fd = sock.fileno()
        reactor.register(self._fd, select.EPOLLIN, self._ready)

    def post(self, kind: Kind, index: int, vector: int, fdid: int, count: int) -> None:
        """Queue ``count`` for sending after this round (coalesced with what is queued)."""
        with self._reactor.lock:
            if not self.alive:
                self.dropped += count
                return
            key = (kind, index, vector, fdid)
            self._backlog[key] = self._backlog.get(key, 0) + count
            self._reactor.defer(self.flush)

    def flush(self) -> None:
        with self._reactor.lock:
            while self._backlog and self.alive:
                batch = self._take_batch()
                try:
                    self._sock.send(b"".join([RECORD.pack(*r) for r in batch]))
                except BlockingIOError:
                    self._requeue(batch)
                    self._watch_out(True)
                    return
                except (BrokenPipeError, ConnectionResetError):
                    self._requeue(batch)
                    self._peer_gone()
                    return
                self.sent += sum(r[4] for r in batch)
            self._watch_out(False)

    def _take_batch(self) -> list[Record]:
        backlog = self._backlog
        if len(backlog) <= MAX_RECORDS and max(backlog.values()) <= MAX_COUNT:
            # The usual case: everything fits one message.
            batch = [(*key, n) for key, n in backlog.items()]
            backlog.clear()
            return batch
        batch = []
        for key in list(backlog)[:MAX_RECORDS]:
            total = backlog[key]
            n = min(total, MAX_COUNT)
            batch.append((*key, n))
            if total > n:
                backlog[key] = total - n
            else:
                del backlog[key]
        return batch

    def _requeue(self, batch: list[Record]) -> None:
        for kind, index, vector, fdid, count in batch:
            key = (kind, index, vector, fdid)
            self._backlog[key] = self._backlog.get(key, 0) + count

    def _watch_out(self, on: bool) -> None:
        if on != self._want_out and self.alive:
            self._want_out = on
            self._reactor.modify(self._fd, select.EPOLLIN | (select.EPOLLOUT if on else 0))

    def _ready(self, events: int) -> None:
        if events & select.EPOLLIN:
            # One message per wake-up: epoll is level-triggered and reports the next one, and
            # a second recv that finds nothing costs an exception on every interrupt.
            try:
                data = self._sock.recv(MAX_MESSAGE)
            except BlockingIOError:
                data = None
            except ConnectionResetError:
                data = b""
            if data is not None:
                if not data:
                    self._peer_gone()
                    return
                try:
                    records = unpack(data)
                except ValueError as e:
                    log.warning("transport: %s; closing the channel", e)
                    self._peer_gone()
                    return
                self._on_records(records)
                if events & select.EPOLLHUP:
                    return  # read all the peer sent before its hang-up, then see EOF
        if events & (select.EPOLLHUP | select.EPOLLERR):
            self._peer_gone()
            return
        if events & select.EPOLLOUT:
            self.flush()

    def _peer_gone(self) -> None:
        if not self.alive:
            return
        self.alive = False
        self.dropped += sum(self._backlog.values())
        self._backlog.clear()
        self._reactor.unregister(self._fd)
        log.info("transport peer hung up (%d interrupts dropped)", self.dropped)
        if self._on_closed is not None:
            self._on_closed(self)

    def close(self) -> None:
        """Close this end; the peer sees EOF."""
        with self._reactor.lock:
            if self.alive:
                self.alive = False
                self._reactor.unregister(self._fd)
            self._backlog.clear()
            self._sock.close()
