"""A sound state file the host will not let vmlend use: a read-only file system, a full disk,
missing permissions, another process's lock. Each is named with its own fix, never as a corrupt
file to move away; reading commands still work where the file can be read.

The conditions are made for real: a read-only bind mount and a tiny full tmpfs inside a private
mount namespace (``unshare``; tests run as root), a process with uid 65534, a second process
holding SQLite's exclusive lock.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from vmlend.errors import StateLockedError
from vmlend.registry import SqliteRegistry
from vmlend.registry.conditions import Condition, FsFacts, classify, classify_errno
from vmlend.wiring.fabric import default_topology_text, init_fabric

CORRUPT_ADVICE = "move it away"
CLI = [sys.executable, "-c", "from vmlend.cli import main; main()"]
NOBODY = 65534

# --- the decision, pure ----------------------------------------------------------------------

SOUND = FsFacts(read_only_fs=False, readable=True, writable=True, space_left=True)


@pytest.mark.parametrize(
    ("code", "facts", "expected"),
    [
        ("SQLITE_BUSY", SOUND, Condition.LOCKED),
        ("SQLITE_LOCKED_SHAREDCACHE", SOUND, Condition.LOCKED),
        ("SQLITE_CORRUPT", SOUND, Condition.DAMAGED),
        ("SQLITE_NOTADB", SOUND, Condition.DAMAGED),
        ("SQLITE_FULL", SOUND, Condition.DISK_FULL),
        ("SQLITE_CANTOPEN", FsFacts(True, True, False, True), Condition.READ_ONLY),
        ("SQLITE_READONLY", FsFacts(True, True, False, False), Condition.READ_ONLY),
        ("SQLITE_CANTOPEN", FsFacts(False, False, False, True), Condition.NO_READ),
        ("SQLITE_READONLY", FsFacts(False, True, False, True), Condition.NO_WRITE),
        ("SQLITE_IOERR_SHMSIZE", FsFacts(False, True, True, False), Condition.DISK_FULL),
        ("SQLITE_IOERR_WRITE", SOUND, None),  # an I/O error nothing explains: no guess
        ("SQLITE_CONSTRAINT", FsFacts(True, True, False, False), None),
    ],
)
def test_classify_names_the_condition(code, facts, expected):
    assert classify(code, facts) is expected


def test_classify_errno_of_a_failed_create():
    import errno

    assert classify_errno(errno.EROFS) is Condition.READ_ONLY
    assert classify_errno(errno.ENOSPC) is Condition.DISK_FULL
    assert classify_errno(errno.EACCES) is Condition.NO_WRITE
    assert classify_errno(errno.EIO) is None


# --- the real conditions ---------------------------------------------------------------------


def _cli(*args: str, state: Path, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "--state", str(state), *args],
        capture_output=True,
        text=True,
        timeout=60,
        **kw,
    )


def _in_private_mounts(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (sh) in a private mount namespace: its mounts vanish with it."""
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-ec", script, "sh", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def state(tmp_path) -> Path:
    folder = tmp_path / "st"
    folder.mkdir()
    path = folder / "state.db"
    text, source = default_topology_text()
    init_fabric(path, text, source, node="gamma")
    return path


def _run_steps(script_head: str, state: Path) -> list[dict]:
    """Run each CLI command of ``STEPS`` inside the namespace after ``script_head``; their
    results as dicts (rc, out, err), in order."""
    cli = " ".join(f"'{a}'" for a in CLI)
    body = "".join(
        f'echo "=== {i}"; {cli} --state "$1" {cmd} 2>&1 && echo "rc=0" || echo "rc=$?"\n'
        for i, cmd in enumerate(STEPS)
    )
    proc = _in_private_mounts(script_head + body, str(state))
    assert proc.returncode == 0, proc.stderr
    out = []
    for chunk in proc.stdout.split("=== ")[1:]:
        text = chunk.split("\n", 1)[1]
        text, rc = text.rsplit("rc=", 1)
        out.append({"rc": int(rc), "out": text})
    return out


STEPS = [
    "devices --json",
    "fabric show",
    "status -c sim:///gamma",
    "unlend 0x10",
]


