"""Which modules a new Python process imported: the tests that keep the hook and the CLI
lean run the real thing in a subprocess and read ``sys.modules`` at its exit (nothing timed)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

_MARK = "MODULES-AT-EXIT"
# Runs a script file or the vmlend CLI under the interpreter flags given, and prints the
# loaded modules at exit (atexit also runs on sys.exit).
# The installed hook ends with os._exit (no atexit): that exit reports too. A script runs
# by exec, as the interpreter runs it (runpy would import typing, re and enum of its own).
_WRAPPER = (
    "import atexit, os, sys\n"
    f"report = lambda: print({_MARK!r}, *sorted(sys.modules), file=sys.stderr, flush=True)\n"
    "atexit.register(report)\n"
    "_exit = os._exit\n"
    "os._exit = lambda code: (report(), _exit(code))\n"
    "target = sys.argv.pop(1)\n"
    "if target == '-vmlend':\n"
    "    from vmlend.cli import main\n"
    "    main()\n"
    "else:\n"
    "    sys.argv[0] = target\n"
    "    with open(target, 'rb') as f:\n"
    "        code = compile(f.read(), target, 'exec')\n"
    "    exec(code, {'__name__': '__main__', '__file__': target})\n"
)


@dataclass(frozen=True)
class Traced:
    code: int
    stdout: bytes
    stderr: list[str]  # without the module list
    modules: frozenset[str]

    def within(self, *packages: str) -> set[str]:
        """The imported modules that are one of ``packages`` or inside one."""
        return {m for m in self.modules if any(m == p or m.startswith(p + ".") for p in packages)}


def _run(argv: list[str], stdin: bytes, env: dict[str, str] | None) -> Traced:
    out = subprocess.run(
        argv, input=stdin, capture_output=True, env=dict(os.environ) | (env or {}), timeout=60
    )
    lines = out.stderr.decode().splitlines()
    marks = [line for line in lines if line.startswith(_MARK)]
    assert len(marks) == 1, out.stderr
    rest = [line for line in lines if not line.startswith(_MARK)]
    return Traced(out.returncode, out.stdout, rest, frozenset(marks[0].split()[1:]))


def run_script(
    script: Path,
    args: list[str],
    stdin: bytes = b"",
    env: dict[str, str] | None = None,
    flags: list[str] | None = None,
) -> Traced:
    """``python FLAGS SCRIPT ARGS`` (flags: e.g. the script's own shebang flags)."""
    return _run([sys.executable, *(flags or []), "-c", _WRAPPER, str(script), *args], stdin, env)


def run_cli(args: list[str], env: dict[str, str] | None = None) -> Traced:
    """``vmlend ARGS``."""
    return _run([sys.executable, "-c", _WRAPPER, "-vmlend", *args], b"", env)
