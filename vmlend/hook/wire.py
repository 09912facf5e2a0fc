"""The hook <-> agent protocol: length-prefixed binary frames on a unix stream socket.

Imports only ``time`` (built in): the hook process loads it right after deciding that a call
concerns vmlend, before anything heavy. All integers are big-endian; every string is UTF-8
(surrogateescape, so argv and environment bytes that are not UTF-8 survive the trip).

Request (hook -> agent), one per connection::

    MAGIC
    u32 argc, then argc times: u32 n, n bytes          libvirt's argv (without argv[0])
    u32 envc, then envc times: key, value as above     the hook's VMLEND_* environment
    u32 n, n bytes                                     the domain XML from stdin
    MAGIC                                              end mark: a request cut short never runs

Answer (agent -> hook), then the agent closes the connection::

    b"R", i32 exit code, u32 n + n bytes stdout, u32 n + n bytes stderr (UTF-8)    it ran
    b"N"                                  not mine (another registry, state, node...): nothing done
    b"D"                                  this peer's uid may not use the agent: nothing done
    b"B"                                  mine, but too many calls are waiting: nothing done yet
"""

from __future__ import annotations

import time

TYPE_CHECKING = False  # not from typing: this module imports nothing heavy at run time
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Protocol

    class _Socket(Protocol):  # socket.socket and the C _socket.socket alike
        def settimeout(self, value: float | None, /) -> None: ...
        def recv(self, bufsize: int, /) -> bytes: ...


MAGIC = b"VMLHOOK1"
RAN = b"R"
NOT_MINE = b"N"
DENIED = b"D"
BUSY = b"B"

#: Bounds on what the agent reads from a peer: libvirt's argv is 4 items, the VMLEND_*
#: environment a handful of paths and names, the XML of a domain a few KiB. The hook checks
#: them before sending (``within_limits``) and runs a call over them in-process.
MAX_STRINGS = 64
MAX_STRING = 8 * 1024
MAX_BLOB = 8 * 1024 * 1024
#: What the hook reads back: the rewritten XML of migrate/restore is a little longer.
MAX_ANSWER = 2 * MAX_BLOB


class WireError(ValueError):
    """A frame that is cut short or malformed."""


def _u32(n: int) -> bytes:
    return n.to_bytes(4, "big")


def _blob(data: bytes) -> bytes:
    return _u32(len(data)) + data


def _text(s: str) -> bytes:
    return _blob(s.encode("utf-8", "surrogateescape"))


def within_limits(argv: list[str], env: dict[str, str], xml: bytes) -> bool:
    """Whether ``decode_request`` would take this request whole."""
    texts = [*argv, *env.keys(), *env.values()]
    return (
        len(argv) <= MAX_STRINGS
        and len(env) <= MAX_STRINGS
        and len(xml) <= MAX_BLOB
        and all(len(t.encode("utf-8", "surrogateescape")) <= MAX_STRING for t in texts)
    )


def encode_request(argv: list[str], env: dict[str, str], xml: bytes) -> bytes:
    parts = [MAGIC, _u32(len(argv))]
    parts += [_text(a) for a in argv]
    parts.append(_u32(len(env)))
    for key, value in env.items():
        parts += [_text(key), _text(value)]
    parts += [_blob(xml), MAGIC]
    return b"".join(parts)


def encode_answer(code: int, stdout: bytes, stderr: str) -> bytes:
    return b"".join([RAN, code.to_bytes(4, "big", signed=True), _blob(stdout), _text(stderr)])


def deadline_recv(sock: _Socket, timeout: float, what: str) -> Callable[[int], bytes]:
    """``sock.recv`` bounded by one deadline for the whole ``what`` (request or answer), not
    per read: a peer that trickles bytes cannot stretch it. TimeoutError when it passes."""
    deadline = time.monotonic() + timeout

    def recv(n: int) -> bytes:
        left = deadline - time.monotonic()
        if left > 0:
            sock.settimeout(left)
            try:
                return sock.recv(n)
            except TimeoutError:
                pass
        raise TimeoutError(f"no whole {what} within {timeout:g} s")

    return recv


class Reader:
    """Reads exact frames through ``recv(n)`` (returns at most n bytes; b"" at the end)."""

    def __init__(self, recv: Callable[[int], bytes]) -> None:
        self._recv = recv

    def exact(self, n: int) -> bytes:
        chunks: list[bytes] = []
        while n > 0:
            chunk = self._recv(n)
            if not chunk:
                raise WireError("the connection ended in the middle of a frame")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def u32(self) -> int:
        return int.from_bytes(self.exact(4), "big")

    def blob(self, limit: int) -> bytes:
        n = self.u32()
        if n > limit:
            raise WireError(f"a field of {n} bytes is over the limit of {limit}")
        return self.exact(n)

    def text(self, limit: int = MAX_STRING) -> str:
        return self.blob(limit).decode("utf-8", "surrogateescape")

    def count(self) -> int:
        n = self.u32()
        if n > MAX_STRINGS:
            raise WireError(f"{n} items are over the limit of {MAX_STRINGS}")
        return n


def decode_request(reader: Reader) -> tuple[list[str], dict[str, str], bytes]:
    """argv, environment and XML of a whole request; WireError if it is not one."""
    if reader.exact(len(MAGIC)) != MAGIC:
        raise WireError("not a vmlend hook request")
    argv = [reader.text() for _ in range(reader.count())]
    env: dict[str, str] = {}
    for _ in range(reader.count()):
        key = reader.text()
        env[key] = reader.text()
    xml = reader.blob(MAX_BLOB)
    if reader.exact(len(MAGIC)) != MAGIC:
        raise WireError("the request has no end mark")
    return argv, env, xml


def decode_answer(reader: Reader) -> tuple[bytes, int, bytes, str]:
    """(kind, exit code, stdout, stderr); only RAN carries the last three."""
    kind = reader.exact(1)
    if kind in (NOT_MINE, DENIED, BUSY):
        return kind, 0, b"", ""
    if kind != RAN:
        raise WireError(f"unknown answer {kind!r}")
    code = int.from_bytes(reader.exact(4), "big", signed=True)
    stdout = reader.blob(MAX_ANSWER)
    return kind, code, stdout, reader.text(MAX_ANSWER)
