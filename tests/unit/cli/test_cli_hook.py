"""`vmlend hook` from the command line: install under --root, idempotence, log, uninstall."""

from __future__ import annotations

import json

from click.testing import CliRunner

from vmlend.cli import main


def test_install_goes_under_root_and_reports_restart(tmp_path, state_path):
    r = CliRunner().invoke(main, ["--root", str(tmp_path), "hook", "install", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["path"] == str(tmp_path / "etc/libvirt/hooks/qemu.d/vmlend")
    assert data["changed"] and data["restart_needed"]
    again = CliRunner().invoke(main, ["--root", str(tmp_path), "hook", "install"])
    assert again.exit_code == 0 and "already installed" in again.output
    gone = CliRunner().invoke(main, ["--root", str(tmp_path), "hook", "uninstall"])
    assert gone.exit_code == 0 and "removed" in gone.output


def test_uninstall_json_says_whether_it_removed_the_hook(tmp_path, state_path):
    root = ["--root", str(tmp_path), "hook"]
    assert CliRunner().invoke(main, [*root, "install"]).exit_code == 0
    path = str(tmp_path / "etc/libvirt/hooks/qemu.d/vmlend")
    for action in ("removed", "unchanged"):
        r = CliRunner().invoke(main, [*root, "uninstall", "--json"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout) == {"format": "vmlend/1", "action": action, "path": path}


def test_hook_log_without_entries_says_where_it_looks(state_path):
    r = CliRunner().invoke(main, ["hook", "log", "--json"])
    assert r.exit_code == 0
    assert json.loads(r.output) == {
        "format": "vmlend/1",
        "path": str(state_path.parent / "hook.log"),
        "entries": [],
    }
