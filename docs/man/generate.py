"""Writes vmlend's man pages, one per command, from the click commands themselves
(``make man``; click-man renders them). ``tests/unit/cli/test_manpages.py`` fails when the
pages in ``docs/man`` no longer match the commands."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from click_man.core import write_man_pages

from vmlend import __version__
from vmlend.cli import main


def generate(target: Path) -> list[Path]:
    """Every page under ``target`` (created), sorted."""
    target.mkdir(parents=True, exist_ok=True)
    main.load_all()  # the top group loads its command modules lazily
    _sort(main)  # click-man lists subcommands in load order, which varies: by name instead
    # No date: the pages change only when the commands do.
    write_man_pages("vmlend", main, version=__version__, target_dir=str(target), date="")
    return sorted(target.glob("*.1"))


def _sort(group: click.Group) -> None:
    group.commands = dict(sorted(group.commands.items()))
    for command in group.commands.values():
        if isinstance(command, click.Group):
            _sort(command)


if __name__ == "__main__":
    for page in generate(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)):
        print(page)
