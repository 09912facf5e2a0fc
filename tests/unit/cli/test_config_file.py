"""The configuration file: its values are the defaults of the CLI's options (global ones at
the top, a table per command), the environment and the command line win over it, and an
unknown key, a table for no command, a bad value, a broken file or one non-root can change is
refused with one line naming the key and the file."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from vmlend.cli import main
from vmlend.cli.config import load_default_map
from vmlend.config import hook_environment
from vmlend.errors import ConfigError
from vmlend.hostenv import HostEnv
from vmlend.kernel.driver import SmartioDriver
from vmlend.wiring.fabric import default_backend


@pytest.fixture
def root(tmp_path, monkeypatch):
    """A host root whose etc/vmlend/vmlend.toml is the file the CLI reads."""
    monkeypatch.delenv("VMLEND_CONFIG")
    for name in ("VMLEND_NODE", "VMLEND_BACKEND", "VMLEND_ROOT", "VMLEND_HOOK_SOCKET"):
        monkeypatch.delenv(name, raising=False)
    r = tmp_path / "root"
    (r / "etc" / "libvirt").mkdir(parents=True)
    (r / "etc" / "vmlend").mkdir()
    return r


def write(root, text: str):
    path = root / "etc" / "vmlend" / "vmlend.toml"
    path.write_text(text)
    return path


def install(root, *args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(
        main, ["--root", str(root), *args, "hook", "install", "--json"], env=env
    )


def test_command_line_beats_environment_beats_file_beats_default(root, state_path):
    write(root, 'node = "alpha"\n\n[hook.install]\nname = "qemu.d/from-file"\n')
    r = install(root)
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["pins"]["node"] == "alpha"
    assert data["path"].endswith("hooks/qemu.d/from-file")
    assert json.loads(install(root, env={"VMLEND_NODE": "beta"}).output)["pins"]["node"] == "beta"
    r = install(root, "--node", "gamma", env={"VMLEND_NODE": "beta"})
    assert json.loads(r.output)["pins"]["node"] == "gamma"


def test_without_a_file_the_built_in_defaults_hold(root, state_path):
    r = install(root)
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert "node" not in data["pins"] and data["path"].endswith("hooks/qemu.d/vmlend")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('nodes = "alpha"\n', "nodes is not an option of vmlend's global options"),
        ("[agent]\nttll = 10\n", "agent.ttll is not an option of 'vmlend agent'"),
        ("[agnt]\nttl = 10\n", "[agnt] names no vmlend command"),
        ("[hook.instal]\nname = 'x'\n", "[hook.instal] names no vmlend command"),
        ("[agent]\nttl = 1\n", "agent.ttl = 1 is refused: 1 is not in the range 2<=x<=3600"),
        ('backend = "kvm"\n', "backend = 'kvm' is refused: "),
        ('root = "/x"\n', "root is not an option of vmlend's global options"),
        ("node = \n", "is not valid TOML"),
    ],
)
def test_bad_keys_and_values_are_refused_naming_key_and_file(root, state_path, text, message):
    path = write(root, text)
    r = CliRunner().invoke(main, ["--root", str(root), "hook", "log"])
    assert r.exit_code == 1
    assert len(r.output.splitlines()) == 1
    assert str(path) in r.output and message in r.output, r.output


def test_a_file_non_root_can_change_is_refused(root, state_path):
    path = write(root, 'node = "alpha"\n')
    path.chmod(0o664)
    r = CliRunner().invoke(main, ["--root", str(root), "hook", "log"])
    assert r.exit_code == 1
    assert f"{path} is writable by its group" in r.output
    assert "make it root's alone" in r.output


def test_a_missing_file_named_by_config_is_refused(tmp_path, state_path):
    missing = tmp_path / "nope.toml"
    r = CliRunner().invoke(main, ["--config", str(missing), "hook", "log"])
    assert r.exit_code == 1
    assert r.output == (
        f"Error: the configuration file {missing} does not exist; create it or pass another"
        " --config\n"
    )


def test_help_and_version_work_with_a_broken_file(root):
    write(root, "[[[\n")
    for args in (["--help"], ["--version"]):
        assert CliRunner().invoke(main, args, env={"VMLEND_ROOT": str(root)}).exit_code == 0


def test_hook_install_writes_the_file_the_hook_reads_and_keeps_the_rest(root, tmp_path):
    path = write(root, '# mine\nnode = "alpha"\n\n[agent]\nttl = 10\n')
    state = tmp_path / "s.db"
    r = install(root, "--state", str(state), "--backend", "sim")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["config"] == "updated"
    text = path.read_text()
    assert text.startswith("# mine\n") and text.endswith("[agent]\nttl = 10\n")
    env: dict[str, str] = {"VMLEND_ROOT": str(root)}
    hook_environment(env)
    assert env == {
        "VMLEND_ROOT": str(root),
        "VMLEND_STATE": str(state),
        "VMLEND_NODE": "alpha",
        "VMLEND_BACKEND": "sim",
        "VMLEND_HOOK_SOCKET": str(root / "run" / "vmlend" / "hook.sock"),
    }
    again = install(root, "--state", str(state), "--backend", "sim")
    assert json.loads(again.output)["config"] == "unchanged"


def test_the_hook_reads_any_toml_the_cli_accepts_and_set_variables_win(root):
    write(root, "state = \"/s\\u00e9.db\"  # escaped\nnode = 'beta'\n[agent]\nttl = 10\n")
    env = {"VMLEND_ROOT": str(root), "VMLEND_NODE": "gamma"}
    hook_environment(env)
    assert env["VMLEND_STATE"] == "/s\u00e9.db" and env["VMLEND_NODE"] == "gamma"


def test_the_hook_refuses_a_setting_that_is_no_string(root):
    path = write(root, "node = 3\n")
    with pytest.raises(ConfigError, match=f"{path}: node must be a non-empty string"):
        hook_environment({"VMLEND_ROOT": str(root)})


def test_shared_hook_socket_is_the_agents_and_installs_default(root, state_path, tmp_path):
    write(root, f'hook-socket = "{tmp_path / "h.sock"}"\n')
    assert json.loads(install(root).output)["pins"]["hook socket"] == str(tmp_path / "h.sock")


def test_a_commands_own_hook_socket_beats_the_shared_one(root, state_path, tmp_path):
    shared, own = tmp_path / "shared.sock", tmp_path / "own.sock"
    text = f'hook-socket = "{shared}"\n\n[hook.install]\nhook-socket = "{own}"\n'
    write(root, text)
    r = install(root)
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["pins"]["hook socket"] == str(own)
    write(root, text)  # as it was before install wrote what it pinned at the top
    defaults = load_default_map(main, ["--root", str(root), "agent"])
    assert defaults is not None
    assert defaults["agent"]["hook_socket"] == str(shared)  # no table of its own


def test_default_backend_is_smartio_where_the_driver_is_loaded(tmp_path):
    host = HostEnv(tmp_path)
    assert default_backend(host) == "sim"
    host.smartio.mkdir(parents=True)
    (host.smartio / "node_id").write_text("4\n")
    assert default_backend(host) == "smartio"
    assert SmartioDriver(host).loaded()  # the same test the kernel backend makes
