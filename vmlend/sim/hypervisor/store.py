"""Files of the simulated hypervisor: one node's domains, shared by every process on it.

Layout under ``data_dir``: ``config/<name>.xml`` (persistent definitions), ``live/<name>.xml``
(running domains), ``paused/<name>.xml`` (markers), ``next-id`` (domain id counter), and the
``flock`` files that serialise operations across processes: ``lock`` (the node: definitions),
``locks/<name>`` (one domain, for a whole job on it, hooks included) and ``id-lock`` (the id
counter). Writes are atomic (temp file and rename), so reads need no lock.

Locks are taken in one order, node before domain, and the id lock last and alone, so no two
operations wait for each other. As in libvirt, where a job holds its domain object's lock
while a hook runs, a long hook of one domain holds up what needs that domain (listing all of
them included) and nothing else: another domain is paused, looked up or changed meanwhile.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

from vmlend import safefile
from vmlend.errors import StateError, StateReadOnlyError


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` whole; a planted link at ``path`` is refused, never followed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    safefile.write_atomically(path, data, mode=0o600)


class SimStore:
    def __init__(self, data_dir: Path, lock_timeout: float = 30.0) -> None:
        self.data_dir = data_dir
        self.lock_timeout = lock_timeout

    def locked(self, domain: str | None = None) -> contextlib.AbstractContextManager[None]:
        """Hold the node's lock, or with ``domain`` that domain's. A hook that calls back into
        the simulated hypervisor on its own domain would wait here, as it would deadlock
        libvirtd; after ``lock_timeout`` that is an error."""
        return self._flocked("lock" if domain is None else f"locks/{domain}")

    @contextlib.contextmanager
    def _flocked(self, relative: str) -> Iterator[None]:
        path = self.data_dir / relative
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            flags = os.O_RDWR | os.O_CREAT | os.O_APPEND
            f = os.fdopen(safefile.open_nofollow(path, flags, 0o600), "a+b")
        except OSError as e:
            if e.errno != errno.EROFS:
                raise
            # Nothing can change on a read-only file system: reading needs no lock, and a
            # write fails in ``write`` with the condition named.
            yield
            return
        with f:
            deadline = time.monotonic() + self.lock_timeout
            while True:
                try:
                    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise StateError(
                            f"simulated hypervisor at {self.data_dir} is busy for more than "
                            f"{self.lock_timeout:g} s; does a hook call back into it?"
                        ) from None
                    time.sleep(0.01)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def _path(self, kind: str, name: str) -> Path:
        return self.data_dir / kind / f"{name}.xml"

    def read(self, kind: str, name: str) -> bytes | None:
        """``kind`` is "config", "live" or "paused" (a marker); None when there is no such file."""
        try:
            return self._path(kind, name).read_bytes()
        except FileNotFoundError:
            return None

    def write(self, kind: str, name: str, xml: bytes) -> None:
        try:
            atomic_write(self._path(kind, name), xml)
        except OSError as e:
            if e.errno == errno.EROFS:
                raise StateReadOnlyError(str(self.data_dir)) from None
            raise

    def remove(self, kind: str, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(kind, name).unlink()

    def names(self) -> list[str]:
        found: set[str] = set()
        for kind in ("config", "live"):
            folder = self.data_dir / kind
            if folder.is_dir():
                found.update(p.stem for p in folder.glob("*.xml"))
        return sorted(found)

    def next_id(self) -> int:
        """The next domain id (libvirt numbers running domains from 1)."""
        path = self.data_dir / "next-id"
        with self._flocked("id-lock"):
            try:
                value = int(path.read_text().strip() or "1")
            except FileNotFoundError:
                value = 1
            except ValueError:
                raise StateError(f"{path} is corrupt; remove it to restart numbering") from None
            atomic_write(path, f"{value + 1}\n".encode())
        return value
