"""Whether this host's ``vmlend agent`` lives: it holds ``<root>/run/vmlend/agent.lock``
(``flock``) for its whole life (``vmlend.agent.identity.HostLock``).

The hook asks before it would run a call in-process: while the agent lives, the hook never
writes beside it (``vmlend.hook.forward``). So this module imports only ``os`` at load, and
``fcntl`` (a small C module) only when the lock file exists: the hook's start stays bare
(``docs/hooks.md``).
"""

from __future__ import annotations

import os

#: The lock under the host root ($VMLEND_ROOT, else /), beside the agent's lease file.
LOCK_UNDER_ROOT = ("run", "vmlend", "agent.lock")


def lock_path(root: str | None) -> str:
    return os.path.join(root or "/", *LOCK_UNDER_ROOT)


def held_elsewhere(path: str) -> bool:
    """Whether another process holds the agent's lock at ``path``: a shared ``flock`` that
    cannot be had. Held for an instant only (the agent retries its own lock meanwhile); a file
    that is missing, a link or cannot be opened is no lock held."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        import fcntl

        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return False
        return False
    finally:
        os.close(fd)
