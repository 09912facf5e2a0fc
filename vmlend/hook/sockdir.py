"""Where the hook socket may live: a directory only root or the agent's user can write.

Whoever can create a file there can put their own listener in the agent's place. The hook
refuses to talk to a listener that is neither root's nor its own (``forward``), and the agent
refuses to serve from such a directory; ``vmlend hook install`` warns about it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from vmlend.errors import ConfigError


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
