"""Bytes verified chunk by chunk, on first read (pure: no I/O).

A topology of 1,024 nodes is 6.6 MB stored, and a hook call or a CLI command reads a few
kilobytes of it: its header, a few indexes, a node's and a few devices' records. Hashing the
whole of it in every process is what made opening a fabric cost eight times more at 1,024
nodes than at 64. So a generation is hashed per ``CHUNK_BYTES`` chunk, its head names the
sha256 of those chunks' digests (``root_of``), and a reader checks a chunk the first time it
reads from it: what a call reads is verified, what it does not read is neither read nor hashed.

``Readable`` is what the compiled topology and the stored generation are decoded from: bytes
checked already (``Plain``), bytes read and checked per chunk into this process's memory
(``Chunked``), or a span of either (``Window``).
"""

from __future__ import annotations

import hashlib
import mmap
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
    """``size`` bytes that ``read(start, length)`` gives (a host's copy of a generation, say)
    whose chunk ``i`` must hash to ``digests[i]``. Each chunk is read and checked on its
    first use and then kept in this process's own memory, so bytes changed in the source
    after they were checked are never used. A chunk that does not match makes ``damaged``
    say so (the source is then not trusted: it may remove it), and is asked of ``refetch``
    (the registry's own pieces); when that cannot give matching bytes either, the exception
    ``damaged`` made is raised, every time the chunk is read."""

    def __init__(
        self,
        size: int,
        digests: bytes,
        read: Callable[[int, int], bytes],
        damaged: Callable[[str], Exception],
        *,
        refetch: Callable[[int, int], bytes | None] | None = None,
        chunk: int = CHUNK_BYTES,
    ) -> None:
        self._size = size
        self._digests = bytes(digests)
        self._read = read
        self._refetch = refetch
        self._damaged = damaged
        self._chunk = chunk
        self._checked = bytearray(chunks_in(size, chunk))
        if len(self._digests) != len(self._checked) * DIGEST_BYTES:
            raise damaged(f"{len(self._digests)} bytes of digests for {len(self._checked)} chunks")
        # anonymous memory: its pages cost nothing until a checked chunk is copied in
        self._memory = mmap.mmap(-1, max(size, 1))
        self._view = memoryview(self._memory)[:size]

    def __len__(self) -> int:
        return self._size

    def view(self, start: int, end: int) -> memoryview:
        _bounds(self._size, start, end)
        size = self._chunk
        for i in range(start // size, chunks_in(end, size)):
            if not self._checked[i]:
                self._check(i)
        return self._view[start:end]

    def _matches(self, i: int, data: bytes | None, length: int) -> bool:
        if data is None or len(data) != length:
            return False
        found = hashlib.sha256(data).digest()
        return found == self._digests[i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES]

    def _check(self, i: int) -> None:
        start = i * self._chunk
        length = min(self._chunk, self._size - start)
        data: bytes | None = self._read(start, length)
        if not self._matches(i, data, length):
            error = self._damaged(f"its chunk {i} does not hash to its digest")
            data = self._refetch(start, length) if self._refetch is not None else None
            if not self._matches(i, data, length):
                raise error
        assert data is not None
        self._memory[start : start + length] = data
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
