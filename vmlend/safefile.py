"""Files that root opens where others may write: never through a planted link, never by a name.

Root edits domain XML in users' directories and keeps logs and state in directories it shares
with other files. A name in a directory another user can write may be renamed to anything
between two system calls, so this module opens the parent directory once and works on
descriptors relative to it: owner and mode are set on the descriptor (``fchown``, ``fchmod``),
a link at the target is refused rather than followed, and inputs are read only from regular
files of bounded size (a FIFO or ``/dev/zero`` would block or grow memory without end).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

from vmlend.errors import UnsafePathError

#: The most vmlend reads from a user's XML or TOML file (the largest real domain is ~100 KiB).
MAX_INPUT_BYTES = 16 << 20

_KINDS = {
    stat.S_IFREG: "a regular file",
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFLNK: "a symbolic link",
}


@contextlib.contextmanager
def own_directory(path: Path, *, create: bool) -> Iterator[int | None]:
    """``path``, opened without following a link, if it is a directory of this process's user
    that nobody else may write to (a root process trusts what it finds there: the agent's
    pause marks, the pending releases). None when it does not exist and ``create`` is false;
    made 0700 otherwise. ``UnsafePathError`` when it is not such a directory."""
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        if create:
            raise
        yield None
        return
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafePathError(str(path), "it is not a directory") from None
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise UnsafePathError(str(path), "another user owns it or may write to it; remove it")
        yield fd
    finally:
        os.close(fd)


def kind_of(mode: int) -> str:
    """What a file of ``mode`` is, in words ("a FIFO")."""
    return _KINDS.get(stat.S_IFMT(mode), "an unknown kind of file")


def _link_refused(path: str | os.PathLike[str]) -> UnsafePathError:
    return UnsafePathError(
        str(path), "it is a symbolic link; remove it (vmlend does not follow links there)"
    )


def open_nofollow(path: str | os.PathLike[str], flags: int, mode: int = 0o600) -> int:
    """``os.open`` that refuses a symbolic link as the last component (``UnsafePathError``)."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _link_refused(path) from None
        raise


def read_regular(path: str | os.PathLike[str], limit: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them. Anything else (a FIFO,
    a device, a directory, a larger file) is an ``UnsafePathError``; ``OSError`` otherwise."""
    # O_NONBLOCK: opening a FIFO for reading would wait for a writer before we can look at it.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(str(path), f"it is {kind_of(st.st_mode)}, not a regular file")
        chunks: list[bytes] = []
        total = 0
        while total <= limit:
            # a file may grow after fstat: the limit is on what is read, not on st_size
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            total += len(chunk)
        raise UnsafePathError(str(path), f"it is larger than {limit} bytes")
    finally:
        os.close(fd)


def write_atomically(
    path: str | os.PathLike[str], data: bytes, *, keep_owner: bool = False, mode: int = 0o644
) -> None:
    """Replace ``path`` with ``data`` so a reader never sees half a file.

    An existing target keeps its permission bits (and, with ``keep_owner``, its owner and
    group); a new one gets ``mode``. A symbolic link or non-regular file at ``path`` is refused
    (``UnsafePathError``) with nothing changed. Other failures are ``OSError``; a ``fchown``
    that is not permitted is ``PermissionError``, raised before anything is replaced.
    """
    parent, name = os.path.split(os.path.abspath(path))
    dfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            st: os.stat_result | None = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise UnsafePathError(
                str(path), "it is a symbolic link; name the file it points to instead"
            )
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(str(path), f"it is {kind_of(st.st_mode)}, not a regular file")
        fd, tmp = _create_temp(dfd, name)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                if st is not None:
                    own = os.fstat(fd)
                    if keep_owner and (own.st_uid, own.st_gid) != (st.st_uid, st.st_gid):
                        os.fchown(fd, st.st_uid, st.st_gid)
                    os.fchmod(fd, stat.S_IMODE(st.st_mode))
                else:
                    os.fchmod(fd, mode)
                os.fsync(fd)
            # rename(2) replaces the name itself, never what a link there points to
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dfd)
            raise
    finally:
        os.close(dfd)


def _create_temp(dfd: int, name: str) -> tuple[int, str]:
    """A new file ``.<name>.<random>`` in the directory ``dfd``, created exclusively (so never
    a file or link someone planted under that name)."""
    for _ in range(100):
        tmp = f".{name}.{secrets.token_hex(4)}"
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            return os.open(tmp, flags, 0o600, dir_fd=dfd), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", name)


#: sizeof(sun_path) on Linux. Python keeps room for the terminating NUL, so the longest path
#: a unix socket can be bound or connected at from Python is one byte shorter.
SUN_PATH_MAX = 108
SOCKET_PATH_BYTES = SUN_PATH_MAX - 1


def socket_path_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot name a unix socket (too long for ``sun_path``), or None. The kernel's
    own error carries no errno, so without this users read "...: None"."""
    size = len(os.fsencode(path))
    if size <= SOCKET_PATH_BYTES:
        return None
    return (
        f"the socket path {os.fspath(path)!r} is {size} bytes, and a unix socket path holds at"
        f" most {SOCKET_PATH_BYTES}: choose a shorter path"
    )


def socket_bind_path(path: Path) -> Path:
    """Where a listener binds before it is renamed onto ``path``: beside it (a rename stays in
    one directory), named for it and this process; or, when that name is too long for
    ``sun_path`` and ``path`` itself is not, a short one (``.<pid>.s``), so that a path a
    socket fits is not refused for its temporary name (the long one is 14 bytes longer)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    if socket_path_problem(tmp) is None or socket_path_problem(path) is not None:
        return tmp
    return path.with_name(f".{os.getpid()}.s")


class NotAnEntry(Exception):
    """A name in a directory of entries that is not a regular file of bounded size (what it
    is, in words: "a symbolic link", "a FIFO", "300000 bytes, over 262144")."""


def read_entry_at(dfd: int, name: str, limit: int) -> bytes | None:
    """The bytes of the regular file ``name`` in the directory ``dfd`` (None: it is gone);
    ``NotAnEntry`` for anything else (a link, a FIFO, a device, more than ``limit`` bytes).
    Opened without following a link and without blocking (a FIFO cannot hang the reader)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotAnEntry("a symbolic link") from None
        raise NotAnEntry(e.strerror or str(e)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotAnEntry(kind_of(st.st_mode))
        if st.st_size > limit:
            raise NotAnEntry(f"{st.st_size} bytes, over {limit}")
        data = os.read(fd, limit + 1)
        if len(data) > limit:
            raise NotAnEntry(f"over {limit} bytes")
        return data
    finally:
        os.close(fd)


def replace_entry_at(dfd: int, name: str, data: bytes) -> None:
    """Replace ``name`` in the directory ``dfd`` with ``data``: a new file (exclusive, no
    link followed) written, fsynced and renamed over it, and the directory fsynced, so a crash
    leaves the old entry or the new one."""
    tmp = f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=dfd)
    fd = os.open(
        tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd
    )
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)  # the name, never a link's target
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dfd)
        raise
    os.fsync(dfd)  # the rename itself survives a crash
