"""Every command the docs quote runs as written: each fenced block of README.md and docs/*.md
whose ``vmlend`` lines are concrete (no placeholders such as NAME or [--opt]) runs line by line
on a fresh simulated cluster, in a scratch directory, and every line must succeed. A block that
cannot run here says why just above it, in ``<!-- not run: REASON -->``."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.support.paths import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)
_NOT_RUN = re.compile(
    r"<!-- (?:not run: |real-host walkthrough: )(?P<why>[^>]{10,}) -->\s*\Z"
)  # a real host's walkthrough runs in its own test, on a fake host root
#: A word a reader replaces (NAME, FDID, DIR, URI...), an optional part, or an ellipsis.
_PLACEHOLDER = re.compile(r"\b[A-Z][A-Z_]{1,}\b|\[|\.\.\.")


def _commands(block: str) -> list[str]:
    out = []
    for line in block.splitlines():
        line = line.removeprefix("$ ")
        if line.startswith("vmlend "):
            out.append(line.split(" #")[0].strip())
    return out


def walkthroughs() -> list[tuple[str, list[str] | str]]:
    """(doc:line, its commands) per concrete block; the reason instead for a block not run."""
    found: list[tuple[str, list[str] | str]] = []
    for doc in DOCS:
        text = doc.read_text()
        for m in _FENCE.finditer(text):
            commands = _commands(m.group(1))
            if not commands or any(_PLACEHOLDER.search(c) for c in commands):
                continue
            where = f"{doc.relative_to(REPO)}:{text[: m.start()].count(chr(10)) + 1}"
            skip = _NOT_RUN.search(text[: m.start()])
            found.append((where, skip["why"] if skip else commands))
    return found


BLOCKS = walkthroughs()
RUN = [(w, c) for w, c in BLOCKS if isinstance(c, list)]


def test_the_docs_have_walkthroughs_to_run_and_say_why_others_do_not():
    assert len(RUN) >= 8, RUN  # the README's tour and the user guide's examples at least
    not_run = {w: c for w, c in BLOCKS if isinstance(c, str)}
    assert len(not_run) <= len(RUN) // 2, not_run  # the exception, each with its reason


def _runs_the_demo(commands: list[str]) -> bool:
    return any("demo" in shlex.split(line) for line in commands)


#: A block that runs ``vmlend demo`` is slow, as tests/scenarios/test_demo.py is: each run
#: starts the real hook as a subprocess 15 times (about 2 s a run).
WALKS = [
    pytest.param(c, id=w, marks=pytest.mark.slow) if _runs_the_demo(c) else pytest.param(c, id=w)
    for w, c in RUN
]


@pytest.mark.parametrize("commands", WALKS)
def test_a_walkthrough_runs_as_written(cluster, tmp_path, monkeypatch, commands):
    monkeypatch.chdir(tmp_path)
    for line in commands:
        r = cluster.cli(*shlex.split(line)[1:])
        assert r.exit_code == 0, (line, r.output)
    assert Path.cwd() == tmp_path
