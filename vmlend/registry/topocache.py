"""A host's copy of the cluster's topology, so that a hook call or a CLI command reads only
the topology's head from etcd (a few hundred bytes) instead of its pieces (megabytes).

One file per registry under the host's state directory: a first line naming the format, a
second line the head the content was read under (JSON), then (format 2 heads) the sha256 of
each 16 KiB chunk of the content, then the content's bytes exactly as the registry's pieces
hold them. The file is used only when its head is the registry's current one *and* its chunks'
digests hash to the sha256 that head names; the file is mapped, not read, and each chunk is
checked against its digest when first read (``vmlend.topology.chunked``), so a process reads
and hashes the few kilobytes it uses, whatever the topology's size. A file of another
generation or cluster is read past and rewritten from the registry; a chunk that does not
match (damage, or somebody else's bytes) is refused when read and the file removed: found
while the copy is opened (its header), the registry is read instead; found later, the command
fails in one line asking to run it again (it then reads the registry). A format-1 head's
content is checked whole, as before. The content is decoded by msgspec into plain typed
records, never unpickled: decoding it runs no code, whoever wrote it.

Writing is best effort: a host that may not write the directory (a user running
``vmlend devices``, a read-only ``/var``) reads the pieces from the registry each time.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import stat
from collections.abc import Callable
from pathlib import Path

import msgspec

from vmlend import safefile
from vmlend.errors import StateError, UnsafePathError
from vmlend.registry import topopieces
from vmlend.registry.topopieces import PIECES_FORMAT_1, StoredView, TopologyHead
from vmlend.topology.chunked import (
    DIGEST_BYTES,
    Chunked,
    Readable,
    chunks_in,
    digests_of,
    root_of,
)

log = logging.getLogger(__name__)

#: The first line of a cache file.
CACHE_FORMAT = b"vmlend-topology-cache/2"

#: The largest cache file read: the text cap (64 MiB) plus its compiled form and room.
MAX_CACHE_BYTES = 256 << 20

#: The most bytes the two lines before the content may take (a head is ~300 bytes).
_MAX_HEADER = 4096


class DamagedCopyError(StateError):
    """A chunk of this host's copy of the topology does not hash to its digest. Raised where
    the chunk is read: when the copy is opened the caller reads the registry instead; later,
    the command fails (the copy was removed, so running it again reads the registry)."""


class TopologyCache:
    """The cache files under ``directory`` (created on first write, mode 0755), or the one
    file ``file`` (an SQLite state's, beside it: ``copy_beside``)."""

    def __init__(self, directory: Path, file: Path | None = None) -> None:
        self.directory = directory
        self._file = file

    def path(self, where: str) -> Path:
        """The file of the registry ``where`` names (an etcd URL and cluster, a state file)."""
        if self._file is not None:
            return self._file
        return self.directory / f"{hashlib.sha256(where.encode()).hexdigest()[:24]}.topology"

    def get(self, where: str, head: TopologyHead) -> bytes | Readable | None:
        """The content of ``head``'s generation if this host has it, else None: for a format-2
        head, read as it is used and verified chunk by chunk; for format 1, verified whole."""
        path = self.path(where)
        data = _map(path)
        if data is None:
            return None  # missing, unreadable, a link or a FIFO planted there: not used
        first = data.find(b"\n", 0, _MAX_HEADER)
        second = data.find(b"\n", first + 1, _MAX_HEADER) if first >= 0 else -1
        if second < 0 or data[:first] != CACHE_FORMAT:
            return None
        try:
            if msgspec.json.decode(data[first + 1 : second], type=TopologyHead) != head:
                return None
        except (msgspec.DecodeError, ValueError, RecursionError):
            return None
        view = memoryview(data)[second + 1 :]
        if head.format == PIECES_FORMAT_1:
            blob = bytes(view)
            if len(blob) != head.size or hashlib.sha256(blob).hexdigest() != head.sha256:
                log.info("topology cache %s is damaged; reading the registry", path)
                return None
            return blob
        size = chunks_in(head.size) * DIGEST_BYTES
        digests, content = view[:size], view[size:]
        if len(content) != head.size or root_of(digests) != head.sha256:
            log.info("topology cache %s is damaged; reading the registry", path)
            return None
        return Chunked(content, digests, _damaged_copy(path))

    def open(self, where: str, head: TopologyHead) -> StoredView | None:
        """``head``'s generation from this host's copy, or None (no usable copy: read the
        registry, then ``put``). A chunk that does not match while its header is read is
        read past like a missing copy (and the copy removed)."""
        found = self.get(where, head)
        if found is None:
            return None
        try:
            return topopieces.unpack(head, found)
        except DamagedCopyError as e:
            log.info("%s; reading the registry", e)
            return None

    def put(self, where: str, head: TopologyHead, blob: bytes | bytearray) -> None:
        """Keep ``blob`` (verified against ``head`` by the caller) for the next process."""
        path = self.path(where)
        parts = [CACHE_FORMAT, b"\n", msgspec.json.encode(head), b"\n"]
        if head.format != PIECES_FORMAT_1:
            parts.append(digests_of(blob))
        parts.append(bytes(blob))
        try:
            self.directory.mkdir(mode=0o755, parents=True, exist_ok=True)
            safefile.write_atomically(path, b"".join(parts), mode=0o644)
        except (OSError, UnsafePathError) as e:
            log.debug("topology cache %s not written: %s", path, e)


def copy_beside(state: Path) -> TopologyCache:
    """The copy of an SQLite state's topology: ``<state>-topology`` beside it, as SQLite
    keeps its ``-wal`` and ``-shm`` files (written by whoever may write the state's
    directory; anyone else reads the pieces)."""
    return TopologyCache(state.parent, state.with_name(state.name + COPY_SUFFIX))


#: The suffix of an SQLite state's copy of its topology (``copy_beside``).
COPY_SUFFIX = "-topology"


def _map(path: Path) -> mmap.mmap | None:
    """``path`` mapped read-only, if it is a regular file (not followed if a link) of at most
    ``MAX_CACHE_BYTES``. The copy is replaced by rename, never rewritten in place, so the
    mapped file does not change under the process."""
    try:
        fd = safefile.open_nofollow(path, os.O_RDONLY | os.O_NONBLOCK)
    except (OSError, UnsafePathError):
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not 0 < st.st_size <= MAX_CACHE_BYTES:
            return None
        return mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def _damaged_copy(path: Path) -> Callable[[str], Exception]:
    """What a chunk of the copy at ``path`` that does not match its digest raises; the copy
    is removed first, so the next process reads the registry and writes a good one."""

    def damaged(problem: str) -> Exception:
        with contextlib.suppress(OSError):
            path.unlink()
        return DamagedCopyError(
            f"this host's copy of the topology {path} is damaged ({problem}); it was"
            " removed: run the command again (it then reads the topology from the registry)"
        )

    return damaged
