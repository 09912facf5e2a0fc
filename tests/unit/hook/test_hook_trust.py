"""libvirtd runs the hook as root: ``vmlend hook install`` refuses (``--force``: warns loudly)
when non-root could change what it runs, imports or writes, and ``vmlend doctor`` reports it.
The hook's own log refuses a planted link."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from tests.support.cli_cluster import one_line
from tests.support.symlink_racer import NOBODY
from vmlend.cli import main
from vmlend.errors import ConfigError, UnsafePathError
from vmlend.hook import trust
from vmlend.hook.actionlog import ActionLog
from vmlend.hook.install import install_hook


@pytest.fixture
def libvirt_dir(tmp_path):
    d = tmp_path / "etc-libvirt"
    d.mkdir()
    return d


def _install(libvirt_dir, state, *extra: str):
    args = ["--state", str(state), "hook", "install", "--libvirt-dir", str(libvirt_dir), *extra]
    return CliRunner().invoke(main, args)


def test_a_state_directory_another_user_owns_is_refused(tmp_path, libvirt_dir):
    user = tmp_path / "user-state"
    user.mkdir()
    os.chown(user, NOBODY, NOBODY)
    line = one_line(_install(libvirt_dir, user / "state.db"))
    assert f"{user} is owned by uid {NOBODY}, not root" in line and "--force" in line
    assert not (libvirt_dir / "hooks" / "qemu.d" / "vmlend").exists()


def test_a_group_writable_directory_above_the_state_is_refused(tmp_path, libvirt_dir):
    shared = tmp_path / "shared"
    (shared / "vmlend").mkdir(parents=True)
    shared.chmod(0o775)
    line = one_line(_install(libvirt_dir, shared / "vmlend" / "state.db"))
    assert f"{shared} is writable by its group" in line
    with pytest.raises(ConfigError, match="writable by its group"):
        install_hook(libvirt_dir, shared / "vmlend" / "state.db", hook_socket=tmp_path / "s")


def test_force_installs_with_a_loud_warning_and_doctor_fails_it(tmp_path, libvirt_dir):
    user = tmp_path / "user-state"
    user.mkdir()
    os.chown(user, NOBODY, NOBODY)
    r = _install(libvirt_dir, user / "state.db", "--force")
    assert r.exit_code == 0, r.output
    assert "WARNING: INSECURE" in r.stderr and f"owned by uid {NOBODY}" in r.stderr
    assert (libvirt_dir / "hooks" / "qemu.d" / "vmlend").exists()
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    os.symlink(libvirt_dir, root / "etc" / "libvirt")
    d = CliRunner().invoke(main, ["--root", str(root), "doctor"])
    [finding] = [ln for ln in d.output.splitlines() if "hook ownership" in ln]
    assert finding.startswith("FAIL") and f"owned by uid {NOBODY}" in finding


def test_a_root_owned_install_under_a_sticky_world_writable_directory_is_accepted(tmp_path):
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    (sticky / "vmlend").mkdir()
    (sticky / "libvirt").mkdir()
    result = install_hook(sticky / "libvirt", sticky / "vmlend" / "state.db", hook_socket=sticky)
    assert result.changed and result.untrusted == []


def test_every_file_below_an_import_root_counts(tmp_path):
    # Two roots, not one changed between two looks: a look is cached for the process, and
    # clearing that cache would make the next hook install walk the interpreter's tree again.
    sound, root = tmp_path / "sound-site", tmp_path / "site"
    for site in (sound, root):
        (site / "pkg").mkdir(parents=True)
        (site / "pkg" / "__init__.py").write_text("")
    os.chown(root / "pkg" / "__init__.py", NOBODY, NOBODY)
    assert trust.tree_problems(sound) == []
    assert trust.tree_problems(root) == [
        f"{root / 'pkg' / '__init__.py'} is owned by uid {NOBODY}, not root"
    ]


def test_a_link_planted_at_the_hook_log_is_refused(tmp_path, state_path):
    victim = tmp_path / "victim"
    victim.write_text("secret\n")
    log = state_path.parent / "hook.log"
    log.symlink_to(victim)
    ActionLog(log).record("vm1", "prepare", "reserved 0x10")  # never a reason to fail a VM
    assert victim.read_text() == "secret\n"
    with pytest.raises(UnsafePathError):
        ActionLog(log).tail()
    line = one_line(CliRunner().invoke(main, ["--state", str(state_path), "hook", "log"]))
    assert (
        line == f"Error: refusing {log}: it is a symbolic link; remove it (vmlend does not"
        " follow links there)"
    )