def test_read_only_file_system_reads_work_and_writes_name_it(state):
    before = _digest(state)
    devices = _cli("devices", "--json", state=state).stdout
    head = 'mount --bind "$(dirname "$1")" "$(dirname "$1")"\n'
    head += 'mount -o remount,bind,ro "$(dirname "$1")"\n'
    got = _run_steps(head, state)
    assert got[0]["rc"] == 0 and json.loads(got[0]["out"]) == json.loads(devices)
    assert got[1]["rc"] == 0 and "fabric 'default'" in got[1]["out"]
    assert got[2]["rc"] == 0, got[2]["out"]
    assert got[3]["rc"] == 1
    line = got[3]["out"].strip()
    assert line == (
        f"Error: cannot change the vmlend state {state}: its file system is read-only;"
        " remount it read-write and retry (commands that only read, such as"
        " 'vmlend status', still work)"
    )
    assert CORRUPT_ADVICE not in line
    assert _digest(state) == before
    assert json.loads(_cli("devices", "--json", state=state).stdout) == json.loads(devices)


def test_a_version_2_state_on_a_read_only_file_system_still_reads(tmp_path, monkeypatch):
    # Schema 3 only adds the compiled topology (a cache of the text): a version-2 state that
    # cannot be migrated, because nothing may write it, is read as it is, not refused.
    from tests.support.older_state import older_vmlend

    folder = tmp_path / "v2"
    folder.mkdir()
    path = folder / "state.db"
    with older_vmlend(monkeypatch, 2):
        init_fabric(path, *default_topology_text(), node="gamma")
    reference = tmp_path / "copy.db"
    shutil.copy(path, reference)  # read (and so migrated) writable, for the expected output
    devices = json.loads(_cli("devices", "--json", state=reference).stdout)
    before = _digest(path)
    head = 'mount --bind "$(dirname "$1")" "$(dirname "$1")"\n'
    head += 'mount -o remount,bind,ro "$(dirname "$1")"\n'
    got = _run_steps(head, path)
    assert got[0]["rc"] == 0, got[0]["out"]
    assert json.loads(got[0]["out"]) == devices
    assert got[1]["rc"] == 0 and got[2]["rc"] == 0, got
    assert got[3]["rc"] == 1 and "read-only" in got[3]["out"]
    assert _digest(path) == before  # still version 2, untouched


def test_full_disk_reads_work_and_writes_name_it(state):
    devices = json.loads(_cli("devices", "--json", state=state).stdout)
    # A 1 MiB tmpfs over the state's directory, the state copied in, the rest filled up.
    head = (
        'dir="$(dirname "$1")"; cp "$1" /tmp/vmlend-full-copy.$$\n'
        'mount -t tmpfs -o size=1m tmpfs "$dir"\n'
        'cp /tmp/vmlend-full-copy.$$ "$1"; rm /tmp/vmlend-full-copy.$$\n'
        'dd if=/dev/zero of="$dir/filler" bs=4k 2>/dev/null || true\n'
    )
    steps = [
        *STEPS,
        # room again: the state is as it was
        None,
        "devices --json",
    ]
    cli = " ".join(f"'{a}'" for a in CLI)
    body = ""
    for i, cmd in enumerate(steps):
        if cmd is None:
            body += 'rm "$dir/filler"\n'
            continue
        body += f'echo "=== {i}"; {cli} --state "$1" {cmd} 2>&1 && echo "rc=0" || echo "rc=$?"\n'
    proc = _in_private_mounts(head + body, str(state))
    assert proc.returncode == 0, proc.stderr
    got = {}
    for chunk in proc.stdout.split("=== ")[1:]:
        idx, text = chunk.split("\n", 1)
        text, rc = text.rsplit("rc=", 1)
        got[int(idx)] = (int(rc), text.strip())
    assert got[0][0] == 0 and json.loads(got[0][1]) == devices
    assert got[1][0] == 0 and got[2][0] == 0, (got[1], got[2])
    assert got[3] == (
        1,
        f"Error: cannot change the vmlend state {state}: its file system is full; free space"
        " there and retry (the state was not changed)",
    )
    assert got[5][0] == 0 and json.loads(got[5][1]) == devices


@pytest.fixture
def nobody_state() -> Iterator[Path]:
    """A state in a directory uid 65534 may enter but not write, the file root's (outside
    pytest's tmp_path, which only root may enter)."""
    text, source = default_topology_text()
    folder = Path(tempfile.mkdtemp(prefix="vmlend-perm-"))
    try:
        folder.chmod(0o755)
        path = folder / "state.db"
        init_fabric(path, text, source, node="gamma")
        path.chmod(0o644)
        yield path
    finally:
        shutil.rmtree(folder)


