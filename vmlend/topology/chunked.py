"""Bytes verified chunk by chunk, on first read (pure: no I/O).

A topology of 1,024 nodes is 6.6 MB stored, and a hook call or a CLI command reads a few
kilobytes of it: its header, a few indexes, a node's and a few devices' records. Hashing the
whole of it in every process is what made opening a fabric cost eight times more at 1,024
nodes than at 64. So a generation is hashed per ``CHUNK_BYTES`` chunk, its head names the
sha256 of those chunks' digests (``root_of``), and a reader checks a chunk the first time it
reads from it: what a call reads is verified, what it does not read is neither read nor hashed.

``Readable`` is what the compiled topology and the stored generation are decoded from: bytes
checked already (``Plain``), bytes checked per chunk (``Chunked``), or a span of either
(``Window``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Protocol

#: The size of one verified chunk: small enough that a lookup hashes little beyond what it
#: reads, large enough that a generation of 4,096 nodes (26 MB) has 1,600 digests (51 KB).
CHUNK_BYTES = 16 * 1024

#: The size of one chunk's digest (sha256).
DIGEST_BYTES = 32


class Readable(Protocol):
    def __len__(self) -> int: ...

    def view(self, start: int, end: int) -> memoryview:
        """Bytes ``start`` to ``end``, checked; ``ValueError`` for a span out of bounds."""
        ...


def digests_of(data: bytes | bytearray | memoryview, chunk: int = CHUNK_BYTES) -> bytes:
    """The sha256 digest of each ``chunk`` bytes of ``data``, one after the other."""
    view = memoryview(data)
    return b"".join(
        hashlib.sha256(view[i : i + chunk]).digest() for i in range(0, len(view), chunk)
    )


def root_of(digests: bytes | memoryview) -> str:
    """What a head names: the sha256 of the chunks' digests (hex)."""
    return hashlib.sha256(digests).hexdigest()


def chunks_in(size: int, chunk: int = CHUNK_BYTES) -> int:
    return -(-size // chunk)


def _bounds(length: int, start: int, end: int) -> None:
    if not 0 <= start <= end <= length:
        raise ValueError(f"bytes {start} to {end} are outside the {length} there are")


class Plain:
    """Bytes checked as a whole already (or not needing it): read as they are."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self._view = memoryview(data)

    def __len__(self) -> int:
        return len(self._view)

    def view(self, start: int, end: int) -> memoryview:
        _bounds(len(self._view), start, end)
        return self._view[start:end]


class Chunked:
    """``data`` (a file's mapping, say) whose chunk ``i`` must hash to ``digests[i]``: each
    is checked on its first read, and a chunk that does not match raises what ``damaged``
    makes of the problem (a ``VmlendError`` telling the user what to do), every time."""

    def __init__(
        self,
        data: bytes | bytearray | memoryview,
        digests: bytes | memoryview,
        damaged: Callable[[str], Exception],
        chunk: int = CHUNK_BYTES,
    ) -> None:
        self._view = memoryview(data)
        self._digests = memoryview(digests)
        self._damaged = damaged
        self._chunk = chunk
        self._checked = bytearray(chunks_in(len(self._view), chunk))
        if len(self._digests) != len(self._checked) * DIGEST_BYTES:
            raise damaged(f"{len(self._digests)} bytes of digests for {len(self._checked)} chunks")

    def __len__(self) -> int:
        return len(self._view)

    def view(self, start: int, end: int) -> memoryview:
        _bounds(len(self._view), start, end)
        size = self._chunk
        for i in range(start // size, chunks_in(end, size)):
            if not self._checked[i]:
                self._check(i)
        return self._view[start:end]

    def _check(self, i: int) -> None:
        size = self._chunk
        found = hashlib.sha256(self._view[i * size : (i + 1) * size]).digest()
        if found != self._digests[i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES]:
            raise self._damaged(f"its chunk {i} does not hash to its digest")
        self._checked[i] = 1


class Window:
    """Bytes ``start`` to ``end`` of ``base``, read through it (so checked as it checks)."""

    def __init__(self, base: Readable, start: int, end: int) -> None:
        _bounds(len(base), start, end)
        self._base = base
        self._start = start
        self._len = end - start

    def __len__(self) -> int:
        return self._len

    def view(self, start: int, end: int) -> memoryview:
        _bounds(self._len, start, end)
        return self._base.view(self._start + start, self._start + end)

    def whole(self) -> memoryview:
        return self.view(0, self._len)


def whole(data: Readable) -> memoryview:
    return data.view(0, len(data))
