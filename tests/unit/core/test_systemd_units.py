"""``vmlend units install`` / ``uninstall`` (``vmlend.systemd_units``): systemd runs the units
as root, so installing around a script non-root can change is refused (or forced with a
warning), and uninstalling removes only the units vmlend wrote."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from vmlend import systemd_units
from vmlend.cli import main
from vmlend.errors import ConfigError

NAMES = ["vmlend-agent.service", "vmlend-mdev-watch.service", "vmlend-relay.service"]


@pytest.fixture
def user_script(tmp_path: Path) -> Path:
    """A vmlend script as a pip install --user leaves it: owned by an ordinary user."""
    script = tmp_path / "bin" / "vmlend"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    if os.geteuid() == 0:
        os.chown(script, 1000, 1000)
    return script


def test_a_script_non_root_can_change_is_refused_and_nothing_is_written(tmp_path, user_script):
    units = tmp_path / "units"
    with pytest.raises(ConfigError, match="non-root can change") as e:
        systemd_units.install(units, [str(user_script), "--flag"])
    assert str(user_script) in str(e.value) and "--force" in str(e.value)
    assert not units.exists()
    done, problems = systemd_units.install(units, [str(user_script)], force=True)
    assert [u.action for u in done] == ["installed"] * 3 and problems
    assert sorted(p.name for p in units.iterdir()) == NAMES


def test_this_installations_command_is_checked_with_its_interpreter_and_code(monkeypatch):
    """The check covers what the unit imports, not only the script (the installed hook's)."""
    seen: list[str] = []
    monkeypatch.setattr(systemd_units, "path_problems", lambda p: seen.append(str(p)) or [])
    from vmlend.hook import trust

    monkeypatch.setattr(trust, "tree_problems", lambda r: seen.append(str(r)) or [])
    command = systemd_units.vmlend_command()
    assert systemd_units.command_problems(command) == []
    import vmlend

    assert command[0] in seen and any(
        Path(vmlend.__file__).resolve().is_relative_to(Path(s)) for s in seen[1:]
    )


def test_uninstall_removes_only_what_install_wrote_and_is_idempotent(tmp_path):
    units = tmp_path / "units"
    systemd_units.install(units, ["/bin/true"])
    theirs = units / "vmlend-relay.service"
    theirs.write_text("[Service]\nExecStart=/usr/local/bin/relay\n")  # an operator's own
    done = {u.name: u.action for u in systemd_units.uninstall(units)}
    assert done == {
        "vmlend-agent.service": "removed",
        "vmlend-mdev-watch.service": "removed",
        "vmlend-relay.service": "kept",
    }
    assert [p.name for p in units.iterdir()] == ["vmlend-relay.service"]
    again = {u.name: u.action for u in systemd_units.uninstall(units)}
    assert again["vmlend-agent.service"] == "absent" and again["vmlend-relay.service"] == "kept"
    assert {u.action for u in systemd_units.uninstall(units, force=True)} == {"absent", "removed"}
    assert list(units.iterdir()) == []
    (units / "vmlend-agent.service").mkdir()  # not a file: one line, not a traceback
    with pytest.raises(ConfigError, match="cannot read"):
        systemd_units.uninstall(units)


def test_the_cli_installs_and_uninstalls_with_one_line_each(tmp_path):
    units = tmp_path / "units"
    run = CliRunner().invoke
    # --force: a developer's own venv is not root's, and this test is not about ownership
    r = run(main, ["--root", str(tmp_path), "units", "install", "--dir", str(units), "--force"])
    assert r.exit_code == 0, r.output
    r = run(main, ["--root", str(tmp_path), "units", "uninstall", "--dir", str(units), "--json"])
    assert r.exit_code == 0, r.output
    assert {u["action"] for u in json.loads(r.stdout)["units"]} == {"removed"}
    r = run(main, ["--root", str(tmp_path), "units", "uninstall", "--dir", str(units)])
    assert r.exit_code == 0 and r.stdout.count("absent: ") == 3


def _ordering(text: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {"After": set(), "Before": set()}
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key in out:
            out[key] |= set(value.split())
    return out


def test_the_agent_comes_after_libvirtd_and_before_the_guests_it_serves_as_documented():
    """The agent reads the host's domains as it starts (after libvirtd); the guests started
    at boot must find the hook served (before libvirt-guests). docs/user-guide.md says both,
    and that libvirtd's own autostart comes before the agent."""
    from tests.support.paths import REPO

    order = _ordering(systemd_units.render("vmlend-agent.service", ["/bin/true"]))
    assert "libvirtd.service" in order["After"] and "virtqemud.service" in order["After"]
    assert order["Before"] == {"libvirt-guests.service"}
    guide = " ".join((REPO / "docs" / "user-guide.md").read_text().split())
    assert "It starts after libvirtd" in guide and "before `libvirt-guests.service`" in guide
    autostart = "libvirtd's own autostart (`virsh autostart`) runs as libvirtd starts, before"
    assert f"{autostart} the agent" in guide
