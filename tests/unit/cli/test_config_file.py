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


@pytest.fixture
def state_path(root, monkeypatch):
    """The state inside the host root: what 'hook install' pins must lie under it."""
    path = root / "var" / "lib" / "vmlend" / "state.db"
    monkeypatch.setenv("VMLEND_STATE", str(path))
    return path


def write(root, text: str):
    path = root / "etc" / "vmlend" / "vmlend.toml"
    path.write_text(text)
    return path


def install(root, *args: str, env: dict[str, str] | None = None, after: tuple[str, ...] = ()):
    return CliRunner().invoke(
        main, ["--root", str(root), *args, "hook", "install", "--json", *after], env=env
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
        f"Error: the configuration file {missing} does not exist; create it, or name another"
        " with --config or $VMLEND_CONFIG\n"
    )


def test_help_and_version_work_with_a_broken_file(root):
    write(root, "[[[\n")
    for args in (["--help"], ["--version"]):
        assert CliRunner().invoke(main, args, env={"VMLEND_ROOT": str(root)}).exit_code == 0


def test_hook_install_writes_the_file_the_hook_reads_and_keeps_the_rest(root, tmp_path):
    path = write(root, '# mine\nnode = "alpha"\n\n[agent]\nttl = 10\n')
    state = root / "s.db"
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
    assert env["VMLEND_STATE"] == f"{root}/s\u00e9.db" and env["VMLEND_NODE"] == "gamma"


def test_the_hook_refuses_a_setting_that_is_no_string(root):
    path = write(root, "node = 3\n")
    with pytest.raises(ConfigError, match=f"{path}: node must be a non-empty string"):
        hook_environment({"VMLEND_ROOT": str(root)})


def test_shared_hook_socket_is_the_agents_and_installs_default(root, state_path):
    write(root, 'hook-socket = "/h.sock"\n')
    assert json.loads(install(root).output)["pins"]["hook socket"] == str(root / "h.sock")


def test_a_commands_own_hook_socket_beats_the_shared_one(root, state_path):
    text = 'hook-socket = "/shared.sock"\n\n[hook.install]\nhook-socket = "/own.sock"\n'
    write(root, text)
    r = install(root)
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["pins"]["hook socket"] == str(root / "own.sock")
    write(root, text)  # as it was before install wrote what it pinned at the top
    defaults = load_default_map(main, ["--root", str(root), "agent"])
    assert defaults is not None
    assert defaults["agent"]["hook_socket"] == str(root / "shared.sock")  # no table of its own


def test_default_backend_is_smartio_where_the_driver_is_loaded(tmp_path):
    host = HostEnv(tmp_path)
    assert default_backend(host) == "sim"
    host.smartio.mkdir(parents=True)
    (host.smartio / "node_id").write_text("4\n")
    assert default_backend(host) == "smartio"
    assert SmartioDriver(host).loaded()  # the same test the kernel backend makes


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("state = 5\n", "state must be a non-empty string, not 5"),
        ('registry = ["a"]\n', "registry must be a non-empty string, not ['a']"),
        ("verbose = true\n", "verbose = True must be an integer"),
        ('verbose = "2"\n', "verbose = '2' must be an integer"),
        ('connect = ["qemu:///system"]\n', "connect = ['qemu:///system'] must be a string"),
        ('[agent]\nttl = "10"\n', "agent.ttl = '10' must be an integer"),
        ("[agent]\ninterval = true\n", "agent.interval = True must be a number"),
        ("[doctor]\nsmartio = 1\n", "doctor.smartio = 1 must be true or false"),
        ('[hook.install]\nlibvirt-dir = 7\n', "hook.install.libvirt-dir = 7 must be a string"),
        ('[xml.new]\ndevice = "0x10"\n', "xml.new.device = '0x10' must be a list of values"),
    ],
)
def test_a_value_of_another_toml_type_is_refused(root, state_path, text, message):
    path = write(root, text)
    r = CliRunner().invoke(main, ["--root", str(root), "hook", "log"])
    assert r.exit_code == 1, r.output
    assert r.output.count("\n") == 1, r.output
    assert f"{path}: {message}" in r.output, r.output


