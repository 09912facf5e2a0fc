"""A host's copy of the cluster's topology, so that a hook call or a CLI command reads only
the topology's head from etcd (a few hundred bytes) instead of its pieces (megabytes).

One file per registry under the host's state directory: a first line naming the format, a
second line the head the content was read under (JSON), then (format 2 heads) the sha256 of
each 16 KiB chunk of the content, then the content's bytes exactly as the registry's pieces
hold them. The file is used only when its head is the registry's current one *and* its chunks'
digests hash to the sha256 that head names. Its content is not read whole: each chunk is read
when first used, checked against its digest and kept in the process's own memory
(``vmlend.topology.chunked``), so a process reads and hashes the few kilobytes it uses,
whatever the topology's size, and bytes changed in the file after they were checked are never
used. A file of another generation or cluster is read past and rewritten from the registry. A
chunk that does not match (damage, or somebody else's bytes) is read from the registry's own
pieces instead, and the file removed (the next process that reads the pieces writes a good
one); only when the registry no longer holds that generation either (another topology was
installed meanwhile) does the command fail, in one line asking to run it again. A format-1
head's content is checked whole, as before. The content is decoded by msgspec into plain typed
records, never unpickled: decoding it runs no code, whoever wrote it.

Writing is best effort: a host that may not write the directory (a user running
``vmlend devices``, a read-only ``/var``) reads the pieces from the registry each time.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import weakref
from collections.abc import Callable
from pathlib import Path

import msgspec

from vmlend import safefile
from vmlend.errors import DamagedCopyError, UnsafePathError
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


#: Reads ``length`` bytes of a generation's content from ``start`` out of the registry's own
#: pieces (``refetch`` of ``chunked.Chunked``); None when they are gone.
Refetch = Callable[[int, int], bytes | None]


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

    def get(
        self, where: str, head: TopologyHead, refetch: Refetch | None = None
    ) -> bytes | Readable | None:
        """The content of ``head``'s generation if this host has it, else None: for a format-2
        head, read as it is used and verified chunk by chunk (a chunk that does not match:
        from ``refetch``); for format 1, verified whole."""
        path = self.path(where)
        fd = _open(path)
        if fd is None:
            return None  # missing, unreadable, a link or a FIFO planted there: not used
        keep = False
        try:
            found = self._read(path, fd, head, refetch)
            keep = isinstance(found, Chunked)
            return found
        except OSError:
            return None
        finally:
            if not keep:
                os.close(fd)

    def _read(
        self, path: Path, fd: int, head: TopologyHead, refetch: Refetch | None
    ) -> bytes | Readable | None:
        top = os.pread(fd, _MAX_HEADER, 0)
        first = top.find(b"\n")
        second = top.find(b"\n", first + 1) if first >= 0 else -1
        if second < 0 or top[:first] != CACHE_FORMAT:
            return None
        try:
            if msgspec.json.decode(top[first + 1 : second], type=TopologyHead) != head:
                return None
        except (msgspec.DecodeError, ValueError, RecursionError):
            return None
        at = second + 1
        if head.format == PIECES_FORMAT_1:
            blob = os.pread(fd, head.size + 1, at)
            if len(blob) != head.size or hashlib.sha256(blob).hexdigest() != head.sha256:
                log.info("topology cache %s is damaged; reading the registry", path)
                return None
            return blob
        size = chunks_in(head.size) * DIGEST_BYTES
        digests = os.pread(fd, size, at)
        if root_of(digests) != head.sha256 or os.fstat(fd).st_size != at + size + head.size:
            log.info("topology cache %s is damaged; reading the registry", path)
            return None
        base = at + size

        def read(start: int, length: int) -> bytes:
            return os.pread(fd, length, base + start)

        found = Chunked(head.size, digests, read, _damaged_copy(path), refetch=refetch)
        weakref.finalize(found, os.close, fd)  # the file stays open while the copy is used
        return found

    def open(
        self, where: str, head: TopologyHead, refetch: Refetch | None = None
    ) -> StoredView | None:
        """``head``'s generation from this host's copy, or None (no usable copy: read the
        registry, then ``put``). A chunk of the header that neither the copy nor ``refetch``
        gives is read past like a missing copy."""
        found = self.get(where, head, refetch)
        if found is None:
            return None
        try:
            return topopieces.unpack(head, found)
        except DamagedCopyError as e:
            log.info("%s; reading the registry", e)
            return None

    def put(
        self,
        where: str,
        head: TopologyHead,
        blob: bytes | bytearray,
        *,
        digests: bytes | None = None,
    ) -> None:
        """Keep ``blob`` (verified against ``head`` by the caller) for the next process.
        ``digests``: its chunks' digests (format 2) as the caller verified it by
        (``topopieces.Verified``), so it is not hashed again; without them, computed here.
        Given digests whose root is not the head's sha256 raise ``ValueError`` (a caller's
        mistake): the copy's digests are always those its head names."""
        path = self.path(where)
        parts: list[bytes | bytearray] = [CACHE_FORMAT, b"\n", msgspec.json.encode(head), b"\n"]
        if head.format == PIECES_FORMAT_1:
            if digests is not None:
                raise ValueError(f"generation {head.generation} is of format 1: no digests")
        else:
            if digests is None:
                digests = digests_of(blob)
            elif (
                len(blob) != head.size
                or len(digests) != chunks_in(len(blob)) * DIGEST_BYTES
                or root_of(digests) != head.sha256
            ):
                raise ValueError(f"digests given for generation {head.generation} are not its")
            parts.append(digests)
        parts.append(blob)  # joined below: not copied on its own first
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


def _open(path: Path) -> int | None:
    """A descriptor of ``path`` if it is a regular file (not followed if a link) of at most
    ``MAX_CACHE_BYTES``, else None. Read with ``pread``, never mapped: a file truncated or
    rewritten in place under the process gives short or other bytes, which its chunks' digests
    refuse, not a bus error."""
    try:
        fd = safefile.open_nofollow(path, os.O_RDONLY | os.O_NONBLOCK)
    except (OSError, UnsafePathError):
        return None
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and 0 < st.st_size <= MAX_CACHE_BYTES:
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _damaged_copy(path: Path) -> Callable[[str], Exception]:
    """What a chunk of the copy at ``path`` that does not match its digest makes: the copy
    removed (once; the next process that reads the registry writes a good one) and a line at
    INFO, and the error raised if the registry cannot give the chunk either. INFO, as a copy
    read past at its open is: the process goes on from the registry, and a command that then
    fails for its own reason says one line, not this one before it (the agent logs INFO).
    A copy that cannot be removed is a WARNING: only its owner can, and until then every
    process reads past it."""
    removed: list[str] = []

    def damaged(problem: str) -> Exception:
        if not removed:
            say = log.info
            try:
                path.unlink()
                removed.append("it was removed")
            except FileNotFoundError:
                removed.append("it was removed")
            except OSError as e:
                removed.append(f"it could not be removed ({e.strerror}): remove it as its owner")
                say = log.warning  # an operator must act: every process would meet it again
            say(
                "this host's copy of the topology %s is damaged (%s); %s; reading the registry",
                path,
                problem,
                removed[0],
            )
        return DamagedCopyError(
            f"this host's copy of the topology {path} is damaged ({problem}) and the registry"
            f" no longer holds that topology's generation (another was installed); {removed[0]}:"
            " run the command again"
        )

    return damaged
