"""The man pages in docs/man are the commands' own help, rendered (``make man``): one page per
command and group, and none that a command no longer has."""

from __future__ import annotations

import importlib.util
import re

import pytest

from tests.support.paths import REPO
from vmlend.cli import main

MAN = REPO / "docs" / "man"
# click-man calls a click helper that click deprecates (its own concern, not the pages').
pytestmark = pytest.mark.filterwarnings("ignore:.*make_default_short_help:DeprecationWarning")


def _generate(target):
    spec = importlib.util.spec_from_file_location("generate_man", MAN / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.generate(target)


def _body(text: str) -> str:
    return re.sub(r'^(\.TH "[^"]*" "1") "[^"]*"', r"\1", text, count=1)  # the date aside


def test_the_pages_match_the_commands(tmp_path):
    fresh = {p.name: _body(p.read_text()) for p in _generate(tmp_path)}
    kept = {p.name: _body(p.read_text()) for p in MAN.glob("*.1")}
    assert sorted(fresh) == sorted(kept), "run 'make man'"
    stale = [name for name in fresh if fresh[name] != kept[name]]
    assert stale == [], f"run 'make man': {stale}"


def test_every_command_has_a_page(tmp_path):
    main.load_all()
    names = {p.name for p in _generate(tmp_path)}
    for name, command in main.commands.items():
        assert f"vmlend-{name}.1" in names
        for sub in getattr(command, "commands", {}):
            assert f"vmlend-{name}-{sub}.1" in names
