"""``vmlend.config``: the one reader of the configuration file. It checks what the file is
before reading a byte (a FIFO, a device, a file over the size bound are refused), parses it
with the one parser the CLI and the hook share, refuses what ``tomllib`` cannot follow, and
takes the file's paths under the host root."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from vmlend.cli import main
from vmlend.cli.config import load_default_map
from vmlend.config import (
    MAX_CONFIG_BYTES,
    hook_environment,
    over_root,
    read_config,
    registry_paths,
    under_root,
)
from vmlend.errors import ConfigError
from vmlend.hook.prefilter import NAMESPACE_FAMILY

VMLEND = os.path.join(os.path.dirname(sys.executable), "vmlend")


@pytest.fixture
def config():
    """The test's own configuration file ($VMLEND_CONFIG, tests/conftest.py)."""
    return Path(os.environ["VMLEND_CONFIG"])


def one_line_error(args: list[str]) -> str:
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 1, r.output
    assert r.output.count("\n") == 1 and r.output.startswith("Error: "), r.output
    return r.output


def test_a_fifo_is_refused_without_waiting_for_a_writer(config):
    config.unlink()
    os.mkfifo(config)
    with pytest.raises(ConfigError, match=f"{config} is a FIFO, not a regular file"):
        read_config(config)
    # The CLI and the hook as processes: on a blocking read they would never return (the
    # timeout only ends a hung run; it is not what is tested).
    hook = [sys.executable, "-m", "vmlend.hook", "vm", "prepare", "begin", "-"]
    for argv in ([VMLEND, "hook", "log"], hook):
        run = subprocess.run(
            argv,
            input=b"<domain xmlns:vmlend='" + NAMESPACE_FAMILY + b"1'/>",
            capture_output=True,
            timeout=120,
        )
        assert run.returncode == 1, run
        assert b"is a FIFO, not a regular file" in run.stderr, run.stderr
        assert run.stderr.count(b"\n") == 1, run.stderr


def test_a_file_over_the_size_bound_is_refused(config):
    config.write_bytes(b"# " + b"x" * MAX_CONFIG_BYTES + b"\n")
    with pytest.raises(ConfigError, match=f"{config} is larger than {MAX_CONFIG_BYTES} bytes"):
        read_config(config)


def test_a_value_nested_thousands_deep_is_one_line(config):
    config.write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="nests arrays or inline tables deeper"):
        read_config(config)
    out = one_line_error(["hook", "log"])
    assert f"{config} nests arrays or inline tables deeper than vmlend reads" in out


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\u0085", "\x1c", "\x1d", "\x1e"])
def test_the_hook_and_the_cli_see_the_same_keys(config, separator, monkeypatch):
    # A comment runs to the end of its line, and only \n ends a TOML line: the state after the
    # separator is part of the comment for tomllib; str.splitlines() would start a line there.
    config.write_text(f'node = "alpha"\n# a comment{separator}state = "/elsewhere.db"\n')
    monkeypatch.delenv("VMLEND_STATE")
    for name in ("VMLEND_NODE", "VMLEND_REGISTRY", "VMLEND_ROOT"):
        monkeypatch.delenv(name, raising=False)
    env = {"VMLEND_CONFIG": str(config)}
    try:
        hook_environment(env)
    except ConfigError as e:  # tomllib refuses a control character in a comment
        with pytest.raises(ConfigError) as cli:
            load_default_map(main, [])
        assert str(cli.value) == str(e)
        return
    defaults = load_default_map(main, []) or {}
    assert "VMLEND_STATE" not in env and "state_path" not in defaults
    assert env["VMLEND_NODE"] == defaults["node"] == "alpha"


def test_a_missing_file_named_by_the_environment_is_refused(tmp_path, monkeypatch):
    missing = tmp_path / "nope.toml"
    monkeypatch.setenv("VMLEND_CONFIG", str(missing))
    out = one_line_error(["hook", "log"])
    assert out == (
        f"Error: the configuration file {missing} does not exist; create it, or name another"
        " with --config or $VMLEND_CONFIG\n"
    )
    with pytest.raises(ConfigError, match=f"{missing} does not exist"):
        hook_environment({"VMLEND_CONFIG": str(missing)})


def test_absolute_paths_in_the_file_are_taken_under_the_root(tmp_path, monkeypatch):
    # docs/real-hardware.md's file on a fake root: every path names a file under the root.
    root = tmp_path / "root"
    (root / "etc" / "vmlend").mkdir(parents=True)
    config = root / "etc" / "vmlend" / "vmlend.toml"
    config.write_text(
        'state = "/var/lib/vmlend/state.db"\nhook-socket = "/run/vmlend/../vmlend/h.sock"\n'
        'registry = "sqlite:///var/lib/vmlend/other.db"\n\n'
        '[hook.install]\nlibvirt-dir = "/etc/libvirt"\n'
    )
    for name in ("VMLEND_CONFIG", "VMLEND_STATE"):
        monkeypatch.delenv(name)
    env = {"VMLEND_ROOT": str(root)}
    hook_environment(env)
    assert env["VMLEND_STATE"] == str(root / "var" / "lib" / "vmlend" / "state.db")
    assert env["VMLEND_HOOK_SOCKET"] == str(root / "run" / "vmlend" / "h.sock")
    assert env["VMLEND_REGISTRY"] == f"sqlite://{root}/var/lib/vmlend/other.db"
    defaults = load_default_map(main, ["--root", str(root), "fabric", "init"])
    assert defaults is not None
    assert defaults["state_path"] == env["VMLEND_STATE"]
    assert defaults["registry"] == env["VMLEND_REGISTRY"]
    assert defaults["hook"]["install"]["libvirt_dir"] == str(root / "etc" / "libvirt")


def test_a_relative_path_in_the_file_is_refused(config, monkeypatch):
    config.write_text('state = "state.db"\n')
    with pytest.raises(ConfigError, match=re.escape("state = 'state.db' must be an absolute path")):
        hook_environment({"VMLEND_CONFIG": str(config)})
    assert "must be an absolute path" in one_line_error(["hook", "log"])


def test_paths_go_under_the_root_and_back():
    assert under_root("/var/x", "/srv/h") == "/srv/h/var/x"
    assert under_root("/../../etc/x", "/srv/h") == "/srv/h/etc/x"  # cannot climb out
    assert under_root("/var//x/", "/") == "/var/x"
    assert over_root("/srv/h/var/x", "/srv/h", "the state") == "/var/x"
    with pytest.raises(ConfigError, match="the state /srv/x is outside the host root /srv/h"):
        over_root("/srv/x", "/srv/h", "the state")
    url = "etcds://h:1/c?cacert=/ca.pem&cert=/c.pem&key=/k.pem"
    assert registry_paths(url, lambda p: under_root(p, "/r")) == (
        "etcds://h:1/c?cacert=/r/ca.pem&cert=/r/c.pem&key=/r/k.pem"
    )
    assert registry_paths("etcd://h:1/c", lambda p: under_root(p, "/r")) == "etcd://h:1/c"
