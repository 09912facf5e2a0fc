from click.testing import CliRunner

from vmlend.cli import main


def test_version_and_help():
    r = CliRunner().invoke(main, ["--version"])
    assert r.exit_code == 0 and "vmlend" in r.output
    r = CliRunner().invoke(main, ["--help"])
    assert r.exit_code == 0


def test_unknown_command_is_a_usage_error():
    r = CliRunner().invoke(main, ["no-such-command"])
    assert r.exit_code == 2
