"""``vmlend hook install`` pins absolute paths and says what it pinned; bad names and a missing
``--libvirt-dir`` are refused with nothing written; ``doctor`` compares the hook's pins with the
CLI's."""

from __future__ import annotations

import json
import os
import sys

import pytest
from click.testing import CliRunner

from vmlend.cli import main
from vmlend.doctor import Status, compare_pins
from vmlend.errors import ConfigError
from vmlend.hook.install import hook_script, read_pins, read_script_pins


def _tree(path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.fixture
def libvirt_dir(tmp_path):
    d = tmp_path / "etc-libvirt"
    d.mkdir()
    return d


def test_a_relative_state_is_pinned_absolute_and_the_pins_are_printed(
    tmp_path, libvirt_dir, monkeypatch
):
    monkeypatch.delenv("VMLEND_STATE", raising=False)
    monkeypatch.delenv("VMLEND_NODE", raising=False)
    monkeypatch.delenv("VMLEND_BACKEND", raising=False)
    monkeypatch.delenv("VMLEND_HOOK_SOCKET", raising=False)
    monkeypatch.delenv("VMLEND_CONFIG")
    monkeypatch.setenv("VMLEND_ROOT", "rel-root")
    monkeypatch.chdir(tmp_path)
    args = ["--state", "rel-root/rel/state.db", "--config", "cfg/vmlend.toml", "hook", "install"]
    args += ["--libvirt-dir", str(libvirt_dir)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    hook = libvirt_dir / "hooks" / "qemu.d" / "vmlend"
    pins = read_pins(hook.read_text())
    sock = tmp_path / "rel-root" / "run" / "vmlend" / "hook.sock"
    config = tmp_path / "cfg" / "vmlend.toml"  # named, so created
    state = tmp_path / "rel-root" / "rel" / "state.db"
    assert pins == {
        "interpreter": os.path.abspath(sys.executable),
        "config": str(config),
        "root": str(tmp_path / "rel-root"),
        "state": str(state),
        "hook socket": str(sock),
    }
    assert r.output.splitlines()[1:] == [
        f"  config       {config} (written)",
        f"  root         {tmp_path / 'rel-root'}",
        f"  interpreter  {os.path.abspath(sys.executable)}",
        f"  registry     {state}",
        "  node         (the state local node)",
        "  backend      (the host's: smartio where the driver is loaded, else sim)",
        f"  hook socket  {sock} (served by 'vmlend agent' when it runs)",
    ]
    data = json.loads(CliRunner().invoke(main, [*args, "--json"]).output)
    assert data["pins"]["state"] == str(state)
    # the file, as the hook's root sees it
    assert config.read_text().splitlines()[2:] == [
        'state = "/rel/state.db"',
        'hook-socket = "/run/vmlend/hook.sock"',
    ]


def test_hook_socket_option_is_pinned_absolute(tmp_path, libvirt_dir, monkeypatch):
    # The same socket 'vmlend agent --hook-socket' serves: the hook must find it from /.
    monkeypatch.chdir(tmp_path)
    args = ["--state", "s.db", "hook", "install", "--libvirt-dir", str(libvirt_dir)]
    r = CliRunner().invoke(main, [*args, "--hook-socket", "sock/hook.sock", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["pins"]["hook socket"] == str(tmp_path / "sock" / "hook.sock")
    hook = libvirt_dir / "hooks" / "qemu.d" / "vmlend"
    assert read_pins(hook.read_text())["hook socket"] == str(tmp_path / "sock" / "hook.sock")


@pytest.mark.parametrize(
    "name",
    ["qemu.d/../../x", "qemu.d/../qemu", "../qemu", "qemu.d/a/b", "qemu.d/vm\nlend", "qemu\n"],
)
def test_a_name_outside_the_hooks_dir_is_refused(tmp_path, libvirt_dir, state_path, name):
    before = _tree(tmp_path)
    r = CliRunner().invoke(
        main, ["hook", "install", "--libvirt-dir", str(libvirt_dir), "--name", name]
    )
    assert r.exit_code == 1
    assert r.output == (
        f"Error: hook name must be 'qemu' or 'qemu.d/<name>' (inside the hooks dir), got {name!r}\n"
    )
    assert _tree(tmp_path) == before


def test_a_missing_libvirt_dir_is_refused(tmp_path, state_path):
    missing = tmp_path / "etc" / "libvirtt"
    before = _tree(tmp_path)
    r = CliRunner().invoke(main, ["hook", "install", "--libvirt-dir", str(missing)])
    assert r.exit_code == 1
    assert r.output == (
        f"Error: --libvirt-dir {missing} does not exist; give libvirt's config dir (the one"
        " that holds libvirtd.conf, usually /etc/libvirt)\n"
    )
    assert _tree(tmp_path) == before


def test_the_hook_pins_its_configuration_file_and_root_and_reads_its_settings_there(tmp_path):
    config = tmp_path / "etc" / "vmlend" / "vmlend.toml"
    text = hook_script("/usr/bin/python3", config, tmp_path)
    assert "VMLEND_STATE" not in text  # the settings are the file's, not the script's
    assert read_script_pins(text) == {
        "interpreter": "/usr/bin/python3",
        "config": str(config),
        "root": str(tmp_path),
    }
    with pytest.raises(ConfigError, match=f"the configuration file {config} does not exist"):
        read_pins(text)  # as the hook would refuse to run without it
    config.parent.mkdir(parents=True)
    config.write_text(  # paths as seen inside the hook's root
        'state = "/s.db"\nnode = "gamma"\nbackend = "smartio"\n'
        'hook-socket = "/s"\n\n[agent]\nttl = 10\n'
    )
    assert read_pins(text) == {
        "interpreter": "/usr/bin/python3",
        "config": str(config),
        "root": str(tmp_path),
        "state": str(tmp_path / "s.db"),
        "node": "gamma",
        "backend": "smartio",
        "hook socket": str(tmp_path / "s"),
    }


def test_compare_pins(tmp_path):
    hook = tmp_path / "vmlend"
    cli = {"interpreter": "/py", "state": "/a.db", "node": "", "backend": ""}
    assert compare_pins(hook, {"interpreter": "/py", "state": "/a.db"}, cli).status is Status.OK
    other = compare_pins(hook, {"interpreter": "/py", "state": "/b.db", "node": "alpha"}, cli)
    assert other.status is Status.FAIL
    assert other.detail == (
        f"{hook} pins registry /b.db vs /a.db; node alpha vs (unset) (hook vs this CLI):"
        " re-run 'vmlend hook install' with this CLI's --config/--state/--registry/--node"
    )
    venv = compare_pins(hook, {"interpreter": "/old/py", "state": "/a.db"}, cli)
    assert venv.status is Status.WARN


def test_doctor_flags_a_hook_pinned_to_another_state(tmp_path, monkeypatch):
    monkeypatch.delenv("VMLEND_NODE", raising=False)
    monkeypatch.delenv("VMLEND_BACKEND", raising=False)
    root = tmp_path / "root"
    (root / "etc" / "libvirt").mkdir(parents=True)
    one, two = str(root / "one.db"), str(root / "two.db")
    r = CliRunner().invoke(main, ["--root", str(root), "--state", one, "hook", "install"])
    assert r.exit_code == 0, r.output

    def pins_check(state: str) -> dict:
        out = CliRunner().invoke(main, ["--root", str(root), "--state", state, "doctor", "--json"])
        return next(c for c in json.loads(out.output)["checks"] if c["check"] == "hook pins")

    assert pins_check(one)["status"] == "ok"
    bad = pins_check(two)
    assert bad["status"] == "fail"
    assert f"pins registry {one} vs {two}" in bad["detail"]
