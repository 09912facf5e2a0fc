"""Root edits a user's domain XML while that user races it: the user gains nothing.

The user owns the directory, so between root's creating the temporary file and acting on it
they can rename a symbolic link to any file over the temporary name. Root must act on its
descriptor, never on the name, and must never follow a link at the target.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.support.symlink_racer import NOBODY, symlink_racer
from vmlend import safefile
from vmlend.cli import main
from vmlend.errors import UnsafePathError
from vmlend.sim.hypervisor.store import atomic_write

ROUNDS = 300


@pytest.fixture
def victim_and_userdir():
    """A root-only victim file and a directory owned by the unprivileged user, both where that
    user can reach them (pytest's own tmp dirs are private to root)."""
    top = Path(tempfile.mkdtemp(prefix="vmlend-race-"))
    try:
        top.chmod(0o755)
        victim = top / "victim"
        victim.write_bytes(b"secret\n")
        victim.chmod(0o600)
        userdir = top / "user"
        userdir.mkdir()
        os.chown(userdir, NOBODY, NOBODY)
        yield victim, userdir
    finally:
        shutil.rmtree(top)


def _ownership(path: Path) -> tuple[int, int, int, bytes]:
    st = path.stat()
    return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode), path.read_bytes()


def _user_file(path: Path, data: bytes) -> None:
    """(Re)make ``path`` a regular file of the user's, as after the user's own 'xml new'."""
    if path.is_symlink() or path.exists():
        path.unlink()
    path.write_bytes(data)
    os.chown(path, NOBODY, NOBODY)
    path.chmod(0o644)


@pytest.mark.daemon
def test_a_racing_user_cannot_change_another_files_owner_or_mode(tmp_path, victim_and_userdir):
    victim, userdir = victim_and_userdir
    before = _ownership(victim)
    domain = userdir / "vm.xml"
    runner = CliRunner()
    state = ["--state", str(tmp_path / "none.db")]  # no state: the ids are checked for syntax
    new = runner.invoke(main, [*state, "xml", "new", "vm", "-o", str(tmp_path / "vm.xml")])
    assert new.exit_code == 0, new.output
    template = (tmp_path / "vm.xml").read_bytes()
    with symlink_racer(str(userdir), ".vm.xml.", str(victim)):
        for i in range(ROUNDS):
            if domain.is_symlink() or not domain.exists():
                _user_file(domain, template)  # the attacker's link was renamed into place
            edit = ["add-device"] if i % 2 == 0 else ["remove-device", "--missing-ok"]
            result = runner.invoke(main, [*state, "xml", *edit, str(domain), "0x10"])
            assert result.exit_code in (0, 1), result.output
            assert _ownership(victim) == before, f"round {i}: {result.output}"
    assert _ownership(victim) == before


def test_a_link_at_the_target_is_refused_with_one_line(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"secret\n")
    victim.chmod(0o600)
    runner = CliRunner()
    state = ["--state", str(tmp_path / "none.db")]
    real = tmp_path / "real.xml"
    assert runner.invoke(main, [*state, "xml", "new", "vm", "-o", str(real)]).exit_code == 0
    link = tmp_path / "vm.xml"
    link.symlink_to(real)
    result = runner.invoke(main, [*state, "xml", "add-device", str(link), "0x10"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        f"Error: refusing {link}: it is a symbolic link; name the file it points to instead"
    ]
    assert link.is_symlink() and b"0x10" not in real.read_bytes()
    link.unlink()
    link.symlink_to(victim)
    result = runner.invoke(main, [*state, "xml", "new", "vm", "-o", str(link), "--force"])
    assert result.exit_code == 1 and "symbolic link" in result.output
    assert victim.read_bytes() == b"secret\n" and link.is_symlink()


def test_the_simulated_hypervisors_files_refuse_a_planted_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"secret\n")
    (tmp_path / "live").mkdir()
    (tmp_path / "live" / "vm.xml").symlink_to(victim)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        atomic_write(tmp_path / "live" / "vm.xml", b"<domain/>")
    assert victim.read_bytes() == b"secret\n"


def test_a_new_file_gets_the_given_mode_and_an_old_one_keeps_its_own(tmp_path):
    path = tmp_path / "f"
    safefile.write_atomically(path, b"1", mode=0o600)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o640)
    safefile.write_atomically(path, b"2")
    assert stat.S_IMODE(path.stat().st_mode) == 0o640 and path.read_bytes() == b"2"
    assert [p.name for p in tmp_path.iterdir()] == ["f"]  # no temporary file left
