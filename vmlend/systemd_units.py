"""The systemd units vmlend ships (``vmlend/data/systemd``): the agent (Type=notify, with a
watchdog), the interrupt relay and the mdev-parent follower. Installing one renders its
``ExecStart`` with the absolute command of this installation and writes it only when it
differs, so installing again changes nothing."""

from __future__ import annotations

import shlex
import sys
from importlib import resources
from pathlib import Path

import msgspec

from vmlend.safefile import write_atomically

#: Where ``ExecStart`` names vmlend in a shipped unit.
PLACEHOLDER = "@VMLEND@"
DEFAULT_DIR = Path("/etc/systemd/system")


class InstalledUnit(msgspec.Struct, frozen=True):
    name: str
    path: str
    action: str  # "installed", "updated" or "unchanged"


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


def install(directory: Path, command: list[str] | None = None) -> list[InstalledUnit]:
    """Every shipped unit rendered into ``directory`` (created if needed)."""
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
    return done
