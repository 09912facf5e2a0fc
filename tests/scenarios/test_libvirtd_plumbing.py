"""The parts of the private-libvirtd fixture that need no daemon: trampoline, recorder, config."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lxml import etree

from tests.support.libvirt_daemon import (
    REAPER,
    RECORD_HOOK,
    SYSTEM_DIRS,
    TRAMPOLINE,
    DaemonLayout,
    HookRecorder,
    LibvirtDaemon,
    guest_xml,
    pid_alive,
    render_conf,
    stop_pid,
    wait_for,
)

DOMAIN = b"<domain type='qemu'><name>vm1</name><uuid>u-1</uuid></domain>"


@pytest.fixture
def hooks_dir(tmp_path: Path) -> Path:
    """A hooks dir with the trampoline installed as ``qemu``, as the fixture does."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    shutil.copyfile(TRAMPOLINE, hooks / "qemu")
    (hooks / "qemu").chmod(0o755)
    return hooks


def run_hook(hooks: Path, *argv: str, stdin: bytes = DOMAIN) -> subprocess.CompletedProcess:
    # libvirt gives hooks only LC_ALL, PATH and HOME; so do we.
    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C", "HOME": "/"}
    return subprocess.run(
        [str(hooks / "qemu"), *argv], input=stdin, capture_output=True, env=env, timeout=30
    )


def write_target(hooks: Path, argv: list[str], env: dict[str, str] | None = None) -> None:
    (hooks / "qemu.target").write_text("".join(f"{w}\n" for w in argv))
    (hooks / "qemu.env").write_text("".join(f"{k}={v}\n" for k, v in (env or {}).items()))


def test_trampoline_without_target_accepts_everything(hooks_dir):
    result = run_hook(hooks_dir, "vm1", "prepare", "begin", "-", stdin=DOMAIN * 10000)
    assert result.returncode == 0
    assert result.stderr == b""


def test_trampoline_passes_argv_stdin_env_and_exit_code_through(hooks_dir, tmp_path):
    script = tmp_path / "probe.sh"
    out = tmp_path / "out"
    script.write_text(
        f'#!/bin/bash\nprintf "%s|" "$@" > {out}\ncat >> {out}\necho "$GREETING" >&2\nexit 3\n'
    )
    script.chmod(0o755)
    write_target(hooks_dir, [str(script), "first word"], {"GREETING": "hello there = yes"})

    result = run_hook(hooks_dir, "vm1", "release", "end", "-")
    assert result.returncode == 3
    assert result.stderr == b"hello there = yes\n"
    assert out.read_bytes() == b"first word|vm1|release|end|-|" + DOMAIN


def test_trampoline_reports_a_missing_hook_command(hooks_dir, tmp_path):
    write_target(hooks_dir, [str(tmp_path / "gone")])
    result = run_hook(hooks_dir, "vm1", "prepare", "begin", "-")
    assert result.returncode != 0
    assert str(tmp_path / "gone").encode() in result.stderr


def recorder_in(hooks_dir: Path, tmp_path: Path, fail: str = "", message: str = ""):
    log = tmp_path / "calls.jsonl"
    env = {"RECORD_HOOK_LOG": str(log), "RECORD_HOOK_FAIL": fail}
    if message:
        env["RECORD_HOOK_MESSAGE"] = message
    write_target(hooks_dir, [sys.executable, str(RECORD_HOOK)], env)
    return log


def test_recording_hook_records_argv_and_domain_identity(hooks_dir, tmp_path):
    log = recorder_in(hooks_dir, tmp_path)
    xml = guest_xml("vm7", "8a1c0c36-3d5e-4f0a-9d63-d8a2f5b4e001", ["mdev-a", "mdev-b"])
    assert run_hook(hooks_dir, "vm7", "prepare", "begin", "-", stdin=xml.encode()).returncode == 0
    assert run_hook(hooks_dir, "vm7", "release", "end", "-", stdin=b"not xml").returncode == 0

    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert records == [
        {
            "argv": ["vm7", "prepare", "begin", "-"],
            "name": "vm7",
            "uuid": "8a1c0c36-3d5e-4f0a-9d63-d8a2f5b4e001",
            "mdevs": ["mdev-a", "mdev-b"],
        },
        {"argv": ["vm7", "release", "end", "-"], "name": None, "uuid": None, "mdevs": None},
    ]