#: The CLI as uid 65534. The interpreter may live where that user cannot enter (pyenv under
#: /root), so it starts as root, imports every vmlend module (and so what they import), then
#: drops to 65534 before the command runs.
AS_NOBODY = f"""
import importlib, os, pkgutil, sys
import vmlend
for m in pkgutil.walk_packages(vmlend.__path__, "vmlend."):
    if not m.name.endswith("__main__"):
        importlib.import_module(m.name)
os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})
from vmlend.cli import main
main(sys.argv[1:], prog_name="vmlend")
"""


AS_NOBODY_OPEN = f"""
import os, sys
from vmlend.errors import StateError
from vmlend.registry import SqliteRegistry
os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})
try:
    SqliteRegistry.open(sys.argv[1]).close()
except StateError as e:
    print(e)
"""


def _as_nobody(*args: str, state: Path) -> subprocess.CompletedProcess[str]:
    # Nor the test's configuration file: it lies in the test's directory, which 65534 cannot
    # enter (an unreadable configuration file is refused).
    env = {k: v for k, v in os.environ.items() if k not in ("VMLEND_STATE", "VMLEND_CONFIG")}
    # Nor the machine's host root: one of its own beside the state, which 65534 may read.
    env["VMLEND_ROOT"] = str(state.parent / "root")
    return subprocess.run(
        [sys.executable, "-c", AS_NOBODY, "--state", str(state), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd="/",
    )


def test_no_write_permission_reads_work_and_writes_name_it(nobody_state):
    before = _digest(nobody_state)
    got = _as_nobody("devices", state=nobody_state)
    assert got.returncode == 0, got.stderr
    assert "0x10" in got.stdout
    got = _as_nobody("unlend", "0x10", state=nobody_state)
    assert got.returncode == 1
    assert got.stderr.strip() == (
        f"Error: cannot write the vmlend state {nobody_state}: permission denied; run vmlend as"
        " a user who may (root for the system state) or fix the owner and mode of the file and"
        " its directory"
    )
    assert _digest(nobody_state) == before


def test_no_read_permission_is_named(nobody_state):
    nobody_state.chmod(0o600)
    got = _as_nobody("devices", state=nobody_state)
    # click's own check of --state comes first: a usage error that names the file.
    assert got.returncode == 2
    assert f"'{nobody_state}' is not readable" in got.stderr
    assert CORRUPT_ADVICE not in got.stderr
    # The hook and the library open it themselves: the same condition, in vmlend's words.
    got = subprocess.run(
        [sys.executable, "-c", AS_NOBODY_OPEN, str(nobody_state)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    assert got.stdout.strip() == (
        f"cannot read the vmlend state {nobody_state}: permission denied; run vmlend as a user"
        " who may (root for the system state) or fix the owner and mode of the file and its"
        " directory"
    ), got.stderr


def test_a_lock_held_by_another_process_is_named(state):
    before = _digest(state)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sqlite3, sys\n"
            "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
            "c.execute('PRAGMA locking_mode = EXCLUSIVE'); c.execute('BEGIN EXCLUSIVE')\n"
            "c.execute('SELECT count(*) FROM meta').fetchall()\n"
            "print('held', flush=True); sys.stdin.read()\n",
            str(state),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(StateLockedError) as info:
            SqliteRegistry.open(state, busy_timeout=0.2)
        assert str(info.value) == (
            f"the vmlend state {state} is locked by another process (waited 0.2 s); retry when"
            f" it is done ('fuser -v {state}' shows which process holds it)"
        )
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=10)
    assert _digest(state) == before
    with SqliteRegistry.open(state) as reg, reg.read() as tx:  # released: usable again
        assert tx.topology().local_node == "gamma"


def test_a_corrupt_file_is_still_refused_as_corrupt(state):
    data = bytearray(state.read_bytes())
    data[4096:8192] = b"\xff" * 4096  # a page of garbage inside the database
    state.write_bytes(bytes(data))
    got = _cli("devices", state=state)
    assert got.returncode == 1
    assert "corrupt" in got.stderr and CORRUPT_ADVICE in got.stderr
