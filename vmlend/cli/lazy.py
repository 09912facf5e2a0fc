"""A click group that imports a command's module only when that command runs.

``vmlend --help`` lists every command from a table of names and one-line summaries, and
``vmlend devices`` imports the devices module and nothing of attach, migrate or the relay. A
``cmd_*`` module the table does not name (say, added on another branch) is still found and
loaded eagerly: a missing table entry costs speed, never a command.
``tests/unit/cli/test_cli_lazy.py`` keeps the table equal to what the modules define.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping
from typing import Any

import click

from vmlend.cli.common import VmlendGroup

#: The prefix of the modules that hold commands (each exposes ``COMMANDS``).
COMMAND_MODULE_PREFIX = "cmd_"


class LazyGroup(VmlendGroup):
    """``lazy``: command name -> (module in ``package``, the first sentence of its help)."""

    def __init__(
        self, *args: Any, package: str, lazy: Mapping[str, tuple[str, str]], **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.package = package
        self.lazy = dict(lazy)
        self._loaded: set[str] = set()
        self._scanned = False

    def load_module(self, module: str) -> None:
        if module in self._loaded:
            return
        self._loaded.add(module)
        loaded = importlib.import_module(f"{self.package}.{module}")
        for command in getattr(loaded, "COMMANDS", ()):
            self.add_command(command)

    def command_modules(self) -> list[str]:
        """Every ``cmd_*`` module of the package, found on disk."""
        found: set[str] = set()
        for directory in sys.modules[self.package].__path__:
            for entry in os.listdir(directory):
                stem, dot, ext = entry.partition(".")
                if stem.startswith(COMMAND_MODULE_PREFIX) and dot and ext == "py":
                    found.add(stem)
        return sorted(found)

    def _load_unlisted(self) -> None:
        if self._scanned:
            return
        self._scanned = True
        listed = {module for module, _summary in self.lazy.values()}
        for module in self.command_modules():
            if module not in listed:
                self.load_module(module)

    def load_all(self) -> None:
        self._load_unlisted()
        for module, _summary in self.lazy.values():
            self.load_module(module)

    def list_commands(self, ctx: click.Context) -> list[str]:
        self._load_unlisted()
        return sorted(set(self.commands) | set(self.lazy))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands:
            if cmd_name in self.lazy:
                self.load_module(self.lazy[cmd_name][0])
            else:
                self._load_unlisted()
        return self.commands.get(cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The command list, from the table for commands not loaded yet."""
        names = self.list_commands(ctx)
        if not names:
            return
        limit = formatter.width - 6 - max(len(n) for n in names)
        rows = []
        for name in names:
            command = self.commands.get(name) or click.Command(name, help=self.lazy[name][1])
            if not command.hidden:
                rows.append((name, command.get_short_help_str(limit)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)