@pytest.mark.parametrize(
    ("fail", "argv", "fails"),
    [
        ("prepare", ["vm1", "prepare", "begin", "-"], True),
        ("prepare/begin", ["vm1", "prepare", "begin", "-"], True),
        ("prepare/end", ["vm1", "prepare", "begin", "-"], False),
        ("prepare", ["vm1", "start", "begin", "-"], False),
        ("", ["vm1", "prepare", "begin", "-"], False),
    ],
)
def test_recording_hook_fails_only_the_operation_it_is_told(hooks_dir, tmp_path, fail, argv, fails):
    recorder_in(hooks_dir, tmp_path, fail=fail, message="held elsewhere")
    result = run_hook(hooks_dir, *argv)
    assert result.returncode == (1 if fails else 0)
    assert (result.stderr == b"held elsewhere\n") is fails


def test_hook_recorder_reads_what_the_hook_wrote(tmp_path):
    daemon = LibvirtDaemon(tmp_path / "d")
    daemon.hooks_dir.mkdir(parents=True)
    recorder = HookRecorder(daemon, tmp_path / "calls.jsonl")
    assert recorder.calls() == []
    recorder.install(fail="start")
    assert (daemon.hooks_dir / "qemu.target").read_text().splitlines() == [
        sys.executable,
        str(RECORD_HOOK),
    ]
    assert "RECORD_HOOK_FAIL=start" in (daemon.hooks_dir / "qemu.env").read_text().splitlines()

    record = {"argv": ["a", "prepare", "begin", "-"], "name": "a", "uuid": "u", "mdevs": []}
    other = {**record, "argv": ["b", "start", "begin", "-"], "name": "b"}
    recorder.log_path.write_text(json.dumps(record) + "\n" + json.dumps(other) + "\n")
    assert recorder.ops("a") == [("prepare", "begin", "-")]
    assert [c.name for c in recorder.calls()] == ["a", "b"]


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        ([], None),
        (["relative/hook"], None),
        (["/bin/true", "a\nb"], None),
        (["/bin/true"], {"A": "x\ny"}),
    ],
)
def test_install_hook_refuses_what_the_trampoline_cannot_run(tmp_path, argv, env):
    daemon = LibvirtDaemon(tmp_path / "d")
    daemon.hooks_dir.mkdir(parents=True)
    with pytest.raises(ValueError):
        daemon.install_hook(argv, env)
    assert not (daemon.hooks_dir / "qemu.target").exists()


def test_remove_hook_is_idempotent(tmp_path):
    daemon = LibvirtDaemon(tmp_path / "d")
    daemon.hooks_dir.mkdir(parents=True)
    daemon.install_hook(["/bin/true"], {"A": "1"})
    daemon.remove_hook()
    daemon.remove_hook()
    assert list(daemon.hooks_dir.iterdir()) == []


def test_layout_keeps_every_daemon_path_under_its_root(tmp_path):
    layout = DaemonLayout(tmp_path)
    binds = layout.binds()
    assert sorted(target for _, target in binds) == sorted(SYSTEM_DIRS.values())
    assert all(source.is_relative_to(tmp_path) for source, _ in binds)
    assert layout.uri == f"qemu+unix:///system?socket={tmp_path}/run/libvirt-sock"
    assert layout.hooks_dir == tmp_path / "etc" / "hooks"
    files = {path.name: content for path, content in layout.config_files().items()}
    assert all(path.parent == layout.config_dir for path in layout.config_files())
    assert f'log_outputs = "3:file:{layout.libvirtd_log}"' in files["libvirtd.conf"]
    assert str(layout.log_dir) in files["virtlogd.conf"]
    assert "cgroup_controllers = []" in files["qemu.conf"]

    shared = tmp_path / "shared-cache"
    assert dict((t, s) for s, t in layout.binds(shared))["/var/cache/libvirt"] == shared


