"""Which host condition stopped SQLite from using a sound state file.

SQLite reports a read-only mount, a full disk or a missing permission with the same few codes
(``SQLITE_CANTOPEN``, ``SQLITE_IOERR_*``, ``SQLITE_READONLY``), and never with the system's
errno. So the file system is asked what is wrong (``probe``), and ``classify`` decides from the
code and those facts: pure, so each combination is tested without a broken disk. Only
``SQLITE_CORRUPT`` and ``SQLITE_NOTADB`` say anything about the file itself.
"""

from __future__ import annotations

import errno
import os
from enum import Enum
from pathlib import Path

import msgspec

from vmlend.errors import (
    StateDiskFullError,
    StateHostError,
    StateLockedError,
    StatePermissionError,
    StateReadOnlyError,
)


class Condition(Enum):
    LOCKED = "locked"
    READ_ONLY = "read-only"
    DISK_FULL = "disk-full"
    NO_READ = "no-read-permission"
    NO_WRITE = "no-write-permission"
    DAMAGED = "damaged"  # the file's content: corrupt or not a database


class FsFacts(msgspec.Struct, frozen=True):
    """What the file system says about a state file and its directory."""

    read_only_fs: bool
    readable: bool
    writable: bool  # the file, and its directory (SQLite creates -wal and -shm beside it)
    space_left: bool


def probe(path: Path) -> FsFacts:
    """Ask the file system (``access`` honours a read-only mount even for root)."""
    folder = path.parent
    try:
        vfs = os.statvfs(folder)
        read_only_fs = bool(vfs.f_flag & os.ST_RDONLY)
        space_left = vfs.f_bavail > 0
    except OSError:
        read_only_fs, space_left = False, True
    readable = os.access(path, os.R_OK) if path.exists() else os.access(folder, os.R_OK)
    writable = os.access(folder, os.W_OK) and (not path.exists() or os.access(path, os.W_OK))
    return FsFacts(read_only_fs, readable, writable, space_left)


def classify(code: str, facts: FsFacts) -> Condition | None:
    """The condition behind SQLite error ``code`` (its name, e.g. ``SQLITE_IOERR_SHMSIZE``);
    None when neither the code nor the file system explains it."""
    if code.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
        return Condition.LOCKED
    if code.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB")):
        return Condition.DAMAGED
    if code == "SQLITE_FULL":
        return Condition.DISK_FULL
    if not code.startswith(("SQLITE_CANTOPEN", "SQLITE_IOERR", "SQLITE_READONLY", "SQLITE_PERM")):
        return None
    if facts.read_only_fs:
        return Condition.READ_ONLY
    if not facts.readable:
        return Condition.NO_READ
    if not facts.writable:
        return Condition.NO_WRITE
    if not facts.space_left:
        return Condition.DISK_FULL
    return None


def classify_errno(code: int) -> Condition | None:
    """The condition behind an ``OSError`` while creating a state file."""
    return {
        errno.EROFS: Condition.READ_ONLY,
        errno.ENOSPC: Condition.DISK_FULL,
        errno.EDQUOT: Condition.DISK_FULL,
        errno.EACCES: Condition.NO_WRITE,
        errno.EPERM: Condition.NO_WRITE,
    }.get(code)


def host_error(condition: Condition, path: Path, busy_timeout: float) -> StateHostError | None:
    """The error to report for ``condition``; None for ``DAMAGED`` (the caller refuses the
    file with its own words)."""
    where = str(path)
    match condition:
        case Condition.LOCKED:
            return StateLockedError(where, busy_timeout)
        case Condition.READ_ONLY:
            return StateReadOnlyError(where)
        case Condition.DISK_FULL:
            return StateDiskFullError(where)
        case Condition.NO_READ:
            return StatePermissionError(where, "read")
        case Condition.NO_WRITE:
            return StatePermissionError(where, "write")
    return None
