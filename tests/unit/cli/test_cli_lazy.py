"""`vmlend` imports a command's module only when that command runs, lists every command
without importing any, and the table it lists from stays equal to what the modules define."""

from __future__ import annotations

import click
from click.testing import CliRunner

import vmlend.cli
from tests.support.modtrace import run_cli
from vmlend.cli.lazy import LazyGroup

HEAVY = ("lxml", "libvirt", "vmlend.irq", "vmlend.hypervisor", "vmlend.domain")


def fresh_group(lazy: dict[str, tuple[str, str]]) -> LazyGroup:
    """A group over vmlend's command modules with its own (empty) cache."""
    return LazyGroup(
        vmlend.cli.main.name, callback=None, package="vmlend.cli", lazy=lazy, params=[]
    )


def help_text(group: click.Group) -> str:
    result = CliRunner().invoke(group, ["--help"], terminal_width=100)
    assert result.exit_code == 0, result.output
    return result.output


def test_help_lists_every_command_and_imports_no_command_module():
    run = run_cli(["--help"])
    assert run.code == 0
    for name in vmlend.cli.COMMANDS:
        assert f"  {name} " in run.stdout.decode()
    assert {m for m in run.modules if m.startswith("vmlend.cli.cmd_")} == set()
    ledger = ("vmlend.fabric", "vmlend.sim", "vmlend.kernel", "vmlend.registry")
    assert run.within(*HEAVY, *ledger) == set()
    assert run.within("dataclasses", "msgspec") == set()  # no record is made to list commands


def test_devices_imports_its_module_and_the_fabric_only(state_path):
    from tests.support.simfabric import make_fabric

    make_fabric(state_path)
    run = run_cli(["devices"], {"VMLEND_STATE": str(state_path)})
    assert run.code == 0 and "0x10" in run.stdout.decode()
    assert {m for m in run.modules if m.startswith("vmlend.cli.cmd_")} == {"vmlend.cli.cmd_devices"}
    assert run.within(*HEAVY) == set()
    assert "dataclasses" not in run.modules  # vmlend's records are msgspec Structs
    # Listing reads state: no guest-memory layout rules or planner, no NVMe share code.
    assert run.within("vmlend.memory", "vmlend.nvme") == set()
    # The registry holds the compiled topology: no TOML parser, no topology validation.
    assert run.within("tomllib", "vmlend.topology.parse") == set()


def test_table_matches_the_commands_the_modules_define():
    group = fresh_group(vmlend.cli.COMMANDS)
    assert set(group.command_modules()) == {m for m, _ in vmlend.cli.COMMANDS.values()}
    group.load_all()
    assert set(group.commands) == set(vmlend.cli.COMMANDS)
    for name, (module, summary) in vmlend.cli.COMMANDS.items():
        command = group.commands[name]
        assert command.callback is None or command.callback.__module__.endswith(module), name
        first_paragraph = " ".join((command.help or "").partition("\n\n")[0].split())
        assert first_paragraph.startswith(summary), name


def test_help_from_the_table_equals_help_from_the_loaded_commands():
    lazy = fresh_group(vmlend.cli.COMMANDS)
    listed = help_text(lazy)
    assert lazy.commands == {}  # nothing was imported to list them
    lazy.load_all()
    assert help_text(lazy) == listed


def test_a_module_missing_from_the_table_still_provides_its_commands():
    partial = {k: v for k, v in vmlend.cli.COMMANDS.items() if v[0] != "cmd_devices"}
    group = fresh_group(partial)
    assert "devices" in group.list_commands(click.Context(group))
    assert group.get_command(click.Context(group), "devices") is not None


def test_unknown_command_is_a_usage_error():
    result = CliRunner().invoke(vmlend.cli.main, ["no-such-command"])
    assert result.exit_code == 2 and "No such command" in result.output
