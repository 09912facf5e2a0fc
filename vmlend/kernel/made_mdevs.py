"""The children this host made, kept on the host: what a release may remove after a lease loss.

The registry records each mdev before the kernel makes it, and a release removes exactly the
children recorded for its VM (``lending.devices.recorded_for``). On etcd those records live on
the host's lease: when the lease ends (the host frozen or cut off past its TTL) they go with
it, the lender takes the device back, and the VM's child stays in this host's kernel. Its VM's
release would then find no record and leave the child, and with it the parent, for an
operator to remove by hand.

So the kernel backend also notes each child here, one file per child under
``<root>/var/lib/vmlend/made-mdevs/`` (the state directory: a child outlives no reboot, but a
record made just before one must be readable after it to be dropped), before the kernel makes
it, and drops the note once the child is gone. A note speaks only where the registry is
silent: a registry record of the same UUID always wins (another VM's, say), and a note never
makes the agent re-create a child (``wanted_mdevs`` reads the registry alone).

The notes make a root process remove a child, so the directory must be the process's own
user's, a real directory nobody else may write to (``safefile.own_directory``); a file in it
that is not a note is skipped with a warning, never followed.

A note also carries the VM's guest RAM once vmlend writes the child's DMA windows
(``SmartioFabric.write_dma_windows``): ``vmlend mdev watch`` re-creating the child after its
lender returns writes the same windows from it, since the watcher knows the VM's name but not
its layout. Notes written before that field existed read as notes without RAM.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import msgspec

from vmlend.errors import UnsafePathError
from vmlend.hostenv import HostEnv
from vmlend.safefile import NotAnEntry, own_directory, read_entry_at, replace_entry_at
from vmlend.topology.model import GuestRam, MdevInfo

log = logging.getLogger(__name__)

#: A note is a few hundred bytes, up to about 3 KiB with the most RAM ranges a driver takes (64,
#: docs/smartio-contract.md section 8); anything larger is not one.
MAX_NOTE_BYTES = 16384


class MadeMdev(msgspec.Struct, frozen=True):
    """One child this host made (or is about to make): for whom, under which parent."""

    uuid: str
    fdid: int
    parent: str
    type_id: str
    node: str
    vm: str
    #: The VM's guest RAM, from the first write of the child's DMA windows; None: not known
    #: here (a note from before the field, or a caller that knew only the RAM's size).
    ram: GuestRam | None = None

    def info(self) -> MdevInfo:
        return MdevInfo(self.uuid, self.parent, self.type_id, self.fdid, self.node, self.vm)


def notes_dir(env: HostEnv) -> Path:
    return env.var / "lib" / "vmlend" / "made-mdevs"


class MadeMdevs:
    """The notes in one directory (``notes_dir``). Each method is one whole step: a note is
    written atomically (``replace_entry_at``), so a crash leaves it or not."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory

    @contextlib.contextmanager
    def _opened(self, create: bool) -> Iterator[int | None]:
        with own_directory(self.dir, create=create) as fd:
            yield fd

    def note(self, made: MadeMdev) -> None:
        """Record ``made`` before the kernel makes it."""
        with self._opened(create=True) as fd:
            assert fd is not None  # create=True makes it or raises
            replace_entry_at(fd, _name(made.uuid), msgspec.json.encode(made))

    def get(self, uuid: str) -> MadeMdev | None:
        """The note of ``uuid`` (None: none, or not a note of vmlend's)."""
        with self._opened(create=False) as fd:
            return None if fd is None else _read(fd, _name(uuid))

    def forget(self, uuid: str) -> None:
        """Drop the note of ``uuid`` (none: nothing to do)."""
        with self._opened(create=False) as fd:
            if fd is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(_name(uuid), dir_fd=fd)

    def all(self) -> list[MadeMdev]:
        """Every note, by UUID. An unsafe directory yields none, said as a warning: a note
        must never come from a file someone else could have put there."""
        try:
            with self._opened(create=False) as fd:
                if fd is None:
                    return []
                return [m for name in sorted(os.listdir(fd)) if (m := _read(fd, name))]
        except UnsafePathError as e:
            log.warning("ignoring the notes of made mdevs: %s", e)
            return []


def _name(uuid: str) -> str:
    return f"{uuid}.json"


def _read(fd: int, name: str) -> MadeMdev | None:
    if name.startswith(".") or not name.endswith(".json"):
        return None
    try:
        data = read_entry_at(fd, name, MAX_NOTE_BYTES)
        if data is None:
            return None
        made = msgspec.json.decode(data, type=MadeMdev)
    except (NotAnEntry, msgspec.ValidationError, msgspec.DecodeError) as e:
        log.warning("made-mdevs/%s is not a note of vmlend's (%s); skipped", name, e)
        return None
    if _name(made.uuid) != name:
        log.warning("made-mdevs/%s names mdev %s; skipped", name, made.uuid)
        return None
    return made
