"""docs/real-hardware.md's set-up of a host ("Setting up a host, step by step"), which two
tests run as written: on a fake host root (tests/scenarios/test_real_host_walkthrough.py) and,
with the Debian package, in a debootstrap root (tests/scenarios/test_debian_package.py)."""

from __future__ import annotations

import re

from tests.support.paths import REPO

DOC = REPO / "docs" / "real-hardware.md"
MARK = "<!-- real-host walkthrough:"


def walkthrough_lines() -> list[str]:
    """The lines of the code block after the page's mark."""
    text = DOC.read_text()
    block = re.search(r"```\n(.*?)```", text[text.index(MARK) :], re.S)
    assert block, "the walkthrough's code block is missing"
    return block.group(1).splitlines()


def walkthrough_commands() -> list[str]:
    """The walkthrough's shell commands, comments dropped, a here-document joined to the
    command that opens it."""
    lines = walkthrough_lines()
    commands: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if "<<'EOF'" in line:
            end = lines.index("EOF", i)
            line = "\n".join([line, *lines[i : end + 1]])
            i = end + 1
        commands.append(line)
    return commands
