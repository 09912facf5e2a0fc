"""The marks the agent keeps of the VMs it paused itself (``vmlend.agent.pause_marks``), and
the guard that writes and clears them."""

from __future__ import annotations

import logging
import os

from tests.support.simcluster import domain_of
from tests.support.simfabric import make_fabric
from vmlend.agent.guard import RemoteVmGuard
from vmlend.agent.pause_marks import PauseMarks
from vmlend.hypervisor.base import DomainState
from vmlend.sim.hypervisor.node import SimHypervisor

GPU = 0x10  # lent by alpha: remote for gamma
APP = "33333333-3333-3333-3333-333333333333"


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


def test_the_guard_marks_what_it_pauses_and_clears_what_it_resumes(tmp_path):
    fabric = make_fabric(tmp_path / "state.db")  # opened as gamma
    hv = SimHypervisor("gamma", tmp_path / "hv", None)
    hv.define(domain_of("app", APP, (GPU,)))
    hv.start("app")
    marks = PauseMarks(tmp_path / "paused")
    guard = RemoteVmGuard(hv, fabric, "gamma", marks)
    assert guard.pause() == ["app"]
    assert marks.names() == ["app"]
    guard.resume_if_paused("app")
    assert hv.lookup("app").state is DomainState.RUNNING
    assert marks.names() == []
