"""The system log: journald's native protocol, else syslog on ``/dev/log``, with the VM and the
device as structured fields (``VMLEND_VM``, ``VMLEND_FDID``; ``journalctl VMLEND_VM=web``).

No libsystemd: journald takes one datagram of ``KEY=value`` lines per entry on
``/run/systemd/journal/socket`` (a value holding a newline is sent length-prefixed, as its
protocol says), and syslog a ``<PRI>tag[pid]: message key=value...`` datagram on ``/dev/log``.
Nothing a VM's name or a message holds can forge a line or a field: control characters are
escaped in both (``\\n``, ``\\x1b``: a terminal escape never reaches ``journalctl``), and a
syslog field's value with a space, ``=``, a quote or a backslash is quoted (``field_value``),
so ``vm="web vm=db"`` is one field. Both paths are
under the host root, and ``$VMLEND_LOG_SOCKET`` names another journald-protocol socket (the
tests own one; this machine has no journald). Sending never raises: logging must not be why a
VM fails to start.
"""

from __future__ import annotations

import contextvars
import logging
import os
import socket
import struct
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from vmlend.messages import single_line

#: A journald-protocol socket to log to instead of the host's (tests).
LOG_SOCKET_ENV = "VMLEND_LOG_SOCKET"
JOURNAL_SOCKET = Path("run/systemd/journal/socket")
SYSLOG_SOCKET = Path("dev/log")
#: journald's own limit for one datagram is larger; an entry past this is cut.
MAX_VALUE = 48 * 1024

# syslog severities (RFC 5424), as journald's PRIORITY takes them
_PRIORITY = {
    logging.CRITICAL: 2,
    logging.ERROR: 3,
    logging.WARNING: 4,
    logging.INFO: 6,
    logging.DEBUG: 7,
}
_DAEMON = 3  # the facility: a system daemon

_fields: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar("vmlend_log_fields")


@contextmanager
def log_fields(**fields: str) -> Iterator[None]:
    """Structured fields (``vm="web"``, ``fdid="0x10"``) for every entry logged inside."""
    token = _fields.set({**_fields.get({}), **fields})
    try:
        yield
    finally:
        _fields.reset(token)


def field_value(value: str) -> str:
    """``value`` as one ``key=value`` word of a log line: as it is when it is a plain word,
    else in double quotes with ``"`` and ``\\`` escaped by a backslash and control characters
    as ``single_line`` writes them (``"web vm=db"``, ``"a\\nb"``)."""
    if value and value.isprintable() and not any(c in value for c in _SPECIAL):
        return value
    quoted = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{single_line(quoted)}"'


_SPECIAL = frozenset(' "\\=')


def current_fields() -> dict[str, str]:
    return dict(_fields.get({}))


def priority(level: int) -> int:
    for floor in sorted(_PRIORITY, reverse=True):
        if level >= floor:
            return _PRIORITY[floor]
    return 7


class Sink(Protocol):
    def send(self, message: str, level: int, fields: Mapping[str, str]) -> bool: ...


class _Datagrams:
    def __init__(self, address: str, identifier: str) -> None:
        self.address = address
        self.identifier = identifier
        self._sock: socket.socket | None = None
        self._broken = False

    def _send(self, payload: bytes) -> bool:
        if self._broken:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(payload, self.address)
        except OSError:
            self._broken = True  # once: a logger gone does not cost every later entry
            return False
        return True


class JournalSink(_Datagrams):
    """journald's native protocol."""

    def send(self, message: str, level: int, fields: Mapping[str, str]) -> bool:
        entry = {
            "MESSAGE": single_line(message)[:MAX_VALUE],
            "PRIORITY": str(priority(level)),
            "SYSLOG_IDENTIFIER": self.identifier,
            "SYSLOG_PID": str(os.getpid()),
        }
        for key, value in fields.items():
            entry[f"VMLEND_{key.upper()}"] = single_line(str(value))[:MAX_VALUE]
        return self._send(encode_entry(entry))


class SyslogSink(_Datagrams):
    """syslog on /dev/log: the fields follow the message as ``key=value`` words."""

    def send(self, message: str, level: int, fields: Mapping[str, str]) -> bool:
        words = "".join(f" {k}={field_value(str(v))}" for k, v in fields.items())
        pri = _DAEMON * 8 + priority(level)
        line = f"<{pri}>{self.identifier}[{os.getpid()}]: {single_line(message)}{words}"
        return self._send(line.encode()[: MAX_VALUE + 512])


def encode_entry(entry: Mapping[str, str]) -> bytes:
    """One journald entry: ``KEY=value`` lines, or for a value with a newline, the key, a
    newline, its length as 64-bit little endian, the value and a newline."""
    out = bytearray()
    for key, value in entry.items():
        data = value.encode()
        if b"\n" in data:
            out += key.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += key.encode() + b"=" + data + b"\n"
    return bytes(out)


def open_system_log(
    root: Path, identifier: str, environ: Mapping[str, str] | None = None
) -> Sink | None:
    """The host's system log for ``identifier`` (``vmlend-agent``, ``vmlend-hook``): journald
    where its socket exists, else syslog's ``/dev/log``, else None (log to stderr only)."""
    env = os.environ if environ is None else environ
    named = env.get(LOG_SOCKET_ENV)
    if named:
        return JournalSink(named, identifier)
    for path, sink in ((JOURNAL_SOCKET, JournalSink), (SYSLOG_SOCKET, SyslogSink)):
        where = root / path
        if where.is_socket():
            return sink(str(where), identifier)
    return None


class SystemLogHandler(logging.Handler):
    """A logging handler over a sink: the record's ``vm``/``fdid``/``node`` (``extra=``) and
    the fields of ``log_fields`` go as structured fields."""

    def __init__(self, sink: Sink, level: int = logging.INFO) -> None:
        super().__init__(level)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        fields = current_fields()
        for key in ("vm", "fdid", "node"):
            value = getattr(record, key, None)
            if value is not None:
                fields[key] = str(value)
        fields["logger"] = record.name
        try:
            message = self.format(record)
        except Exception:  # a bad format string must not lose the entry
            message = str(record.msg)
        self.sink.send(message, record.levelno, fields)
