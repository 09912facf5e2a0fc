"""The configuration file (``vmlend.config``) as click's ``default_map``.

Every key is checked against the command it configures before any command runs: an unknown
key, a table for no command, a value of another TOML type than the option takes (``state = 5``,
``registry = ["a"]``), or a value the option would refuse stops ``vmlend`` with one line naming
the key and the file. Keys are long option names without their dashes (``hook-socket``;
``hook_socket`` is read the same); tables nest like the commands (``[hook.install]``). Path
options are paths on the host under ``--root`` (``vmlend.config.under_root``); the top-level
settings the hook reads too go through the hook's own check (``vmlend.config.hook_settings``),
so the CLI and the hook take the same values from one file.

One table is no command: ``[alias]`` names vendor/product pairs that ``--device`` and the
device arguments of ``attach`` and ``nvme reserve`` take (``vmlend.topology.selectors``); it
is checked here too and handed to the command beside the default_map.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from vmlend.config import (
    HOOK_KEYS,
    config_file,
    hook_settings,
    host_root,
    read_config,
    spellings_of,
    under_root,
)
from vmlend.errors import ConfigError

if TYPE_CHECKING:
    from vmlend.topology.selectors import Alias

#: Options that say where the configuration is or what vmlend is: never in the file.
NOT_CONFIGURABLE = frozenset({"root", "config", "help", "version"})
#: Top-level keys that are no global option but options of several commands (each command's
#: table may still set its own): the agent serves the hook on ``hook-socket``, ``hook
#: install`` pins it and the hook reads it.
SHARED = {"hook-socket": (("agent",), ("hook", "install"))}
#: The table of device aliases (Nova's ``[pci] alias``): names, not a command's options.
ALIAS_TABLE = "alias"
#: Global options that take a value (what ``scan_globals`` must step over).
_VALUED = ("--state", "--registry", "--node", "--root", "-c", "--connect", "--backend", "--config")


def scan_globals(args: Sequence[str]) -> dict[str, str]:
    """``--root`` and ``--config`` from the global options in ``args`` (before the command
    name), read before click parses: they say where the file is whose values click then uses;
    ``command``: the command's first two words (``hook install``)."""
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
            found["command"] = " ".join([arg, *[a for a in [next(it, "")] if a]])
            break  # the command: its options are its own
    return found


#: The command that creates the configuration file it is named (``--config NEWFILE``).
CREATES_CONFIG = "hook install"


def _options(command: click.Command) -> dict[str, click.Option]:
    by_key: dict[str, click.Option] = {}
    for param in command.params:
        if not isinstance(param, click.Option) or param.name is None:
            continue
        longs = [o[2:] for o in param.opts if o.startswith("--")]
        for key in [*longs, param.name]:
            by_key.setdefault(key.replace("_", "-"), param)
    return by_key


def _toml_type(option: click.Option) -> tuple[tuple[type, ...], str]:
    """The TOML value types ``option`` takes from the file, and how to say so."""
    kind = option.type
    if option.count or isinstance(kind, click.types.IntParamType):
        return (int,), "an integer"
    if isinstance(kind, click.types.FloatParamType):
        return (int, float), "a number"
    if option.is_bool_flag or isinstance(kind, click.types.BoolParamType):
        return (bool,), "true or false"
    return (str,), "a string"


def _check_type(option: click.Option, value: Any, where: str, path: Path) -> None:
    """``ConfigError`` unless ``value`` is of the TOML type ``option`` takes (a list of them
    for a repeatable option): click would turn ``["a"]`` into the string ``"['a']"`` and fail
    on ``5`` where it wants a path."""
    types, said = _toml_type(option)
    items: list[Any] | None = [value]
    if option.multiple:
        said = f"a list of values, each {said}"
        items = value if isinstance(value, list) else None
    # bool is an int to Python, not to TOML
    if items is None or not all(
        isinstance(v, types) and (bool in types or not isinstance(v, bool)) for v in items
    ):
        raise ConfigError(f"{path}: {where} = {value!r} must be {said}")


def _under_root(option: click.Option, value: Any, where: str, path: Path, root: str) -> Any:
    """A path option's value (or values) taken under the host root; it must be absolute."""
    if not isinstance(option.type, click.Path):
        return value
    values = value if isinstance(value, list) else [value]
    for v in values:
        if not v.startswith("/"):
            raise ConfigError(
                f"{path}: {where} = {v!r} must be an absolute path (the file's paths are taken"
                " under the host root)"
            )
    moved = [under_root(v, root) for v in values]
    return moved if isinstance(value, list) else moved[0]


def to_default_map(
    command: click.Command,
    table: dict[str, Any],
    path: Path,
    prefix: str = "",
    root: str = "/",
) -> dict[str, Any]:
    """``table`` (one level of the file) as ``command``'s default_map, every key and value
    checked; path options taken under ``root``."""
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
            out[key] = to_default_map(sub, value, path, f"{where}.", root)
            continue
        option = options.get(key.replace("_", "-"))
        if option is None or option.name in NOT_CONFIGURABLE:
            words = prefix.rstrip(".").replace(".", " ")
            name = f"'vmlend {words}'" if prefix else "vmlend's global options"
            raise ConfigError(
                f"{path}: {where} is not an option of {name}; remove it or fix its name"
                " (keys are long option names, see --help)"
            )
        _check_type(option, value, where, path)
        if not (prefix == "" and key.replace("_", "-") in HOOK_KEYS):  # resolved already
            value = _under_root(option, value, where, path, root)
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
    return load_config(command, args)[0]


def load_config(
    command: click.Command, args: Sequence[str]
) -> tuple[dict[str, Any] | None, dict[str, Alias]]:
    """``load_default_map``'s default_map, and the file's ``[alias]`` table parsed (empty
    when there is none): both checked before any command runs."""
    given = scan_globals(args)
    name, named = config_file(given.get("config"), root=given.get("root"))
    path = Path(name)
    table = read_config(path, required=named and given.get("command") != CREATES_CONFIG)
    if not table:
        return None, {}
    root = host_root(given.get("root"))
    # The settings the hook reads as well: its own check, so both see the same values.
    resolved = hook_settings(table, path, root)
    for key, env in HOOK_KEYS.items():
        for spelling in spellings_of(key):
            if spelling in table:
                table[spelling] = resolved[env]
    aliases = _aliases(table.pop(ALIAS_TABLE, None), path)
    shared = {key: table.pop(key) for key in list(table) if key.replace("_", "-") in SHARED}
    out = to_default_map(command, table, path, root=root)
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
                checked = to_default_map(sub, {key: value}, path, root=root)
                for name, v in checked.items():
                    level.setdefault(name, v)
    return out, aliases


def _aliases(table: object, path: Path) -> dict[str, Alias]:
    if table is None:
        return {}
    from vmlend.topology.selectors import parse_aliases  # only a file with aliases pays it

    return parse_aliases(table, str(path))
