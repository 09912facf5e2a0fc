"""The host's configuration file: ``<root>/etc/vmlend/vmlend.toml`` (``$VMLEND_CONFIG`` or
``--config`` name another).

One TOML file holds every option the CLI and the agent take: top-level keys are the global
options (``state``, ``registry``, ``node``, ``backend``, ``connect``, ``verbose``), and a table
per command holds that command's options (``[agent] ttl = 10``, ``[hook.install] name = ...``),
each key spelled like the long option without its dashes. The CLI loads it into click's
``default_map`` (``vmlend.cli.config``), so the command line wins over the environment, the
environment over the file, the file over the built-in default.

No click here: the libvirt hook reads the same file (``hook_environment``) and must start fast.
The file configures what root runs, so when root reads it, it passes the hook's ownership rules
(``vmlend.hook.trust``): owned by root, not group- or other-writable, nor any directory above it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vmlend import ownership
from vmlend.errors import ConfigError

#: Names the configuration file instead of ``<root>/etc/vmlend/vmlend.toml``.
CONFIG_ENV = "VMLEND_CONFIG"
#: The file under the host root.
CONFIG_UNDER_ROOT = ("etc", "vmlend", "vmlend.toml")

#: Top-level keys the hook takes from the file, and the environment variable each stands for
#: (a variable already set wins, as on the command line).
HOOK_KEYS = {
    "state": "VMLEND_STATE",
    "registry": "VMLEND_REGISTRY",
    "node": "VMLEND_NODE",
    "backend": "VMLEND_BACKEND",
    "hook-socket": "VMLEND_HOOK_SOCKET",
}


def config_path(
    explicit: str | os.PathLike[str] | None = None,
    root: str | os.PathLike[str] | None = None,
    environ: dict[str, str] | os._Environ[str] | None = None,
) -> Path:
    """``explicit``, else ``$VMLEND_CONFIG``, else ``etc/vmlend/vmlend.toml`` under ``root``
    (default ``$VMLEND_ROOT``, else /)."""
    env = os.environ if environ is None else environ
    chosen = explicit or env.get(CONFIG_ENV)
    if chosen:
        return Path(os.path.abspath(chosen))
    base = root or env.get("VMLEND_ROOT") or "/"
    return Path(os.path.abspath(os.path.join(base, *CONFIG_UNDER_ROOT)))


def read_config(
    path: Path,
    *,
    required: bool = False,
    parse: Callable[[str], dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    """The file's tables as a dict; ``{}`` when it does not exist (unless ``required``).
    ``ConfigError`` naming the file when it cannot be read, is not TOML, or (read by root)
    could be changed by non-root. ``parse``: a quicker reader that may decline (None)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        if required:
            raise ConfigError(
                f"the configuration file {path} does not exist; create it or pass another --config"
            ) from None
        return {}
    except OSError as e:
        raise ConfigError(f"cannot read the configuration file {path}: {e.strerror}") from None
    if os.geteuid() == 0:
        problems = ownership.path_problems(path)
        if problems:
            raise ConfigError(
                f"the configuration file {path} configures what root runs, but non-root can"
                f" change it: {ownership.summary(problems)}; make it root's alone (chown root,"
                " chmod go-w; docs/security.md)"
            )
    try:
        text = data.decode("utf-8")
        quick = parse(text) if parse is not None else None
        if quick is not None:
            return quick
        import tomllib

        return tomllib.loads(text)
    except (ValueError, UnicodeDecodeError) as e:  # tomllib.TOMLDecodeError is a ValueError
        raise ConfigError(f"{path} is not valid TOML ({e}); fix it") from None


def hook_settings(config: dict[str, Any], path: Path) -> dict[str, str]:
    """The file's top-level settings the hook uses, as environment variables (``HOOK_KEYS``).
    A value that is not a string is refused naming the key and the file."""
    out: dict[str, str] = {}
    for key, env in HOOK_KEYS.items():
        if key not in config:
            continue
        value = config[key]
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{path}: {key} must be a non-empty string, not {value!r}")
        out[env] = value
    return out


_BARE_KEY = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


def _plain_top_level(text: str) -> dict[str, Any] | None:
    """The top-level keys of ``text`` when each line before the first table is blank, a
    comment or ``key = "string"`` without escapes (what ``vmlend hook install`` writes), else
    None. The hook reads such a file without importing ``tomllib`` (~8 ms, with datetime);
    keys are first found here and the CLI checks the whole file."""
    out: dict[str, Any] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            break
        key, eq, rest = line.partition("=")
        key, value = key.strip(), rest.strip()
        if not eq or not key or not set(key) <= _BARE_KEY or key in out:
            return None
        end = value.find('"', 1)
        if not value.startswith('"') or end < 0:
            return None
        inner, after = value[1:end], value[end + 1 :].strip()
        if (after and not after.startswith("#")) or "\\" in inner:
            return None
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in inner):
            return None
        out[key] = inner
    return out


def hook_environment(environ: dict[str, str] | os._Environ[str]) -> None:
    """Fill the hook's environment from the configuration file it pins (``$VMLEND_CONFIG``,
    else the one under ``$VMLEND_ROOT``): variables already set win."""
    path = config_path(environ=environ)
    config = read_config(path, parse=_plain_top_level)
    for name, value in hook_settings(config, path).items():
        environ.setdefault(name, value)


def render(settings: dict[str, str]) -> str:
    """A configuration file holding top-level ``settings`` (what ``vmlend hook install``
    writes when there is none)."""
    import json  # a JSON string is a valid TOML basic string for the text we write

    lines = [
        '# vmlend\'s configuration (docs/user-guide.md, "Configuration"): written by',
        "# 'vmlend hook install'; the CLI, the agent and the libvirt hook all read it.",
    ]
    lines += [f"{key} = {json.dumps(value, ensure_ascii=False)}" for key, value in settings.items()]
    return "\n".join(lines) + "\n"
