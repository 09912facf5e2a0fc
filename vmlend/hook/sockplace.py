"""Where this host's agent serves the hook, and how its socket takes that place safely.

- The directory: owned by root or the agent's uid, writable by nobody else (whoever could
  write there could put their own listener in the agent's place; the hook, for its part,
  talks only to a listener of root's or its own uid: ``forward``).
- One agent per path: an ``flock`` on a lock file beside the socket, held for the agent's
  life, so two agents starting together cannot both pass the stale check.
- A socket file is stale only when connecting to it is refused; one that does not answer a
  short probe (a stopped agent, a full backlog) or cannot be probed is left alone.
- The socket appears at its path already ``0600`` and listening (bound under a temporary name,
  then renamed), and is removed on stop only if it is still this agent's.
"""

from __future__ import annotations

import fcntl
import os
import socket
import stat
from pathlib import Path

from vmlend.errors import ConfigError
from vmlend.safefile import socket_bind_path, socket_path_problem

#: How long a starting agent waits for an existing socket to accept its probe.
PROBE_TIMEOUT = 1.0


def check_socket_directory(directory: Path, create: bool = False) -> None:
    """ConfigError unless ``directory`` is owned by root or us and writable by its owner only
    (whoever else could write there could replace the agent's socket with their own).
    ``create``: make it 0755 if missing."""
    if create and not directory.exists():
        try:
            directory.mkdir(mode=0o755, parents=True, exist_ok=True)
            os.chmod(directory, 0o755)  # not narrowed by the umask: the hook must enter it
        except OSError as e:
            raise ConfigError(
                f"cannot create {directory} for the hook socket: {e.strerror}"
            ) from None
    try:
        st = directory.stat()
    except OSError as e:
        raise ConfigError(f"cannot use {directory} for the hook socket: {e.strerror}") from None
    uid = os.geteuid()
    if st.st_uid not in (0, uid) or st.st_mode & 0o022:
        raise ConfigError(
            f"the hook socket's directory {directory} (owner uid {st.st_uid}, mode"
            f" {stat.S_IMODE(st.st_mode):o}) is writable by others: make it owned by root or uid"
            f" {uid} and mode 755, or choose another --hook-socket"
        )


class SocketPlace:
    """The hook socket at ``path`` for one agent: ``claim``, ``bind``, ``remove``, ``release``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock_fd: int | None = None
        self._inode: int | None = None

    def claim(self) -> None:
        """ConfigError unless the directory is safe and no other agent serves ``path``; takes
        the lock (kept until ``release``) and removes a stale socket file."""
        check_socket_directory(self.path.parent, create=True)
        self._lock()
        self._replace_stale(self.path)

    def _lock(self) -> None:
        """An exclusive ``flock`` on ``.<socket name>.lock`` for the agent's life: of two
        agents starting together only one gets past this, so the stale check and the rename
        below never race another agent's."""
        if self._lock_fd is not None:
            return
        lock = self.path.with_name(f".{self.path.name}.lock")
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            raise ConfigError(
                f"cannot serve the hook on {self.path}: {lock}: {e.strerror}"
            ) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in (0, os.geteuid()) or st.st_nlink != 1:
            # A lock file someone else made (or linked) could be held by them for ever.
            os.close(fd)
            raise ConfigError(
                f"cannot serve the hook on {self.path}: {lock} is not a plain file of root or"
                " this user; remove it"
            )
        os.fchmod(fd, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ConfigError(
                f"another vmlend agent serves the hook on {self.path}; stop it first"
            ) from None
        self._lock_fd = fd

    def release(self) -> None:
        """Let the next agent take the path (once the socket is closed)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # the file stays: removing it would race the next agent
            self._lock_fd = None

    def bind(self, backlog: int) -> socket.socket:
        """A listening socket at ``path`` (``claim`` first if not done)."""
        path = self.path
        # Bound under a temporary name, made 0600, listening, then renamed into place: the
        # socket never exists at its real path with a wider mode or before it accepts.
        tmp = socket_bind_path(path)
        problem = socket_path_problem(path) or socket_path_problem(tmp)
        if problem is not None:
            raise ConfigError(f"cannot serve the hook on {path}: {problem}")
        self.claim()
        tmp.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(tmp))
            os.chmod(tmp, 0o600)
            listener.listen(backlog)
            os.replace(tmp, path)
            self._inode = path.stat().st_ino
        except OSError as e:
            listener.close()
            tmp.unlink(missing_ok=True)
            raise ConfigError(f"cannot serve the hook on {path}: {e.strerror}") from None
        return listener

    @staticmethod
    def _replace_stale(path: Path) -> None:
        """A socket file no one listens on (connection refused) is a killed agent's: remove
        it. Anything else is another agent's, or cannot be told apart from one: refuse to
        start rather than take its hooks."""
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise ConfigError(f"{path} exists and is not a socket; remove it and start again")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(PROBE_TIMEOUT)  # a stopped agent, or a full backlog, never accepts
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)
            return
        except (TimeoutError, BlockingIOError):
            raise ConfigError(
                f"another vmlend agent serves the hook on {path} but does not answer (stopped?"
                " overloaded?); stop it first"
            ) from None
        except OSError as e:
            raise ConfigError(
                f"cannot tell whether an agent serves the hook on {path} ({e.strerror});"
                " remove it if none does"
            ) from None
        else:
            raise ConfigError(f"another vmlend agent serves the hook on {path}; stop it first")
        finally:
            probe.close()

    def remove(self) -> None:
        """Remove the socket file if it is still ours: from then on nobody can connect."""
        try:
            if self.path.stat().st_ino == self._inode:  # not a newer agent's
                self.path.unlink()
        except OSError:
            pass