def test_a_daemon_can_have_its_own_host_uuid(tmp_path):
    # Two daemons on one machine migrate to each other only with different host UUIDs.
    files = {
        p.name: c
        for p, c in DaemonLayout(tmp_path, "0b3c2a9e-1d44-4f5e-8c77-aa01b2c3d4e5")
        .config_files()
        .items()
    }
    assert 'host_uuid = "0b3c2a9e-1d44-4f5e-8c77-aa01b2c3d4e5"' in files["libvirtd.conf"]
    # unchosen: derived from the daemon's root, stable, and another daemon's differs
    one, other = DaemonLayout(tmp_path / "a"), DaemonLayout(tmp_path / "b")
    assert one.host_uuid == DaemonLayout(tmp_path / "a").host_uuid != other.host_uuid
    conf = {p.name: c for p, c in one.config_files().items()}["libvirtd.conf"]
    assert f'host_uuid = "{one.host_uuid}"' in conf


def test_render_conf_quotes_values_and_refuses_unquotable_ones():
    text = render_conf({"a": "x y", "n": 3, "l": ["p", "q"], "e": []})
    assert text == 'a = "x y"\nn = 3\nl = ["p", "q"]\ne = []\n'
    with pytest.raises(ValueError):
        render_conf({"a": 'say "hi"'})


def test_wait_for_returns_elapsed_time_or_times_out():
    start = time.monotonic()
    assert wait_for(lambda: time.monotonic() - start > 0.05, 5, "thing") >= 0.05
    with pytest.raises(TimeoutError, match=r"never not ready after 0\.05 s"):
        wait_for(lambda: False, 0.05, "never")


@pytest.mark.daemon
def test_stop_pid_terminates_and_kills_a_process_ignoring_sigterm():
    polite = subprocess.Popen(["sleep", "30"])
    assert stop_pid(polite.pid, proc=polite) is False
    assert not pid_alive(polite.pid)

    ignore_term = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        " print('ready', flush=True); time.sleep(30)"
    )
    stubborn = subprocess.Popen([sys.executable, "-c", ignore_term], stdout=subprocess.PIPE)
    assert stubborn.stdout.readline() == b"ready\n"
    assert stop_pid(stubborn.pid, timeout=0.3, proc=stubborn) is True
    assert not pid_alive(stubborn.pid)
    stubborn.stdout.close()


def test_guest_xml_is_the_template_with_name_uuid_and_mdevs():
    root = etree.fromstring(guest_xml("g1", "0b7d4b3e-2b0b-4a43-a9c3-7a3c5e1f0001", ["m1"]))
    assert root.get("type") == "qemu"
    assert root.findtext("name") == "g1"
    assert root.findtext("uuid") == "0b7d4b3e-2b0b-4a43-a9c3-7a3c5e1f0001"
    assert root.findtext("memory") == "64"
    assert root.xpath("devices/hostdev/source/address/@uuid") == ["m1"]
    assert root.find("devices/interface") is None
    assert root.find("devices/disk") is None


def test_reaper_passes_the_exit_status_through():
    assert subprocess.run([sys.executable, str(REAPER), "bash", "-c", "exit 7"]).returncode == 7
    assert subprocess.run([sys.executable, str(REAPER)], capture_output=True).returncode == 2


@pytest.mark.daemon
def test_reaper_reaps_orphans_at_once_and_forwards_sigterm(tmp_path):
    # The command leaves an orphan (like libvirtd's double-forked QEMU) that exits soon.
    orphan_pid = tmp_path / "orphan.pid"
    script = f"(sleep 0.5 & echo $! > {orphan_pid}); echo ready; exec sleep 30"
    reaper = subprocess.Popen(
        [sys.executable, str(REAPER), "bash", "-c", script], stdout=subprocess.PIPE
    )
    try:
        assert reaper.stdout.readline() == b"ready\n"
        orphan = Path(f"/proc/{int(orphan_pid.read_text())}")
        stat = (orphan / "stat").read_text()
        assert int(stat[stat.rindex(")") + 2 :].split()[1]) == reaper.pid, "not adopted"
        # Gone from /proc entirely, not a zombie waiting for PID 1.
        wait_for(lambda: not orphan.exists(), 1.0, "reaping of the orphan")
        reaper.terminate()
        assert reaper.wait(timeout=5) == 128 + 15  # sleep died of the forwarded SIGTERM
    finally:
        reaper.kill()
        reaper.wait()
        reaper.stdout.close()


def test_start_refuses_a_root_too_deep_for_a_unix_socket(tmp_path):
    daemon = LibvirtDaemon(tmp_path / ("d" * 100))
    with pytest.raises(ValueError, match="too long for a unix socket"):
        daemon.start()
    assert not daemon.root.exists()
