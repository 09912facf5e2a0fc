"""The host's configuration file: ``<root>/etc/vmlend/vmlend.toml`` (``$VMLEND_CONFIG`` or
``--config`` name another).

One TOML file holds every option the CLI and the agent take: top-level keys are the global
options (``state``, ``registry``, ``node``, ``backend``, ``connect``, ``verbose``), and a table
per command holds that command's options (``[agent] ttl = 10``, ``[hook.install] name = ...``),
each key spelled like the long option without its dashes. The CLI loads it into click's
``default_map`` (``vmlend.cli.config``), so the command line wins over the environment, the
environment over the file, the file over the built-in default.

One reader for everyone: the CLI, the agent and the libvirt hook (``hook_environment``) all read
the file through ``read_config`` and parse it with ``tomllib``, so no two of them can see
different keys in one file. The hook must start fast, so this module imports neither click nor
``pathlib`` (``tomllib`` costs what ``pathlib`` would: ``docs/hooks.md``).

The file is checked before it is read: it must be a regular file (a FIFO would block root's
reader) of at most ``MAX_CONFIG_BYTES``, and, when root reads it, pass the hook's ownership rules
(``vmlend.ownership``): owned by root, not group- or other-writable, nor any directory above it.

Paths in the file are paths on the host whose root is ``--root``/``$VMLEND_ROOT``: an absolute
``state = "/var/lib/vmlend/state.db"`` names ``<root>/var/lib/vmlend/state.db``
(``under_root``), so a fake host root never reaches the machine's own files.
"""

from __future__ import annotations

import os
import stat

from vmlend import ownership
from vmlend.errors import ConfigError

TYPE_CHECKING = False  # typing is not imported on the hook's path for this alone
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, MutableMapping
    from pathlib import Path
    from typing import Any

#: Names the configuration file instead of ``<root>/etc/vmlend/vmlend.toml``.
CONFIG_ENV = "VMLEND_CONFIG"
#: The host root (``vmlend.hostenv.ROOT_ENV``, not imported: it loads msgspec and pathlib).
ROOT_ENV = "VMLEND_ROOT"
#: The file under the host root.
CONFIG_UNDER_ROOT = ("etc", "vmlend", "vmlend.toml")
#: The largest configuration file read (a real one is a few hundred bytes).
MAX_CONFIG_BYTES = 1 << 20

#: Top-level keys the hook takes from the file, and the environment variable each stands for
#: (a variable already set wins, as on the command line).
HOOK_KEYS = {
    "state": "VMLEND_STATE",
    "registry": "VMLEND_REGISTRY",
    "node": "VMLEND_NODE",
    "backend": "VMLEND_BACKEND",
    "hook-socket": "VMLEND_HOOK_SOCKET",
}
#: Hook keys whose values are paths on the host (``registry`` may hold one too).
PATH_KEYS = frozenset({"state", "hook-socket"})


