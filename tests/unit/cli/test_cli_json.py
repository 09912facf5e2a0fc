"""Every data or action command takes ``--json`` and every document carries its format version
(issue 26). The walk reads click's command tree with every command module loaded, so a new
command without ``--json`` fails here until it gets one or a reason in ``NO_JSON``."""

from __future__ import annotations

import json

import click
import pytest
from click.testing import CliRunner

import vmlend.cli
from vmlend.cli.common import JSON_FORMAT, emit_action, emit_json
from vmlend.cli.lazy import LazyGroup

#: The commands that print no JSON document, each with its reason. Keep it small.
NO_JSON: dict[tuple[str, ...], str] = {
    ("agent",): "a daemon: serves the hook socket in the foreground until stopped (log lines)",
    ("relay",): "without a subcommand, the interrupt relay daemon in the foreground",
    ("hook", "run"): "libvirt runs it as its qemu hook and reads only the exit status and stderr",
    ("mdev", "watch"): "follows uevents in the foreground until interrupted (log lines)",
    ("vm", "dumpxml"): "an XML emitter: the domain XML, as 'virsh dumpxml'",
    ("xml", "new"): "an XML emitter: a new domain XML on stdout or in -o FILE",
}


def _tree() -> LazyGroup:
    group = LazyGroup(
        vmlend.cli.main.name,
        callback=None,
        package="vmlend.cli",
        lazy=vmlend.cli.COMMANDS,
        params=[],
    )
    group.load_all()
    return group


def _commands(
    group: click.Group, path: tuple[str, ...] = ()
) -> dict[tuple[str, ...], click.Command]:
    """Every command a user can run: the leaves, and a group that runs without a subcommand."""
    found: dict[tuple[str, ...], click.Command] = {}
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None, name
        here = (*path, name)
        if isinstance(command, click.Group):
            if command.invoke_without_command:
                found[here] = command
            found |= _commands(command, here)
        else:
            found[here] = command
    return found


COMMANDS = _commands(_tree())


def _has_json(command: click.Command) -> bool:
    return any("--json" in getattr(p, "opts", ()) for p in command.params)


def test_every_data_or_action_command_has_json_and_the_allow_list_is_exact():
    without = {path for path, command in COMMANDS.items() if not _has_json(command)}
    assert without == set(NO_JSON), "a command without --json needs it, or a reason in NO_JSON"


def test_the_walk_found_the_commands_the_issue_names():
    named = ["fabric node-down", "fabric node-up", "fabric reclaim", "mdev create", "mdev remove",
             "nvme share", "nvme unshare", "nvme reserve", "nvme release", "vm define",
             "vm undefine", "vm start", "vm shutdown", "vm destroy", "vm domstate"]  # fmt: skip
    for words in named:
        assert _has_json(COMMANDS[tuple(words.split())]), words


@pytest.mark.parametrize("path", [p for p in sorted(COMMANDS) if p not in NO_JSON], ids=" ".join)
def test_help_exits_0_and_offers_json(path):
    r = CliRunner().invoke(vmlend.cli.main, [*path, "--help"], terminal_width=100)
    assert r.exit_code == 0, r.output
    assert "--json" in r.output


def test_a_document_is_an_object_with_the_format_first(capsys):
    emit_json({"devices": []})
    emit_action("started", vm="web", node="gamma")
    decoder = json.JSONDecoder()
    text = capsys.readouterr().out
    first, end = decoder.raw_decode(text)
    second, _ = decoder.raw_decode(text[end:].lstrip())
    assert list(first) == ["format", "devices"] and first["format"] == JSON_FORMAT == "vmlend/1"
    assert second == {"format": "vmlend/1", "action": "started", "vm": "web", "node": "gamma"}


def test_a_document_cannot_hide_the_version():
    with pytest.raises(ValueError, match="format"):
        emit_json({"format": "dot"})
