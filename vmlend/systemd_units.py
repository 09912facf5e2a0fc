"""The systemd units vmlend ships (``vmlend/data/systemd``): the agent (Type=notify, with a
watchdog), the interrupt relay and the mdev-parent follower. Installing one renders its
``ExecStart`` with the absolute command of this installation and writes it only when it
differs, so installing again changes nothing. systemd runs them as root, so what their
``ExecStart`` runs is held to the installed hook's rule (``vmlend.ownership``): installing
around a script non-root can change is refused unless forced. Uninstalling removes only the
units that say vmlend installed them."""

from __future__ import annotations

import shlex
import sys
from importlib import resources
from pathlib import Path

import msgspec

from vmlend.errors import ConfigError
from vmlend.ownership import path_problems, summary
from vmlend.safefile import write_atomically

#: Where ``ExecStart`` names vmlend in a shipped unit.
PLACEHOLDER = "@VMLEND@"
DEFAULT_DIR = Path("/etc/systemd/system")
#: Every shipped unit's header names the command that installs it: what ``uninstall`` trusts.
MARK = "'vmlend units install'"


class InstalledUnit(msgspec.Struct, frozen=True):
    name: str
    path: str
    action: str  # "installed", "updated", "unchanged"; uninstall: "removed", "absent", "kept"


def unit_names() -> list[str]:
    return sorted(
        p.name
        for p in resources.files("vmlend.data").joinpath("systemd").iterdir()
        if p.name.endswith(".service")
    )


def vmlend_command() -> list[str]:
    """How a unit runs this vmlend: the ``vmlend`` script beside this interpreter (a venv's or
    the system's), else the interpreter running the CLI module."""
    script = Path(sys.executable).parent / "vmlend"
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "import vmlend.cli; vmlend.cli.run()"]


def render(name: str, command: list[str] | None = None) -> str:
    text = resources.files("vmlend.data").joinpath("systemd", name).read_text()
    return text.replace(PLACEHOLDER, shlex.join(command or vmlend_command()))


def command_problems(command: list[str]) -> list[str]:
    """What non-root could change of what ``command`` runs as root: the program (the
    ``vmlend`` script or the interpreter) and, for this installation's own command, the
    interpreter and the code it imports (as the installed hook's check)."""
    problems = path_problems(command[0])
    if command == vmlend_command():
        from vmlend.hook import trust
        from vmlend.hook.install import import_roots

        for found in (path_problems(sys.executable), *map(trust.tree_problems, import_roots())):
            problems += [p for p in found if p not in problems]
    return problems


def install(
    directory: Path, command: list[str] | None = None, *, force: bool = False
) -> tuple[list[InstalledUnit], list[str]]:
    """Every shipped unit rendered into ``directory`` (created if needed), and what non-root
    could change of what they run (``ConfigError`` for any, nothing written, unless
    ``force``)."""
    command = command or vmlend_command()
    problems = command_problems(command)
    if problems and not force:
        raise ConfigError(
            f"the units would run {command[0]} as root from {len(problems)} path(s) non-root"
            f" can change: {summary(problems)}; make them owned by root and not group- or"
            " other-writable (docs/security.md), or pass --force to install anyway"
        )
    directory.mkdir(parents=True, exist_ok=True)
    done = []
    for name in unit_names():
        path = directory / name
        text = render(name, command)
        old = path.read_text() if path.is_file() else None
        if old == text:
            action = "unchanged"
        else:
            write_atomically(path, text.encode(), mode=0o644)
            action = "installed" if old is None else "updated"
        done.append(InstalledUnit(name, str(path), action))
    return done, problems


def uninstall(directory: Path, *, force: bool = False) -> list[InstalledUnit]:
    """Remove the shipped units from ``directory``: "removed", "absent", or "kept" for a file
    of that name vmlend did not install (no ``MARK``; removed too with ``force``)."""
    done = []
    for name in unit_names():
        path = directory / name
        try:
            text = path.read_text(errors="replace") if not path.is_symlink() else ""
        except FileNotFoundError:
            done.append(InstalledUnit(name, str(path), "absent"))
            continue
        except OSError as e:  # a directory, no permission: say so, remove nothing more
            why = e.strerror or e
            raise ConfigError(f"cannot read {path}: {why}; nothing more removed") from None
        if MARK not in text and not force:
            done.append(InstalledUnit(name, str(path), "kept"))  # a masked unit too (a link)
            continue
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot remove {path}: {e.strerror or e}") from None
        done.append(InstalledUnit(name, str(path), "removed"))
    return done
