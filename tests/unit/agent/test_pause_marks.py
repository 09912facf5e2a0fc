"""The marks the agent keeps of the VMs it paused itself (``vmlend.agent.pause_marks``); the
worker that writes and clears them is tested in ``test_guest.py``."""

from __future__ import annotations

import logging
import os

from vmlend.agent.pause_marks import PauseMarks


def test_a_mark_is_kept_until_cleared_whatever_the_vm_is_called(tmp_path):
    marks = PauseMarks(tmp_path / "paused")
    assert marks.names() == []  # no directory yet
    odd = "../web vm/ü\n"
    marks.mark("web")
    marks.mark(odd)
    marks.mark("web")  # twice: one mark
    assert marks.names() == sorted(["web", odd])
    assert sorted(os.listdir(tmp_path)) == ["paused"]  # nothing written outside
    marks.clear(odd)
    marks.clear("never-marked")
    assert PauseMarks(tmp_path / "paused").names() == ["web"]  # on disk, for the next agent


def test_files_that_are_not_marks_are_ignored(tmp_path):
    marks = PauseMarks(tmp_path)
    marks.mark("web")
    (tmp_path / "db").write_text("db")  # not named after its content's digest
    (tmp_path / "notes").mkdir()
    os.symlink("/etc/passwd", tmp_path / "link")
    assert marks.names() == ["web"]


def test_a_mark_that_cannot_be_written_does_not_stop_the_pause(tmp_path, caplog):
    (tmp_path / "paused").write_text("a file where the directory should be")
    marks = PauseMarks(tmp_path / "paused")
    with caplog.at_level(logging.WARNING):
        marks.mark("web")
    assert "resume it by hand" in caplog.text
    assert marks.names() == []


def test_a_marks_directory_another_user_may_write_to_is_not_used(tmp_path, caplog):
    shared = tmp_path / "paused"
    shared.mkdir()
    marks = PauseMarks(shared)
    marks.mark("web")
    shared.chmod(0o777)  # anyone could plant a mark that makes root resume a VM
    with caplog.at_level(logging.WARNING):
        assert marks.names() == []
        marks.mark("db")
    assert "may write to it" in caplog.text
    linked = PauseMarks(tmp_path / "link")
    os.symlink(shared, tmp_path / "link")
    assert linked.names() == []


def test_clearing_a_vm_that_has_no_mark_says_nothing(tmp_path, caplog):
    marks = PauseMarks(tmp_path / "paused")
    marks.mark("web")
    with caplog.at_level(logging.WARNING):
        marks.clear("db")
        PauseMarks(tmp_path / "none").clear("db")
    assert caplog.text == ""
