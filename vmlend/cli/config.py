"""The configuration file (``vmlend.config``) as click's ``default_map``.

Every key is checked against the command it configures before any command runs: an unknown
key, a table for no command, or a value the option would refuse stops ``vmlend`` with one line
naming the key and the file. Keys are long option names without their dashes (``hook-socket``;
``hook_socket`` is read the same); tables nest like the commands (``[hook.install]``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from vmlend.config import config_path, read_config
from vmlend.errors import ConfigError

#: Options that say where the configuration is or what vmlend is: never in the file.
NOT_CONFIGURABLE = frozenset({"root", "config", "help", "version"})
#: Top-level keys that are no global option but options of several commands (each command's
#: table may still set its own): the agent serves the hook on ``hook-socket``, ``hook
#: install`` pins it and the hook reads it.
SHARED = {"hook-socket": (("agent",), ("hook", "install"))}
#: Global options that take a value (what ``scan_globals`` must step over).
_VALUED = ("--state", "--registry", "--node", "--root", "-c", "--connect", "--backend", "--config")


def scan_globals(args: Sequence[str]) -> dict[str, str]:
    """``--root`` and ``--config`` from the global options in ``args`` (before the command
    name), read before click parses: they say where the file is whose values click then uses."""
    found: dict[str, str] = {}
    it = iter(args)
    for arg in it:
        if arg == "--":
            break
        name, eq, value = arg.partition("=")
        if name in _VALUED:
            if not eq:
                value = next(it, "")
            if name in ("--root", "--config"):
                found[name[2:]] = value
            continue
        if not arg.startswith("-"):
            break  # the command: its options are its own
    return found


def _options(command: click.Command) -> dict[str, click.Option]:
    by_key: dict[str, click.Option] = {}
    for param in command.params:
        if not isinstance(param, click.Option) or param.name is None:
            continue
        longs = [o[2:] for o in param.opts if o.startswith("--")]
        for key in [*longs, param.name]:
            by_key.setdefault(key.replace("_", "-"), param)
    return by_key


def to_default_map(
    command: click.Command, table: dict[str, Any], path: Path, prefix: str = ""
) -> dict[str, Any]:
    """``table`` (one level of the file) as ``command``'s default_map, every key and value
    checked."""
    ctx = click.Context(command, info_name=command.name, resilient_parsing=True)
    options = _options(command)
    out: dict[str, Any] = {}
    for key, value in table.items():
        where = f"{prefix}{key}"
        if isinstance(value, dict):
            sub = command.get_command(ctx, key) if isinstance(command, click.Group) else None
            if sub is None:
                raise ConfigError(
                    f"{path}: [{where}] names no vmlend command; remove it or fix its name"
                    " (tables are commands: [agent], [hook.install])"
                )
            out[key] = to_default_map(sub, value, path, f"{where}.")
            continue
        option = options.get(key.replace("_", "-"))
        if option is None or option.name in NOT_CONFIGURABLE:
            words = prefix.rstrip(".").replace(".", " ")
            name = f"'vmlend {words}'" if prefix else "vmlend's global options"
            raise ConfigError(
                f"{path}: {where} is not an option of {name}; remove it or fix its name"
                " (keys are long option names, see --help)"
            )
        try:
            option.type_cast_value(ctx, value)
        except click.BadParameter as e:
            raise ConfigError(f"{path}: {where} = {value!r} is refused: {e.message}") from None
        assert option.name is not None
        out[option.name] = value
    return out


def load_default_map(command: click.Command, args: Sequence[str]) -> dict[str, Any] | None:
    """The default_map of the root command for ``args``: the configuration file's values
    (None when there is no file). A file named by ``--config`` must exist."""
    given = scan_globals(args)
    path = config_path(given.get("config"), root=given.get("root"))
    table = read_config(path, required="config" in given)
    if not table:
        return None
    shared = {key: table.pop(key) for key in list(table) if key.replace("_", "-") in SHARED}
    out = to_default_map(command, table, path)
    for key, value in shared.items():
        for names in SHARED[key.replace("_", "-")]:
            sub, level = command, out
            for name in names:
                ctx = click.Context(sub, info_name=sub.name, resilient_parsing=True)
                found = sub.get_command(ctx, name) if isinstance(sub, click.Group) else None
                if found is None:
                    break  # a command this build does not have
                sub = found
                level = level.setdefault(name, {})
            else:
                checked = to_default_map(sub, {key: value}, path)
                for name, v in checked.items():
                    level.setdefault(name, v)
    return out
