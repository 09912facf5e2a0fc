"""A host's copy of the cluster's topology, so that a hook call or a CLI command reads only
the topology's head from etcd (a few hundred bytes) instead of its pieces (megabytes).

One file per registry under the host's state directory: a first line naming the format, a
second line the head the content was read under (JSON), then the content's bytes exactly as
the registry's pieces hold them. The file is used only when its head is the registry's
current one *and* its bytes hash to the sha256 that head names, so a damaged file, one of
another generation or cluster, or one somebody else wrote, is never used: it is read past and
rewritten from the registry. Its content is decoded by msgspec into plain typed records
(``topopieces.StoredTopology``), never unpickled: decoding it runs no code, whoever wrote it.

Writing is best effort: a host that may not write the directory (a user running
``vmlend devices``, a read-only ``/var``) reads the pieces from the registry each time.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import msgspec

from vmlend import safefile
from vmlend.errors import UnsafePathError
from vmlend.registry.topopieces import TopologyHead

log = logging.getLogger(__name__)

#: The first line of a cache file.
CACHE_FORMAT = b"vmlend-topology-cache/1"

#: The largest cache file read: the text cap (64 MiB) plus its compiled form and room.
MAX_CACHE_BYTES = 256 << 20


class TopologyCache:
    """The cache files under ``directory`` (created on first write, mode 0755)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, where: str) -> Path:
        """The file of the registry ``where`` names (an etcd URL and cluster)."""
        return self.directory / f"{hashlib.sha256(where.encode()).hexdigest()[:24]}.topology"

    def get(self, where: str, head: TopologyHead) -> bytes | None:
        """The content of ``head``'s generation if this host has it, verified; else None."""
        path = self.path(where)
        try:
            data = safefile.read_regular(path, MAX_CACHE_BYTES)
        except (OSError, UnsafePathError):
            return None  # missing, unreadable, a link or a FIFO planted there: not used
        # find, not partition: each partition would copy the megabytes after the line
        first = data.find(b"\n")
        second = data.find(b"\n", first + 1) if first >= 0 else -1
        if second < 0 or data[:first] != CACHE_FORMAT:
            return None
        header, blob = data[first + 1 : second], data[second + 1 :]
        try:
            if msgspec.json.decode(header, type=TopologyHead) != head:
                return None
        except (msgspec.DecodeError, ValueError, RecursionError):
            return None
        if len(blob) != head.size or hashlib.sha256(blob).hexdigest() != head.sha256:
            log.info("topology cache %s is damaged; reading the registry", path)
            return None
        return blob

    def put(self, where: str, head: TopologyHead, blob: bytes) -> None:
        """Keep ``blob`` (verified against ``head`` by the caller) for the next process."""
        path = self.path(where)
        data = b"\n".join((CACHE_FORMAT, msgspec.json.encode(head), blob))
        try:
            self.directory.mkdir(mode=0o755, parents=True, exist_ok=True)
            safefile.write_atomically(path, data, mode=0o644)
        except (OSError, UnsafePathError) as e:
            log.debug("topology cache %s not written: %s", path, e)