def test_values_of_the_right_type_are_taken(root, state_path):
    write(root, '[agent]\ninterval = 1\n\n[xml.new]\ndevice = ["0x10", "gpu"]\n')
    defaults = load_default_map(main, ["--root", str(root), "agent"])
    assert defaults is not None
    assert defaults["agent"]["interval"] == 1
    assert defaults["xml"]["new"]["devices"] == ["0x10", "gpu"]


OPERATORS_FILE = """\
# The operator's own words, kept by 'hook install'.
state = "/var/lib/vmlend/old.db"     # --state: where the fabric lives
node = "alpha"                        # this host

# the agent
[agent]
ttl = 10  # seconds
"""


def test_hook_install_keeps_the_operators_comments_and_layout(root, state_path):
    path = write(root, OPERATORS_FILE)
    r = install(root, "--backend", "sim")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["config"] == "updated"
    assert path.read_text() == OPERATORS_FILE.replace(
        '"/var/lib/vmlend/old.db"     #', '"/var/lib/vmlend/state.db"     #'
    ).replace(
        "# this host\n",
        '# this host\nbackend = "sim"\nhook-socket = "/run/vmlend/hook.sock"\n',
    )


def test_hook_install_replaces_a_key_as_the_file_spells_it(root, state_path):
    path = write(root, 'hook_socket = "/old.sock"  # mine\n')
    args = ["--root", str(root), "hook", "install", "--hook-socket", str(root / "new.sock")]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert path.read_text() == (
        'hook_socket = "/new.sock"  # mine\nstate = "/var/lib/vmlend/state.db"\n'
    )


def test_hook_install_creates_the_file_named_by_config(root, state_path, tmp_path):
    new = tmp_path / "conf" / "private.toml"
    r = install(root, "--config", str(new))
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["config"] == "written"
    assert json.loads(r.output)["pins"]["config"] == str(new)
    env = {"VMLEND_CONFIG": str(new), "VMLEND_ROOT": str(root)}
    hook_environment(env)
    assert env["VMLEND_STATE"] == str(state_path)
    # another command still refuses a named file that is missing
    r = CliRunner().invoke(main, ["--config", str(tmp_path / "nope.toml"), "hook", "log"])
    assert r.exit_code == 1 and "does not exist" in r.output


def test_a_second_libvirt_dir_never_rewrites_the_hosts_file(root, monkeypatch):
    path = write(root, OPERATORS_FILE)
    monkeypatch.setenv("VMLEND_STATE", str(root / "host.db"))
    assert install(root).exit_code == 0
    host_file = path.read_text()
    private = root / "private-libvirt"
    private.mkdir()
    monkeypatch.setenv("VMLEND_STATE", str(root / "private.db"))
    r = install(root, after=("--libvirt-dir", str(private)))
    assert r.exit_code == 1
    assert r.output == (
        f"Error: --libvirt-dir {private} is not this host's libvirt ({root / 'etc' / 'libvirt'}):"
        " name the configuration file its hook reads with --config FILE (created if missing),"
        f" so {path} keeps the host hook's settings\n"
    )
    own = root / "etc" / "vmlend" / "private.toml"
    r = install(root, "--config", str(own), after=("--libvirt-dir", str(private)))
    assert r.exit_code == 0, r.output
    assert path.read_text() == host_file
    pins = json.loads(r.output)["pins"]
    assert (pins["config"], pins["state"]) == (str(own), str(root / "private.db"))


def test_hook_install_refuses_a_state_outside_the_root(root, tmp_path, monkeypatch):
    path = write(root, OPERATORS_FILE)
    monkeypatch.setenv("VMLEND_STATE", str(tmp_path / "outside.db"))
    r = install(root)
    assert r.exit_code == 1
    assert r.output == (
        f"Error: the state {tmp_path / 'outside.db'} is outside the host root {root}: the"
        " configuration file's paths are taken under the root; choose one under it\n"
    )
    assert path.read_text() == OPERATORS_FILE