def config_file(
    explicit: str | os.PathLike[str] | None = None,
    root: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[str, bool]:
    """The configuration file's absolute path, and whether it was named (``explicit``, else
    ``$VMLEND_CONFIG``): a named file must exist. Else ``etc/vmlend/vmlend.toml`` under
    ``root`` (default ``$VMLEND_ROOT``, else /), which may be absent."""
    env = os.environ if environ is None else environ
    chosen = explicit or env.get(CONFIG_ENV)
    if chosen:
        return os.path.abspath(chosen), True
    base = root or env.get(ROOT_ENV) or "/"
    return os.path.abspath(os.path.join(base, *CONFIG_UNDER_ROOT)), False


def config_path(
    explicit: str | os.PathLike[str] | None = None,
    root: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Path:
    """``config_file``'s path as a ``Path`` (for the CLI)."""
    from pathlib import Path

    return Path(config_file(explicit, root, environ)[0])


def host_root(
    root: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None
) -> str:
    """The host root the file's paths are taken under: ``root``, else ``$VMLEND_ROOT``, else /."""
    env = os.environ if environ is None else environ
    return os.path.abspath(root or env.get(ROOT_ENV) or "/")


def read_config(path: str | os.PathLike[str], *, required: bool = False) -> dict[str, Any]:
    """The file's tables as a dict; ``{}`` when it does not exist (unless ``required``: a file
    named by ``--config`` or ``$VMLEND_CONFIG``). ``ConfigError`` naming the file when it is no
    regular file, is larger than ``MAX_CONFIG_BYTES``, (read by root) could be changed by
    non-root, cannot be read, or is not TOML."""
    data = read_config_bytes(path, required=required)
    return {} if data is None else parse_config(data, os.fspath(path))


def read_config_bytes(path: str | os.PathLike[str], *, required: bool = False) -> bytes | None:
    """The file's bytes (None when it does not exist and is not ``required``), checked as
    ``read_config`` says: type and ownership before a byte is read."""
    name = os.fspath(path)
    as_root = os.geteuid() == 0
    if as_root:
        _refuse_untrusted(name, ownership.path_problems(name))
    try:
        # O_NONBLOCK: opening a FIFO for reading would wait for a writer first
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        if required:
            raise ConfigError(
                f"the configuration file {name} does not exist; create it, or name another with"
                f" --config or ${CONFIG_ENV}"
            ) from None
        return None
    except OSError as e:
        raise ConfigError(f"cannot read the configuration file {name}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            from vmlend.safefile import kind_of

            raise ConfigError(
                f"the configuration file {name} is {kind_of(st.st_mode)}, not a regular file;"
                " put the settings in a file there"
            )
        if as_root:  # the file opened, in case it was replaced since the check of its path
            why = ownership.problem_of(name, st, above=False)
            _refuse_untrusted(name, [why] if why else [])
        return _read_bounded(fd, name)
    except OSError as e:
        raise ConfigError(f"cannot read the configuration file {name}: {e.strerror}") from None
    finally:
        os.close(fd)


def _refuse_untrusted(name: str, problems: list[str]) -> None:
    if problems:
        raise ConfigError(
            f"the configuration file {name} configures what root runs, but non-root can"
            f" change it: {ownership.summary(problems)}; make it root's alone (chown root,"
            " chmod go-w; docs/security.md)"
        )


def _read_bounded(fd: int, name: str) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while total <= MAX_CONFIG_BYTES:
        chunk = os.read(fd, MAX_CONFIG_BYTES + 1 - total)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        total += len(chunk)
    raise ConfigError(
        f"the configuration file {name} is larger than {MAX_CONFIG_BYTES} bytes; a"
        " configuration is a few lines"
    )


def parse_config(data: bytes, name: str) -> dict[str, Any]:
    """``data`` (a configuration file's bytes) as TOML: the one parser of the CLI, the agent
    and the hook. ``ConfigError`` naming ``name`` for anything that is not TOML."""
    if not data:
        return {}  # what tomllib makes of it, without its import (an empty file: 'touch')
    import tomllib

    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{name} is not UTF-8 ({e.reason} at byte {e.start}); fix it") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{name} is not valid TOML ({e}); fix it") from None
    except RecursionError:  # tomllib recurses into nested arrays and inline tables
        raise ConfigError(
            f"{name} nests arrays or inline tables deeper than vmlend reads; no setting needs"
            " more than one level"
        ) from None


def under_root(value: str, root: str) -> str:
    """The absolute path ``value`` (a path in the configuration file) on the host whose root is
    ``root``: ``/var/lib/x`` under ``/srv/host`` is ``/srv/host/var/lib/x``. ``..`` cannot
    climb above the root."""
    inside = os.path.normpath("/" + value.lstrip("/"))  # "/.." is "/"
    if root == "/":
        return inside
    return os.path.join(root, inside.lstrip("/"))


def over_root(path: str, root: str, what: str) -> str:
    """``under_root``'s inverse: how the configuration file spells the absolute ``path``, which
    must lie under ``root`` (``what`` names it in the refusal)."""
    if root == "/":
        return path
    inside = os.path.relpath(path, root)
    if inside == ".." or inside.startswith("../"):
        raise ConfigError(
            f"{what} {path} is outside the host root {root}: the configuration file's paths are"
            " taken under the root; choose one under it"
        )
    return "/" if inside == "." else "/" + inside


def registry_paths(value: str, move: Callable[[str], str]) -> str:
    """A registry location with ``move`` applied to each path in it: the file of
    ``sqlite:///PATH`` or a plain path, the ``cacert=``/``cert=``/``key=``/``password-file=``
    files of an etcd URL."""
    if value.startswith("sqlite://"):
        return "sqlite://" + move(value.removeprefix("sqlite://"))
    if value.startswith(("etcd://", "etcds://")):
        base, question, query = value.partition("?")
        if not question:
            return value
        from urllib.parse import parse_qsl, quote

        pairs = parse_qsl(query, keep_blank_values=True)
        moved = [(k, move(v) if k in _URL_FILES and v.startswith("/") else v) for k, v in pairs]
        return base + "?" + "&".join(f"{quote(k)}={quote(v, safe='/@')}" for k, v in moved)
    return move(value) if "://" not in value else value


_URL_FILES = ("cacert", "cert", "key", "password-file")


def spellings_of(key: str) -> tuple[str, ...]:
    """How the file may spell ``key``: ``hook-socket`` or ``hook_socket``."""
    return tuple(dict.fromkeys((key, key.replace("-", "_"))))


def _absolute_path(key: str, value: str, path: str) -> None:
    if not value.startswith("/"):
        raise ConfigError(
            f"{path}: {key} = {value!r} must be an absolute path (the hook runs from /, and"
            " the file's paths are taken under the host root)"
        )


def hook_settings(
    config: Mapping[str, Any], path: str | os.PathLike[str], root: str
) -> dict[str, str]:
    """The file's top-level settings the hook uses, as environment variables (``HOOK_KEYS``),
    paths taken under ``root``. A value that is not a non-empty string, or a path that is not
    absolute, is refused naming the key and the file."""
    where = os.fspath(path)
    out: dict[str, str] = {}
    for key, env in HOOK_KEYS.items():
        spellings = [k for k in spellings_of(key) if k in config]
        if not spellings:
            continue
        if len(spellings) > 1:
            raise ConfigError(f"{where}: {' and '.join(spellings)} are one setting; keep one")
        value = config[spellings[0]]
        if not isinstance(value, str) or not value:
            raise ConfigError(
                f"{where}: {spellings[0]} must be a non-empty string, not {value!r}"
            )
        if key in PATH_KEYS:
            _absolute_path(spellings[0], value, where)
            value = under_root(value, root)
        elif key == "registry":
            if "://" not in value or value.startswith("sqlite://"):
                _absolute_path(spellings[0], value.removeprefix("sqlite://"), where)
            if root != "/":
                value = registry_paths(value, lambda p: under_root(p, root))
        out[env] = value
    return out


def hook_environment(environ: MutableMapping[str, str]) -> None:
    """Fill the hook's environment from the configuration file it pins (``$VMLEND_CONFIG``,
    which must exist, else the one under ``$VMLEND_ROOT``): variables already set win."""
    path, named = config_file(environ=environ)
    config = read_config(path, required=named)
    for name, value in hook_settings(config, path, host_root(environ=environ)).items():
        environ.setdefault(name, value)
