"""libvirt's hook arguments map to the right vmlend action; installation follows libvirt's
rules for when a daemon restart is needed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vmlend.errors import ConfigError
from vmlend.hook.actionlog import ActionLog
from vmlend.hook.contract import Action, parse_argv
from vmlend.hook.install import install_hook, uninstall_hook


@pytest.mark.parametrize(
    ("argv", "action"),
    [
        (["vm1", "prepare", "begin", "-"], Action.PREPARE),
        (["vm1", "start", "begin", "-"], Action.IGNORE),
        (["vm1", "started", "begin", "-"], Action.IGNORE),
        (["vm1", "stopped", "end", "-"], Action.IGNORE),
        (["vm1", "release", "end", "-"], Action.RELEASE),
        (["vm1", "release", "end", "destroyed"], Action.RELEASE),
        (["vm1", "reconnect", "begin", "-"], Action.RECONNECT),
        (["vm1", "migrate", "begin", "-"], Action.MIGRATE),
        (["vm1", "restore", "begin", "-"], Action.RESTORE),
        (["vm1", "attach", "begin", "-"], Action.IGNORE),
    ],
)
def test_operations_map_to_actions(argv, action):
    assert parse_argv(argv).action is action


def test_extra_dash_means_empty_and_reason_is_kept():
    assert parse_argv(["vm", "release", "end", "-"]).extra == ""
    assert parse_argv(["vm", "release", "end", "shutdown"]).extra == "shutdown"
    assert parse_argv(["vm", "release", "end"]).extra == ""


def test_too_few_arguments_is_a_usage_message():
    with pytest.raises(ConfigError, match="usage"):
        parse_argv(["vm", "prepare"])


def test_install_into_fresh_dir_needs_restart_and_is_idempotent(tmp_path):
    state = tmp_path / "state.db"
    first = install_hook(tmp_path / "libvirt", state, "gamma", interpreter=sys.executable)
    assert first.changed and first.restart_needed
    assert "restart libvirtd" in first.advice()
    assert first.path == tmp_path / "libvirt" / "hooks" / "qemu.d" / "vmlend"
    assert first.path.stat().st_mode & 0o111
    again = install_hook(tmp_path / "libvirt", state, "gamma", interpreter=sys.executable)
    assert not again.changed and not again.restart_needed


def test_installed_script_runs_with_pinned_state(tmp_path):
    res = install_hook(tmp_path / "lv", tmp_path / "s" / "state.db", None)
    # An operation vmlend ignores: exits 0 and reads nothing but stdin.
    out = subprocess.run(
        [str(res.path), "vm", "started", "begin", "-"],
        input=b"<domain/>",
        capture_output=True,
        env={"PATH": "/nonexistent"},  # libvirtd's PATH is not ours: the shebang is absolute
        timeout=30,
    )
    assert out.returncode == 0, out.stderr


def test_foreign_hook_is_not_overwritten(tmp_path):
    target = tmp_path / "hooks" / "qemu"
    target.parent.mkdir(parents=True)
    target.write_text("#!/bin/sh\nexit 0\n")
    with pytest.raises(ConfigError, match="not installed by vmlend"):
        install_hook(tmp_path, tmp_path / "state.db", None, name="qemu")
    assert target.read_text() == "#!/bin/sh\nexit 0\n"
    with pytest.raises(ConfigError, match="not installed by vmlend"):
        uninstall_hook(tmp_path, name="qemu")


def test_existing_main_hook_means_no_restart(tmp_path):
    (tmp_path / "hooks").mkdir()
    (tmp_path / "hooks" / "qemu").write_text("#!/bin/sh\n")
    assert not install_hook(tmp_path, tmp_path / "s.db", None).restart_needed
    assert uninstall_hook(tmp_path) is True
    assert uninstall_hook(tmp_path) is False


def test_bad_hook_name(tmp_path):
    with pytest.raises(ConfigError, match=r"qemu\.d/<name>"):
        install_hook(tmp_path, tmp_path / "s.db", None, name="lxc")


def test_action_log_appends_and_tails(tmp_path):
    log = ActionLog(tmp_path / "d" / "hook.log")
    assert log.tail() == []
    for i in range(30):
        log.record("vm1", "prepare", f"step {i}")
    tail = log.tail(3)
    assert len(tail) == 3 and tail[-1].endswith("vm=vm1 prepare: step 29")


def test_install_leaves_nothing_else_in_qemu_d_and_fixes_a_lost_mode(tmp_path):
    first = install_hook(tmp_path, tmp_path / "s.db", None)
    assert sorted(p.name for p in first.path.parent.iterdir()) == ["vmlend"]
    assert sorted(p.name for p in (tmp_path / "hooks").iterdir()) == ["qemu.d"]
    first.path.chmod(0o644)  # libvirt ignores a non-executable hook
    again = install_hook(tmp_path, tmp_path / "s.db", None)
    assert again.changed and first.path.stat().st_mode & 0o111
