"""A host's etcd user and its password, read from the root-only file the registry URL names
(``?user=NAME&password-file=PATH``).

The password is a secret that root reads for every hook call, so its file is held to stricter
rules than the configuration file: before a byte is read, the path and every directory above it
must be root's and writable by nobody else (``vmlend.ownership``), and the file itself must be
readable by root alone (no group or other bits at all). It is opened non-blocking (a FIFO would
block root's reader), must be a regular file of at most ``MAX_PASSWORD_BYTES`` and hold exactly
one line. A process that is not root (a user's read-only ``vmlend status``) skips the
ownership rules: it can read the file only if root let it. Every refusal is one
``ConfigError`` naming the file, raised before any request reaches etcd.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from vmlend import ownership
from vmlend.errors import ConfigError

#: The largest password file read (a password is one line).
MAX_PASSWORD_BYTES = 4096


class EtcdAuth:
    """An etcd user and its password; ``source`` names where the password came from (for
    messages). The password never shows in a ``repr`` (a log line or a traceback)."""

    __slots__ = ("password", "source", "user")

    def __init__(self, user: str, password: str, source: str = "") -> None:
        self.user = user
        self.password = password
        self.source = source

    def __repr__(self) -> str:
        return f"EtcdAuth(user={self.user!r}, password=<from {self.source or 'memory'}>)"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EtcdAuth) and (other.user, other.password) == (
            self.user,
            self.password,
        )

    def __hash__(self) -> int:
        return hash(self.user)


def read_password_file(path: Path, user: str) -> EtcdAuth:
    """``user`` and the password in ``path``, checked as the module says; ``ConfigError``
    in one line otherwise."""
    name = str(path)
    what = f"the etcd password file {name} (password-file= in the registry URL)"
    as_root = os.geteuid() == 0
    if as_root:
        problems = ownership.path_problems(name)
        if problems:
            raise ConfigError(
                f"{what} holds user {user!r}'s password, but non-root can change it:"
                f" {ownership.summary(problems)}; make it root's alone (chown root, chmod 600)"
            )
    try:
        # O_NONBLOCK: opening a FIFO for reading would wait for a writer first
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(
            f"{what} does not exist; put user {user!r}'s password on its one line (root's,"
            " mode 0600) or fix the path in --registry / VMLEND_REGISTRY"
        ) from None
    except OSError as e:
        raise ConfigError(
            f"cannot read {what}: {e.strerror}; it is root's alone, so run vmlend as root"
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            from vmlend.safefile import kind_of

            raise ConfigError(
                f"{what} is {kind_of(st.st_mode)}, not a regular file; put user {user!r}'s"
                " password on the one line of a file there"
            )
        if as_root:  # the file opened, in case it was replaced since the path was checked
            why = ownership.problem_of(name, st, above=False)
            if why is not None:
                raise ConfigError(f"{what} cannot be trusted: {why}; chown root, chmod 600")
            if st.st_mode & 0o077:
                raise ConfigError(
                    f"{what} is readable by others than root (mode"
                    f" {stat.S_IMODE(st.st_mode):04o}); it is a secret: chmod 600 {name}"
                )
        data = os.read(fd, MAX_PASSWORD_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read {what}: {e.strerror}") from None
    finally:
        os.close(fd)
    return EtcdAuth(user, _one_line(data, what, user), name)


def _one_line(data: bytes, what: str, user: str) -> str:
    if len(data) > MAX_PASSWORD_BYTES:
        raise ConfigError(
            f"{what} is larger than {MAX_PASSWORD_BYTES} bytes; a password is one line"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{what} is not UTF-8 text; put user {user!r}'s password in it") from None
    line = text.removesuffix("\n").removesuffix("\r")
    if not line:
        raise ConfigError(f"{what} is empty; put user {user!r}'s password on its one line")
    if "\n" in line or "\r" in line:
        raise ConfigError(
            f"{what} holds more than one line; put only user {user!r}'s password in it"
        )
    if any(c.isspace() for c in line):
        # 'etcdctl user add --interactive=false' reads a password up to its first blank: the
        # user's password would be its first word, and this file's would never match it.
        raise ConfigError(
            f"{what} holds a blank; etcdctl reads a password from its input up to the first"
            " blank, so use one without (e.g. 'openssl rand -base64 24')"
        )
    return line
